"""Claim: per step, the tensor-parallel executor's way of reaching every rank — the scheduler
output pickled once and the same bytes written to each rank's Unix socket pair, rank 0 answering
on its socket (atb_plugin/engine/executor/multiproc.py) — costs less than the collective alternative: the
core as rank 0 of a gloo group that ``broadcast_object_list``s the same object to the ranks and
gathers the answer back (what a "driver in the group" design does).

Both move a representative decode step of 32 running requests (each scheduled for 1 token, a
block id list) to 2 rank processes, which answer with 32 sampled ids; the message is built
the way the engine builds it (``SchedulerOutput``). The two transports alternate in rounds
(this machine is shared and noisy) and the ratio of medians is printed; last line is JSON.

    python benchmarks/bench_tp_broadcast.py [--rounds 5] [--steps 300] [--requests 32]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import pickle
import socket
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atb_plugin.engine.scheduler import SchedulerOutput  # noqa: E402


def step_message(requests: int) -> SchedulerOutput:
    ids = [f"chatcmpl-{i:032x}" for i in range(requests)]
    return SchedulerOutput({r: 1 for r in ids}, [], {r: [1000 + i] for i, r in enumerate(ids)},
                           computed_tokens={r: 300 + i for i, r in enumerate(ids)})


def _socket_rank(sock: socket.socket, rank: int, steps: int) -> None:
    conn = Connection(sock.detach())
    for _ in range(steps):
        output = conn.recv()
        if rank == 0:
            conn.send({r: 7 for r in output.num_scheduled_tokens})
    conn.close()


def _gloo_member(rank: int, size: int, port: int, steps: int, requests: int, queue) -> None:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=60))
    message = step_message(requests)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        box = [message if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        answer = [{r: 7 for r in box[0].num_scheduled_tokens} if rank == 1 else None]
        dist.broadcast_object_list(answer, src=1)  # rank 1 is the model's rank 0
        times.append(time.perf_counter() - start)
    if rank == 0:
        queue.put(statistics.median(times))
    dist.destroy_process_group()


def socket_round(steps: int, requests: int) -> float:
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for rank in range(2):
        ours, theirs = socket.socketpair()
        proc = ctx.Process(target=_socket_rank, args=(theirs, rank, steps))
        proc.start()
        theirs.close()
        conns.append(Connection(ours.detach()))
        procs.append(proc)
    message, times = step_message(requests), []
    for _ in range(steps):
        start = time.perf_counter()
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in conns:
            conn.send_bytes(payload)
        conns[0].recv()
        times.append(time.perf_counter() - start)
    for proc in procs:
        proc.join()
    return statistics.median(times)


def gloo_round(steps: int, requests: int) -> float:
    ctx = mp.get_context("spawn")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gloo_member, args=(rank, 3, port, steps, requests, queue)) for rank in range(3)]
    for proc in procs:
        proc.start()
    result = queue.get()
    for proc in procs:
        proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    sockets, gloo = [], []
    for index in range(args.rounds):
        order = (socket_round, gloo_round) if index % 2 == 0 else (gloo_round, socket_round)
        for fn in order:
            (sockets if fn is socket_round else gloo).append(fn(args.steps, args.requests) * 1e6)
        print(f"round {index + 1}: socket pair {sockets[-1]:.0f} us, gloo broadcast {gloo[-1]:.0f} us per step")
    summary = {"socket_pair_us": statistics.median(sockets), "gloo_broadcast_us": statistics.median(gloo),
               "requests": args.requests, "payload_bytes": len(pickle.dumps(step_message(args.requests)))}
    summary["gloo_over_socket"] = summary["gloo_broadcast_us"] / summary["socket_pair_us"]
    print(f"socket pair {summary['socket_pair_us']:.0f} us vs gloo broadcast_object_list "
          f"{summary['gloo_broadcast_us']:.0f} us per step: {summary['gloo_over_socket']:.2f}x")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

"""The Mooncake checks of tests/test_kv_mooncake.py, run inside a network namespace with only a
loopback interface (the Transfer Engine's listeners bind every interface):

    python -m tests.kv_mooncake_netns_checks OUT.json

A producer process registers memory (the wrapper alone, then a MooncakeConnector's worker side
over fake KV tensors); this process reads from it. Everything observed goes to OUT.json
(tracebacks included), for the test to assert on.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
import traceback

import torch

from atb_plugin.engine.kv_transfer.base import ConnectorContext, KVConnectorRole
from atb_plugin.engine.kv_transfer.config import KVTransferConfig
from atb_plugin.engine.kv_transfer.mooncake.connector import MooncakeConnector
from atb_plugin.engine.kv_transfer.mooncake.transfer import MooncakeError, MooncakeTransfer
from atb_plugin.engine.request import Request, RequestStatus
from atb_plugin.engine.sampling_params import SamplingParams

NBYTES = 4 << 20
BLOCK_SIZE = 4
KV_SHAPE = (12, BLOCK_SIZE, 2, 8)  # (num_blocks, block_size, kv_heads, head_dim)
NUM_LAYERS = 2


def pattern(n: int, seed: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.int64) * 7 + seed).remainder(251).to(torch.uint8)


def fake_kv(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(KV_SHAPE, generator=generator), torch.randn(KV_SHAPE, generator=generator))
            for _ in range(NUM_LAYERS)]


def connector(role: str, kv_role: str, port: int, engine_id: str, **extra) -> MooncakeConnector:
    config = KVTransferConfig("MooncakeConnector", kv_role, {"side_channel_port": port, "transfer_timeout_s": 2,
                                                             **extra}, engine_id=engine_id)
    context = ConnectorContext("tiny", BLOCK_SIZE, KV_SHAPE[0])
    return MooncakeConnector(config, KVConnectorRole(role), context)


def wait_stopped(pid: int, timeout: float = 5.0) -> None:
    """Until every thread of ``pid`` is stopped (SIGSTOP lands when each is next scheduled: on a
    busy machine a thread may still answer a read right after kill() returns)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as handle:
                    states.append(handle.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue
        if states and all(state in ("T", "t") for state in states):
            return
        time.sleep(0.01)


def raw_producer(pipe) -> None:
    transfer = MooncakeTransfer(timeout_s=2)
    buffer = pattern(NBYTES, 3)
    transfer.register_tensor(buffer)
    pipe.send((transfer.session, buffer.data_ptr()))
    pipe.recv()  # until told to go


def connector_producer(pipe, port: int) -> None:
    """A producer's two sides in one process: the scheduler side finishes a request, the
    worker side serves its blocks until the consumer acknowledges."""
    scheduler = connector("scheduler", "kv_producer", port, "producer-engine")
    worker = connector("worker", "kv_producer", port, "producer-engine")
    kv = fake_kv(seed=1)
    worker.register_kv_caches(kv)
    request = Request("r1", list(range(10)), SamplingParams(max_tokens=1),
                      kv_transfer_params={"do_remote_decode": True})
    request.status = RequestStatus.FINISHED_LENGTH
    delay, params = scheduler.request_finished(request, [5, 6, 9])
    worker.bind_connector_metadata(scheduler.build_connector_meta(None))
    worker.start_load_kv()
    pipe.send((delay, params, [[t.clone() for t in layer] for layer in kv]))
    finished = set()
    deadline = time.monotonic() + 20
    while "r1" not in finished and time.monotonic() < deadline:
        finished |= worker.get_finished(set())[0]
        time.sleep(0.02)
    pipe.send(sorted(finished))
    pipe.recv()
    worker.shutdown()


def check_wrapper(out: dict) -> None:
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(target=raw_producer, args=(theirs,), daemon=True)
    child.start()
    session, remote = ours.recv()
    transfer = MooncakeTransfer(timeout_s=2)
    local = torch.zeros(NBYTES, dtype=torch.uint8)
    transfer.register_tensor(local)
    half = NBYTES // 2
    started = time.perf_counter()
    transfer.read(session, [local.data_ptr(), local.data_ptr() + half], [remote, remote + half], [half, half])
    out["read_seconds"] = time.perf_counter() - started
    out["byte_exact"] = bool(torch.equal(local, pattern(NBYTES, 3)))
    # More ranges than one Mooncake batch takes (it fails past ~2048): the wrapper splits them.
    local.zero_()
    ranges = 3000
    size = NBYTES // ranges
    offsets = [i * size for i in range(ranges)]
    transfer.read(session, [local.data_ptr() + o for o in offsets], [remote + o for o in offsets], [size] * ranges)
    out["many_ranges_exact"] = bool(torch.equal(local[:ranges * size], pattern(NBYTES, 3)[:ranges * size]))
    stray = torch.zeros(4096, dtype=torch.uint8)
    try:
        transfer.read(session, [stray.data_ptr()], [remote], [4096])
        out["unregistered_local"] = "accepted"
    except MooncakeError as error:
        out["unregistered_local"] = str(error)
    out["stray_untouched"] = bool((stray == 0).all())
    try:
        transfer.read(session, [local.data_ptr()], [remote + NBYTES], [4096])
        out["remote_out_of_range"] = "accepted"
    except MooncakeError as error:
        out["remote_out_of_range"] = str(error)
    # A frozen peer (SIGSTOP): the read fails after MC_TCP_PROGRESS_TIMEOUT_SEC (2 s here), not 30 s.
    os.kill(child.pid, signal.SIGSTOP)
    wait_stopped(child.pid)
    started = time.perf_counter()
    try:
        transfer.read(session, [local.data_ptr()], [remote], [NBYTES])
        out["frozen_peer"] = "accepted"
    except MooncakeError as error:
        out["frozen_peer"] = str(error)
    out["frozen_peer_seconds"] = time.perf_counter() - started
    os.kill(child.pid, signal.SIGCONT)
    ours.send("go")
    child.join(10)
    started = time.perf_counter()
    try:
        transfer.read(session, [local.data_ptr()], [remote], [4096])
        out["dead_peer"] = "accepted"
    except MooncakeError as error:
        out["dead_peer"] = str(error)
    out["dead_peer_seconds"] = time.perf_counter() - started
    transfer.close()


def check_connector(out: dict) -> None:
    from tests.server_helpers import free_port

    port = free_port()
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(target=connector_producer, args=(theirs, port), daemon=True)
    child.start()
    delay, params, producer_kv = ours.recv()
    out["delay_free"] = delay
    out["params"] = params

    scheduler = connector("scheduler", "kv_consumer", port, "consumer-engine")
    worker = connector("worker", "kv_consumer", port, "consumer-engine")
    kv = fake_kv(seed=2)
    before = [[t.clone() for t in layer] for layer in kv]
    worker.register_kv_caches(kv)
    request = Request("r1", list(range(10)), SamplingParams(max_tokens=4), kv_transfer_params=params)
    out["matched"] = list(scheduler.get_num_new_matched_tokens(request, 0))
    scheduler.update_state_after_alloc(request, [2, 3, 7], out["matched"][0])
    out["params_after_alloc"] = request.kv_transfer_params.get("do_remote_prefill")
    worker.bind_connector_metadata(scheduler.build_connector_meta(None))
    worker.start_load_kv()
    out["load_errors"] = sorted(worker.get_block_ids_with_load_errors())
    exact = True
    for layer, (ours_kv, theirs_kv, old) in enumerate(zip(kv, producer_kv, before)):
        for tensor, remote, original in zip(ours_kv, theirs_kv, old):
            for local_block, remote_block in zip([2, 3, 7], [5, 6, 9]):
                exact &= bool(torch.equal(tensor[local_block], remote[remote_block]))
            untouched = [b for b in range(KV_SHAPE[0]) if b not in (2, 3, 7)]
            exact &= bool(torch.equal(tensor[untouched], original[untouched]))
    out["blocks_exact"] = exact
    out["stats"] = worker.get_stats()
    out["producer_finished"] = ours.recv()

    # A layout that does not match (another head_dim): a load error, not garbage.
    wrong = connector("worker", "kv_consumer", port, "consumer-engine-2")
    wrong.register_kv_caches([(torch.zeros(KV_SHAPE[:3] + (4,)), torch.zeros(KV_SHAPE[:3] + (4,)))])
    request = Request("r2", list(range(10)), SamplingParams(max_tokens=4), kv_transfer_params=params)
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, [1, 2, 3], 9)
    wrong.bind_connector_metadata(scheduler.build_connector_meta(None))
    wrong.start_load_kv()
    out["mismatch_errors"] = sorted(wrong.get_block_ids_with_load_errors())
    wrong.shutdown()

    # The producer gone: a load error within the transfer timeout.
    ours.send("go")
    child.join(10)
    request = Request("r3", list(range(10)), SamplingParams(max_tokens=4), kv_transfer_params=params)
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, [4, 5, 6], 9)
    worker._peer_layouts.clear()
    worker.bind_connector_metadata(scheduler.build_connector_meta(None))
    started = time.perf_counter()
    worker.start_load_kv()
    out["dead_producer_seconds"] = time.perf_counter() - started
    out["dead_producer_errors"] = sorted(worker.get_block_ids_with_load_errors())
    worker.shutdown()


def check_offline(out: dict) -> None:
    """The offline LLM as a producer: kv_transfer_params in, RequestOutput.kv_transfer_params out."""
    from atb_plugin import LLM
    from atb_plugin.testing.tiny import tiny_checkpoint
    from tests.server_helpers import free_port

    config = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
              "kv_connector_extra_config": {"side_channel_port": free_port()}}
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    with LLM(tiny_checkpoint("qwen2"), block_size=16, max_model_len=128, kv_transfer_config=config) as llm:
        prompt = "The quick brown fox jumps over the lazy dog again and again"
        handed, plain = llm.generate([prompt, prompt], greedy, kv_transfer_params=[{"do_remote_decode": True}, None])
        out["handed"] = handed.kv_transfer_params
        out["plain"] = plain.kv_transfer_params
        out["prompt_tokens"] = len(handed.prompt_token_ids)
        try:
            llm.generate(prompt, SamplingParams(max_tokens=1, n=2), kv_transfer_params={"do_remote_decode": True})
            out["n2"] = "accepted"
        except ValueError as error:
            out["n2"] = str(error)


def check_media(out: dict) -> None:
    """An image chat whose KV is pulled runs no vision encoder: one kv_both engine (prefix cache
    off, so only the connector can spare positions) produces, then consumes its own blocks."""
    import atb_plugin.multimodal.prompt as prompt_module
    from atb_plugin import LLM
    from atb_plugin.testing.tiny import tiny_checkpoint
    from tests.server_helpers import data_url, free_port

    calls = []
    encode = prompt_module.encode_pixels

    def counted(*args, **kwargs):
        calls.append(1)
        return encode(*args, **kwargs)

    prompt_module.encode_pixels = counted
    chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(seed=3)}},
                                         {"type": "text", "text": "What is in this picture?"}]}]
    config = {"kv_connector": "MooncakeConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"side_channel_port": free_port()}}
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    try:
        with LLM(tiny_checkpoint("qwen2_vl"), block_size=16, max_model_len=512, enable_prefix_caching=False,
                 kv_transfer_config=config) as llm:
            calls.clear()  # the start-up memory profile encodes too
            (handed,) = llm.chat(chat, SamplingParams(max_tokens=1, temperature=0.0),
                                 kv_transfer_params={"do_remote_decode": True})
            out["producer_encoder_calls"] = len(calls)
            calls.clear()
            (pulled,) = llm.chat(chat, greedy, kv_transfer_params=handed.kv_transfer_params)
            out["consumer_encoder_calls"] = len(calls)
            out["consumer_cached"] = [pulled.num_cached_tokens, len(pulled.prompt_token_ids)]
            calls.clear()
            (computed,) = llm.chat(chat, greedy)
            out["plain_encoder_calls"] = len(calls)
            out["same_tokens"] = pulled.outputs[0].token_ids == computed.outputs[0].token_ids
    finally:
        prompt_module.encode_pixels = encode


def main(path: str) -> None:
    results = {}
    for name, check in (("wrapper", check_wrapper), ("connector", check_connector), ("offline", check_offline),
                        ("media", check_media)):
        section = results[name] = {}
        try:
            check(section)
        except Exception:
            section["error"] = traceback.format_exc()
    with open(path, "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main(sys.argv[1])

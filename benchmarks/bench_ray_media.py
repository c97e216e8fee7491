"""How a rank on another node should get a request's pixels: Ray's object store or the process group.

    python benchmarks/bench_ray_media.py [--repeats 15]

``/dev/shm`` is per node, so the engine core ships media to ranks on other nodes
(``multimodal/shipped.py``, ``engine/executor/ray.py``). Two ways were possible:

- object store (what the executor does): the core ``ray.put``s the step with the pixels in it and
  every actor's ``step`` call receives it; timed from the put to the remote actor holding the
  array;
- process group: rank 0 (on the core's node) reads the pixels from shared memory and
  ``dist.broadcast``s them over gloo to the remote rank; timed from the call to both ranks done.

A local Ray cluster of two logical nodes, one actor on each, in a network namespace with only
loopback (the script re-runs itself under ``unshare -n`` as the Ray tests do), so both paths
cross loopback TCP: a lower bound on a real network for both, which makes their ratio the
comparable number. Sizes: a uint8 image at Qwen2-VL's default budget (0.6 MB), a large image
(6 MB) and a 16-frame video (19 MB). Medians of interleaved runs; the ratio is process group /
object store (above 1: the object store is faster).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

SIZES = {"image 448x448 uint8": 448 * 448 * 3, "image 1344x1568 uint8": 1344 * 1568 * 3,
         "video 16x(448x896) uint8": 16 * 448 * 896 * 3}


class Peer:
    """One end: rank 0 or 1 of a two-rank gloo group."""

    def __init__(self, rank: int):
        self.rank = rank

    def port(self) -> int:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return probe.getsockname()[1]

    def join(self, init_method: str) -> str:
        import ray
        import torch.distributed as dist

        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        dist.init_process_group("gloo", init_method=init_method, rank=self.rank, world_size=2)
        return ray.get_runtime_context().get_node_id()

    def take(self, step: dict) -> int:  # the object-store path: Ray resolved the argument here
        return int(step["pixels"][-1])

    def broadcast(self, nbytes: int) -> int:
        import torch
        import torch.distributed as dist

        tensor = torch.ones(nbytes, dtype=torch.uint8) if self.rank == 0 else torch.empty(nbytes, dtype=torch.uint8)
        dist.broadcast(tensor, src=0)
        return int(tensor[-1])


def measure(repeats: int) -> None:
    import numpy as np
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="ERROR")
        group = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
        ray.get(group.ready())
        actor = ray.remote(Peer)
        peers = [actor.options(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote(i)
                 for i in range(2)]
        init = f"tcp://127.0.0.1:{ray.get(peers[0].port.remote())}"
        nodes = ray.get([peer.join.remote(init) for peer in peers])
        assert nodes[0] != nodes[1], "the two peers must sit on different nodes"
        print(f"two nodes ({nodes[0][:8]}, {nodes[1][:8]}), loopback only; {repeats} interleaved runs each\n")
        print(f"{'payload':28} {'MB':>6} {'object store ms':>16} {'process group ms':>17} {'pg / store':>11}")
        for name, nbytes in SIZES.items():
            pixels = np.ones(nbytes, dtype=np.uint8)
            store, group_times = [], []
            for _ in range(2):  # warm both paths
                ray.get(peers[1].take.remote(ray.put({"pixels": pixels})))
                ray.get([peer.broadcast.remote(nbytes) for peer in peers])
            for _ in range(repeats):
                start = time.perf_counter()
                ray.get(peers[1].take.remote(ray.put({"pixels": pixels})))
                store.append(time.perf_counter() - start)
                start = time.perf_counter()
                ray.get([peer.broadcast.remote(nbytes) for peer in peers])
                group_times.append(time.perf_counter() - start)
            a, b = statistics.median(store) * 1e3, statistics.median(group_times) * 1e3
            print(f"{name:28} {nbytes / 1e6:6.1f} {a:16.2f} {b:17.2f} {b / a:11.2f}")
        ray.shutdown()
    finally:
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--in-namespace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.in_namespace:
        prefix = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-rn"]
        if shutil.which("unshare") is None:
            sys.exit("needs unshare (util-linux): the Ray cluster must not use the host's network")
        command = [*prefix, "sh", "-c", 'ip link set lo up && exec "$0" "$1" --in-namespace --repeats "$2"',
                   sys.executable, os.path.abspath(__file__), str(args.repeats)]
        sys.exit(subprocess.call(command))
    measure(args.repeats)


if __name__ == "__main__":
    main()

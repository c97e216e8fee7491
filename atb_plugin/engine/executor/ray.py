"""``RayExecutor`` (``--distributed-executor-backend ray``): tensor-parallel ranks as Ray actors,
which may sit on other nodes than the engine core (docs/architecture.md, "Multi-node ranks on Ray").

    EngineCore ── SchedulerOutput (+ shipped media) ── ray.put once ──► rank actors' execute()
                                                     ◄── rank 0's RunnerOutput ──

Ray places the processes, torch.distributed does the collectives: the core (the Ray driver)
reserves one placement-group bundle per rank (its CPU threads, plus one device on NPU / CUDA),
starts one actor in each, and forms the process group from the actors' node addresses (rank 0
on the core's node where a bundle landed there). Ranks of one node split its cores as ``mp``
ranks do; when every rank shares one node the collectives take the shared-memory exchange, else
gloo / hccl / nccl between the nodes. A rank on another node cannot open the frontend's shared
memory: the core reads those requests' media once per step and ships them in the step
(``multimodal/shipped.py``); same-node ranks keep reading shared memory.

The cluster is Ray's: the core joins the one ``RAY_ADDRESS`` names (``ray start --head`` on the
first node, ``ray start --address=...`` on the others), else starts a local one for itself. An
actor that dies, or a rank that fails, ends the engine exactly as an ``mp`` rank does
(``RankFailed``, the core's death, a non-zero exit of the service); the core's own death takes
its actors with it (Ray kills the actors of an owner that is gone).
"""

from __future__ import annotations

import logging
import os

from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.executor.base import DIST_TIMEOUT_S, STOP_WAIT_S, Executor, free_port, weights_per_rank
from atb_plugin.engine.model_runner import RunnerOutput, readable_instances
from atb_plugin.engine.scheduler import SchedulerOutput
from atb_plugin.engine.worker import Rank, RankPlacement, WorkerInfo
from atb_plugin.multimodal.shipped import ship
from atb_plugin.platform import platform_for

logger = logging.getLogger(__name__)

__all__ = ["RayExecutor", "import_ray"]

# How long the cluster may take to find room for every rank's bundle.
PLACEMENT_TIMEOUT_S = 120.0
# Ray's resource name for one device of each platform (CPU ranks reserve cores only).
_DEVICE_RESOURCE = {"npu": "NPU", "cuda": "GPU"}


def import_ray():
    try:
        import ray
    except ImportError as error:
        raise RuntimeError("--distributed-executor-backend ray needs Ray, an optional dependency: "
                           "pip install 'atb-plugin[ray]'") from error
    return ray


class RankActor:
    """The Ray actor hosting one rank (a Ray remote class once ``RayExecutor`` wraps it: Ray is an
    optional import). ``start`` joins the group, ``load`` / ``initialize`` / ``execute`` /
    ``propose`` are the driver's calls, run in the actor's process."""

    def __init__(self):
        self.rank: Rank | None = None
        self.start_args: tuple | None = None

    def where(self) -> tuple[str, str, int]:
        """(Ray node id, the node's address, pid): where Ray placed this actor."""
        ray = import_ray()
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def free_port(self, address: str) -> int:
        return free_port(address)

    def start(self, config: EngineConfig, placement: RankPlacement, init_method: str, env: dict[str, str],
              log_level: int) -> None:
        os.environ.update(env)
        logging.basicConfig(level=log_level,
                            format=f"%(asctime)s %(levelname)s [ray rank {placement.rank}] %(message)s")
        self.start_args = (config, placement, init_method)

    def load(self) -> WorkerInfo:
        # Joining the group is part of the load stage, as for an mp rank: a failure to join is
        # reported as that stage's.
        self.rank = Rank(*self.start_args, DIST_TIMEOUT_S)
        return self.rank.load()

    def initialize(self, num_blocks: int) -> str:
        return self.rank.initialize(num_blocks)

    def execute(self, output: SchedulerOutput) -> RunnerOutput | None:
        return self.rank.answer(self.rank.execute(output))

    def propose(self, request_ids: list[str], num_tokens: list[int], max_drafts: list[int]) -> list[list[int]] | None:
        drafts = self.rank.propose(request_ids, num_tokens, max_drafts)
        return drafts if self.rank.rank == 0 else None

    def stop(self) -> None:
        if self.rank is not None:
            self.rank.close()


class RayExecutor(Executor):
    """``tensor_parallel_size`` rank actors in one placement group; the core keeps scheduling."""

    def __init__(self, config: EngineConfig):
        self.ray = import_ray()
        self.placement_group = None
        self.actors: list = []
        self.remote_ranks: list[int] = []
        self._owns_ray = not self.ray.is_initialized()
        super().__init__(config)

    def _start_ranks(self) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, config = self.ray, self.config
        if self._owns_ray:
            # RAY_ADDRESS (Ray's own variable) names the cluster to join; unset, Ray starts a
            # local one that ends with this process.
            ray.init(address=os.environ.get("RAY_ADDRESS") or None, logging_level=logging.WARNING)
        size = config.tensor_parallel_size
        threads = max(1, config.num_threads // size)
        device = _DEVICE_RESOURCE.get(platform_for(config.device).name)
        bundle = {"CPU": threads, **({device: 1} if device else {})}
        # PACK (vLLM's choice too): fill a node before spilling to the next, so ranks share a node,
        # its memory and its fast collectives wherever the cluster lets them.
        self.placement_group = placement_group([dict(bundle) for _ in range(size)], strategy="PACK")
        try:
            ray.get(self.placement_group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"the Ray cluster has no room for {size} ranks of {bundle} within {PLACEMENT_TIMEOUT_S:.0f} s "
                f"(its resources: {ray.cluster_resources()}); add nodes or lower --tensor-parallel-size / "
                f"--num-threads") from None
        actor_class = ray.remote(RankActor)
        actors = [actor_class.options(
            num_cpus=threads, resources={device: 1} if device else None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=i),
        ).remote() for i in range(size)]
        self.actors = actors
        where = ray.get([actor.where.remote() for actor in actors])
        core_node = ray.get_runtime_context().get_node_id()
        # Rank 0 (the one that answers) on the core's node where one landed there; each node's
        # ranks together, so their local indices slice that node's cores.
        order = sorted(range(size), key=lambda i: (where[i][0] != core_node, where[i][0], i))
        self.actors = [actors[i] for i in order]
        where = [where[i] for i in order]
        nodes = [node for node, _, _ in where]
        self.nodes = len(set(nodes))
        self.remote_ranks = [rank for rank, node in enumerate(nodes) if node != core_node]
        address = where[0][1]
        port = ray.get(self.actors[0].free_port.remote(address))
        init_method = f"tcp://{address}:{port}"
        # All on loopback (one machine, or a test's network namespace): gloo must bind there too;
        # across machines it takes the interface the node's host name resolves to, or the
        # GLOO_SOCKET_IFNAME the nodes were started with.
        env = {"GLOO_SOCKET_IFNAME": "lo"} if all(ip.startswith("127.") for _, ip, _ in where) else {}
        placements = [RankPlacement(rank, local_rank=nodes[:rank].count(nodes[rank]),
                                    local_size=nodes.count(nodes[rank]), same_node=self.nodes == 1,
                                    remote_media=rank in self.remote_ranks, device_index=0 if device else None)
                      for rank in range(size)]
        for rank, (node, ip, pid) in enumerate(where):
            logger.info("ray rank %d: pid %d on node %s (%s)%s", rank, pid, node[:12], ip,
                        "" if node == core_node else ", media shipped with each step")
        level = logging.getLogger().level or logging.INFO
        ray.get([actor.start.remote(config, placement, init_method, env, level)
                 for actor, placement in zip(self.actors, placements)])

    def _started(self) -> None:
        logger.info("tensor parallel on Ray: %d ranks on %d node(s), weights per rank %s MiB", len(self.actors),
                    self.nodes, weights_per_rank(self.weight_bytes))

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        if self.remote_ranks and output.new_requests and not self.failed:
            output.shipped_media = ship((request.prompt_token_ids, readable_instances(self.config, request))
                                        for request in output.new_requests if min(request.prompt_token_ids) < 0)
        return super().execute(output)

    def _rpc(self, method: str, args: tuple, what: str, leader_only: bool) -> list:
        """Every rank's answer, in rank order; as soon as any rank's call fails (its actor died, or
        it raised), ``fail`` naming that rank. Every rank is waited for, even when only rank 0
        answers: a failure is seen as soon as any call ends."""
        ray = self.ray
        args = [ray.put(arg) for arg in args]  # serialised once, read by every actor
        refs = [getattr(actor, method).remote(*args) for actor in self.actors]
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        answers: dict[int, object] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            rank = rank_of[ready[0]]
            try:
                answers[rank] = ray.get(ready[0])
            except ray.exceptions.RayActorError as error:
                self.fail(f"tensor-parallel rank {rank} (a Ray actor) {what}: its actor died: {error}")
            except ray.exceptions.RayError as error:
                # A rank whose peer died fails in its collective first (gloo: connection closed);
                # the dead peer is the cause: name it when Ray reports it within moments.
                dead = self._dead_rank(pending, rank_of)
                if dead is not None:
                    self.fail(f"tensor-parallel rank {dead[0]} (a Ray actor) {what}: its actor died: {dead[1]}; "
                              f"rank {rank} then failed in a collective")
                self.fail(f"tensor-parallel rank {rank} (a Ray actor) {what}:\n{error}")
        return [answers[0]] if leader_only else [answers[rank] for rank in range(len(refs))]

    def _dead_rank(self, pending: list, rank_of: dict, wait_s: float = 5.0):
        """``(rank, error)`` of a pending call whose actor died, seen within ``wait_s``, else None."""
        ray = self.ray
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=wait_s) if pending else ([], [])
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as error:
                return rank_of[ref], error
            except ray.exceptions.RayError:
                continue
        return None

    def _stop_ranks(self, graceful: bool) -> None:
        """Stop the actors (asked to leave the process group first when ``graceful``), release the
        placement group, and end the local Ray this executor started, if it did."""
        ray = self.ray
        if graceful and self.actors:
            try:
                ray.wait([actor.stop.remote() for actor in self.actors], num_returns=len(self.actors),
                         timeout=STOP_WAIT_S)
            except Exception:  # noqa: BLE001 - stopping: an actor already gone is fine
                pass
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001
                pass
        if self.placement_group is not None:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.placement_group)
            except Exception:  # noqa: BLE001
                pass
        if self._owns_ray:
            ray.shutdown()

"""``Worker``: the device side of one tensor-parallel rank — its model shard, its shard of the
KV cache and the model runner. The engine core drives it through an executor
(``atb_plugin.engine.executor``): in its own process at TP = 1 (``UniprocExecutor``), else as a
``Rank`` in a rank process (``executor/multiproc.py``) or a Ray actor (``executor/ray.py``).

Every rank runs the whole step on the same inputs: the same scheduler output, the same
all-gathered logits, the same sampler with the same per-request generators (seeded) or the same
global generator state (unseeded: every rank seeds it alike at start), so every rank samples
the same tokens and keeps the same batch without being told; only rank 0 answers the core.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from atb_plugin.distributed import destroy_tensor_parallel, init_tensor_parallel
from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.kv_transfer.base import kv_block_layout
from atb_plugin.engine.memory_profile import MiB, kv_bytes_per_block, kv_cache_budget, weight_bytes
from atb_plugin.engine.model_runner import ModelRunner, RunnerOutput
from atb_plugin.engine.request import Request
from atb_plugin.engine.scheduler import SchedulerOutput, computed_advance, emitted_tokens
from atb_plugin.engine.spec_decode.head_proposer import HeadProposer
from atb_plugin.engine.spec_decode.loading import load_spec_model
from atb_plugin.models import registry
from atb_plugin.models.pooling_adapters import as_pooling_model
from atb_plugin.platform import platform_for
from atb_plugin.pooling.config import pooler_config
from atb_plugin.utils import available_cores, cdiv

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Unseeded requests draw from torch's global generator: the same seed on every rank keeps their
# draws identical across ranks.
_GLOBAL_SEED = 0


def load_model(config: EngineConfig, device):
    """The model ``config`` names (this rank's shard of it), on ``device``, and its pooler on a
    pooling runner (None when generating): a native pooling class as it is, a generative one
    through its convert adapter, pooled as the checkpoint's own pooling files say."""
    model_cls = registry.import_model_class(config.model_cls_path)
    pooling = config.runner == "pooling"
    hf_config = config.checkpoint_config() if pooling else {}
    if pooling:
        model_cls = as_pooling_model(model_cls, config.convert, hf_config)
    # A generating model's tied head gets its own layer, packed or quantized like the others.
    model = model_cls.from_pretrained(config.model, dtype=_TORCH_DTYPES[config.dtype], device=device,
                                      quantization=config.quantization, quantize_lm_head=config.quantize_lm_head,
                                      pack_weights=config.pack_weights, share_lm_head=not pooling)
    platform_for(config.device).prepare_model(model)
    pooler = model.build_pooler(pooler_config(config.model, model_cls.default_pooling_type,
                                              hf_config.get("pooler_config"))) if pooling else None
    return model, pooler


@dataclass(frozen=True)
class WorkerInfo:
    """What a rank reports once its shard is loaded."""

    available_kv_blocks: int  # the most KV blocks its budget holds (the null block included)
    weight_bytes: int  # its shard plus what every rank replicates, as held (packed weights are buffers)
    # One KV block of its shard, with a KV connector configured (kv_transfer/base.py, kv_block_layout).
    kv_block_bytes: int = 0
    kv_block_layout: str = ""


class Worker:
    """One rank: ``load()`` builds the model shard, ``initialize(num_blocks)`` its KV cache and
    runner (the core picks ``num_blocks``: the smallest that every rank can hold),
    ``execute(step)`` runs one step."""

    def __init__(self, config: EngineConfig, device_index: int | None = None, remote_media: bool = False):
        self.config = config
        self.platform = platform_for(config.device)
        # The rank's device (``Rank`` chose it); a lone worker takes rank 0's.
        self.device = self.platform.device(config.rank_device(0) if device_index is None else device_index)
        self.remote_media = remote_media
        self.model = self.pooler = self.runner = self.spec_model = self.proposer = self.lora = None

    def load(self) -> WorkerInfo:
        self.model, self.pooler = load_model(self.config, self.device)
        if self.config.enable_lora:  # its slots allocated before the KV cache is sized (docs/lora.md)
            from atb_plugin.lora.manager import attach_lora

            config = self.config
            self.lora = attach_lora(self.model, config.checkpoint_config(), config.max_loras, config.max_lora_rank,
                                    config.max_cpu_loras)
        # A speculative method's draft or head: loaded now, so that the KV budget counts it.
        self.spec_model = load_spec_model(self.config, self.model, self.device, load_model)
        spec_weights = weight_bytes(self.spec_model.module) if self.spec_model is not None else 0
        block = (kv_block_layout(self.model.make_kv_caches(1, self.config.block_size))
                 if self.config.kv_transfer_config is not None else (0, ""))
        return WorkerInfo(self._blocks_for_budget(), weight_bytes(self.model) + spec_weights, *block)

    def initialize(self, num_blocks: int) -> str:
        """Allocate the KV cache and the runner; returns how decode steps run (``decode_capture``)."""
        self.runner = ModelRunner(self.model, self.config, num_blocks, self.pooler, remote_media=self.remote_media,
                                  spec_model=self.spec_model, lora=self.lora)
        spec = self.spec_model
        if self.config.tensor_parallel_size > 1 and spec is not None and spec.hidden_states is not None:
            # A head drafts where the target's hidden states are (at TP = 1 the core builds it).
            self.proposer = HeadProposer(spec.module, spec.hidden_states, self.config, num_blocks)
        return self.runner.decode_capture

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(output)

    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.shutdown()

    def propose(self, request_ids: list[str], token_ids: list[list[int]], max_drafts: list[int]) -> list[list[int]]:
        return self.proposer.propose(request_ids, token_ids, max_drafts)

    def _blocks_for_budget(self) -> int:
        """Blocks that fit the KV budget (``memory_profile.kv_cache_budget``: ``kv_cache_bytes`` on the
        CPU, what the start-up memory profile leaves of ``gpu_memory_utilization`` of the device
        memory on NPU / CUDA), but no more than every sequence at full length needs. A budget that
        cannot hold one ``max_model_len`` request is a start-up error naming what it needs.
        Under TP the budget is per rank and so is a block's size (this rank's KV heads). A
        speculative draft or head keeps as many blocks of its own: a block's bytes count both."""
        config = self.config
        if config.kv_cache_blocks is not None:
            return config.kv_cache_blocks
        bytes_per_block = kv_bytes_per_block(self.model, config.block_size)
        if self.spec_model is not None:
            bytes_per_block += kv_bytes_per_block(self.spec_model.module, config.block_size)
        per_request = cdiv(config.max_model_len, config.block_size)
        needed = config.max_num_seqs * per_request
        if bytes_per_block == 0:  # an encoder keeps no KV: blocks are bookkeeping only, cost nothing
            return 1 + needed
        budget = kv_cache_budget(self.model, config, self.platform)
        if budget.bytes // bytes_per_block < per_request:
            raise ValueError(
                f"max_model_len {config.max_model_len} needs {per_request} KV blocks x {bytes_per_block} bytes = "
                f"{per_request * bytes_per_block / MiB:.1f} MiB of KV cache, but the budget is {budget.describe()}: "
                f"raise {budget.flag} or lower --max-model-len")
        blocks = min(budget.bytes // bytes_per_block, needed)
        logger.info("KV cache: %d blocks x %d bytes = %.1f MiB (budget %s; weights %.1f MiB)", blocks,
                    bytes_per_block, blocks * bytes_per_block / MiB, budget.describe(), budget.weight_bytes / MiB)
        return 1 + blocks  # + the null block


class RequestMirror:
    """A rank process's copies of the running requests, kept as the core keeps its own: the
    runner reads a request's computed tokens and outputs from it. New (and re-scheduled)
    requests arrive whole in the scheduler output; a step then advances each scheduled request
    by its tokens and its sampled token, as ``Scheduler.update_from_output`` does in the core.
    ``num_computed_tokens`` from the core is checked each step, so a divergence fails loudly."""

    def __init__(self):
        self.requests: dict[str, Request] = {}

    def before(self, output: SchedulerOutput) -> None:
        for request_id in output.finished_request_ids + output.preempted_request_ids:
            self.requests.pop(request_id, None)
        for request in output.new_requests:
            self.requests[request.request_id] = request
        for request_id, count in output.computed_tokens.items():
            mine = self.requests.get(request_id)
            if mine is not None and mine.num_computed_tokens != count:
                raise RuntimeError(f"rank state diverged: request {request_id} has {mine.num_computed_tokens} "
                                   f"computed tokens here, {count} in the core")
        # The runner must see these objects, not the pickled copies of the same requests.
        output.new_requests = [self.requests[r.request_id] for r in output.new_requests]

    def after(self, output: SchedulerOutput, result: RunnerOutput) -> None:
        for request_id, count in output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request_id in result.failed:
                del self.requests[request_id]
                continue
            tokens = emitted_tokens(request_id, result.sampled, result.spec_sampled)
            request.num_computed_tokens += computed_advance(count, len(output.scheduled_spec_tokens.get(request_id, ())),
                                                            len(tokens))
            for token in tokens:
                request.append_output_token(token)


@dataclass(frozen=True)
class RankPlacement:
    """Where a rank runs, as its executor placed it. ``local_rank`` / ``local_size``: its index
    among the engine's ranks on its node, and how many there are (its slice of the node's cores);
    ``same_node``: every rank of the group shares one node (the shared-memory exchange for
    collectives); ``remote_media``: not on the engine core's node, so media blocks come with the
    step (multimodal/shipped.py); ``device_index``: None for ``config.rank_device(rank)``, else
    the index within what the placement made visible (Ray narrows each actor's devices to its own)."""

    rank: int
    local_rank: int
    local_size: int
    same_node: bool = True
    remote_media: bool = False
    device_index: int | None = None

    @classmethod
    def on_one_node(cls, rank: int, size: int) -> "RankPlacement":
        return cls(rank, rank, size)


def _bind_cpu_threads(config: EngineConfig, placement: RankPlacement) -> None:
    """CPU: each rank takes its own slice of its node's cores (``num_threads`` / TP threads, at
    least one)."""
    per_rank = max(1, config.num_threads // config.tensor_parallel_size)
    torch.set_num_threads(per_rank)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= per_rank * placement.local_size:
        os.sched_setaffinity(0, cores[placement.local_rank * per_rank:(placement.local_rank + 1) * per_rank])


class Rank:
    """One tensor-parallel rank from joining its group to leaving it, whatever process hosts it:
    the ``mp`` rank process (``executor/multiproc.py``) and the Ray actor (``executor/ray.py``)
    both drive one. ``load`` / ``initialize`` are the executor's two start-up stages, ``execute``
    runs one step on this rank's mirror of the running requests (the calls a ``Worker`` answers
    in the core's process at TP = 1)."""

    def __init__(self, config: EngineConfig, placement: RankPlacement, init_method: str, timeout_s: float):
        platform = platform_for(config.device)
        if platform.name == "cpu":
            _bind_cpu_threads(config, placement)
        else:
            torch.set_num_threads(max(1, available_cores() // placement.local_size))
        device = config.rank_device(placement.rank) if placement.device_index is None else placement.device_index
        platform.bind_device(device)
        init_tensor_parallel(placement.rank, config.tensor_parallel_size, platform.dist_backend, init_method,
                             timeout_s, same_node=placement.same_node, expert_parallel=config.enable_expert_parallel)
        torch.manual_seed(_GLOBAL_SEED)
        self.rank = placement.rank
        self.worker = Worker(config, device, remote_media=placement.remote_media)
        self.mirror = RequestMirror()

    def load(self) -> WorkerInfo:
        return self.worker.load()

    def initialize(self, num_blocks: int) -> str:
        return self.worker.initialize(num_blocks)

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        self.mirror.before(output)
        result = self.worker.execute(output)
        self.mirror.after(output, result)
        return result

    def answer(self, result: RunnerOutput) -> RunnerOutput | None:
        """What this rank sends back for a step: rank 0 its whole result; with a KV connector the
        other ranks their connector's report alone (the executor merges them); else nothing."""
        if self.rank == 0:
            return result
        if self.worker.runner.kv_connector is not None:
            return RunnerOutput(kv_connector_output=result.kv_connector_output)
        return None

    def propose(self, request_ids: list[str], num_tokens: list[int], max_drafts: list[int]) -> list[list[int]]:
        """A head's drafts on this rank, for sequences the mirror holds (``num_tokens``: the
        core's lengths, checked: a divergence fails loudly)."""
        token_ids = []
        for request_id, count in zip(request_ids, num_tokens):
            request = self.mirror.requests[request_id]
            if request.num_tokens != count:
                raise RuntimeError(f"rank state diverged: request {request_id} has {request.num_tokens} tokens "
                                   f"here, {count} in the core")
            token_ids.append(request.all_token_ids)
        return self.worker.propose(request_ids, token_ids, max_drafts)

    def close(self) -> None:
        try:
            self.worker.shutdown()
        finally:
            destroy_tensor_parallel()

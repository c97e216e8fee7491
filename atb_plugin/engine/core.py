"""``EngineCore``: token ids in, token ids out. Scheduler + KV cache manager + model runner.

    add_request(EngineCoreRequest) ──► Scheduler.waiting
    step():  Scheduler.schedule ─► ModelRunner.execute ─► Scheduler.update_from_output
             (append tokens, stop checks, free blocks) ─► [EngineCoreOutput]
    abort(ids) ──► Scheduler.finish(ABORTED)

A structured-output request (``SamplingParams.structured_outputs``) has its grammar compiled on a
background thread by the ``StructuredOutputManager``; the scheduler holds it back until then, the
runner masks its logits to the grammar and advances its matcher with each sampled token.

No tokenizer, no ``ShmStore``, no text: the frontend owns those, either the offline ``LLM``
(``atb_plugin.frontend.llm``) calling this class in its own process, or the service's frontend
talking over IPC to the engine-core process (``atb_plugin.engine.process``), which wraps this
class in a busy loop. Pixels are read by the model runner through ``atb_plugin.multimodal`` from
the segments each request registered. The KV budget comes from the start-up memory profile
(``atb_plugin.engine.memory_profile``).
"""

from __future__ import annotations

import logging

import torch

from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.kv_cache_manager import KVCacheManager
from atb_plugin.engine.memory_profile import MiB, kv_bytes_per_block, kv_cache_budget
from atb_plugin.engine.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from atb_plugin.engine.model_runner import ModelRunner
from atb_plugin.engine.request import Request, RequestStatus
from atb_plugin.engine.scheduler import Scheduler
from atb_plugin.engine.structured_output import StructuredOutputManager
from atb_plugin.engine.structured_output import check as check_structured_outputs
from atb_plugin.models import registry
from atb_plugin.models.pooling_adapters import as_pooling_model
from atb_plugin.platform import platform_for
from atb_plugin.pooling.config import pooler_config
from atb_plugin.utils import cdiv

logger = logging.getLogger(__name__)

# A step that ran nothing waits this long at most for a grammar compile, rather than spinning
# (the engine process's loop reads aborts and new requests between steps).
_COMPILE_WAIT_S = 0.05
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_model(config: EngineConfig, device):
    """The model ``config`` names, on ``device``, and its pooler on a pooling runner (None when
    generating): a native pooling class as it is, a generative one through its convert adapter,
    pooled as the checkpoint's own pooling files say (else the class default)."""
    model_cls = registry.import_model_class(config.model_cls_path)
    pooling = config.runner == "pooling"
    hf_config = config.checkpoint_config() if pooling else {}
    if pooling:
        model_cls = as_pooling_model(model_cls, config.convert, hf_config)
    model = model_cls.from_pretrained(config.model, dtype=_TORCH_DTYPES[config.dtype], device=device)
    if not pooling:
        model.get_language_model().share_tied_lm_head()  # a swapped-in head (packing) is the tied one too
    # Before the pooler is built: it must hold the modules the platform swapped in.
    platform_for(config.device).prepare_model(model, pack_weights=config.pack_weights)
    pooler = model.build_pooler(pooler_config(config.model, model_cls.default_pooling_type,
                                              hf_config.get("pooler_config"))) if pooling else None
    return model, pooler


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        # The engine owns the intra-op threads (the frontend processes keep one each).
        torch.set_num_threads(config.num_threads)
        device = platform_for(config.device).device()
        self.model, self.pooler = load_model(config, device)
        self.kv_cache_blocks = config.kv_cache_blocks or self._blocks_for_budget()
        self.kv_cache_manager = KVCacheManager(self.kv_cache_blocks, config.block_size, config.enable_prefix_caching)
        # Compiling a grammar on the CPU platform takes cores from the model's threads: one thread
        # there (a slower compile), xgrammar's default 8 where the model runs on a device.
        self.structured_output = StructuredOutputManager(config.model, config.vocab_size,
                                                         compile_threads=1 if device.type == "cpu" else 8)
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager, self.structured_output.is_ready)
        self.runner = ModelRunner(self.model, config, self.kv_cache_blocks, self.pooler, self.structured_output)
        logger.info("engine core: %s on %s (runner %s%s), %d KV blocks of %d tokens", type(self.model).__name__, device,
                    config.runner, f", tasks {', '.join(self.pooler.tasks)}" if self.pooler else "",
                    self.kv_cache_blocks, config.block_size)

    def _blocks_for_budget(self) -> int:
        """Blocks that fit the KV budget (``memory_profile.kv_cache_budget``: ``kv_cache_bytes`` on the
        CPU, what the start-up memory profile leaves of ``gpu_memory_utilization`` of the device
        memory on NPU / CUDA), but no more than every sequence at full length needs. A budget that
        cannot hold one ``max_model_len`` request is a start-up error naming what it needs."""
        config = self.config
        bytes_per_block = kv_bytes_per_block(self.model, config.block_size)
        per_request = cdiv(config.max_model_len, config.block_size)
        needed = config.max_num_seqs * per_request
        if bytes_per_block == 0:  # an encoder keeps no KV: blocks are bookkeeping only, cost nothing
            return 1 + needed
        budget = kv_cache_budget(self.model, config, platform_for(config.device))
        if budget.bytes // bytes_per_block < per_request:
            raise ValueError(
                f"max_model_len {config.max_model_len} needs {per_request} KV blocks x {bytes_per_block} bytes = "
                f"{per_request * bytes_per_block / MiB:.1f} MiB of KV cache, but the budget is {budget.describe()}: "
                f"raise {budget.flag} or lower --max-model-len")
        blocks = min(budget.bytes // bytes_per_block, needed)
        logger.info("KV cache: %d blocks x %d bytes = %.1f MiB (budget %s; weights %.1f MiB)", blocks,
                    bytes_per_block, blocks * bytes_per_block / MiB, budget.describe(), budget.weight_bytes / MiB)
        return 1 + blocks  # + the null block

    @property
    def max_tokens_per_request(self) -> int:
        """The most tokens one request can ever hold (KV capacity, capped by max_model_len):
        a frontend refuses prompt + max_tokens beyond it up front."""
        return min(self.config.max_model_len, (self.kv_cache_blocks - 1) * self.config.block_size)

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, message: EngineCoreRequest) -> None:
        """Queue a request. ``ValueError`` for one the core can never run (the prompt fills the
        context window, or it can outgrow the KV cache, or it names token ids outside the vocabulary):
        the caller's mistake, reported to it."""
        vocab = self.config.vocab_size
        bad = [t for t in message.prompt_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (size {vocab})")
        params = message.sampling_params
        if params is not None:
            params.check_vocabulary(vocab)
            if params.structured_outputs is not None:
                check_structured_outputs(params.structured_outputs)  # the compile itself runs later, off the loop
        self.config.check_task(message.pooling_params)
        request = Request.from_engine_core_request(message)
        self.scheduler.add_request(request)
        self.structured_output.register(request)

    def abort(self, request_ids) -> None:
        """End these requests now (unknown or finished ids are ignored: an abort can race a finish)."""
        for request_id in request_ids:
            self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
            self.structured_output.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the loop --------------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        scheduled = self.scheduler.schedule()
        result = self.runner.execute(scheduled)
        result.failed.update(self.structured_output.pop_compile_errors())
        outputs = self.scheduler.update_from_output(scheduled, result.sampled, result.logprobs, result.failed,
                                                    result.pooled, prompt_logprobs=result.prompt_logprobs)
        for output in outputs:
            if output.finished:
                self.structured_output.remove(output.request_id)
        if not scheduled.num_scheduled_tokens:
            self.structured_output.wait_for_compile(_COMPILE_WAIT_S)
        return outputs

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()


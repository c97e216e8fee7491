"""``EngineCore``: token ids in, token ids out. Scheduler + KV cache manager + model runner.

    add_request(EngineCoreRequest) ──► Scheduler.waiting
    step():  Scheduler.schedule ─► ModelRunner.execute ─► Scheduler.update_from_output
             (append tokens, stop checks, free blocks) ─► [EngineCoreOutput]
    abort(ids) ──► Scheduler.finish(ABORTED)

No tokenizer, no ``ShmStore``, no text: the frontend (the offline ``LLM`` in the same process,
or the server's API process over IPC) owns those. Pixels are read by the model runner through
``atb_plugin.multimodal`` from the segments each request registered. The same class runs in both
places; ``atb_plugin.server.engine_process`` wraps it in a busy loop.
"""

from __future__ import annotations

import logging

import torch

from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.kv_cache_manager import KVCacheManager
from atb_plugin.engine.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from atb_plugin.engine.model_runner import ModelRunner
from atb_plugin.engine.request import Request, RequestStatus
from atb_plugin.engine.scheduler import Scheduler
from atb_plugin.models import registry
from atb_plugin.platform import platform_for
from atb_plugin.utils import cdiv

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        device = platform_for(config.device).device()
        model_cls = registry.import_model_class(config.model_cls_path)  # config.json was read once, by the config
        self.model = model_cls.from_pretrained(config.model, dtype=_TORCH_DTYPES[config.dtype], device=device)
        self.kv_cache_blocks = config.kv_cache_blocks or self._blocks_for_budget()
        self.kv_cache_manager = KVCacheManager(self.kv_cache_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager)
        self.runner = ModelRunner(self.model, config, self.kv_cache_blocks)
        logger.info("engine core: %s on %s, %d KV blocks of %d tokens", model_cls.__name__, device,
                    self.kv_cache_blocks, config.block_size)

    def _blocks_for_budget(self) -> int:
        """Blocks that fit ``kv_cache_bytes``, but no more than every sequence at full length needs."""
        probe = self.model.make_kv_caches(1, self.config.block_size)
        bytes_per_block = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in probe)
        needed = self.config.max_num_seqs * cdiv(self.config.max_model_len, self.config.block_size)
        return 1 + max(1, min(self.config.kv_cache_bytes // bytes_per_block, needed))  # + the null block

    @property
    def max_tokens_per_request(self) -> int:
        """The most tokens one request can ever hold (KV capacity, capped by max_model_len):
        a frontend refuses prompt + max_tokens beyond it up front."""
        return min(self.config.max_model_len, (self.kv_cache_blocks - 1) * self.config.block_size)

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, message: EngineCoreRequest) -> None:
        """Queue a request. ``ValueError`` for one the core can never run (the prompt fills the
        context window, or it can outgrow the KV cache): the caller's mistake, reported to it."""
        vocab = self.config.vocab_size
        bad = [t for t in message.prompt_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (size {vocab})")
        self.scheduler.add_request(Request.from_engine_core_request(message))

    def abort(self, request_ids) -> None:
        """End these requests now (unknown or finished ids are ignored: an abort can race a finish)."""
        for request_id in request_ids:
            self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the loop --------------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        scheduled = self.scheduler.schedule()
        result = self.runner.execute(scheduled)
        return self.scheduler.update_from_output(scheduled, result.sampled, result.logprobs, result.failed)

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

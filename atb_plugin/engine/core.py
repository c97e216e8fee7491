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
import time

from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.executor import make_executor
from atb_plugin.engine.kv_cache_manager import KVCacheManager
from atb_plugin.engine.kv_transfer.base import KV_TRANSFER_POLL_S, ConnectorContext, KVConnectorBase, KVConnectorRole
from atb_plugin.engine.kv_transfer.factory import create_connector
from atb_plugin.engine.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from atb_plugin.engine.request import Request, RequestStatus
from atb_plugin.engine.scheduler import Scheduler, emitted_tokens
from atb_plugin.engine.spec_decode.proposer import Proposer, make_proposer
from atb_plugin.engine.structured_output import GrammarViolation, StructuredOutputManager
from atb_plugin.engine.structured_output import check as check_structured_outputs
from atb_plugin.platform import platform_for

logger = logging.getLogger(__name__)

# A step that ran nothing waits this long at most for a grammar compile, rather than spinning
# (the engine process's loop reads aborts and new requests between steps).
_COMPILE_WAIT_S = 0.05
class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        # The model runs in this process (TP = 1) or on tensor-parallel ranks (engine/executor/).
        self.executor = make_executor(config)
        try:
            self.kv_cache_blocks = self.executor.kv_cache_blocks
            self.kv_cache_manager = KVCacheManager(self.kv_cache_blocks, config.block_size,
                                                   config.enable_prefix_caching)
            # Compiling a grammar on the CPU platform takes cores from the model's threads: one
            # thread there (a slower compile), xgrammar's default 8 where the model runs on a device.
            on_cpu = platform_for(config.device).name == "cpu"
            self.structured_output = StructuredOutputManager(config.model, config.vocab_size,
                                                             compile_threads=1 if on_cpu else 8)
            # The scheduler side of the KV connector (docs/kv-transfer.md); its worker side lives
            # in each rank's model runner.
            self.kv_connector: KVConnectorBase | None = None
            if config.kv_transfer_config is not None:
                self.kv_connector = create_connector(config.kv_transfer_config, KVConnectorRole.SCHEDULER,
                                                     ConnectorContext(config.model, config.block_size,
                                                                      self.kv_cache_blocks, config.tensor_parallel_size,
                                                                      0, config.data_parallel_rank,
                                                                      self.executor.kv_block_bytes,
                                                                      self.executor.kv_block_layout))
            self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager, self.structured_output.is_ready,
                                       connector=self.kv_connector)
            # Speculative decoding: drafts are asked for here, in the core (made here, or by a head
            # on the ranks under TP: rank 0's come back), and travel with the step to every rank
            # (one set of drafts, no rank can disagree about them).
            self.proposer: Proposer | None = None
            if config.speculative_config is not None:
                self.proposer = make_proposer(config, self.kv_cache_blocks, self.executor)
        except BaseException:
            self.executor.shutdown()
            raise
        logger.info("engine core: %s on %s x %d (runner %s, tasks %s), %d KV blocks of %d tokens, decode step: %s",
                    config.architecture, config.device, config.tensor_parallel_size, config.runner,
                    ", ".join(config.tasks), self.kv_cache_blocks, config.block_size, self.executor.decode_capture)

    @property
    def runner(self):
        """The model runner when it runs in this process (TP = 1), else None (it runs on ranks)."""
        return self.executor.runner

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks (at TP = 1: release the runner's KV connector)."""
        try:
            if getattr(self, "kv_connector", None) is not None:
                self.kv_connector.shutdown()
        finally:
            self.executor.shutdown()

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

    def has_pending_kv_transfers(self) -> bool:
        """Finished requests whose KV blocks a connector still reads: keep stepping (empty steps
        run no model, only the workers' connector polls) until they are freed."""
        return self.scheduler.has_pending_kv_transfers()

    # -- the loop --------------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        scheduled = self.scheduler.schedule()
        # Masks of every scheduled structured request (one in a prefill chunk short of its prompt's
        # end samples nothing: its row goes unused).
        scheduled.grammar_bitmask = self.structured_output.grammar_bitmask(
            [self.scheduler.requests[r] for r in scheduled.num_scheduled_tokens], scheduled.scheduled_spec_tokens)
        result = self.executor.execute(scheduled)
        # A failed KV load voids its requests' step before anything reads their tokens.
        kv_outputs, voided = self.scheduler.update_from_kv_connector_output(result.kv_connector_output)
        for request_id in voided:
            result.drop(request_id)
        self._advance_grammars(result)
        result.failed.update(self.structured_output.pop_compile_errors())
        outputs = kv_outputs + self.scheduler.update_from_output(scheduled, result.sampled, result.logprobs, result.failed,
                                                    result.pooled, prompt_logprobs=result.prompt_logprobs,
                                                    spec_sampled=result.spec_sampled,
                                                    spec_logprobs=result.spec_logprobs)
        for output in outputs:
            if output.finished:
                self.structured_output.remove(output.request_id)
        if not scheduled.num_scheduled_tokens:
            self.structured_output.wait_for_compile(_COMPILE_WAIT_S)
            if self.scheduler.has_requests_receiving_kv() or self.scheduler.has_pending_kv_transfers():
                time.sleep(KV_TRANSFER_POLL_S)
        if self.proposer is not None:
            self._propose()
        return outputs

    def _propose(self) -> None:
        """Drafts for the next step of every running request that decodes: at most k, and never
        so many that an accepted run could pass max_tokens or the context window (a verify step
        emits up to drafts + 1 tokens). A structured request's drafts are cut to what its
        grammar accepts; its masks then cover every verified position."""
        k = self.config.speculative_config.num_speculative_tokens
        max_len = self.config.max_model_len
        decoding, limits = [], []
        for request in self.scheduler.running:
            params = request.sampling_params
            if (params is None or not request.output_token_ids
                    or request.num_computed_tokens != request.num_tokens - 1):
                continue
            limit = min(k, max_len - request.num_tokens - 1)
            if params.max_tokens is not None:
                limit = min(limit, params.max_tokens - request.num_output_tokens - 1)
            if limit > 0:
                decoding.append(request)
                limits.append(limit)
        if decoding:
            drafts = self.proposer.propose([r.request_id for r in decoding], [r.all_token_ids for r in decoding],
                                           limits)
            for request, tokens in zip(decoding, drafts):
                request.spec_token_ids = self.structured_output.validate_drafts(request, tokens)

    def _advance_grammars(self, result) -> None:
        """Feed each sampled token to its request's grammar. A token the grammar refuses (the
        other constraints left it no choice: ``GrammarViolation``) fails that request alone.
        Preemption recomputes the KV but keeps the output tokens, which the matcher has accepted
        already: it never needs a rollback."""
        for request_id in list(result.sampled):
            try:
                for emitted in emitted_tokens(request_id, result.sampled, result.spec_sampled):
                    self.structured_output.accept(self.scheduler.requests[request_id], emitted)
            except GrammarViolation as error:
                result.failed[request_id] = str(error)
                del result.sampled[request_id]
                result.logprobs.pop(request_id, None)
                result.spec_sampled.pop(request_id, None)

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()


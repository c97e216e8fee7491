"""The model runner: one scheduler step on the device.

    SchedulerOutput ──► update the InputBatch (rows, block tables, new tokens)
                    ──► prepare_inputs (positions, slots, attention metadata: vectorised)
                    ──► embeddings (text + image features of the chunk's media blocks)
                    ──► model forward over the paged KV cache ──► logits of sampling requests
                    ──► grammar bitmask (structured requests) ──► sampler ──► one token per
                    sampling request ──► the structured requests' grammar matchers
                    (pooling runner: hidden states ──► DispatchPooler ──► one result per request)

A request whose media block is bad fails alone (``RunnerOutput.failed``); the rest of the
batch runs.

With a KV connector (docs/kv-transfer.md) its worker side wraps every step, an empty one too:
bind the step's metadata, ``start_load_kv`` before the forward, ``wait_for_save`` after it, then
the finished transfers, the blocks whose load failed and the stats into
``RunnerOutput.kv_connector_output``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.graph_runner import make_graph_runner
from atb_plugin.engine.input_batch import InputBatch
from atb_plugin.engine.kv_transfer.base import (ConnectorContext, KVConnectorBase, KVConnectorOutput, KVConnectorRole,
                                                kv_block_layout)
from atb_plugin.engine.kv_transfer.factory import create_connector
from atb_plugin.engine.messages import KVTransferStats, LogprobsEntry, PooledData
from atb_plugin.engine.prepare_inputs import prepare_inputs
from atb_plugin.engine.request import Request
from atb_plugin.engine.sampler import Sampler, make_generator
from atb_plugin.engine.scheduler import SchedulerOutput
from atb_plugin.engine.spec_decode.loading import SpecModel
from atb_plugin.engine.spec_decode.rejection_sampler import RejectionSampler, VerifyRequest
from atb_plugin.distributed import tp_rank, tp_size
from atb_plugin.models.interfaces import SupportsMedia, SupportsMRoPE, SupportsTokenTypes
from atb_plugin.models.poolers import DispatchPooler, PoolingBatch
from atb_plugin.multimodal import MediaBlockError, MultimodalPrompt
from atb_plugin.multimodal.shipped import MediaReader, read_shared_memory, shipped_reader
from atb_plugin.ops import AttentionMetadata
from atb_plugin.platform import platform_for

logger = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, object] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why
    pooled: dict[str, PooledData] = field(default_factory=dict)
    # Per request computing its prompt (SamplingParams.prompt_logprobs): the entries of the prompt
    # tokens this step's chunk [start, end) predicts, i.e. of positions start + 1 .. (at most the
    # prompt's end); [] for a chunk that predicts none (its only position is the prompt's last).
    prompt_logprobs: dict[str, list[LogprobsEntry]] = field(default_factory=dict)
    # Per request that verified speculative drafts: the tokens it emits after ``sampled``'s (the
    # accepted drafts past the first emitted token, then the target's own), and their logprobs.
    spec_sampled: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list] = field(default_factory=dict)
    # The KV connector's report of the step (None without a connector); under TP the executor
    # merges every rank's (kv_transfer/base.py, KVOutputAggregator).
    kv_connector_output: KVConnectorOutput | None = None

    def drop(self, request_id: str) -> None:
        """Forget what the step produced for ``request_id`` (its KV load failed: garbage)."""
        for results in (self.sampled, self.logprobs, self.pooled, self.prompt_logprobs, self.spec_sampled,
                        self.spec_logprobs):
            results.pop(request_id, None)


# Prompt positions whose logits are computed at once: a 2048-token chunk would otherwise need
# 2048 x vocab floats (1.2 GiB for a 150k vocabulary) next to the step's activations.
_PROMPT_LOGITS_ROWS = 256


def readable_instances(config: EngineConfig, request: Request) -> tuple[str, ...]:
    """The shm instances ``request`` may read: those its frontend registered, narrowed to the
    config's pinned set when there is one. Empty: no segment is acceptable."""
    pinned = config.shm_instances
    return tuple(i for i in request.shm_instances if not pinned or i in pinned)


@dataclass
class _RequestState:
    request: Request
    media: MultimodalPrompt | None = None
    mrope_positions: torch.Tensor | None = None  # (3, num_prompt_tokens)
    rope_delta: int = 0


class ModelRunner:
    """Contract: ``execute(scheduler_output)`` runs one step and returns a ``RunnerOutput``;
    it keeps per-request device state (batch row, media features, M-RoPE positions, sampling
    generator) from a request's first scheduling until the scheduler reports it finished.
    With a ``pooler`` (the pooling runner) its requests' hidden states are pooled instead of
    sampled. A structured request's logits are masked to its grammar before sampling
    (``SchedulerOutput.grammar_bitmask``, made by the core, which also advances the grammar with
    the sampled token)."""

    def __init__(self, model, config: EngineConfig, num_blocks: int, pooler: DispatchPooler | None = None,
                 remote_media: bool = False, spec_model: SpecModel | None = None, lora=None):
        self.model = model
        # Speculative decoding's draft or head (the engine core's proposer drives it); a head
        # drafts from the target's hidden states, recorded here after each step.
        self.spec_model = spec_model
        self.target_hidden = spec_model.hidden_states if spec_model is not None else None
        # The LoRA adapters' slots (lora/manager.py, LoRAManager) when the engine serves them.
        self.lora = lora
        # A rank on another node than the engine core reads media blocks from the step
        # (SchedulerOutput.shipped_media), not from this node's shared memory (multimodal/shipped.py).
        self.remote_media = remote_media
        self.config = config
        self.device = next(model.parameters()).device
        self.block_size = config.block_size
        self.kv_caches = model.make_kv_caches(num_blocks, config.block_size)
        # The worker side of the KV connector: this rank's shard of the cache, registered once.
        self.kv_connector: KVConnectorBase | None = None
        if config.kv_transfer_config is not None:
            self.kv_connector = create_connector(config.kv_transfer_config, KVConnectorRole.WORKER, ConnectorContext(
                config.model, config.block_size, num_blocks, tp_size(), tp_rank(), config.data_parallel_rank,
                *kv_block_layout(self.kv_caches)))
            self.kv_connector.register_kv_caches(self.kv_caches)
        # The captured decode step: made once, over these caches, which are never reallocated.
        # NPU / CUDA: a device graph per batch size (engine/graph_runner.py); the CPU: its native
        # plan (models/native_decode.py). compilation_config says whether (enforce_eager: never).
        platform = platform_for(config.device)
        self.graphs = None
        compilation = config.compilation_config
        if config.enforce_eager:
            self.decode_capture = "off (enforce_eager)"
        elif not compilation.captures and compilation.explicit:
            self.decode_capture = "off (cudagraph_mode NONE)"
        elif not compilation.captures:  # the platform's default (the simulated NPU's: NONE)
            self.decode_capture = f"eager (no captured decode step on {platform.name} yet)"
        elif pooler is not None:
            self.decode_capture = "off (pooling)"
        elif platform.device_graphs() is not None and (why := getattr(
                model.get_language_model(), "no_decode_graphs", None)) is not None:
            # Even when asked for: capturing would bake one step's host-derived gathers into the graph.
            logger.warning("decode graphs: %s; decode runs eager", why)
            self.decode_capture = f"eager ({why})"
        elif platform.device_graphs() is not None:
            self.graphs, self.decode_capture = make_graph_runner(model, self.kv_caches, config, platform, self.device,
                                                                 isinstance(model, SupportsMRoPE))
        elif self.target_hidden is not None and self.target_hidden.reads_layers:
            self.decode_capture = "eager (EAGLE-3 reads intermediate layers)"
        elif not platform.captures_decode_step:
            self.decode_capture = f"eager (no captured decode step on {platform.name})"
        else:
            # A verify step runs captured too, one row per query token (_one_query_per_row).
            spec = config.speculative_config
            rows = config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))
            self.decode_capture = model.get_language_model().capture_decode_step(self.kv_caches, rows)
        logger.info("decode step: %s", self.decode_capture)
        self.input_batch = InputBatch(config.max_num_seqs, config.max_model_len, config.block_size)
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.layout = model.media_layouts if isinstance(model, SupportsMedia) else None
        self.uses_mrope = isinstance(model, SupportsMRoPE)
        self.pooler = pooler
        self.uses_token_types = isinstance(model, SupportsTokenTypes)
        self.states: dict[str, _RequestState] = {}
        # Per request, made once and advanced only by its own sampling, kept across preemption:
        # a seeded request draws the same stream whatever its batch and however often it is
        # recomputed (restarting from the seed would replay draws already spent on its tokens).
        self.generators: dict[str, torch.Generator | None] = {}

    # -- batch bookkeeping -----------------------------------------------------------------------

    def _add(self, request: Request, block_ids: list[int], read: MediaReader) -> None:
        state = _RequestState(request)
        prompt = request.prompt_token_ids
        if self.layout is not None and min(prompt) < 0:
            state.media = MultimodalPrompt.from_ids(prompt, self.layout, expected_instance=readable_instances(
                self.config, request), read=read)
            # The encoder runs once, now (a bad block fails here), on the blocks the prefix cache
            # does not already hold: a resent image costs no second encoder pass.
            state.media.features(self.model, cached_tokens=request.num_computed_tokens)
            prompt = state.media.token_ids.tolist()
        elif min(prompt) < 0:
            raise MediaBlockError(f"the prompt has media handles but {type(self.model).__name__} takes no images")
        if self.uses_mrope and state.media is None:
            # Text only: an image / video pad id in it (sent as text, or sampled and recomputed
            # after a preemption) is text, as transformers positions it without pixel values.
            state.mrope_positions, state.rope_delta = self.model.decode_positions(0, len(prompt), 0).contiguous(), 0
        elif self.uses_mrope:
            blocks = state.media.blocks
            state.mrope_positions, state.rope_delta = self.model.get_mrope_positions(
                torch.tensor(prompt), [block.grid_thw for block in blocks],
                second_per_grid_ts=[block.second_per_grid_t for block in blocks])
        if request.request_id not in self.generators and not request.is_pooling:
            self.generators[request.request_id] = make_generator(request.sampling_params.seed, device=self.device)
        self.input_batch.add_request(request.request_id, prompt + request.output_token_ids,
                                     request.num_computed_tokens, block_ids)
        self.states[request.request_id] = state

    def _remove(self, request_id: str) -> None:
        if self.states.pop(request_id, None) is not None:
            self.input_batch.remove_request(request_id)

    def _update_batch(self, output: SchedulerOutput, result: RunnerOutput) -> None:
        for request_id in output.finished_request_ids:
            self.generators.pop(request_id, None)
        for request_id in output.finished_request_ids + output.preempted_request_ids:
            self._remove(request_id)
            if self.target_hidden is not None:
                self.target_hidden.drop(request_id)
        new_ids = set()
        read = shipped_reader(output.shipped_media) if self.remote_media else read_shared_memory
        for request in output.new_requests:
            self._remove(request.request_id)  # a preempted request comes back with fresh state
            try:
                self._add(request, output.new_block_ids[request.request_id], read)
            except MediaBlockError as error:
                result.failed[request.request_id] = str(error)
            new_ids.add(request.request_id)
        for request_id in output.num_scheduled_tokens:
            if request_id in new_ids or request_id not in self.states:
                continue
            self.input_batch.append_block_ids(request_id, output.new_block_ids.get(request_id, []))
            self.input_batch.set_num_computed_tokens(request_id, self.states[request_id].request.num_computed_tokens)

    # -- the step --------------------------------------------------------------------------------

    @torch.no_grad()
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        result = RunnerOutput()
        self._update_batch(output, result)
        connector = self.kv_connector
        if connector is None:
            return self._run(output, result)
        connector.bind_connector_metadata(output.kv_connector_metadata)
        try:
            connector.start_load_kv()  # before the forward reads the loaded blocks
            self._run(output, result)
            connector.wait_for_save()
            sending, recving = connector.get_finished(set(output.finished_request_ids))
            result.kv_connector_output = KVConnectorOutput(
                set(sending), set(recving), set(connector.get_block_ids_with_load_errors()),
                set(connector.get_stored_block_hashes()), KVTransferStats.from_value(connector.get_stats()))
        finally:
            connector.clear_connector_metadata()
        return result

    def shutdown(self) -> None:
        """Release what the KV connector's worker side holds (threads, files, registrations)."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    def _run(self, output: SchedulerOutput, result: RunnerOutput) -> RunnerOutput:
        """The step's forward and sampling (none when it schedules no rows)."""
        request_ids = [r for r in output.num_scheduled_tokens if r in self.states and r not in result.failed]
        lora_slots: list[int] = []
        if self.lora is not None:
            request_ids, lora_slots = self._lora_slots(request_ids, result)
        if not request_ids:
            return result
        counts = [output.num_scheduled_tokens[r] for r in request_ids]
        verifying = {r: output.scheduled_spec_tokens[r] for r in request_ids if r in output.scheduled_spec_tokens}
        for request_id, drafts in verifying.items():  # read by prepare_inputs as the step's input ids
            self.input_batch.set_tokens(request_id, self.states[request_id].request.num_tokens, drafts)
        prepared = prepare_inputs(self.input_batch, request_ids, counts, device=self.device)
        metadata = prepared.attn_metadata
        # Adapted rows: the captured CPU step holds the adapters (models/native_decode.py), a
        # device graph does not (those steps run eager).
        adapted = any(slot >= 0 for slot in lora_slots)
        if verifying and self.decode_capture == "captured" and all(
                count == 1 or request_id in verifying for request_id, count in zip(request_ids, counts)):
            metadata = _one_query_per_row(prepared)
        spans = self._spans(request_ids, counts)
        positions = self._mrope_positions(spans) if self.uses_mrope else prepared.positions
        inputs_embeds = self._embeddings(prepared.input_ids, spans)
        graphed = None
        if self.graphs is not None and inputs_embeds is None and not self.uses_token_types and not adapted:
            graphed = self.graphs.run(prepared.input_ids, positions, prepared.attn_metadata)
        if graphed is not None:
            hidden = graphed
        elif self.uses_token_types:
            hidden = self.model.forward_with_token_types(prepared.input_ids, positions, self.kv_caches,
                                                         metadata, self._token_types(spans, prepared))
        else:
            # With LoRA, each row through its own adapter (lora/manager.py: LoRAManager.step).
            with self.lora.step(lora_slots, counts) if self.lora is not None else contextlib.nullcontext():
                hidden = self.model(prepared.input_ids, positions, self.kv_caches, metadata, inputs_embeds=inputs_embeds)

        if self.pooler is not None:  # a pooling runner: every request pools (EngineConfig.check_task)
            self._pool(hidden, prepared, spans, result)
            return result
        features = self.target_hidden.features(hidden) if self.target_hidden is not None else None
        self._prompt_logprobs(hidden, spans, result)
        sampling = [i for i, samples in enumerate(prepared.samples) if samples and request_ids[i] not in verifying]
        if verifying:
            self._verify(hidden, prepared, request_ids, verifying, output.grammar_bitmask, result)
        if sampling:
            logits = self.model.compute_logits(hidden[prepared.logits_indices[sampling]])
            states = [self.states[request_ids[i]] for i in sampling]
            if output.grammar_bitmask is not None:
                output.grammar_bitmask.apply(logits, [s.request.request_id for s in states])
            sampled = self.sampler.sample(
                logits,
                [s.request.sampling_params for s in states],
                [self.generators[s.request.request_id] for s in states],
                [s.request.num_output_tokens for s in states],
                [s.request.eos_token_ids for s in states],
                # For penalties and bad words (negative media-handle prompt ids are ignored there).
                prompt_token_ids=[s.request.prompt_token_ids for s in states],
                output_token_ids=[s.request.output_token_ids for s in states],
            )
            for state, token, logprobs in zip(states, sampled.token_ids, sampled.logprobs):
                request_id = state.request.request_id
                result.sampled[request_id] = token
                result.logprobs[request_id] = logprobs
                self.input_batch.append_token(request_id, token)
        if features is not None:
            self._record_hidden(features, spans, verifying, result)
        return result

    def _record_hidden(self, features, spans, verifying, result: RunnerOutput) -> None:
        """A head proposer's input: each request's rows of the positions this step keeps (a
        verify step: its last token and the drafts it accepted)."""
        for state, offset, start, end in spans:
            request_id = state.request.request_id
            if request_id in result.failed:
                continue
            kept = end - start
            if request_id in verifying:
                kept = 1 + len(result.spec_sampled.get(request_id, ())) if request_id in result.sampled else 0
            self.target_hidden.record(request_id, start, features[offset:offset + kept])

    def _lora_slots(self, request_ids: list[str], result: RunnerOutput) -> tuple[list[str], list[int]]:
        """The step's requests whose adapter is in a device slot, ordered by slot, and each one's
        slot (-1: the base model); a request whose adapter fails to load fails alone
        (``result.failed``)."""
        slots, failed = self.lora.slots_for([self.states[r].request.lora_request for r in request_ids])
        for index, why in failed.items():
            result.failed[request_ids[index]] = why
        # Ordered by slot (stable): each adapter's rows are one run of the step (lora/layers.py).
        kept = sorted((i for i in range(len(request_ids)) if i not in failed), key=lambda i: slots[i])
        return [request_ids[i] for i in kept], [slots[i] for i in kept]

    def _verify(self, hidden, prepared, request_ids, verifying: dict[str, list[int]], grammar_bitmask,
                result: RunnerOutput) -> None:
        """Speculative decoding: the logits of each verifying request's last 1 + k positions
        (its last token and its k drafts) in one pass, masked per position to a structured
        request's grammar, the rejection sampler's verdict, and the batch row rewritten to the
        tokens kept (the rejected drafts' KV is overwritten later)."""
        rows, requests, row_ids, row_positions = [], [], [], []
        for i, request_id in enumerate(request_ids):
            drafts = verifying.get(request_id)
            if drafts is None:
                continue
            last = int(prepared.logits_indices_cpu[i])
            rows += range(last - len(drafts), last + 1)
            row_ids += [request_id] * (len(drafts) + 1)
            row_positions += range(len(drafts) + 1)
            request = self.states[request_id].request
            requests.append(VerifyRequest(drafts, request.sampling_params, self.generators[request_id],
                                          request.num_output_tokens, request.eos_token_ids,
                                          request.prompt_token_ids, request.output_token_ids))
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
        if grammar_bitmask is not None:
            grammar_bitmask.apply(logits, row_ids, row_positions)
        for request_id, verified in zip([r for r in request_ids if r in verifying],
                                        self.rejection_sampler.verify(logits, requests)):
            tokens = verified.token_ids
            result.sampled[request_id], result.spec_sampled[request_id] = tokens[0], tokens[1:]
            result.logprobs[request_id], result.spec_logprobs[request_id] = verified.logprobs[0], verified.logprobs[1:]
            self.input_batch.set_tokens(request_id, self.states[request_id].request.num_tokens, tokens)

    def _prompt_logprobs(self, hidden, spans, result: RunnerOutput) -> None:
        """For each request that owes its prompt logprobs and runs a prompt chunk [start, end):
        the raw logprobs (log_softmax of the logits, as for sampled tokens) of prompt token p + 1
        at each position p of the chunk whose successor is still in the prompt, with the top
        ``prompt_logprobs`` entries. Logits are made ``_PROMPT_LOGITS_ROWS`` positions at a time."""
        for state, offset, start, end in spans:
            request = state.request
            if not request.needs_prompt_logprobs or start >= request.num_prompt_tokens:
                continue
            last = min(end, request.num_prompt_tokens - 1)  # positions [start, last) predict a prompt token
            prompt = state.media.token_ids if state.media is not None else torch.tensor(request.prompt_token_ids)
            targets = prompt[start + 1:last + 1].to(self.device)
            # The sampler's entries (rank, top-k), with the request's prompt_logprobs as its top-N.
            params = [dataclasses.replace(request.sampling_params, logprobs=request.sampling_params.prompt_logprobs)]
            entries: list[LogprobsEntry] = []
            for first in range(start, last, _PROMPT_LOGITS_ROWS):
                rows = slice(first - start, min(first + _PROMPT_LOGITS_ROWS, last) - start)
                logits = self.model.compute_logits(hidden[offset + rows.start:offset + rows.stop])
                raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
                entries += Sampler.gather_logprobs(raw_logprobs, targets[rows], params * raw_logprobs.shape[0])
            result.prompt_logprobs[request.request_id] = entries

    def _pool(self, hidden, prepared, spans, result: RunnerOutput) -> None:
        """Pool the step's hidden states: each request ran its whole prompt in this step."""
        batch = PoolingBatch.from_query_start_loc(prepared.attn_metadata.query_start_loc,
                                                  [state.request.pooling_params for state, *_ in spans],
                                                  prepared.input_ids)
        for (state, *_), value in zip(spans, self.pooler(hidden, batch)):
            result.pooled[state.request.request_id] = PooledData.from_array(value.detach().cpu().numpy())

    def _token_types(self, spans, prepared) -> torch.Tensor | None:
        """``(T,)`` token types: 1 from each pair's ``token_type_start`` to its end, else 0; None
        (all 0) when the step holds no pair."""
        pairs = [(offset, end - start, state.request.token_type_start - start)
                 for state, offset, start, end in spans if state.request.token_type_start is not None]
        if not pairs:
            return None
        types = torch.zeros_like(prepared.input_ids)
        for offset, length, boundary in pairs:
            types[offset + boundary:offset + length] = 1
        return types

    def _spans(self, request_ids, counts) -> list[tuple[_RequestState, int, int, int]]:
        """(state, offset in the batch, first position, last position + 1) per request."""
        spans, offset = [], 0
        for request_id, count in zip(request_ids, counts):
            state = self.states[request_id]
            start = state.request.num_computed_tokens
            spans.append((state, offset, start, start + count))
            offset += count
        return spans

    def _mrope_positions(self, spans) -> torch.Tensor:
        pieces = []
        for state, _, start, end in spans:
            prompt_len = state.mrope_positions.shape[1]
            if start < prompt_len:
                pieces.append(state.mrope_positions[:, start:min(end, prompt_len)])
            if end > prompt_len:
                first = max(start, prompt_len)
                pieces.append(self.model.decode_positions(first, end - first, state.rope_delta))
        return torch.cat(pieces, dim=1).to(self.device)

    def _embeddings(self, input_ids, spans) -> torch.Tensor | None:
        with_media = [(s, o, a, b) for s, o, a, b in spans
                      if s.media is not None and s.media.blocks and a < s.media.token_ids.shape[0]]
        if not with_media:
            return None
        # The batch's ids are the restored prompts (_add feeds the InputBatch media.token_ids), so
        # each span's rows are already its text embeddings: only the feature rows are written.
        embeds = self.model.get_input_embeddings(input_ids)
        for state, offset, start, end in with_media:
            prompt_end = min(end, state.media.token_ids.shape[0])
            state.media.merge_features(self.model, embeds[offset:offset + prompt_end - start], start, prompt_end)
        return embeds


def _one_query_per_row(prepared) -> AttentionMetadata:
    """A verify step (and the plain decodes beside it) as a decode-only step: each query token a
    row of its own, attending to its sequence's cache up to itself (its position + 1, its
    request's block table). Exact: a step writes every row's keys and values before any row
    attends (the captured step and the eager ops alike), and a row sees no later position. So
    the captured CPU decode step runs verify steps (docs/speculative.md)."""
    seq_lens = torch.from_numpy((prepared.positions_cpu + 1).astype(np.int32))
    query_start_loc = torch.arange(prepared.num_tokens + 1, dtype=torch.int32)
    device = prepared.attn_metadata.slot_mapping.device
    return AttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens.to(device),
        block_tables=torch.from_numpy(prepared.block_tables_cpu[prepared.req_indices]).to(device),
        slot_mapping=prepared.attn_metadata.slot_mapping,
        max_query_len=1,
        max_seq_len=prepared.max_seq_len,
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )

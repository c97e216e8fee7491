"""Full decode graphs on the NPU (ACL graphs, ``torch_npu.npu.NPUGraph``) and CUDA (``torch.cuda.CUDAGraph``).

Why: a decode step is hundreds of small kernels; launched one by one from Python the host, not
the device, sets the pace (vllm-ascend measured DeepSeek-R1 W8A8 at 9.78 tokens/s per NPU eager,
38.94 with graphs). Captured once per batch size, a step is one replay.

    start-up   static buffers sized for the largest capture size: input ids, positions, slots,
               sequence lengths, block tables (device) and the host copies of the lengths; per
               size, largest first, one shared memory pool: an eager warm-up run, then the
               capture of the model's forward over those buffers (``ops.graph_capture``: the
               kernels take their graph path and leave update tasks)
    each step  a uniform step (every request ``uniform_decode_len`` new tokens: decode, or a
               speculative verify) of n tokens pads up to the nearest size S (``graph_size``);
               the buffers are refreshed (n real rows, S - n padded rows writing the null
               block), the update tasks re-launch the attention ops' host lengths
               (graph_task_update_begin/end on the NPU), the graph replays, and the first n
               rows of its output are the step's hidden states. Logits and sampling stay outside.
    eager      prefill and mixed steps, steps with media embeddings, steps above the largest size,
               and steps whose padding would not fit in the null block

Capture failure at start-up (an op the graph cannot hold, memory): eager decode and one warning,
unless ``compilation_config.cudagraph_mode`` was given explicitly: then a start-up error.
The same class runs on both platforms (``Platform.device_graphs()`` names the API); under
tensor parallelism every rank captures the same sizes and replays in step (the same scheduler
output reaches every rank).
"""

from __future__ import annotations

import logging
import time

import torch

from atb_plugin.engine.compilation_config import CompilationConfig
from atb_plugin.ops import AttentionMetadata
from atb_plugin.ops.graph_capture import GraphParams, capture
from atb_plugin.utils import cdiv

logger = logging.getLogger(__name__)
MiB = 1 << 20


class GraphCaptureFailed(RuntimeError):
    """Capture failed while the user asked for graphs explicitly (a start-up error)."""


class _Captured:
    __slots__ = ("graph", "params", "metadata", "output", "requests")

    def __init__(self, graph, params, metadata, output, requests):
        self.graph, self.params, self.metadata, self.output, self.requests = graph, params, metadata, output, requests


class GraphRunner:
    """Captures ``model``'s forward over ``kv_caches`` at every size of ``compilation`` and replays
    it (module docstring). ``capture_all()`` -> how decode runs, for the log; ``run(...)`` -> the
    step's hidden states, or None where the step runs eager. ``memory_bytes``: what the graphs
    and their buffers took (measured around the capture)."""

    def __init__(self, model, kv_caches, compilation: CompilationConfig, *, platform, device, block_size: int,
                 max_model_len: int, uses_mrope: bool):
        self.model, self.kv_caches, self.platform = model, kv_caches, platform
        self.compilation = compilation
        self.graphs_api = platform.device_graphs()
        self.q = compilation.uniform_decode_len
        self.block_size = block_size
        self.device = device
        self.num_slots = kv_caches[0][0].shape[0] * kv_caches[0][0].shape[1]
        self.captured: dict[int, _Captured] = {}
        self.memory_bytes = 0
        self.replays = 0
        tokens = compilation.max_cudagraph_capture_size
        requests = tokens // self.q
        width = cdiv(max_model_len, block_size)
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros((3, tokens) if uses_mrope else (tokens,), dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(requests, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(requests, width, dtype=torch.int32, device=device)
        # A uniform batch's query starts never change: 0, q, 2q, ...
        starts = torch.arange(0, (requests + 1) * self.q, self.q, dtype=torch.int32)
        self.query_start_loc = starts.to(device)
        self.query_start_loc_cpu = starts.clone()
        self.seq_lens_cpu = torch.zeros(requests, dtype=torch.int32)
        # Padded rows: their tokens write the null block (block 0, never read as a request's data).
        self.pad_slots = torch.arange(block_size, dtype=torch.int64, device=device)

    # -- capture ---------------------------------------------------------------------------------

    def _metadata(self, size: int) -> AttentionMetadata:
        requests = size // self.q
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:requests + 1], seq_lens=self.seq_lens[:requests],
            block_tables=self.block_tables[:requests], slot_mapping=self.slot_mapping[:size], max_query_len=self.q,
            max_seq_len=self.block_tables.shape[1] * self.block_size,
            query_start_loc_cpu=self.query_start_loc_cpu[:requests + 1], seq_lens_cpu=self.seq_lens_cpu[:requests])

    def _dummy_step(self, size: int) -> None:
        """Start-up inputs: every row a padded one of q tokens over its own fresh slots (no request
        holds KV yet, so any slot outside the null block is free to scribble on)."""
        requests = size // self.q
        self.input_ids[:size].zero_()
        self.positions[..., :size].zero_()
        usable = max(1, self.num_slots - self.block_size)
        self.slot_mapping[:size].copy_(torch.arange(size, device=self.device) % usable + self.block_size)
        self.seq_lens[:requests].fill_(self.q)
        self.seq_lens_cpu[:requests].fill_(self.q)
        self.block_tables[:requests].zero_()  # what the rows read back is never used

    def _forward(self, size: int, metadata: AttentionMetadata):
        positions = self.positions[..., :size]
        return self.model(self.input_ids[:size], positions, self.kv_caches, metadata, inputs_embeds=None)

    def capture_all(self) -> str:
        """Capture every size, largest first into one pool. Returns how decode runs."""
        started = time.perf_counter()
        before = self.platform.memory_in_use()
        pool = self.graphs_api.pool_handle()
        update_stream = self.graphs_api.stream()
        for size in reversed(self.compilation.cudagraph_capture_sizes):
            metadata = self._metadata(size)
            self._dummy_step(size)
            self._forward(size, metadata)  # warm-up: lazy caches and workspaces made outside the graph
            if self.platform.name == "cuda":
                # The graph path's own kernels (torch_kernels.captured_decode's masked SDPA) once
                # more outside the graph: CUDA loads kernel modules lazily, and a first load inside
                # the capture invalidates it (seen with an explicit kv_cache_blocks, where no memory
                # profile had run them). Not on the NPU: its graph path needs a live capture.
                with capture(GraphParams(update_stream)):
                    self._forward(size, metadata)
            self.graphs_api.synchronize()
            self._dummy_step(size)
            params = GraphParams(update_stream)
            graph = self.graphs_api.new_graph()
            with capture(params), self.graphs_api.capture(graph, pool):
                output = self._forward(size, metadata)
            self.captured[size] = _Captured(graph, params, metadata, output, size // self.q)
        self.graphs_api.synchronize()
        self.memory_bytes = max(0, self.platform.memory_in_use() - before)
        sizes = self.compilation.cudagraph_capture_sizes
        return (f"{self.platform.name} graphs: {len(sizes)} sizes up to {sizes[-1]} tokens "
                f"({self.q} per request) in {time.perf_counter() - started:.1f} s, "
                f"{self.memory_bytes / MiB:.1f} MiB")

    # -- replay ----------------------------------------------------------------------------------

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata):
        """The hidden states of a uniform step through its padded graph, or None (eager)."""
        tokens, requests = input_ids.shape[0], metadata.num_reqs
        if metadata.max_query_len != self.q or tokens != requests * self.q:
            return None
        size = self.compilation.graph_size(tokens)
        if size is None or size - tokens > self.block_size:
            return None
        captured = self.captured[size]
        if metadata.block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        self.input_ids[:tokens].copy_(input_ids)
        self.input_ids[tokens:size].zero_()
        self.positions[..., :tokens].copy_(positions)
        self.positions[..., tokens:size].zero_()
        self.slot_mapping[:tokens].copy_(metadata.slot_mapping)
        self.slot_mapping[tokens:size].copy_(self.pad_slots[:size - tokens])
        self.seq_lens[:requests].copy_(metadata.seq_lens)
        self.seq_lens[requests:captured.requests].fill_(self.q)
        self.seq_lens_cpu[:requests].copy_(metadata.seq_lens_cpu)
        self.seq_lens_cpu[requests:captured.requests].fill_(self.q)
        self._write_block_tables(metadata.block_tables, captured.requests)
        captured.params.update(captured.metadata)  # the attention ops' host lengths of this step
        captured.graph.replay()
        self.replays += 1
        return captured.output[:tokens]

    def _write_block_tables(self, tables: torch.Tensor, rows: int) -> None:
        """The step's block tables into the static buffer, zero (the null block) past each row's
        width and in the padded rows."""
        requests, width = tables.shape
        self.block_tables[:requests, :width].copy_(tables)
        self.block_tables[:requests, width:].zero_()
        self.block_tables[requests:rows].zero_()


def make_graph_runner(model, kv_caches, config, platform, device, uses_mrope: bool) -> tuple[GraphRunner | None, str]:
    """A ``GraphRunner`` with every size captured, or None and how decode runs instead. A capture
    that fails falls back to eager decode with one warning, or raises ``GraphCaptureFailed`` when
    ``cudagraph_mode`` was asked for explicitly."""
    compilation = config.compilation_config
    runner = GraphRunner(model, kv_caches, compilation, platform=platform, device=device,
                         block_size=config.block_size, max_model_len=config.max_model_len, uses_mrope=uses_mrope)
    try:
        return runner, runner.capture_all()
    except Exception as error:  # noqa: BLE001 - any capture failure: eager decode, or the user's error
        why = f"{type(error).__name__}: {error}"
        if compilation.explicit:
            raise GraphCaptureFailed(
                f"compilation_config.cudagraph_mode = {compilation.cudagraph_mode} was asked for, but capturing the "
                f"decode graphs on {platform.name} failed ({why}); start with cudagraph_mode NONE or --enforce-eager "
                "to run eager") from error
        logger.warning("decode graphs: capture on %s failed, decode runs eager (%s); set --enforce-eager to "
                       "skip the capture, or --compilation-config '{\"cudagraph_mode\": \"FULL_DECODE_ONLY\"}' to "
                       "make this an error", platform.name, why)
        return None, f"eager (graph capture failed: {why})"


__all__ = ["GraphCaptureFailed", "GraphRunner", "make_graph_runner"]

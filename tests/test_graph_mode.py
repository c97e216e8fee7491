"""Graph mode (docs/graph-mode.md): decode steps captured as device graphs and replayed.

No NPU or GPU is needed: the simulated NPU's graph (``atb_plugin/testing/fake_npu_graph.py``)
records a capture and replays it over the same tensors, and refuses what a real ACL graph cannot
hold or would replay wrongly. Covered here:

- the configuration (``compilation_config`` / ``enforce_eager``, CLI ``-O``), capture sizes and
  padding, the per-platform defaults;
- greedy output with graphs == eager for every family (Qwen2 / Llama / Qwen3 text, Qwen3-MoE,
  Qwen2-VL decoding after an image prefill, a W8A8 model) on the simulated NPU, both kernel sets,
  with batch sizes on and between capture sizes and above the largest, and with preemption;
- TP = 2 (one process group for the module): every rank captures and replays the same sizes;
- the fake catching seeded mistakes: a stale block table, host lengths not updated, a host sync
  and host data inside capture, a moved input;
- the CUDA path's platform-agnostic parts on the CPU: the plain-torch graph attention, and the
  runner over the plain-torch kernels under a simulated graph API;
- the graphs' pool in the KV budget of a device platform.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
import torch

import transformers.activations  # noqa: F401 - imported before the fake NPU is installed (its NPU probe)
from atb_plugin import LLM, SamplingParams
from atb_plugin.engine.compilation_config import CompilationConfig, default_capture_sizes
from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.graph_runner import GraphCaptureFailed, GraphRunner
from atb_plugin.platform import use_platform
from atb_plugin.testing import fake_torch_npu
from atb_plugin.testing.fake_npu_graph import GraphCaptureError, GraphReplayError
from atb_plugin.testing.tiny import tiny_checkpoint

SIZES = {"cudagraph_capture_sizes": [1, 2, 4]}
# The simulated NPU captures only when asked (its default is NONE: test_platform_defaults).
GRAPHS = {"cudagraph_mode": "FULL_DECODE_ONLY", **SIZES}
# Five requests finishing one step apart: decode batches of 5 (above the largest size: eager),
# 4 (on a size), 3 (between: padded to 4), 2 and 1.
PROMPTS = ["the cat sat on the mat", "hello world", "a b c d e f g", "one two three", "red green blue yellow"]
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 3, 4, 5, 6)]


def _runner(llm):
    return llm.engine.client.core.runner


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@contextlib.contextmanager
def simulated_npu(kernels: str, monkeypatch, **install):
    monkeypatch.setenv("ATB_PLUGIN_NPU_KERNELS", kernels)
    with fake_torch_npu.install(**install) as fake, use_platform("npu"):
        yield fake


def _graph_vs_eager(family: str, kernels: str, monkeypatch, prompts=PROMPTS, params=PARAMS, **config):
    with simulated_npu(kernels, monkeypatch) as fake:
        with LLM(tiny_checkpoint(family), compilation_config=GRAPHS, **config) as llm:
            assert _runner(llm).decode_capture.startswith("npu graphs: 3 sizes up to 4 tokens")
            graphs = _tokens(llm.generate(prompts, params))
            replays = _runner(llm).graphs.replays
        stats = fake.graph_stats()
        with LLM(tiny_checkpoint(family), enforce_eager=True, **config) as llm:
            eager = _tokens(llm.generate(prompts, params))
    assert graphs == eager
    return stats, replays


# ------------------------------------------------------------------------------------------------
# configuration


def test_compilation_config_resolves_as_vllm_does():
    resolved = CompilationConfig().resolve(enforce_eager=False, max_num_seqs=64, max_num_batched_tokens=2048)
    assert resolved.cudagraph_mode == "FULL_DECODE_ONLY" and not resolved.explicit
    assert resolved.cudagraph_capture_sizes == tuple(default_capture_sizes(64)) == (1, 2, 4, 8, 16, 24, 32, 40, 48,
                                                                                     56, 64)
    assert default_capture_sizes(512)[-3:] == [480, 496, 512]
    assert [resolved.graph_size(n) for n in (1, 3, 5, 9, 64, 65)] == [1, 4, 8, 16, 64, None]
    # enforce_eager wins over everything (vLLM's rule), the CPU's native plan included
    eager = CompilationConfig("FULL_DECODE_ONLY").resolve(enforce_eager=True, max_num_seqs=8,
                                                          max_num_batched_tokens=64)
    assert (eager.cudagraph_mode, eager.cudagraph_capture_sizes, eager.explicit) == ("NONE", (), True)
    # speculative decoding: sizes are multiples of 1 + k, and no larger than a step can be
    spec = CompilationConfig.from_value('{"cudagraph_capture_sizes": [1, 2, 3, 4, 8, 1000]}').resolve(
        enforce_eager=False, max_num_seqs=4, max_num_batched_tokens=2048, uniform_decode_len=3)
    assert spec.cudagraph_capture_sizes == (3, 6, 9) and spec.max_cudagraph_capture_size == 9
    assert spec.resolve(enforce_eager=False, max_num_seqs=4, max_num_batched_tokens=2048,
                        uniform_decode_len=3) == spec
    limited = CompilationConfig(max_cudagraph_capture_size=20).resolve(enforce_eager=False, max_num_seqs=64,
                                                                       max_num_batched_tokens=2048)
    assert limited.cudagraph_capture_sizes == (1, 2, 4, 8, 16)


@pytest.mark.parametrize("value, message", [
    ({"cudagraph_mode": "PIECEWISE"}, "'PIECEWISE' is not supported: this engine captures whole decode steps only; "
                                      "use FULL_DECODE_ONLY"),
    ({"cudagraph_mode": "FULL_AND_PIECEWISE"}, "use FULL_DECODE_ONLY .the default. or NONE"),
    ({"cudagraph_mode": "fast"}, "expected one of NONE, FULL_DECODE_ONLY"),
    ({"cudagraph_capture_sizes": [0, 2]}, r"cudagraph_capture_sizes\[\] = 0: must be >= 1"),
    ({"cudagraph_capture_sizes": "1,2"}, "expected a list of batch sizes"),
    ({"cuda_graph_sizes": [1]}, "unknown key.*cuda_graph_sizes"),
    ("{not json", "not JSON"),
])
def test_bad_compilation_configs_are_refused_naming_the_fix(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(str(tiny_checkpoint("qwen2")), compilation_config=value)


def test_unreachable_capture_sizes_are_an_error():
    with pytest.raises(ValueError, match="no size is reachable .a step holds at most 4 tokens"):
        EngineConfig(str(tiny_checkpoint("qwen2")), max_num_seqs=4, compilation_config={"cudagraph_capture_sizes": [8]})


def test_cli_and_llm_take_the_same_settings():
    from atb_plugin.server.cli import parse_config

    path = str(tiny_checkpoint("qwen2"))
    setting = {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [4, 1, 2]}
    cli = parse_config(["--model", path, "--compilation-config", json.dumps(setting)]).engine
    short = parse_config(["--model", path, "-O", json.dumps(setting)]).engine
    offline = EngineConfig(path, compilation_config=setting)
    assert cli.compilation_config == short.compilation_config == offline.compilation_config
    assert offline.compilation_config.cudagraph_capture_sizes == (1, 2, 4) and offline.compilation_config.explicit
    assert parse_config(["--model", path, "-O0"]).engine.compilation_config.cudagraph_mode == "NONE"
    assert parse_config(["--model", path, "-O3"]).engine.compilation_config == EngineConfig(path).compilation_config
    eager = parse_config(["--model", path, "--enforce-eager"]).engine
    assert eager.enforce_eager and eager.compilation_config.cudagraph_mode == "NONE"


def test_platform_defaults(monkeypatch):
    """CPU: the native captured step (one switch, enforce_eager / NONE, turns it off); the
    simulated NPU: NONE unless asked (its replay saves nothing); a real NPU / CUDA: FULL_DECODE_ONLY."""
    from atb_plugin.platform.cuda import CudaPlatform
    from atb_plugin.platform.npu import NpuPlatform

    path = str(tiny_checkpoint("qwen2"))
    assert EngineConfig(path, device="cpu").compilation_config.cudagraph_mode == "FULL_DECODE_ONLY"
    assert CudaPlatform().default_cudagraph_mode() == "FULL_DECODE_ONLY"
    assert CudaPlatform().device_graphs().graph_class == "CUDAGraph"
    with simulated_npu("fia", monkeypatch):
        assert EngineConfig(path).compilation_config.cudagraph_mode == "NONE"
        monkeypatch.setattr(NpuPlatform, "is_simulated", lambda self: False)
        assert EngineConfig(path).compilation_config.cudagraph_mode == "FULL_DECODE_ONLY"
    with LLM(path, device="cpu", compilation_config={"cudagraph_mode": "NONE"}) as llm:
        assert _runner(llm).decode_capture == "off (cudagraph_mode NONE)"


# ------------------------------------------------------------------------------------------------
# greedy output: graphs == eager on the simulated NPU


@pytest.mark.parametrize("family, kernels, config", [
    ("qwen2", "atb", {}),
    ("llama", "fia", {}),
    ("qwen3", "fia", {}),
    ("qwen3_moe", "fia", {}),
    ("qwen2", "fia", {"quantization": "w8a8"}),
])
def test_graphs_equal_eager_for_every_text_family(family, kernels, config, monkeypatch):
    stats, replays = _graph_vs_eager(family, kernels, monkeypatch, **config)
    # batches of 4, 3 (padded), 2, 1 replayed; the batch of 5 ran eager
    assert stats == {"captures": 3, "replays": replays} and replays == 4


def test_vl_decode_after_an_image_prefill_replays(tmp_path, monkeypatch):
    """Qwen2-VL: the image enters at prefill (eager, its M-RoPE positions), decode replays."""
    from input_builders.media_config import MediaConfig
    from tests.helpers import write_test_images

    write_test_images(tmp_path, sizes=((60, 90),))
    media = MediaConfig(allowed_local_media_paths=(str(tmp_path),))
    chat = [[{"role": "user", "content": [{"image": str(tmp_path / "image0.png")}, {"text": "What is this?"}]}],
            [{"role": "user", "content": "Describe a cat."}]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outputs = {}
    with simulated_npu("fia", monkeypatch) as fake:
        for eager in (False, True):
            with LLM(tiny_checkpoint("qwen2_vl"), media_config=media, enforce_eager=eager,
                     compilation_config=None if eager else GRAPHS) as llm:
                outputs[eager] = [_tokens(llm.chat(conversation, params)) for conversation in chat]
        assert fake.graph_stats() == {"captures": 3, "replays": 8}
    assert outputs[False] == outputs[True]


def test_graphs_equal_eager_with_preemption(monkeypatch):
    """Blocks run out mid-decode: requests are preempted and recomputed; the graph batches
    change size under them and the tokens stay eager's."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = PROMPTS[:3]
    tokens = {}
    with simulated_npu("atb", monkeypatch) as fake:
        for eager in (False, True):
            with LLM(tiny_checkpoint("qwen2"), block_size=16, kv_cache_blocks=6, enforce_eager=eager,
                     compilation_config=None if eager else GRAPHS) as llm:
                tokens[eager] = _tokens(llm.generate(prompts, params))
                assert llm.engine.scheduler.num_preemptions > 0
        assert fake.graph_stats()["replays"] > 10
    assert tokens[False] == tokens[True]


def test_speculative_verify_steps_replay_at_multiples_of_the_verify_width(monkeypatch):
    """n-gram drafts of k = 2: sizes are multiples of 3; a step where every request verifies two
    drafts (3 tokens each) replays, the others run eager; the tokens are eager's (and plain decoding's)."""
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}
    prompts = ["a b c a b c a b c a b c a b", "one two one two one two one two", "x y z x y z x y z"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = {}
    with simulated_npu("fia", monkeypatch) as fake:
        for eager in (False, True):
            with LLM(tiny_checkpoint("qwen2"), speculative_config=ngram, enforce_eager=eager,
                     compilation_config=None if eager else {"cudagraph_mode": "FULL_DECODE_ONLY",
                                                            "cudagraph_capture_sizes": [1, 2, 4, 8]}) as llm:
                if not eager:
                    assert llm.engine.config.compilation_config.cudagraph_capture_sizes == (3, 6, 9)
                tokens[eager] = _tokens(llm.generate(prompts, params))
        assert fake.graph_stats()["replays"] >= 1
    assert tokens[False] == tokens[True]


# ------------------------------------------------------------------------------------------------
# the fake catches seeded mistakes


def test_a_stale_block_table_is_refused_at_replay(monkeypatch):
    monkeypatch.setattr(GraphRunner, "_write_block_tables", lambda self, tables, rows: None)
    with simulated_npu("fia", monkeypatch):
        with LLM(tiny_checkpoint("qwen2"), compilation_config=GRAPHS) as llm:
            with pytest.raises(GraphReplayError, match="stale metadata: npu_fused_infer_attention_score.out's "
                                                       "block_table reads a .* buffer not written since the last"):
                llm.generate(PROMPTS[:2], PARAMS[-1])


@pytest.mark.parametrize("kernels, op", [("fia", "npu_fused_infer_attention_score.out"),
                                         ("atb", "_npu_paged_attention")])
def test_host_lengths_not_updated_are_refused_at_replay(kernels, op, monkeypatch):
    from atb_plugin.ops.graph_capture import GraphParams

    monkeypatch.setattr(GraphParams, "update", lambda self, metadata: None)
    with simulated_npu(kernels, monkeypatch):
        with LLM(tiny_checkpoint("qwen2"), compilation_config=GRAPHS) as llm:
            with pytest.raises(GraphReplayError, match=f"stale metadata: {op}'s host parameters"):
                llm.generate(PROMPTS[:1], PARAMS[-1])


def _host_sync_in_forward(monkeypatch):
    """Seed a host sync into the decoder's forward (what a data-dependent branch would do)."""
    from atb_plugin.models.decoder import DecoderModel

    forward = DecoderModel.forward

    def syncing(self, positions, *args, **kwargs):
        if int(positions.max()) < 0:  # .item() of a device tensor
            raise AssertionError("unreachable")
        return forward(self, positions, *args, **kwargs)

    monkeypatch.setattr(DecoderModel, "forward", syncing)


def test_a_host_sync_inside_capture_falls_back_to_eager_with_one_warning(monkeypatch, caplog):
    """The mode not given (the platform's default: a real NPU's, FULL_DECODE_ONLY): a warning."""
    from atb_plugin.platform.npu import NpuPlatform

    _host_sync_in_forward(monkeypatch)
    monkeypatch.setattr(NpuPlatform, "default_cudagraph_mode", lambda self: "FULL_DECODE_ONLY")
    with simulated_npu("fia", monkeypatch) as fake:
        with LLM(tiny_checkpoint("qwen2"), compilation_config=SIZES) as llm:
            assert _runner(llm).decode_capture.startswith("eager (graph capture failed: GraphCaptureError: "
                                                               "host sync inside graph capture")
            eager = _tokens(llm.generate(PROMPTS[:2], PARAMS[-1]))
        assert fake.graph_stats()["replays"] == 0
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "decode graphs" in r.getMessage()]
    assert len(warnings) == 1 and "decode runs eager" in warnings[0].getMessage()
    assert all(len(t) == 6 for t in eager)


def test_a_capture_failure_is_a_start_up_error_when_the_mode_was_asked_for(monkeypatch):
    _host_sync_in_forward(monkeypatch)
    with simulated_npu("fia", monkeypatch):
        with pytest.raises(GraphCaptureFailed, match="cudagraph_mode = FULL_DECODE_ONLY was asked for, but capturing "
                                                     "the decode graphs on npu failed .* host sync inside graph "
                                                     "capture.*--enforce-eager"):
            LLM(tiny_checkpoint("qwen2"), compilation_config=GRAPHS)


def test_the_fake_graph_replays_recorded_work_and_refuses_what_a_device_cannot(monkeypatch):
    with fake_torch_npu.install() as fake:
        npu = fake.module.npu
        static_in, weight = torch.zeros(4), torch.full((4,), 2.0)
        graph = npu.NPUGraph()
        with npu.graph(graph):
            static_out = (static_in * weight).sum(0, keepdim=True) + 1
        static_in.copy_(torch.arange(4.0))
        graph.replay()
        assert static_out.tolist() == [13.0]  # read at replay: (0 + 2 + 4 + 6) + 1
        assert fake.graph_stats() == {"captures": 1, "replays": 1}

        seeded = {
            "item": lambda: static_in.sum().item(),
            "tolist": lambda: static_in.tolist(),
            "bool": lambda: bool(static_in.sum() > 0),
            "synchronize": lambda: npu.synchronize(),
            "host data": lambda: static_in + torch.tensor([1.0, 2.0, 3.0, 4.0]),
            "no task group": lambda: fake.module.npu_fused_infer_attention_score.out(
                torch.zeros(1, 1, 16, dtype=torch.bfloat16), torch.zeros(1, 16, 16, dtype=torch.bfloat16),
                torch.zeros(1, 16, 16, dtype=torch.bfloat16), actual_seq_lengths=[1], actual_seq_lengths_kv=[1],
                block_table=torch.zeros(1, 1, dtype=torch.int32), input_layout="TND", block_size=16,
                workspace=torch.empty(64, dtype=torch.uint8),
                out=[torch.empty(1, 1, 16, dtype=torch.bfloat16), torch.empty(1)]),
            "eager-only op": lambda: fake.module.npu_fused_infer_attention_score(
                torch.zeros(1, 1, 16, dtype=torch.bfloat16), torch.zeros(1, 16, 16, dtype=torch.bfloat16),
                torch.zeros(1, 16, 16, dtype=torch.bfloat16)),
        }
        for what, seed in seeded.items():
            with pytest.raises(GraphCaptureError), npu.graph(npu.NPUGraph()):
                seed()
            assert not npu.is_current_stream_capturing(), what

        static_in.set_(torch.zeros(8))  # the captured input now lives elsewhere
        with pytest.raises(GraphReplayError, match="moved since capture"):
            graph.replay()


def test_the_graph_ops_follow_the_wheels_schemas():
    """The fakes of the graph-path ops against npu_schemas.txt's graph-mode section (read from the
    torch_npu wheel; ``.out``'s binding takes the two output tensors as ``Tensor[] out``)."""
    import inspect

    from atb_plugin.testing import fake_npu_graph
    from tests.test_npu_schemas import check_signature, load_schemas

    _, schemas = load_schemas()
    for fn in fake_npu_graph.GRAPH_OPS:
        assert check_signature(schemas[fn.__name__], inspect.signature(fn)) == [], fn.__name__
    assert check_signature(schemas["npu_fused_infer_attention_score.out"],
                           inspect.signature(fake_npu_graph.npu_fused_infer_attention_score_out)) == []
    module = fake_torch_npu.build_module()
    assert module.npu_fused_infer_attention_score.out.__wrapped__ is fake_npu_graph.npu_fused_infer_attention_score_out


# ------------------------------------------------------------------------------------------------
# tensor parallelism: every rank captures the same sizes and replays in step


def _decode_metadata(seq_lens: list[int], tables: list[list[int]], block_size: int, positions: list[int]):
    from atb_plugin.ops import AttentionMetadata

    count = len(seq_lens)
    slots = [tables[i][p // block_size] * block_size + p % block_size for i, p in enumerate(positions)]
    return AttentionMetadata(
        query_start_loc=torch.arange(count + 1, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32), slot_mapping=torch.tensor(slots),
        max_query_len=1, max_seq_len=max(seq_lens))


@torch.no_grad()
def _greedy_graph_and_eager(model, config: EngineConfig, platform, steps: int = 4) -> dict:
    """Three sequences (prompts of 5, 3, 7 tokens) prefilled eagerly into two copies of the KV
    cache, then ``steps`` greedy decode steps: through the graph runner on one copy, the eager
    forward on the other. Returns both token streams and the replays."""
    from atb_plugin.ops import AttentionMetadata

    block_size = config.block_size
    graph_kv, eager_kv = (model.make_kv_caches(8, block_size) for _ in range(2))
    runner = GraphRunner(model, graph_kv, config.compilation_config, platform=platform, device=torch.device("cpu"),
                         block_size=block_size, max_model_len=config.max_model_len, uses_mrope=False)
    runner.capture_all()
    prompts = [list(range(3, 8)), [9, 4, 2], [11, 12, 13, 14, 15, 16, 17]]
    tables = [[1, 0], [2, 0], [3, 0]]
    streams = {}
    for name, kv in (("graph", graph_kv), ("eager", eager_kv)):
        last = []
        for prompt, table in zip(prompts, tables):
            metadata = AttentionMetadata.for_prefill([len(prompt)], block_size, first_block=table[0])
            hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), kv, metadata)
            last.append(int(model.compute_logits(hidden[-1:]).argmax()))
        lengths, tokens = [len(p) for p in prompts], [[t] for t in last]
        for _ in range(steps):
            positions = list(lengths)
            lengths = [n + 1 for n in lengths]
            metadata = _decode_metadata(lengths, tables, block_size, positions)
            ids, pos = torch.tensor([t[-1] for t in tokens]), torch.tensor(positions)
            hidden = runner.run(ids, pos, metadata) if name == "graph" else model(ids, pos, kv, metadata)
            assert hidden is not None
            for stream, token in zip(tokens, model.compute_logits(hidden).argmax(-1).tolist()):
                stream.append(token)
        streams[name] = tokens
    streams["replays"] = runner.replays
    return streams


def rank_graphs_tp(rank: int, size: int, init_method: str) -> dict:
    """One rank of the TP group: qwen2 bf16 on its simulated NPU (FIA kernels), graphs vs eager."""
    import os

    from atb_plugin.platform import use_platform as platform_scope
    from tests.test_tensor_parallel import _load, join_group

    os.environ["ATB_PLUGIN_NPU_KERNELS"] = "fia"
    fake = fake_torch_npu.install(device_count=size)
    with platform_scope("npu") as platform:
        platform.bind_device(rank)
        join_group(rank, size, init_method, platform.dist_backend)
        config = EngineConfig(str(tiny_checkpoint("qwen2")), compilation_config=GRAPHS, max_model_len=256)
        streams = _greedy_graph_and_eager(_load("qwen2", torch.bfloat16), config, platform)
    return {**streams, "stats": fake.graph_stats()}


def test_tp2_ranks_capture_the_same_sizes_and_replay_eager_tokens():
    from tests.test_tensor_parallel import run_ranks

    ranks = run_ranks(rank_graphs_tp, 2)
    for outputs in ranks:
        assert outputs["graph"] == outputs["eager"] == ranks[0]["graph"]
        assert outputs["stats"] == {"captures": 3, "replays": 4} == {"captures": 3, "replays": outputs["replays"]}


# ------------------------------------------------------------------------------------------------
# the CUDA path's platform-agnostic parts, on the CPU


def test_plain_torch_graph_attention_equals_the_eager_decode():
    from atb_plugin.ops import AttentionMetadata, torch_kernels
    from atb_plugin.ops.graph_capture import GraphParams, capture

    generator = torch.Generator().manual_seed(0)
    key_cache, value_cache = (torch.randn(9, 4, 2, 16, generator=generator) for _ in range(2))
    query = torch.randn(3, 4, 16, generator=generator)
    seq_lens = [5, 1, 11]
    metadata = AttentionMetadata(
        query_start_loc=torch.arange(4, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([[3, 1, 0], [2, 0, 0], [4, 5, 6]], dtype=torch.int32),
        slot_mapping=torch.tensor([1 * 4 + 0, 2 * 4 + 0, 6 * 4 + 2]), max_query_len=1, max_seq_len=11)
    eager = torch_kernels.paged_attention(query, key_cache, value_cache, metadata, 0.25)
    with capture(GraphParams()):
        graphed = torch_kernels.paged_attention(query, key_cache, value_cache, metadata, 0.25)
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-6)


@dataclasses.dataclass(frozen=True)
class _SimulatedDevicePlatform:
    """What the graph runner asks of a platform, with the simulated graph API: the CUDA runner's
    code over the plain-torch kernels (the CUDA kernel set) on the CPU."""

    graphs: object
    name: str = "cuda"

    def device_graphs(self):
        return self.graphs

    def memory_in_use(self) -> int:
        return 0


def test_the_runner_over_the_plain_torch_kernels_replays_eager_tokens(monkeypatch):
    from atb_plugin.platform.base import DeviceGraphs
    from atb_plugin.testing.fake_npu_graph import FakeGraphApi
    from tests.test_tensor_parallel import _load

    monkeypatch.setenv("ATB_PLUGIN_CPU_KERNELS", "torch")  # ctypes kernels are invisible to a recorder
    api = FakeGraphApi()
    config = EngineConfig(str(tiny_checkpoint("llama")), device="cpu", block_size=16, max_model_len=64,
                          compilation_config=SIZES)
    streams = _greedy_graph_and_eager(_load("llama"), config, _SimulatedDevicePlatform(DeviceGraphs(api, "NPUGraph")))
    assert streams["graph"] == streams["eager"] and streams["replays"] == 4
    assert api.stats() == {"captures": 3, "replays": 4}


# ------------------------------------------------------------------------------------------------
# memory


def test_the_graph_pool_is_taken_from_the_kv_budget(monkeypatch):
    from atb_plugin.engine import memory_profile
    from atb_plugin.platform.cpu import CpuPlatform
    from tests.test_tensor_parallel import _load

    @dataclasses.dataclass(frozen=True)
    class DevicePlatform(CpuPlatform):
        def total_memory(self) -> int:
            return 8 << 30

        def device_graphs(self):
            return object()

    model = _load("qwen2")
    path = str(tiny_checkpoint("qwen2"))
    graphs = EngineConfig(path, device="cpu", compilation_config={"cudagraph_capture_sizes": [64]})
    eager = graphs.replace(enforce_eager=True)
    monkeypatch.setattr(memory_profile, "graph_pool_bytes", lambda *a: 123 << 20)
    with_graphs = memory_profile.kv_cache_budget(model, graphs, DevicePlatform())
    assert with_graphs.graph_bytes == 123 << 20 and "123.0 MiB decode graphs" in with_graphs.describe()
    monkeypatch.undo()
    assert memory_profile.graph_pool_bytes(model, eager, DevicePlatform()) == 0
    assert memory_profile.graph_pool_bytes(model, graphs, DevicePlatform()) >= 0  # measured: one decode forward

"""The native CPU kernels (atb_plugin/ops/cpu_native.py, csrc/cpu_kernels.c) against the torch ops
they replace and a float64 reference; the build, the choice and its errors.

Tolerances: the kernels compute in float32 like the torch ops, summing in another order (and with
libm's expf where torch uses its vectorised exp), so outputs agree to a few float32 ulps of the
values involved: 1e-6 relative for single ops, 1e-5 for attention (sums over hundreds of keys).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from atb_plugin import LLM, SamplingParams
from atb_plugin.ops import AttentionMetadata, cpu_native, torch_kernels
from atb_plugin.testing.tiny import tiny_checkpoint


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


@pytest.fixture
def library():
    lib = cpu_native.library_for(torch.float32, torch.device("cpu"))
    assert lib is not None, "the native CPU kernels should build on this machine (gcc is installed)"
    return lib


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """Forget the loaded library and build into an empty cache (restored after the test)."""
    monkeypatch.setattr(cpu_native, "_loaded", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def _torch_path(monkeypatch):
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "torch")


# -- elementwise ops ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (3, 5, 32), (200, 48)])
def test_rms_norm_equals_torch_and_float64(library, gen, monkeypatch, shape):
    x = torch.randn(*shape, generator=gen) * 3
    weight = torch.randn(shape[-1], generator=gen)
    native = torch_kernels.rms_norm(x, weight, 1e-6)
    _torch_path(monkeypatch)
    reference = torch_kernels.rms_norm(x, weight, 1e-6)
    exact = weight.double() * x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert native.shape == x.shape and native.dtype == torch.float32
    torch.testing.assert_close(native, reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(native.double(), exact, rtol=1e-6, atol=1e-6)


def test_rms_norm_reads_strided_rows(library, gen):
    wide = torch.randn(6, 100, generator=gen)
    x = wide[:, 10:74]  # rows 100 floats apart
    weight = torch.randn(64, generator=gen)
    torch.testing.assert_close(torch_kernels.rms_norm(x, weight, 1e-5),
                               torch_kernels.rms_norm(x.contiguous(), weight, 1e-5), rtol=0, atol=0)


@pytest.mark.parametrize("tokens, heads, head_dim", [(1, 9, 64), (5, 3, 64), (70, 2, 16), (4, 4, 128)])
def test_rotary_on_a_slice_of_fused_qkv_equals_torch(library, gen, monkeypatch, tokens, heads, head_dim):
    qkv = torch.randn(tokens, (heads + 2) * head_dim, generator=gen)
    x = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)  # not contiguous: rows of the fused output
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 50
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    native = torch_kernels.apply_rotary(x, cos, sin)
    _torch_path(monkeypatch)
    reference = torch_kernels.apply_rotary(x, cos, sin)
    assert native.shape == (tokens, heads, head_dim) and native.is_contiguous()
    torch.testing.assert_close(native, reference, rtol=1e-6, atol=1e-6)


def test_silu_and_mul_equals_torch(library, gen, monkeypatch):
    x = torch.randn(33, 200, generator=gen)[:, :192] * 4  # strided rows, as a fused gate-up output may be
    native = torch_kernels.silu_and_mul(x)
    assert native.shape == (33, 96)
    torch.testing.assert_close(native, F.silu(x[:, :96]) * x[:, 96:], rtol=2.5e-7, atol=1e-7)


def test_silu_and_mul_over_the_whole_float_range(library):
    """The kernel's vectorised exp clamps its argument to [-87, 88]: beyond, silu is ~0 or ~x."""
    gate = torch.cat([torch.linspace(-150, 150, 3001), torch.tensor([float("inf"), 0.0, -0.0, 1e-30, -1e-30])])
    x = torch.cat([gate, torch.linspace(-3, 3, gate.numel())])[None]  # width 3006 + 3006: a scalar tail too
    native = torch_kernels.silu_and_mul(x)
    torch.testing.assert_close(native[0], F.silu(gate) * x[0, gate.numel():], rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("width", [1, 5, 16, 17, 100, 49152])
def test_argmax_equals_torch_on_ties_nan_and_infinities(library, gen, width):
    cases = [torch.randn(9, width, generator=gen) for _ in range(3)]
    ties = torch.randn(9, width, generator=gen).round()  # many equal maxima: the first one wins
    ties[4] = 1.0
    special = torch.randn(9, width, generator=gen)
    special[1, -1] = float("inf")
    special[2, width // 2] = float("nan")  # torch counts NaN as the maximum: its first NaN
    special[3] = float("-inf")
    special[5, :width // 3] = float("-inf")
    for x in [*cases, ties, special, special[:, :max(1, width - 1)]]:  # the last: rows a stride apart
        assert torch.equal(cpu_native.argmax(library, x), x.argmax(dim=-1))


def test_half_precision_and_other_devices_take_the_torch_ops(library):
    assert cpu_native.library_for(torch.bfloat16, torch.device("cpu")) is None
    assert cpu_native.library_for(torch.float32, torch.device("meta")) is None
    x, weight = torch.randn(4, 16).to(torch.bfloat16), torch.randn(16).to(torch.bfloat16)
    hidden = x.float()
    expected = weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    torch.testing.assert_close(torch_kernels.rms_norm(x, weight, 1e-6), expected, rtol=0, atol=0)


# -- decode attention --------------------------------------------------------------------------


def _decode_case(gen, lens, heads, kv_heads, head_dim, block_size, query_scale=1.0):
    """Random caches, shuffled blocks, one new token per request; returns what paged_attention takes
    and a float64 reference over each request's contiguous keys."""
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = 1 + sum(blocks) + 2
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width, tables = max(blocks), []
    for count in blocks:
        tables.append(order[:count] + [0] * (width - count))
        order = order[count:]
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    query = torch.randn(len(lens), heads, head_dim, generator=gen) * query_scale
    metadata = AttentionMetadata(
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32), slot_mapping=torch.zeros(len(lens), dtype=torch.int64),
        max_query_len=1, max_seq_len=max(lens))
    expected = []
    for r, n in enumerate(lens):
        positions = torch.arange(n)
        slots = torch.tensor(tables[r])[positions // block_size]
        k = key_cache[slots, positions % block_size].double().repeat_interleave(heads // kv_heads, 1)
        v = value_cache[slots, positions % block_size].double().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,khd->hk", query[r].double(), k) * head_dim ** -0.5
        expected.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v))
    return (query, key_cache, value_cache, metadata, head_dim ** -0.5), torch.stack(expected)


@pytest.mark.parametrize("lens, heads, kv_heads, head_dim, block_size", [
    ([37, 1, 200, 16, 64], 9, 3, 64, 16),  # SmolLM2's heads; the head_dim the kernel specialises
    ([5], 4, 2, 64, 16),  # a lone decode (the torch path would take it alone, ungathered)
    ([130, 7, 260], 4, 4, 128, 32),
    ([3, 30], 6, 1, 24, 4),  # a head_dim the kernel leaves to SDPA, one KV head for all
])
def test_decode_attention_equals_torch_and_float64(library, gen, monkeypatch, lens, heads, kv_heads, head_dim,
                                                   block_size):
    args, expected = _decode_case(gen, lens, heads, kv_heads, head_dim, block_size)
    native = torch_kernels.paged_attention(*args)
    _torch_path(monkeypatch)
    args[3].step_cache.clear()
    reference = torch_kernels.paged_attention(*args)
    torch.testing.assert_close(native.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)


def test_decode_attention_with_peaked_scores(library, gen):
    """Queries 30x larger: most softmax arguments fall far below the kernel's e^-87 floor (its
    vectorised exp clamps there) and one key dominates each head, as in a sharply attending model."""
    args, expected = _decode_case(gen, [150, 40], 9, 3, 64, 16, query_scale=30.0)
    torch.testing.assert_close(torch_kernels.paged_attention(*args).double(), expected, rtol=1e-5, atol=1e-5)


def test_decode_attention_refuses_a_block_outside_the_cache(library, gen):
    (query, key_cache, value_cache, metadata, scale), _ = _decode_case(gen, [20, 9], 4, 2, 16, 8)
    metadata.block_tables[1, 0] = key_cache.shape[0]  # one past the last block: the C code would read past it
    with pytest.raises(IndexError, match=f"names block {key_cache.shape[0]}, the cache has {key_cache.shape[0]}"):
        torch_kernels.paged_attention(query, key_cache, value_cache, metadata, scale)


def test_engine_greedy_tokens_and_logprobs_equal_with_native_and_torch_kernels(library, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = ["hello world", "the quick brown fox jumps", "a"]
    outputs = {}
    for choice in ("native", "torch"):
        monkeypatch.setenv(cpu_native.KERNELS_ENV, choice)
        with LLM(tiny_checkpoint("qwen2"), block_size=4) as llm:
            outputs[choice] = [o.outputs[0] for o in llm.generate(prompts, params)]
    for native, reference in zip(outputs["native"], outputs["torch"]):
        assert native.token_ids == reference.token_ids
        for a, b in zip(native.logprobs, reference.logprobs):
            assert a.top_token_ids == b.top_token_ids
            assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-4)


# -- build, choice, errors ---------------------------------------------------------------------


def test_the_library_is_built_once_into_the_cache_and_reused(fresh_build):
    assert cpu_native.library_for(torch.float32, torch.device("cpu")) is not None
    built = list((fresh_build / "atb-plugin" / "kernels").iterdir())
    assert len(built) == 1 and built[0].name.startswith("cpu_kernels-") and built[0].suffix == ".so"
    cpu_native._loaded.clear()
    before = built[0].stat().st_mtime_ns
    assert cpu_native.library_for(torch.float32, torch.device("cpu")) is not None
    assert [p.stat().st_mtime_ns for p in built] == [before]  # not rebuilt


def test_native_forced_without_a_compiler_is_an_error_naming_it(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "native")
    with pytest.raises(cpu_native.NativeKernelError, match="no C compiler .*/nonexistent/cc.*install gcc or set CC"):
        cpu_native.library_for(torch.float32, torch.device("cpu"))


def test_auto_with_a_failing_compiler_warns_and_the_torch_ops_give_the_same_answer(fresh_build, monkeypatch, caplog,
                                                                                   gen):
    monkeypatch.setenv("CC", "false")  # a "compiler" that exits 1
    x, weight = torch.randn(3, 32, generator=gen), torch.randn(32, generator=gen)
    with caplog.at_level("WARNING", logger=cpu_native.__name__):
        assert cpu_native.library_for(torch.float32, torch.device("cpu")) is None
        out = torch_kernels.rms_norm(x, weight, 1e-6)
    assert "native CPU kernels unavailable" in caplog.text and "false failed (1)" in caplog.text
    assert not list((fresh_build / "atb-plugin" / "kernels").iterdir())  # no half-written library left
    expected = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_an_unknown_choice_is_refused(monkeypatch):
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="ATB_PLUGIN_CPU_KERNELS='fast': expected one of auto, native, torch"):
        cpu_native.library_for(torch.float32, torch.device("cpu"))


def test_an_unknown_choice_fails_the_engine_config_not_a_step(monkeypatch):
    from atb_plugin.engine.config import EngineConfig

    monkeypatch.setenv(cpu_native.KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="ATB_PLUGIN_CPU_KERNELS='fast'"):
        EngineConfig(model=str(tiny_checkpoint("qwen2")))


def test_native_forced_without_a_compiler_fails_at_model_load(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "native")
    with pytest.raises(cpu_native.NativeKernelError, match="no C compiler"):
        LLM(tiny_checkpoint("qwen2"), block_size=4)


def test_loading_the_library_leaves_denormals_alone():
    """Built without -ffast-math: a shared library linked with it sets flush-to-zero for the whole
    process at load time, changing every float op of the engine."""
    code = ("import torch; from atb_plugin.ops import cpu_native; "
            "assert cpu_native.library_for(torch.float32, torch.device('cpu')) is not None; "
            "x = torch.tensor([1e-39]); print(float(x * 1.0) != 0.0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"

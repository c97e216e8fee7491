"""Platform selection, the ops' CPU path against naive references and transformers, the NPU path
(real ``npu_kernels`` over the simulated torch_npu) against the CPU path, and the simulation's
own honesty (hand-computed results, contract violations raise).

The fake is installed per test through the ``fake_npu`` fixture and always uninstalled; the one
process-wide remainder, the PrivateUse1 -> "npu" rename, is checked to be harmless.
"""

from __future__ import annotations

import math
import os
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

# transformers is imported before any fake is installed, so nothing it caches sees a torch_npu.
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply_rotary_pos_emb
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

from atb_plugin import ops
from atb_plugin.ops import AttentionMetadata, RotaryEmbedding
from atb_plugin.platform import (
    PLATFORMS,
    current_platform,
    npu as npu_platform_module,
    reset_current_platform,
    use_platform,
)
from atb_plugin.ops import npu_kernels
from atb_plugin.testing import fake_torch_npu
from atb_plugin.testing.fake_torch_npu import NpuOpError

FP32_TOL = 1e-5
# The ATB attention ops take float16 / bfloat16 only, so the NPU path runs in half precision and is
# compared with the CPU path in float32 on the same (fp32-drawn) inputs. Inputs of magnitude ~1,
# head_dim 16, the fake's softmax in fp32, output rounded once:
# - bfloat16: 8 significant bits, unit roundoff 2^-9 ~ 2e-3 per rounding; rounding q, k, v and the
#   output (and the q·k sum over 16 terms) gives errors ~1e-2 on outputs ~1 -> atol = rtol = 3e-2.
# - float16: 11 significant bits, unit roundoff 2^-12 ~ 2.4e-4 -> about 8x tighter: 4e-3.
HALF_TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3}
HALF_DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


# --------------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------------


pytestmark = pytest.mark.usefixtures("atb_kernel_set")


@pytest.fixture
def fake_npu_fp32(fake_npu):
    """The fake with float32 let through the ATB attention ops: for tests about something other
    than precision (the real ops take fp16 / bf16 only)."""
    with fake_npu.allow_fp32_attention():
        yield fake_npu


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def _host(values) -> torch.Tensor:
    """An int32 length tensor marked as host data, as npu_kernels passes ATB's seq_len / context_lens."""
    return npu_kernels.host(torch.tensor(values, dtype=torch.int32))


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


# --------------------------------------------------------------------------------------------
# platform selection
# --------------------------------------------------------------------------------------------


def test_default_platform_is_cpu_here(clean_platform):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert "torch_npu" not in sys.modules
    platform = current_platform()
    assert platform.name == "cpu" and platform.device() == torch.device("cpu")
    assert platform.kernels.__name__ == "atb_plugin.ops.torch_kernels"


def test_forcing_cpu_works(clean_platform, monkeypatch):
    monkeypatch.setenv("ATB_PLUGIN_DEVICE", "cpu")
    assert current_platform() is PLATFORMS["cpu"]


@pytest.mark.parametrize("name, reason", [("npu", "torch_npu does not import"), ("cuda", "torch.cuda.is_available")])
def test_forcing_an_unavailable_platform_is_a_clear_error(clean_platform, monkeypatch, name, reason):
    if name == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.setenv("ATB_PLUGIN_DEVICE", name)
    with pytest.raises(RuntimeError, match=rf"platform '{name}' was asked for.*not available.*{re.escape(reason)}"):
        current_platform()
    with pytest.raises(RuntimeError, match="not available"):
        with use_platform(name):
            pass


def test_unknown_device_name_is_rejected(clean_platform, monkeypatch):
    monkeypatch.setenv("ATB_PLUGIN_DEVICE", "tpu")
    with pytest.raises(ValueError, match="expected one of npu, cuda, cpu"):
        current_platform()


def test_platform_names_backends_and_visible_device_variables():
    expected = {
        "npu": ("npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES", "atb_plugin.ops.npu_kernels"),
        "cuda": ("cuda", "nccl", "CUDA_VISIBLE_DEVICES", "atb_plugin.ops.torch_kernels"),
        "cpu": ("cpu", "gloo", None, "atb_plugin.ops.torch_kernels"),
    }
    for name, (device_type, backend, env, kernels) in expected.items():
        p = PLATFORMS[name]
        assert (p.name, p.device_type, p.dist_backend, p.visible_devices_env, p.kernels_module) == (
            name, device_type, backend, env, kernels)
    assert PLATFORMS["cuda"].device(1) == torch.device("cuda", 1)


def test_fake_npu_is_detected_and_can_be_forced(fake_npu, monkeypatch):
    platform = current_platform()
    assert platform.name == "npu" and platform.is_simulated()
    assert platform.device() == torch.device("cpu")  # FAKE_DEVICE: the simulated NPU keeps tensors on CPU
    assert platform.kernels.__name__ == "atb_plugin.ops.npu_kernels"
    reset_current_platform()
    monkeypatch.setenv("ATB_PLUGIN_DEVICE", "npu")
    assert current_platform() is PLATFORMS["npu"]
    assert torch.device("npu", 1).type == "npu"  # PrivateUse1 renamed as the real torch_npu does
    assert torch.npu.is_available() and torch.npu.device_count() == 1
    fake_npu.module.npu.set_device("npu:0")
    with pytest.raises(NpuOpError, match="out of range"):
        fake_npu.module.npu.set_device(torch.device("npu", 1))


def test_npu_without_devices_is_not_chosen(clean_platform, monkeypatch):
    with fake_torch_npu.install(device_count=0):
        assert current_platform().name == "cpu"
        monkeypatch.setenv("ATB_PLUGIN_DEVICE", "npu")
        reset_current_platform()
        with pytest.raises(RuntimeError, match="is_available\\(\\) is False"):
            current_platform()


def test_use_platform_switches_and_restores(fake_npu):
    reset_current_platform()
    with use_platform("cpu"):
        before = current_platform()
        with use_platform("npu") as p:
            assert p is PLATFORMS["npu"] and current_platform() is p
        assert current_platform() is before is PLATFORMS["cpu"]


def test_real_npu_device_when_not_simulated(monkeypatch):
    """Without FAKE_DEVICE the NPU platform hands out npu:i (torch_npu itself renames PrivateUse1)."""
    fake = fake_torch_npu.build_module()
    del fake.FAKE_DEVICE
    fake_torch_npu._npu_proxy()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    assert PLATFORMS["npu"].device(3) == torch.device("npu", 3)
    assert not PLATFORMS["npu"].is_simulated()


def test_uninstall_leaves_nothing_that_matters(clean_platform):
    with fake_torch_npu.install() as fake:
        assert sys.modules["torch_npu"] is fake.module
        with pytest.raises(RuntimeError, match="already loaded"):
            fake_torch_npu.install()
    assert "torch_npu" not in sys.modules and fake_torch_npu.installed() is None
    assert not PLATFORMS["npu"].is_available() and current_platform().name == "cpu"
    # The irreversible rename stays harmless: no accelerator is reported, allocation still fails.
    assert not torch.npu.is_available() and torch.npu.device_count() == 0
    assert not torch.accelerator.is_available()
    assert torch._C._get_accelerator() == torch.device("cpu")
    assert torch.accelerator.current_accelerator(check_available=True) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.manual_seed(0)  # no "set seed for npu does not take effect" warning
    with pytest.raises(Exception):
        torch.empty(1, device="npu")
    from transformers.utils import is_torch_npu_available

    assert not is_torch_npu_available()


def test_no_magicmock_stands_in_for_torch_npu():
    root = Path(__file__).resolve().parents[1]
    mock = "Magic" + "Mock"
    assignment = re.compile(r"sys\.modules\[\s*['\"]torch_npu['\"]\s*\]\s*=")
    offenders = []
    for path in root.rglob("*.py"):
        if any(part in {".venv", ".git", "build", "node_modules"} or part.endswith(".egg-info") for part in path.parts):
            continue
        text = path.read_text(errors="replace")
        for line in text.splitlines():
            if assignment.search(line) and (mock in line or "Mock(" in line):
                offenders.append(f"{path}: {line.strip()}")
        if mock in text and "torch_npu" in text and path.name != Path(__file__).name:
            offenders.append(f"{path}: mentions {mock} and torch_npu")
    assert not offenders, offenders


# --------------------------------------------------------------------------------------------
# paged attention scenarios
# --------------------------------------------------------------------------------------------


class Scenario:
    """Requests with ``computed`` cached tokens and ``new`` tokens this step, laid out in a paged
    cache with shuffled (non-contiguous) blocks. Holds each request's full K/V and new queries."""

    def __init__(self, gen, computed, new, block_size, num_heads=4, num_kv_heads=2, head_dim=16,
                 dtype=torch.float32, spare_blocks=3):
        self.block_size, self.dtype = block_size, dtype
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        seq_lens = [c + n for c, n in zip(computed, new)]
        blocks_needed = [-(-s // block_size) for s in seq_lens]
        num_blocks = 1 + sum(blocks_needed) + spare_blocks
        order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0: null block
        tables, width = [], max(blocks_needed)
        for count in blocks_needed:
            tables.append(order[:count] + [0] * (width - count))
            order = order[count:]
        self.full_k = [randn(gen, s, num_kv_heads, head_dim, dtype=dtype) for s in seq_lens]
        self.full_v = [randn(gen, s, num_kv_heads, head_dim, dtype=dtype) for s in seq_lens]
        self.query = torch.cat([randn(gen, n, num_heads, head_dim, dtype=dtype) for n in new])
        self.computed, self.new, self.seq_lens, self.tables = computed, new, seq_lens, tables
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Garbage everywhere, so reading a slot that was never written shows up.
        self.initial_key_cache = randn(gen, *shape, dtype=dtype) * 100
        self.initial_value_cache = randn(gen, *shape, dtype=dtype) * 100
        for r, c in enumerate(computed):
            for pos in range(c):
                block, offset = tables[r][pos // block_size], pos % block_size
                self.initial_key_cache[block, offset] = self.full_k[r][pos]
                self.initial_value_cache[block, offset] = self.full_v[r][pos]
        slots = [tables[r][pos // block_size] * block_size + pos % block_size
                 for r in range(len(new)) for pos in range(computed[r], seq_lens[r])]
        qsl = [0]
        for n in new:
            qsl.append(qsl[-1] + n)
        self.metadata = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(new),
            max_seq_len=max(seq_lens),
        )
        self.new_k = torch.cat([k[c:] for k, c in zip(self.full_k, computed)])
        self.new_v = torch.cat([v[c:] for v, c in zip(self.full_v, computed)])
        self.scale = head_dim ** -0.5

    def run(self, platform: str, dtype: torch.dtype | None = None):
        """Write this step's K/V, then attend, on ``platform``, in ``dtype`` (default: the
        scenario's; the inputs are cast). Returns (out, key_cache, value_cache)."""
        dtype = dtype or self.dtype
        key_cache, value_cache = self.initial_key_cache.to(dtype), self.initial_value_cache.to(dtype)
        if key_cache.data_ptr() == self.initial_key_cache.data_ptr():
            key_cache, value_cache = key_cache.clone(), value_cache.clone()
        with use_platform(platform):
            ops.write_kv_cache(self.new_k.to(dtype), self.new_v.to(dtype), key_cache, value_cache,
                               self.metadata.slot_mapping)
            out = ops.paged_attention(self.query.to(dtype), key_cache, value_cache, self.metadata, self.scale)
        return out, key_cache, value_cache

    def reference(self) -> torch.Tensor:
        """Naive causal attention over each request's whole contiguous K/V, in float64."""
        outs, start = [], 0
        groups = self.num_heads // self.num_kv_heads
        for r, (c, n, s) in enumerate(zip(self.computed, self.new, self.seq_lens)):
            q = self.query[start:start + n].double()
            k = self.full_k[r].double().repeat_interleave(groups, dim=1)
            v = self.full_v[r].double().repeat_interleave(groups, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            visible = torch.arange(s)[None, :] <= torch.arange(c, s)[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
            outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
            start += n
        return torch.cat(outs)


CASES = {
    "prefill_only": ([0, 0, 0], [5, 17, 9]),
    "decode_only": ([4, 20, 33], [1, 1, 1]),
    "mixed_chunked_prefill": ([0, 7, 20, 3, 16], [6, 1, 9, 1, 16]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
@pytest.mark.parametrize("kernels", ["native", "torch"])  # the C decode kernel, and SDPA (CUDA's path)
def test_cpu_paged_attention_equals_full_attention(gen, monkeypatch, case, block_size, heads, kernels):
    monkeypatch.setenv("ATB_PLUGIN_CPU_KERNELS", kernels)
    scenario = Scenario(gen, *CASES[case], block_size=block_size, num_heads=heads[0], num_kv_heads=heads[1])
    out, _, _ = scenario.run("cpu")
    torch.testing.assert_close(out.double(), scenario.reference(), atol=FP32_TOL, rtol=FP32_TOL)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(4, 2), (6, 1)])
@HALF_DTYPES
def test_npu_paged_attention_equals_cpu(fake_npu, gen, case, block_size, heads, dtype):
    """NPU path in bf16 / fp16 (what ATB runs) against the CPU path in fp32 (HALF_TOL)."""
    scenario = Scenario(gen, *CASES[case], block_size=block_size, num_heads=heads[0], num_kv_heads=heads[1])
    cpu_out, cpu_k, cpu_v = scenario.run("cpu")
    npu_out, npu_k, npu_v = scenario.run("npu", dtype)
    torch.testing.assert_close(npu_k, cpu_k.to(dtype), atol=0, rtol=0)  # the cache write is a copy
    torch.testing.assert_close(npu_v, cpu_v.to(dtype), atol=0, rtol=0)
    assert npu_out.dtype == dtype
    torch.testing.assert_close(npu_out.float(), cpu_out, atol=HALF_TOL[dtype], rtol=HALF_TOL[dtype])
    expected_op = {"prefill_only": "_npu_flash_attention", "decode_only": "_npu_paged_attention",
                   "mixed_chunked_prefill": "_npu_paged_attention_splitfuse"}[case]
    calls = fake_npu.module.calls
    assert calls[expected_op] == 1 and calls["_npu_reshape_and_cache"] == 1
    assert sum(calls[op] for op in ("_npu_flash_attention", "_npu_paged_attention",
                                    "_npu_paged_attention_splitfuse")) == 1


@pytest.mark.parametrize("case", ["prefill_only", "mixed_chunked_prefill", "decode_only"])
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_npu_paged_attention_half_precision_masks(fake_npu, gen, case, dtype, tol):
    """bf16 / fp16 use the other mask conventions (0/1 for the bf16 prefill mask, -10000 / -inf
    additive otherwise); the NPU path must still equal the CPU path."""
    scenario = Scenario(gen, *CASES[case], block_size=16, dtype=dtype)
    cpu_out, _, _ = scenario.run("cpu")
    npu_out, _, _ = scenario.run("npu")
    assert npu_out.dtype == dtype
    torch.testing.assert_close(npu_out.float(), cpu_out.float(), atol=tol, rtol=tol)


@HALF_DTYPES
def test_npu_paged_attention_skips_requests_without_new_tokens(fake_npu, gen, dtype):
    scenario = Scenario(gen, [3, 8, 5], [4, 0, 2], block_size=16)
    torch.testing.assert_close(scenario.run("npu", dtype)[0].float(), scenario.run("cpu")[0],
                               atol=HALF_TOL[dtype], rtol=HALF_TOL[dtype])


def test_npu_per_step_derivations_follow_a_metadata_updated_in_place(fake_npu_fp32, gen):
    """The NPU kernels derive masks and indices once per step and keep them on the metadata; an
    engine that updates one metadata object in place for the next step must not see stale ones.
    (About caching, not precision: fp32 on the simulated NPU, opted in.)"""
    # 1. Same lengths, block table rewritten in place (blocks renumbered, caches moved to match).
    scenario = Scenario(gen, *CASES["prefill_only"], block_size=16)
    out, key_cache, value_cache = scenario.run("npu")
    renumber = torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(key_cache.shape[0] - 1, generator=gen) + 1])
    moved_k, moved_v = torch.empty_like(key_cache), torch.empty_like(value_cache)
    moved_k[renumber], moved_v[renumber] = key_cache, value_cache
    scenario.metadata.block_tables.copy_(renumber[scenario.metadata.block_tables.long()].to(torch.int32))
    with use_platform("npu"):
        again = ops.paged_attention(scenario.query, moved_k, moved_v, scenario.metadata, scenario.scale)
    torch.testing.assert_close(again, out, atol=FP32_TOL, rtol=FP32_TOL)
    # 2. Every field replaced by the next step's.
    first = Scenario(gen, *CASES["mixed_chunked_prefill"], block_size=16)
    second = Scenario(gen, [2, 30, 0, 9, 1], [5, 1, 3, 2, 8], block_size=16)
    expected, _, _ = second.run("cpu")
    first.run("npu")
    for field in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping", "max_query_len", "max_seq_len",
                  "query_start_loc_cpu", "seq_lens_cpu"):
        setattr(first.metadata, field, getattr(second.metadata, field))
    second.metadata = first.metadata
    torch.testing.assert_close(second.run("npu")[0], expected, atol=FP32_TOL, rtol=FP32_TOL)


@pytest.mark.parametrize("block_size, head_dim, computed, match", [
    (4, 16, [0, 0], "multiple of 16"),
    (48, 16, [0, 0], None),  # a multiple of 16 up to 128 is fine
    (256, 16, [0, 0], "at most 128"),  # refused at the first prefill already, not at the first decode
    (256, 16, [4, 20], "at most 128"),
    (128, 256, [4, 20], r"block_size \* head_size <= 128 \* 128"),  # splitfuse only
    (128, 256, [0, 0], None),
    (16, 288, [0, 0], "head sizes up to 256"),  # SelfAttention
])
def test_npu_paged_attention_refuses_sizes_atb_cannot_run(fake_npu, gen, block_size, head_dim, computed, match):
    scenario = Scenario(gen, computed, [5, 3], block_size=block_size, head_dim=head_dim, num_heads=2, num_kv_heads=1)
    if match is None:
        scenario.run("npu", torch.float16)
        return
    calls_before = sum(fake_npu.module.calls.values())
    with pytest.raises(npu_kernels.UnsupportedOnNpu, match=match) as info:
        with use_platform("npu"):
            ops.paged_attention(scenario.query.half(), scenario.initial_key_cache.half(),
                                scenario.initial_value_cache.half(), scenario.metadata, scenario.scale)
    assert isinstance(info.value, NotImplementedError) and isinstance(info.value, ValueError)
    assert sum(fake_npu.module.calls.values()) == calls_before  # refused before any ATB call


def test_fake_refuses_block_sizes_and_head_sizes_the_real_ops_refuse(npu):
    """The fake checks the limits itself too (a kernel that skipped its own check would hit them)."""
    with pytest.raises(NpuOpError, match="block_size must be <= 128"):
        npu._npu_paged_attention(**_paged_args(key_cache=torch.randn(2, 256, 2, 8), value_cache=torch.randn(2, 256, 2, 8)))
    big = dict(key_cache=torch.randn(4, 128, 2, 256), value_cache=torch.randn(4, 128, 2, 256),
               query=torch.randn(2, 2, 256), out=torch.empty(2, 2, 256), context_lens=_host([20]),
               seq_len=_host([2]), mask=torch.zeros(2, 20))
    with pytest.raises(NpuOpError, match=r"block_size \* head_size must be <= 128 \* 128"):
        npu._npu_paged_attention_splitfuse(**{k: v for k, v in _paged_args(**big).items()})
    q = torch.zeros(3, 1, 288)
    with pytest.raises(NpuOpError, match=r"head_size 288 outside \(0, 256\]"):
        npu._npu_flash_attention_unpad(query=q, key=q, value=q, seq_len=_host([3]), scale_value=1.0, num_heads=1,
                                       num_kv_heads=1, out=torch.empty_like(q))


@pytest.mark.parametrize("platform, block_size, kernels", [("cpu", 4, "native"), ("cpu", 16, "native"),
                                                        ("cpu", 16, "torch"), ("npu", 16, "auto")])
def test_prefill_then_token_by_token_decode_equals_full_attention(fake_npu_fp32, gen, monkeypatch, platform,
                                                                   block_size, kernels):
    """About step sequencing, not precision: fp32 on the simulated NPU (opted in)."""
    monkeypatch.setenv("ATB_PLUGIN_CPU_KERNELS", kernels)
    heads, kv_heads, dim, prompt, steps = 4, 2, 16, [5, 11], 6
    total = [p + steps for p in prompt]
    full = Scenario(gen, [0, 0], total, block_size=block_size, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim)
    expected = full.reference()
    key_cache, value_cache = torch.zeros_like(full.initial_key_cache), torch.zeros_like(full.initial_value_cache)
    tables = torch.tensor(full.tables, dtype=torch.int32)

    def step(new_positions):  # new_positions[r] = range of positions request r adds this step
        slots, qsl, index = [], [0], []
        for r, positions in enumerate(new_positions):
            slots += [full.tables[r][p // block_size] * block_size + p % block_size for p in positions]
            qsl.append(qsl[-1] + len(positions))
            index += [sum(total[:r]) + p for p in positions]
        seq_lens = [positions[-1] + 1 for positions in new_positions]
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=tables, slot_mapping=torch.tensor(slots), max_query_len=max(map(len, new_positions)),
            max_seq_len=max(seq_lens))
        index = torch.tensor(index)
        with use_platform(platform):
            ops.write_kv_cache(full.new_k[index], full.new_v[index], key_cache, value_cache, metadata.slot_mapping)
            out = ops.paged_attention(full.query[index], key_cache, value_cache, metadata, full.scale)
        torch.testing.assert_close(out.double(), expected[index], atol=FP32_TOL, rtol=FP32_TOL)

    step([range(0, p) for p in prompt])
    for i in range(steps):
        step([range(p + i, p + i + 1) for p in prompt])


# --------------------------------------------------------------------------------------------
# write_kv_cache
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [4, 16])
def test_write_kv_cache_npu_equals_cpu_with_skipped_slots(fake_npu, gen, block_size):
    """bf16 on both paths (ReshapeAndCache takes fp16 / bf16 / int8): the write is a copy, so exact."""
    num_blocks, kv_heads, dim, tokens, bf16 = 6, 2, 8, 9, torch.bfloat16
    key, value = randn(gen, tokens, kv_heads, dim, dtype=bf16), randn(gen, tokens, kv_heads, dim, dtype=bf16)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[1, 4, 8]] = -1
    caches = {}
    for platform in ("cpu", "npu"):
        k_cache = randn(torch.Generator().manual_seed(7), num_blocks, block_size, kv_heads, dim, dtype=bf16)
        v_cache = k_cache.clone() + 1
        with use_platform(platform):
            ops.write_kv_cache(key, value, k_cache, v_cache, slots)
        caches[platform] = (k_cache, v_cache)
    torch.testing.assert_close(caches["npu"], caches["cpu"], atol=0, rtol=0)
    k_cache, v_cache = caches["npu"]
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[i]) and torch.equal(flat_v[slot], value[i])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    original = randn(torch.Generator().manual_seed(7), num_blocks, block_size, kv_heads, dim,
                     dtype=bf16).view(-1, kv_heads, dim)
    assert torch.equal(flat_k[untouched], original[untouched])
    assert fake_npu.module.calls["_npu_reshape_and_cache"] == 1


def test_write_kv_cache_all_slots_skipped(fake_npu, gen):
    cache = torch.zeros(2, 16, 1, 4, dtype=torch.float16)
    with use_platform("npu"):
        ops.write_kv_cache(randn(gen, 2, 1, 4, dtype=torch.float16), randn(gen, 2, 1, 4, dtype=torch.float16), cache,
                           cache.clone(), torch.tensor([-1, -1]))
    assert not cache.any() and fake_npu.module.calls["_npu_reshape_and_cache"] == 0


# --------------------------------------------------------------------------------------------
# varlen attention, norms, rotary, activation: NPU == CPU
# --------------------------------------------------------------------------------------------


def _naive_varlen(q, k, v, bounds, scale, causal):
    out = torch.empty(q.shape, dtype=torch.float64)
    groups = q.shape[1] // k.shape[1]
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e == s:
            continue
        scores = torch.einsum("qhd,khd->hqk", q[s:e].double(), k[s:e].double().repeat_interleave(groups, 1)) * scale
        if causal:
            scores = scores.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool).triu(1), float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[s:e].double().repeat_interleave(groups, 1))
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
@HALF_DTYPES
def test_varlen_attention_npu_equals_cpu_equals_naive(fake_npu, gen, causal, heads, dtype):
    """CPU path in fp32 against the naive reference; NPU path in bf16 / fp16 against it (HALF_TOL)."""
    bounds = [0, 5, 5, 12, 20, 21]
    q = randn(gen, 21, heads[0], 16)
    k, v = randn(gen, 21, heads[1], 16), randn(gen, 21, heads[1], 16)
    cu = torch.tensor(bounds, dtype=torch.int32)
    with use_platform("cpu"):
        cpu = ops.varlen_attention(q, k, v, cu, 0.3, causal=causal)
    with use_platform("npu"):
        npu = ops.varlen_attention(q.to(dtype), k.to(dtype), v.to(dtype), cu, 0.3, causal=causal)
    torch.testing.assert_close(cpu.double(), _naive_varlen(q, k, v, bounds, 0.3, causal), atol=FP32_TOL, rtol=FP32_TOL)
    assert npu.dtype == dtype
    torch.testing.assert_close(npu.float(), cpu, atol=HALF_TOL[dtype], rtol=HALF_TOL[dtype])
    expected_op = "_npu_flash_attention" if causal else "_npu_flash_attention_unpad"
    assert fake_npu.module.calls[expected_op] == 1


@pytest.mark.parametrize("shape", [(7, 32), (2, 5, 64)])
def test_rms_norm_npu_equals_cpu(fake_npu, gen, shape):
    x, weight = randn(gen, *shape) * 3, randn(gen, shape[-1])
    with use_platform("cpu"):
        cpu = ops.rms_norm(x, weight, 1e-6)
    with use_platform("npu"):
        npu = ops.rms_norm(x, weight, 1e-6)
    naive = weight.double() * x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    torch.testing.assert_close(cpu.double(), naive, atol=FP32_TOL, rtol=FP32_TOL)
    torch.testing.assert_close(npu, cpu, atol=FP32_TOL, rtol=FP32_TOL)
    assert fake_npu.module.calls["npu_rms_norm"] == 1


@pytest.mark.parametrize("mrope_section", [None, [2, 3, 3]])
def test_apply_rotary_npu_equals_cpu(fake_npu, gen, mrope_section):
    tokens, heads, dim = 9, 3, 16
    rope = RotaryEmbedding(dim, {"rope_theta": 10000.0}, mrope_section=mrope_section)
    positions = torch.randint(0, 100, (3, tokens) if mrope_section else (tokens,), generator=gen)
    cos, sin = rope.cos_sin(positions, torch.float32)
    x = randn(gen, tokens, heads, dim)
    with use_platform("cpu"):
        cpu = ops.apply_rotary(x, cos, sin)
    with use_platform("npu"):
        npu = ops.apply_rotary(x, cos, sin)
    torch.testing.assert_close(npu, cpu, atol=FP32_TOL, rtol=FP32_TOL)
    assert npu.shape == x.shape and fake_npu.module.calls["npu_rotary_mul"] == 1


def test_silu_and_mul_npu_equals_cpu(fake_npu, gen):
    wide = randn(gen, 7, 96)
    x = wide[:, :64]  # a non-contiguous view, as a fused gate-up projection may hand over
    with use_platform("cpu"):
        cpu = ops.silu_and_mul(x)
    with use_platform("npu"):
        npu = ops.silu_and_mul(x)
    # Within 2 ulp: the native CPU kernel's expf and torch's vectorised exp round differently.
    torch.testing.assert_close(cpu, F.silu(x[:, :32]) * x[:, 32:], atol=0, rtol=2.5e-7)
    torch.testing.assert_close(npu, cpu, atol=FP32_TOL, rtol=FP32_TOL)
    assert fake_npu.module.calls["npu_swiglu"] == 1


# --------------------------------------------------------------------------------------------
# rotary embeddings vs transformers
# --------------------------------------------------------------------------------------------


def _llama_config(head_dim, rope):
    return LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, rope_parameters=rope,
                       max_position_embeddings=131072)


def test_default_inverse_frequencies_match_transformers():
    rope = {"rope_type": "default", "rope_theta": 1000000.0}
    expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(_llama_config(128, rope))
    torch.testing.assert_close(RotaryEmbedding(128, rope).inv_freq, expected, atol=0, rtol=1e-6)


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
])
def test_scaled_inverse_frequencies_match_transformers(rope):
    expected, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](_llama_config(128, dict(rope)))
    torch.testing.assert_close(RotaryEmbedding(128, rope).inv_freq, expected, atol=0, rtol=1e-6)


@pytest.mark.parametrize("head_dim, section", [(16, [2, 3, 3]), (128, [16, 24, 24])])
def test_mrope_cos_sin_match_transformers_qwen2_vl(gen, head_dim, section):
    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": section}
    config = Qwen2VLTextConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim, rope_parameters=rope)
    positions = torch.randint(0, 4096, (3, 23), generator=gen)
    expected_cos, expected_sin = Qwen2VLRotaryEmbedding(config)(torch.zeros(1), positions[:, None, :])
    cos, sin = RotaryEmbedding(head_dim, rope, mrope_section=section).cos_sin(positions, torch.float32)
    torch.testing.assert_close(cos, expected_cos[0], atol=FP32_TOL, rtol=0)
    torch.testing.assert_close(sin, expected_sin[0], atol=FP32_TOL, rtol=0)


def test_mrope_with_equal_rows_is_plain_rope(gen):
    positions = torch.randint(0, 500, (11,), generator=gen)
    plain = RotaryEmbedding(16, {"rope_theta": 10000.0}).cos_sin(positions, torch.float32)
    mrope = RotaryEmbedding(16, {"rope_theta": 10000.0}, mrope_section=[2, 3, 3])
    for got in (mrope.cos_sin(positions, torch.float32), mrope.cos_sin(positions.expand(3, -1), torch.float32)):
        torch.testing.assert_close(got, plain, atol=0, rtol=0)


def test_apply_rotary_matches_transformers(gen):
    tokens, heads, dim = 10, 3, 32
    rope = RotaryEmbedding(dim, {"rope_theta": 10000.0})
    cos, sin = rope.cos_sin(torch.arange(tokens), torch.float32)
    q, k = randn(gen, tokens, heads, dim), randn(gen, tokens, heads, dim)
    expected_q, expected_k = hf_apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    with use_platform("cpu"):
        torch.testing.assert_close(ops.apply_rotary(q, cos, sin), expected_q[0].transpose(0, 1), atol=FP32_TOL, rtol=0)
        torch.testing.assert_close(ops.apply_rotary(k, cos, sin), expected_k[0].transpose(0, 1), atol=FP32_TOL, rtol=0)


# --------------------------------------------------------------------------------------------
# the fake is honest: hand-computed results, contract violations raise
# --------------------------------------------------------------------------------------------


@pytest.fixture
def npu(fake_npu_fp32):
    """The simulated torch_npu with fp32 opted in: the by-hand tests below check semantics on
    exact fp32 values (the fp32 refusal itself is tested separately)."""
    return fake_npu_fp32.module


def test_fake_rms_norm_by_hand(npu):
    y, rstd = npu.npu_rms_norm(torch.tensor([[3.0, 4.0]]), torch.ones(2), epsilon=0.0)
    torch.testing.assert_close(y, torch.tensor([[3.0, 4.0]]) / math.sqrt(12.5))
    torch.testing.assert_close(rstd, torch.tensor([[1 / math.sqrt(12.5)]]))
    y, _ = npu.npu_rms_norm(torch.tensor([3.0, 4.0]), torch.tensor([2.0, -1.0]), epsilon=0.0)
    torch.testing.assert_close(y, torch.tensor([6.0, -4.0]) / math.sqrt(12.5))


def test_fake_swiglu_by_hand(npu):
    y = npu.npu_swiglu(torch.tensor([0.0, 1.0, 2.0, 3.0]))
    torch.testing.assert_close(y, torch.tensor([0.0, 3.0 / (1.0 + math.exp(-1.0))]))


def test_fake_rotary_mul_by_hand(npu):
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    ones, zeros = torch.ones(1, 1, 1, 4), torch.zeros(1, 1, 1, 4)
    torch.testing.assert_close(npu.npu_rotary_mul(x, ones, zeros), x)
    torch.testing.assert_close(npu.npu_rotary_mul(x, zeros, ones).flatten(), torch.tensor([-3.0, -4.0, 1.0, 2.0]))
    torch.testing.assert_close(npu.npu_rotary_mul(x, zeros, ones, rotary_mode="interleave").flatten(),
                               torch.tensor([-2.0, 1.0, -4.0, 3.0]))


def test_fake_reshape_and_cache_by_hand(npu):
    key_cache, value_cache = torch.zeros(3, 16, 1, 2), torch.zeros(3, 16, 1, 2)
    key = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]])
    npu._npu_reshape_and_cache(key=key, value=-key, key_cache=key_cache, value_cache=value_cache,
                               slot_indices=torch.tensor([17, 2], dtype=torch.int32))
    assert key_cache[1, 1, 0].tolist() == [1.0, 2.0] and key_cache[0, 2, 0].tolist() == [3.0, 4.0]
    assert value_cache[1, 1, 0].tolist() == [-1.0, -2.0]
    assert key_cache.abs().sum() == 10.0


def _two_token_kv():
    """Keys all equal (so visible tokens get equal weight); values 1s and 3s."""
    key = torch.zeros(2, 1, 4)
    value = torch.stack([torch.ones(1, 4), 3 * torch.ones(1, 4)])
    return key, value


@pytest.mark.parametrize("dtype, masked", [(torch.float32, torch.finfo(torch.float32).min),
                                           (torch.float16, float("-inf")), (torch.bfloat16, 1.0)])
def test_fake_flash_attention_by_hand(npu, dtype, masked):
    key, value = _two_token_kv()
    query = torch.randn(2, 1, 4)
    mask = torch.tensor([[0.0, masked], [0.0, 0.0]]).to(dtype)
    out = torch.empty(2, 1, 4, dtype=dtype)
    npu._npu_flash_attention(query=query.to(dtype), key=key.to(dtype), value=value.to(dtype), mask=mask,
                             seq_len=_host([2]), scale_value=0.5, num_heads=1,
                             num_kv_heads=1, out=out)
    # token 0 sees only itself (value 1); token 1 sees both equally weighted (value 2)
    torch.testing.assert_close(out.float(), torch.tensor([[[1.0] * 4], [[2.0] * 4]]))


def test_fake_flash_attention_unpad_by_hand(npu):
    key, value = _two_token_kv()
    out = torch.empty(3, 1, 4)
    npu._npu_flash_attention_unpad(query=torch.randn(3, 1, 4), key=torch.cat([key, key[:1]]),
                                   value=torch.cat([value, 5 * torch.ones(1, 1, 4)]),
                                   seq_len=_host([2, 1]), scale_value=1.0, num_heads=1,
                                   num_kv_heads=1, out=out)
    torch.testing.assert_close(out, torch.tensor([[[2.0] * 4], [[2.0] * 4], [[5.0] * 4]]))


def test_fake_paged_attention_by_hand(npu):
    """One query over two cached tokens in block 2: scores 0 and ln 3 give weights 1/4, 3/4."""
    key_cache, value_cache = torch.full((3, 16, 1, 2), 50.0), torch.full((3, 16, 1, 2), 50.0)
    key_cache[2, 0, 0] = torch.tensor([0.0, 0.0])
    key_cache[2, 1, 0] = torch.tensor([math.log(3.0), 0.0])
    value_cache[2, 0, 0] = torch.tensor([1.0, 1.0])
    value_cache[2, 1, 0] = torch.tensor([3.0, 3.0])
    out = torch.empty(1, 1, 2)
    npu._npu_paged_attention(query=torch.tensor([[[1.0, 0.0]]]), key_cache=key_cache, value_cache=value_cache,
                             num_kv_heads=1, num_heads=1, scale_value=1.0,
                             block_table=torch.tensor([[2, 0]], dtype=torch.int32),
                             context_lens=_host([2]), out=out)
    torch.testing.assert_close(out, torch.tensor([[[2.5, 2.5]]]))


def test_fake_paged_attention_splitfuse_by_hand(npu):
    """Three cached tokens (values 1, 3, 5, equal keys); two query tokens at positions 1 and 2:
    the mask rows let them see 2 and 3 tokens -> means 2 and 3. Without the mask, both see all."""
    key_cache, value_cache = torch.zeros(2, 16, 1, 2), torch.full((2, 16, 1, 2), 99.0)
    for pos, val in enumerate([1.0, 3.0, 5.0]):
        value_cache[1, pos, 0] = val
    neg = torch.finfo(torch.float32).min
    args = dict(query=torch.randn(2, 1, 2), key_cache=key_cache, value_cache=value_cache,
                block_table=torch.tensor([[1]], dtype=torch.int32), context_lens=_host([3]),
                seq_len=_host([2]), num_kv_heads=1, num_heads=1, scale_value=1.0)
    out = torch.empty(2, 1, 2)
    npu._npu_paged_attention_splitfuse(mask=torch.tensor([[0.0, 0.0, neg], [0.0, 0.0, 0.0]]), out=out, **args)
    torch.testing.assert_close(out, torch.tensor([[[2.0, 2.0]], [[3.0, 3.0]]]))
    npu._npu_paged_attention_splitfuse(mask=torch.zeros(2, 3), out=out, **args)
    torch.testing.assert_close(out, torch.full((2, 1, 2), 3.0))


def _paged_args(**overrides):
    args = dict(query=torch.randn(1, 2, 8), key_cache=torch.randn(4, 16, 2, 8), value_cache=torch.randn(4, 16, 2, 8),
                num_kv_heads=2, num_heads=2, scale_value=1.0, block_table=torch.tensor([[1, 2]], dtype=torch.int32),
                context_lens=_host([20]), out=torch.empty(1, 2, 8))
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides, message", [
    (dict(key_cache=torch.randn(4, 2, 16, 8), value_cache=torch.randn(4, 2, 16, 8)), "num_kv_heads=2 but"),
    (dict(key_cache=torch.randn(16, 2, 8), value_cache=torch.randn(16, 2, 8)), "num_kv_heads=2 but"),
    (dict(key_cache=torch.randn(16, 4, 2, 8), value_cache=torch.randn(16, 4, 2, 8)), "multiple of 16"),
    (dict(block_table=torch.tensor([[1, 2]])), "int32"),
    (dict(block_table=torch.tensor([[1, 9]], dtype=torch.int32)), r"\[0, num_blocks=4\)"),
    (dict(block_table=torch.tensor([[1]], dtype=torch.int32)), "cover max\\(context_lens\\)"),
    (dict(context_lens=torch.tensor([20])), "int32"),
    (dict(query=torch.randn(1, 1, 2, 8)), r"query must be \[num_tokens, num_heads, head_size\]"),
    (dict(num_heads=3), "num_heads=3 but query has 2"),
    (dict(out=torch.empty(1, 2, 8, dtype=torch.float16)), "out must match query"),
    (dict(key_cache=torch.randn(4, 16, 2, 8).half()), "dtype"),
])
def test_fake_paged_attention_rejects_wrong_layouts(npu, overrides, message):
    with pytest.raises(NpuOpError, match=message):
        npu._npu_paged_attention(**_paged_args(**overrides))


def test_fake_rejects_wrong_layouts_elsewhere(npu):
    cache = torch.zeros(2, 16, 2, 4)
    with pytest.raises(NpuOpError, match="does not fit key_cache"):  # cache as [blocks, heads, block_size, dim]
        npu._npu_reshape_and_cache(key=torch.zeros(1, 2, 4), value=torch.zeros(1, 2, 4),
                                   key_cache=torch.zeros(2, 2, 16, 4), value_cache=torch.zeros(2, 2, 16, 4),
                                   slot_indices=torch.tensor([0], dtype=torch.int32))
    with pytest.raises(NpuOpError, match="int32"):
        npu._npu_reshape_and_cache(key=torch.zeros(1, 2, 4), value=torch.zeros(1, 2, 4), key_cache=cache,
                                   value_cache=cache.clone(), slot_indices=torch.tensor([0]))
    with pytest.raises(NpuOpError, match="slot_indices must lie"):
        npu._npu_reshape_and_cache(key=torch.zeros(1, 2, 4), value=torch.zeros(1, 2, 4), key_cache=cache,
                                   value_cache=cache.clone(), slot_indices=torch.tensor([-1], dtype=torch.int32))
    q = torch.zeros(3, 2, 4)
    flash = dict(query=q, key=q, value=q, seq_len=_host([3]), scale_value=1.0, num_heads=2,
                 num_kv_heads=2, out=torch.empty_like(q))
    with pytest.raises(NpuOpError, match="mask must be"):
        npu._npu_flash_attention(mask=torch.zeros(2, 2), **flash)
    with pytest.raises(NpuOpError, match="sum to num_tokens"):
        npu._npu_flash_attention(mask=torch.zeros(3, 3), **{**flash, "seq_len": _host([2])})
    with pytest.raises(NpuOpError, match="seq_len must be int32"):
        npu._npu_flash_attention(mask=torch.zeros(3, 3), **{**flash, "seq_len": torch.tensor([3])})
    with pytest.raises(NpuOpError, match="seq_len must be a host"):  # ATB reads the lengths as host data
        npu._npu_flash_attention(mask=torch.zeros(3, 3),
                                 **{**flash, "seq_len": torch.tensor([3], dtype=torch.int32, device="meta")})
    qb = q.bfloat16()
    with pytest.raises(NpuOpError, match="0 \\(visible\\) / 1 \\(masked\\)"):
        npu._npu_flash_attention(query=qb, key=qb, value=qb, mask=torch.full((3, 3), float("-inf")).bfloat16().triu(1),
                                 seq_len=_host([3]), scale_value=1.0, num_heads=2,
                                 num_kv_heads=2, out=torch.empty_like(qb))
    with pytest.raises(NpuOpError, match="4-D"):
        npu.npu_rotary_mul(torch.zeros(3, 2, 4), torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4))
    with pytest.raises(NpuOpError, match="contiguous"):
        npu.npu_swiglu(torch.zeros(4, 8)[:, :4])
    with pytest.raises(NpuOpError, match="gamma dtype"):
        npu.npu_rms_norm(torch.zeros(2, 4), torch.ones(4, dtype=torch.float16))
    splitfuse = _paged_args(query=torch.randn(2, 2, 8), out=torch.empty(2, 2, 8), seq_len=_host([2]))
    with pytest.raises(NpuOpError, match=r"mask must be \[num_tokens=2"):
        npu._npu_paged_attention_splitfuse(mask=torch.zeros(1, 20), **splitfuse)


def test_fake_ops_compute_real_values(npu, gen):
    """Guard against stubs: every op's output depends on its input and is not all zeros."""
    x = randn(gen, 4, 8)
    assert npu.npu_swiglu(x).abs().sum() > 0 and not torch.equal(npu.npu_swiglu(x), npu.npu_swiglu(x + 1))
    assert npu.npu_rms_norm(x, torch.ones(8))[0].abs().sum() > 0
    assert os.environ.get("ATB_PLUGIN_DEVICE") is None  # the fixture left the environment alone
    assert npu_platform_module.torch_npu() is npu


# --------------------------------------------------------------------------------------------
# the fake's documented rules: dtypes (fp32 only by opt-in), host marks, workspace
# --------------------------------------------------------------------------------------------


def _flash_args(dtype, **overrides):
    q = torch.zeros(3, 2, 4, dtype=dtype)
    args = dict(query=q, key=q, value=q, mask=torch.zeros(3, 3, dtype=dtype), seq_len=_host([3]), scale_value=1.0,
                num_heads=2, num_kv_heads=2, out=torch.empty_like(q))
    args.update(overrides)
    return args


def test_fake_refuses_fp32_attention_unless_opted_in(fake_npu):
    npu = fake_npu.module
    with pytest.raises(NpuOpError, match=r"_npu_flash_attention: query is float32, but the ATB op takes "
                                         r"float16 / bfloat16 only.*allow_fp32_attention"):
        npu._npu_flash_attention(**_flash_args(torch.float32))
    with pytest.raises(NpuOpError, match=r"_npu_paged_attention: query is float32"):
        npu._npu_paged_attention(**_paged_args())
    with pytest.raises(NpuOpError, match=r"_npu_reshape_and_cache: key is float32.*float16 / bfloat16 / int8"):
        npu._npu_reshape_and_cache(key=torch.zeros(1, 2, 4), value=torch.zeros(1, 2, 4),
                                   key_cache=torch.zeros(2, 16, 2, 4), value_cache=torch.zeros(2, 16, 2, 4),
                                   slot_indices=torch.tensor([0], dtype=torch.int32))
    npu._npu_flash_attention(**_flash_args(torch.float16))  # half precision is the contract
    with fake_npu.allow_fp32_attention():
        npu._npu_flash_attention(**_flash_args(torch.float32))
    with pytest.raises(NpuOpError, match="float32"):  # the opt-in ends with the block
        npu._npu_flash_attention(**_flash_args(torch.float32))
    npu.npu_rms_norm(torch.ones(2, 4), torch.ones(4))  # aclnn RmsNorm takes fp32: no opt-in needed


def test_install_can_opt_in_to_fp32(clean_platform):
    with fake_torch_npu.install(allow_fp32_attention=True) as fake:
        fake.module._npu_flash_attention(**_flash_args(torch.float32))


def test_fake_requires_host_marked_lengths(npu):
    unmarked = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(NpuOpError, match="seq_len must be a host tensor"):
        npu._npu_flash_attention(**_flash_args(torch.float16, seq_len=unmarked))
    with pytest.raises(NpuOpError, match="context_lens must be a host tensor"):
        npu._npu_paged_attention(**_paged_args(context_lens=torch.tensor([20], dtype=torch.int32)))
    assert npu_kernels.HOST_MARK == fake_torch_npu.HOST_MARK
    with pytest.raises(RuntimeError, match="host"):
        npu_kernels.host(torch.zeros(1, dtype=torch.int32, device="meta"))


def test_fake_paged_attention_takes_a_keyword_only_workspace(npu):
    plain = _paged_args()
    npu._npu_paged_attention(**plain)
    with_workspace = {**plain, "out": torch.empty_like(plain["out"]), "workspace": torch.empty(64, dtype=torch.uint8)}
    npu._npu_paged_attention(**with_workspace)
    torch.testing.assert_close(with_workspace["out"], plain["out"])
    positional = list(_paged_args().values())
    with pytest.raises(TypeError):
        npu._npu_paged_attention(*positional, torch.empty(64, dtype=torch.uint8))


def test_a_cpu_prefill_chunk_after_cached_tokens_equals_the_masked_attention():
    """The two-kernel path (cached keys all visible + the chunk's own keys causal, merged by
    log-sum-exp) against one masked SDPA over the same keys: equal within float32 rounding."""
    import torch.nn.functional as F

    from atb_plugin.ops.torch_kernels import _chunk_after_prefix

    generator = torch.Generator().manual_seed(5)
    q_len, seq_len, heads, kv_heads, dim = 37, 100, 6, 2, 16
    query = torch.randn(q_len, heads, dim, generator=generator)
    key = torch.randn(seq_len, kv_heads, dim, generator=generator)
    value = torch.randn(seq_len, kv_heads, dim, generator=generator)
    positions = torch.arange(seq_len - q_len, seq_len)
    mask = torch.arange(seq_len)[None, :] <= positions[:, None]
    expected = F.scaled_dot_product_attention(query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                              value.transpose(0, 1)[None], attn_mask=mask, scale=0.25,
                                              enable_gqa=True)[0].transpose(0, 1)
    got = _chunk_after_prefix(query, key, value, 0.25, seq_len - q_len)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_the_per_step_rotary_tables_do_not_keep_a_step_alive():
    """The tables derived once per step are kept on that step's ``cos``; nothing kept there may
    refer back to ``cos`` (a view would: a cycle through the view's base that the garbage
    collector cannot see, which leaked every step's tables)."""
    import gc
    import weakref

    from atb_plugin.ops import torch_kernels

    refs = []
    for _ in range(3):
        cos, sin = torch.randn(8, 16), torch.randn(8, 16)
        torch_kernels.apply_rotary(torch.randn(8, 2, 16), cos, sin)
        torch_kernels.apply_rotary(torch.randn(8, 2, 16), cos, sin)  # the second layer reuses them
        refs.append(weakref.ref(cos))
        del cos, sin
    gc.collect()
    assert [ref() for ref in refs] == [None, None, None]

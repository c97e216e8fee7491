"""The FIA NPU kernel set (``atb_plugin.ops.npu_fia_kernels``) over the simulated aclnn ops of
``atb_plugin.testing.fake_fia_ops``:

1. the fakes themselves: real signatures (checked against the wheel's schemas), results equal to
   a plain reference (SDPA over each request's gathered blocks), contract violations raise and
   unsimulated features raise ``NotImplementedError`` naming them;
2. the kernels through ``atb_plugin.ops`` equal the CPU kernels (prefill, decode, chunked
   prefill / mixed batches, requests without new tokens), with one FIA call per layer and step;
3. every decoder family the engine serves (qwen2, llama, and the LMs of qwen2_vl, llava, qwen_vl)
   through the FIA kernels in float16 and bfloat16 against the CPU path in float32, over a
   multi-request schedule that covers prefill-only, mixed and decode-only steps.

The kernel set is selected per block with ``ATB_PLUGIN_NPU_KERNELS`` (``fia`` / ``atb``; the
simulated chip's own default is ``atb``), falling back to a platform copy whose ``kernels`` is the
wanted module where the platform has no such switch.

Tolerances (max |difference| over all logits, in units of ``eps * scale``, ``scale`` the largest
|logit| of the fp32 reference, ``eps`` the dtype's machine epsilon). The simulated ops compute
attention in float32 and round once, like the CPU kernels; what separates a half-precision run
from the fp32 reference is the rounding of every weight and activation to the dtype over two
layers and the LM head:

* float16 (11 significant bits, eps = 2**-10 ~ 9.8e-4) and bfloat16 (8 significant bits,
  eps = 2**-7 ~ 7.8e-3): bound ``8 * eps * scale``. Measured 1.7-3.5 for every family in both
  dtypes; an attention bug as small as dropping the last cached token measures ~150 (fp16) and
  ~19 (bf16), so the bound separates rounding from wrong attention.
* FIA kernels vs the ATB kernel set in the *same* dtype (same weights, same rounding everywhere
  but inside the attention op, where only float32 summation order differs): ``2 * eps * scale``
  (measured <= 0.94).

Op-level checks in half precision compare with a float32 reference over the same half inputs:
one rounding of the output, ``atol = rtol = 2e-3`` (fp16) / ``1.6e-2`` (bf16), about 2 eps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from atb_plugin import ops
from atb_plugin.ops import AttentionMetadata, npu_fia_kernels, npu_kernels
from atb_plugin.platform import PLATFORMS, use_platform
from atb_plugin.testing import fake_fia_ops, fake_torch_npu
from atb_plugin.testing.fake_torch_npu import NpuOpError
from atb_plugin.testing.tiny import tiny_checkpoint
from atb_plugin.utils import cdiv
from routers import get_router

FIA = "npu_fused_infer_attention_score"
SCATTER = "npu_scatter_pa_kv_cache"
ATB_ATTENTION_OPS = ("_npu_flash_attention", "_npu_paged_attention", "_npu_paged_attention_splitfuse",
                     "_npu_reshape_and_cache")
EPS = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
OP_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SCHEMA_FILE = Path(fake_torch_npu.__file__).with_name("npu_schemas.txt")


# --------------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------------


KERNELS_ENV = "ATB_PLUGIN_NPU_KERNELS"  # the NPU platform's kernel-set switch: atb | fia
KERNEL_SET_NAMES = {npu_kernels: "atb", npu_fia_kernels: "fia"}


def _platform_with(kernels_module):
    """A copy of the NPU platform whose ``kernels`` is ``kernels_module`` (for a platform without
    the ``ATB_PLUGIN_NPU_KERNELS`` switch, whose ``kernels`` is a cached property)."""
    platform = dataclasses.replace(PLATFORMS["npu"], kernels_module=kernels_module.__name__)
    if platform.kernels is not kernels_module:
        platform.__dict__["kernels"] = kernels_module
    assert platform.kernels is kernels_module
    return platform


@contextlib.contextmanager
def on_kernels(kernels_module):
    """Run a block on the (simulated) NPU with ``kernels_module`` as its kernel set: chosen
    through ``ATB_PLUGIN_NPU_KERNELS``, else by swapping in a platform copy."""
    previous_env, previous = os.environ.get(KERNELS_ENV), PLATFORMS["npu"]
    os.environ[KERNELS_ENV] = KERNEL_SET_NAMES[kernels_module]
    try:
        if PLATFORMS["npu"].kernels is not kernels_module:
            PLATFORMS["npu"] = _platform_with(kernels_module)
        with use_platform("npu") as platform:
            assert platform.kernels is kernels_module
            yield
    finally:
        PLATFORMS["npu"] = previous
        if previous_env is None:
            os.environ.pop(KERNELS_ENV, None)
        else:
            os.environ[KERNELS_ENV] = previous_env


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(4321)


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


# --------------------------------------------------------------------------------------------
# signatures
# --------------------------------------------------------------------------------------------


def _schema_lines() -> dict[str, str]:
    lines = [line.strip() for line in SCHEMA_FILE.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return {line.split("(", 1)[0]: line for line in lines}


@pytest.mark.parametrize("fn", fake_fia_ops.OPS, ids=lambda fn: fn.__name__)
def test_fake_signatures_are_the_real_schemas(fn):
    """Names, order, positional vs keyword-only, defaults: as torch_npu 2.13 registers them."""
    schema_text = fake_fia_ops.SCHEMAS[fn.__name__]
    if SCHEMA_FILE.exists() and fn.__name__ in _schema_lines():
        assert _schema_lines()[fn.__name__] == schema_text, "the wheel's schema changed"
    schema = torch._C.parse_schema(schema_text)
    params = list(inspect.signature(fn).parameters.values())
    assert [p.name for p in params] == [a.name for a in schema.arguments]
    for param, arg in zip(params, schema.arguments):
        kind = inspect.Parameter.KEYWORD_ONLY if arg.kwarg_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        assert param.kind == kind, param.name
        if arg.has_default_value():
            assert param.default == arg.default_value, param.name
        else:
            assert param.default is inspect.Parameter.empty, param.name


# --------------------------------------------------------------------------------------------
# the fakes against a reference
# --------------------------------------------------------------------------------------------


class PagedCase:
    """Requests with ``computed`` cached tokens and ``new`` query tokens; caches in our ND layout
    with scrambled blocks and garbage in every unused slot."""

    def __init__(self, gen, computed, new, block_size=128, heads=4, kv_heads=2, dim=32, dtype=torch.float16):
        self.block_size, self.heads, self.kv_heads, self.dim, self.dtype = block_size, heads, kv_heads, dim, dtype
        self.computed, self.new = computed, new
        self.seq_lens = [c + n for c, n in zip(computed, new)]
        need = [cdiv(s, block_size) for s in self.seq_lens]
        num_blocks = 1 + sum(need) + 2
        order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        width = max(need)
        self.tables = []
        for count in need:
            self.tables.append(order[:count] + [0] * (width - count))
            order = order[count:]
        shape = (num_blocks, block_size, kv_heads, dim)
        self.key_cache = randn(gen, *shape, dtype=dtype)
        self.value_cache = randn(gen, *shape, dtype=dtype)
        self.query = randn(gen, sum(new), heads, dim, dtype=dtype)
        self.scale = dim**-0.5
        qsl = [0]
        for n in new:
            qsl.append(qsl[-1] + n)
        self.qsl = qsl
        self.new_k = randn(gen, sum(new), kv_heads, dim, dtype=dtype)
        self.new_v = randn(gen, sum(new), kv_heads, dim, dtype=dtype)
        slots = [self.tables[r][p // block_size] * block_size + p % block_size
                 for r in range(len(new)) for p in range(computed[r], self.seq_lens[r])]
        self.metadata = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(self.tables, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(new), max_seq_len=max(self.seq_lens))

    def reference(self, key_cache=None, value_cache=None, causal=True):
        """SDPA (float32) per request over its blocks gathered from the cache; bottom-right causal."""
        key_cache = self.key_cache if key_cache is None else key_cache
        value_cache = self.value_cache if value_cache is None else value_cache
        outs, lses = [], []
        for r, (n, s) in enumerate(zip(self.new, self.seq_lens)):
            if n == 0:
                continue
            blocks = torch.tensor(self.tables[r][:cdiv(s, self.block_size)])
            k = key_cache[blocks].flatten(0, 1)[:s].float().transpose(0, 1)
            v = value_cache[blocks].flatten(0, 1)[:s].float().transpose(0, 1)
            q = self.query[self.qsl[r]:self.qsl[r] + n].float().transpose(0, 1)
            mask = None
            if causal:
                mask = torch.arange(s)[None, :] <= torch.arange(s - n, s)[:, None]
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                                       enable_gqa=self.heads != self.kv_heads).transpose(0, 1))
            groups = self.heads // self.kv_heads
            scores = torch.einsum("hqd,hkd->hqk", q, k.repeat_interleave(groups, 0)) * self.scale
            if causal:
                scores = scores.masked_fill(~mask, float("-inf"))
            lses.append(torch.logsumexp(scores, -1).transpose(0, 1))
        return torch.cat(outs), torch.cat(lses)

    def fia_kwargs(self, **overrides):
        active = [r for r, n in enumerate(self.new) if n]
        nb = self.key_cache.shape[0]
        kwargs = dict(
            atten_mask=torch.ones(2048, 2048, dtype=torch.int8).triu(1),
            actual_seq_lengths=[self.qsl[r + 1] for r in active],
            actual_seq_lengths_kv=[self.seq_lens[r] for r in active],
            block_table=torch.tensor(self.tables, dtype=torch.int32)[active],
            num_heads=self.heads, scale=self.scale, input_layout="TND", num_key_value_heads=self.kv_heads,
            sparse_mode=3, block_size=self.block_size)
        kwargs.update(overrides)
        key = self.key_cache.view(nb, self.block_size, -1)
        value = self.value_cache.view(nb, self.block_size, -1)
        return (self.query, key, value), kwargs


CASES = {
    "prefill_only": ([0, 0, 0], [5, 130, 17]),
    "decode_only": ([4, 200, 128], [1, 1, 1]),
    "mixed_chunked_prefill": ([0, 127, 20, 3, 250], [6, 1, 140, 1, 16]),
    "with_idle_request": ([3, 8, 5], [4, 0, 2]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (8, 1)])
def test_fia_paged_tnd_causal_equals_sdpa_over_gathered_blocks(gen, case, dtype, heads):
    c = PagedCase(gen, *CASES[case], heads=heads[0], kv_heads=heads[1], dtype=dtype)
    args, kwargs = c.fia_kwargs(softmax_lse_flag=True)
    out, lse = fake_fia_ops.npu_fused_infer_attention_score(*args, **kwargs)
    expected, expected_lse = c.reference()
    assert out.dtype == dtype and out.shape == c.query.shape
    assert lse.dtype == torch.float32 and lse.shape == (c.query.shape[0], heads[0], 1)
    tol = OP_TOL[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(lse[..., 0], expected_lse, atol=1e-4, rtol=1e-4)
    # Without the flag: the documented placeholder.
    args, kwargs = c.fia_kwargs()
    out2, placeholder = fake_fia_ops.npu_fused_infer_attention_score(*args, **kwargs)
    assert torch.equal(out2, out) and placeholder.shape == (1,) and not placeholder.any()


def test_fia_paged_bnsd_style_cache_layout(gen):
    """The other documented cache layout, (num_blocks, KV_N, block_size, D), gives the same result."""
    c = PagedCase(gen, [0, 127, 20], [6, 1, 140])
    args, kwargs = c.fia_kwargs()
    expected, _ = fake_fia_ops.npu_fused_infer_attention_score(*args, **kwargs)
    k4 = c.key_cache.transpose(1, 2).contiguous()
    v4 = c.value_cache.transpose(1, 2).contiguous()
    out, _ = fake_fia_ops.npu_fused_infer_attention_score(c.query, k4, v4, **kwargs)
    assert torch.equal(out, expected)


def test_fia_contiguous_tnd_without_mask_is_full_attention(gen):
    """No block_table: TND key/value with cumulative actual_seq_lengths_kv; sparse_mode 0 without
    a mask attends to every key of the request (the vision-tower case)."""
    lens_q, lens_kv, heads, dim = [3, 5], [4, 7], 4, 16
    q = randn(gen, sum(lens_q), heads, dim, dtype=torch.bfloat16)
    k = randn(gen, sum(lens_kv), 2, dim, dtype=torch.bfloat16)
    v = randn(gen, sum(lens_kv), 2, dim, dtype=torch.bfloat16)
    out, _ = fake_fia_ops.npu_fused_infer_attention_score(
        q, k, v, actual_seq_lengths=[3, 8], actual_seq_lengths_kv=[4, 11], num_heads=heads, scale=0.3,
        input_layout="TND", num_key_value_heads=2)
    expected = torch.cat([
        F.scaled_dot_product_attention(q[:3].float().transpose(0, 1), k[:4].float().transpose(0, 1),
                                       v[:4].float().transpose(0, 1), scale=0.3, enable_gqa=True),
        F.scaled_dot_product_attention(q[3:].float().transpose(0, 1), k[4:].float().transpose(0, 1),
                                       v[4:].float().transpose(0, 1), scale=0.3, enable_gqa=True),
    ], dim=1).transpose(0, 1)
    torch.testing.assert_close(out.float(), expected, atol=OP_TOL[torch.bfloat16], rtol=OP_TOL[torch.bfloat16])


def _expect(exc, match, c, args_fn=None, **overrides):
    args, kwargs = c.fia_kwargs(**overrides)
    if args_fn is not None:
        args = args_fn(args)
    with pytest.raises(exc, match=match):
        fake_fia_ops.npu_fused_infer_attention_score(*args, **kwargs)


def test_fia_contract_violations_raise(gen):
    c = PagedCase(gen, [0, 20], [9, 3])
    _expect(NpuOpError, "float16 or bfloat16", c, args_fn=lambda a: tuple(t.float() for t in a))
    _expect(NpuOpError, "dtypes differ", c, args_fn=lambda a: (a[0], a[1].bfloat16(), a[2]))
    _expect(NpuOpError, r"\(2048, 2048\)", c, atten_mask=torch.ones(64, 64, dtype=torch.int8).triu(1))
    _expect(NpuOpError, "compressed causal mask", c, atten_mask=torch.ones(2048, 2048, dtype=torch.int8).tril())
    _expect(NpuOpError, "bool/int8/uint8", c, atten_mask=torch.ones(2048, 2048).triu(1))
    _expect(NpuOpError, "needs atten_mask", c, atten_mask=None)
    _expect(NpuOpError, "cumulative", c, actual_seq_lengths=[9, 3])
    _expect(NpuOpError, "end at T", c, actual_seq_lengths=[9, 11])
    _expect(NpuOpError, "SymInt", c, actual_seq_lengths=torch.tensor([9, 12]))
    _expect(NpuOpError, "query length <= its KV length", c, actual_seq_lengths_kv=[9, 2])
    _expect(NpuOpError, "num_heads=2", c, num_heads=2)
    _expect(NpuOpError, "multiple of num_key_value_heads", c, num_key_value_heads=3)
    _expect(NpuOpError, "int32", c, block_table=torch.tensor(c.tables, dtype=torch.int64))
    _expect(NpuOpError, "contiguous", c, args_fn=lambda a: (a[0].transpose(0, 1).contiguous().transpose(0, 1),
                                                            a[1], a[2]))
    # Our 4-D ND cache passed as is reads as (num_blocks, KV_N, block_size, D): refused.
    _expect(NpuOpError, "KV_N, block_size, D", c, args_fn=lambda a: (a[0], c.key_cache, c.value_cache))
    # Block sizes: Q_S > 1 needs a multiple of 128 in [128, 512]; decode-only 16-aligned.
    small = PagedCase(gen, [0, 20], [9, 3], block_size=16)
    _expect(NpuOpError, "multiple of 128", small)
    decode = PagedCase(gen, [5, 20], [1, 1], block_size=16)
    out, _ = fake_fia_ops.npu_fused_infer_attention_score(*decode.fia_kwargs()[0], **decode.fia_kwargs()[1])
    torch.testing.assert_close(out.float(), decode.reference()[0], atol=2e-3, rtol=2e-3)
    odd = PagedCase(gen, [5, 20], [1, 1], block_size=8)
    _expect(NpuOpError, "multiple of 16", odd)


def test_fia_unsimulated_features_raise_not_implemented(gen):
    c = PagedCase(gen, [0], [4])
    _expect(NotImplementedError, "input_layout='BSH'", c, input_layout="BSH")
    _expect(NotImplementedError, "input_layout='BNSD'", c, input_layout="BNSD")
    _expect(NotImplementedError, "sparse_mode=2", c, sparse_mode=2)
    _expect(NotImplementedError, "sparse_mode=0 with an atten_mask", c, sparse_mode=0)
    _expect(NotImplementedError, "pse_shift", c, pse_shift=torch.zeros(1))
    _expect(NotImplementedError, "query_rope", c, query_rope=torch.zeros(1))
    _expect(NotImplementedError, "key_antiquant_mode=1", c, key_antiquant_mode=1)
    _expect(NpuOpError, "sparse_mode must be", c, sparse_mode=6)


def test_scatter_pa_kv_cache_writes_slots(gen):
    nb, bs, heads, dk, dv, tokens = 5, 16, 2, 32, 16, 11
    key = randn(gen, tokens, heads, dk, dtype=torch.bfloat16)
    value = randn(gen, tokens, heads, dv, dtype=torch.bfloat16)
    key_cache = randn(gen, nb, bs, heads, dk, dtype=torch.bfloat16)
    value_cache = randn(gen, nb, bs, heads, dv, dtype=torch.bfloat16)
    slots = torch.randperm(nb * bs, generator=gen)[:tokens]
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    expected_k.view(-1, heads, dk)[slots] = key
    expected_v.view(-1, heads, dv)[slots] = value
    for slot_dtype in (torch.int64, torch.int32):
        k_out, v_out = key_cache.clone(), value_cache.clone()
        assert fake_fia_ops.npu_scatter_pa_kv_cache(key, value, k_out, v_out, slots.to(slot_dtype),
                                                    cache_mode="Norm") is None
        assert torch.equal(k_out, expected_k) and torch.equal(v_out, expected_v)


def test_scatter_pa_kv_cache_contract(gen):
    key = randn(gen, 3, 2, 16, dtype=torch.float16)
    cache = torch.zeros(2, 16, 2, 16, dtype=torch.float16)
    slots = torch.tensor([0, 5, 17])

    def call(k=key, kc=cache, s=slots, **kw):
        kw.setdefault("cache_mode", "Norm")
        fake_fia_ops.npu_scatter_pa_kv_cache(k, k.clone(), kc, kc.clone(), s, **kw)

    with pytest.raises(NpuOpError, match="PA_NZ"):
        fake_fia_ops.npu_scatter_pa_kv_cache(key, key.clone(), cache, cache.clone(), slots)  # default mode
    with pytest.raises(NpuOpError, match="distinct"):
        call(s=torch.tensor([0, 5, 5]))
    with pytest.raises(NpuOpError, match="lie in"):
        call(s=torch.tensor([0, 5, -1]))
    with pytest.raises(NpuOpError, match="lie in"):
        call(s=torch.tensor([0, 5, 64]))
    with pytest.raises(NpuOpError, match="share one dtype"):
        call(kc=cache.bfloat16())
    with pytest.raises(NpuOpError, match="int32 or int64"):
        call(s=slots.float())
    with pytest.raises(NpuOpError, match="ND key_cache"):
        call(kc=cache.transpose(1, 2).contiguous())
    with pytest.raises(NpuOpError, match="contiguous"):
        call(k=torch.zeros(2, 3, 16, dtype=torch.float16).transpose(0, 1))
    with pytest.raises(NotImplementedError, match="compress"):
        call(seq_lens=torch.tensor([3]))


# --------------------------------------------------------------------------------------------
# the kernel set through atb_plugin.ops
# --------------------------------------------------------------------------------------------


def test_kernel_set_interface():
    """Same public functions as the ATB set; everything but the paged KV path is the ATB one."""
    names = ("write_kv_cache", "paged_attention", "varlen_attention", "rms_norm", "apply_rotary", "silu_and_mul")
    for name in names:
        fia, atb = getattr(npu_fia_kernels, name), getattr(npu_kernels, name)
        assert list(inspect.signature(fia).parameters) == list(inspect.signature(atb).parameters), name
    for name in names[2:]:
        assert getattr(npu_fia_kernels, name) is getattr(npu_kernels, name)


def _run(case: PagedCase, kernels):
    key_cache, value_cache = case.key_cache.clone(), case.value_cache.clone()
    ctx = on_kernels(kernels) if kernels is not None else use_platform("cpu")
    with ctx:
        ops.write_kv_cache(case.new_k, case.new_v, key_cache, value_cache, case.metadata.slot_mapping)
        out = ops.paged_attention(case.query, key_cache, value_cache, case.metadata, case.scale)
    return out, key_cache, value_cache


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fia_kernels_equal_cpu_kernels(fake_npu, gen, case, dtype):
    c = PagedCase(gen, *CASES[case], dtype=dtype)
    cpu_out, cpu_k, cpu_v = _run(c, None)
    out, k, v = _run(c, npu_fia_kernels)
    assert torch.equal(k, cpu_k) and torch.equal(v, cpu_v)  # the KV write is exact
    expected, _ = c.reference(cpu_k, cpu_v)
    torch.testing.assert_close(out.float(), expected, atol=OP_TOL[dtype], rtol=OP_TOL[dtype])
    torch.testing.assert_close(out.float(), cpu_out.float(), atol=OP_TOL[dtype], rtol=OP_TOL[dtype])
    calls = fake_npu.module.calls
    assert calls[FIA] == 1 and calls[SCATTER] == 1
    assert not any(calls[op] for op in ATB_ATTENTION_OPS)


def test_mask_and_step_inputs_are_built_once(fake_npu, gen):
    c = PagedCase(gen, *CASES["mixed_chunked_prefill"])
    seen = []
    real = fake_npu.module.npu_fused_infer_attention_score

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    fake_npu.module.npu_fused_infer_attention_score = spy
    with on_kernels(npu_fia_kernels):
        for _ in range(3):  # three "layers" of one step
            ops.paged_attention(c.query, c.key_cache, c.value_cache, c.metadata, c.scale)
    assert len(seen) == 3
    assert all(kw["atten_mask"] is seen[0]["atten_mask"] for kw in seen)
    assert all(kw["block_table"] is seen[0]["block_table"] for kw in seen)
    assert all(kw["actual_seq_lengths"] is seen[0]["actual_seq_lengths"] for kw in seen)
    assert npu_fia_kernels.causal_mask("cpu") is seen[0]["atten_mask"]
    assert seen[0]["actual_seq_lengths"] == [6, 7, 147, 148, 164]  # cumulative query ends
    assert seen[0]["actual_seq_lengths_kv"] == [6, 128, 160, 4, 266]  # per-request seq_lens


def test_step_inputs_follow_a_metadata_updated_in_place(fake_npu, gen):
    first = PagedCase(gen, *CASES["mixed_chunked_prefill"])
    second = PagedCase(gen, *CASES["decode_only"])
    with on_kernels(npu_fia_kernels):
        ops.paged_attention(first.query, first.key_cache, first.value_cache, first.metadata, first.scale)
        for field in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping", "max_query_len",
                      "max_seq_len", "query_start_loc_cpu", "seq_lens_cpu"):
            setattr(first.metadata, field, getattr(second.metadata, field))
        out = ops.paged_attention(second.query, second.key_cache, second.value_cache, first.metadata, second.scale)
    torch.testing.assert_close(out.float(), second.reference()[0], atol=2e-3, rtol=2e-3)


def test_fia_kernels_refuse_what_the_op_cannot_run(fake_npu, gen):
    small = PagedCase(gen, [0, 3], [5, 2], block_size=16)
    with on_kernels(npu_fia_kernels), pytest.raises(ValueError, match="multiple of 128"):
        ops.paged_attention(small.query, small.key_cache, small.value_cache, small.metadata, small.scale)
    c = PagedCase(gen, [0, 3], [5, 2])
    with on_kernels(npu_fia_kernels), pytest.raises(ValueError, match="float16 / bfloat16"):
        ops.paged_attention(c.query.float(), c.key_cache.float(), c.value_cache.float(), c.metadata, c.scale)


def test_write_kv_cache_skips_padding_slots(fake_npu, gen):
    c = PagedCase(gen, [0, 0], [3, 4])
    slots = c.metadata.slot_mapping.clone()
    slots[[1, 5]] = -1
    caches = {}
    for kernels in (None, npu_fia_kernels):
        k, v = c.key_cache.clone(), c.value_cache.clone()
        with on_kernels(kernels) if kernels else use_platform("cpu"):
            ops.write_kv_cache(c.new_k, c.new_v, k, v, slots)
        caches[kernels] = (k, v)
    assert torch.equal(caches[None][0], caches[npu_fia_kernels][0])
    assert torch.equal(caches[None][1], caches[npu_fia_kernels][1])
    with on_kernels(npu_fia_kernels):
        ops.write_kv_cache(c.new_k[:2], c.new_v[:2], c.key_cache, c.value_cache, torch.tensor([-1, -1]))
    assert fake_npu.module.calls[SCATTER] == 1


# --------------------------------------------------------------------------------------------
# every decoder family: FIA kernels in fp16 / bf16 vs the CPU path in fp32
# --------------------------------------------------------------------------------------------

BLOCK_SIZE = 128
LENGTHS = {"A": 166, "B": 150}
# (request, new tokens) per step: prefill only; two chunks crossing block 0's end (one a cache
# hit, one fresh); chunk + decode; then decode-only steps.
SCHEDULE = [[("A", 100)], [("A", 60), ("B", 140)], [("B", 5), ("A", 1)]] + [[("A", 1), ("B", 1)]] * 5
STEPS = len(SCHEDULE)
FAMILIES = ["qwen2", "llama", "qwen2_vl", "llava", "qwen_vl"]
MROPE = {"qwen2_vl"}


class MultiRunner:
    """Several sequences through a model's paged path on one shared cache, scheduled step by
    step as the engine would batch them; returns each request's logits."""

    def __init__(self, model, family, seed=0):
        self.model, self.mrope = model, family in MROPE
        gen = torch.Generator().manual_seed(seed)
        vocab = model.get_language_model().config.vocab_size
        self.ids = {r: torch.randint(0, vocab, (n,), generator=gen) for r, n in LENGTHS.items()}
        need = {r: cdiv(n, BLOCK_SIZE) for r, n in LENGTHS.items()}
        num_blocks = 1 + sum(need.values()) + 1
        order = (torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(1)) + 1).tolist()
        self.tables = {}
        for r, count in need.items():
            self.tables[r], order = order[:count], order[count:]
        self.width = max(need.values())
        self.kv_caches = model.make_kv_caches(num_blocks, BLOCK_SIZE)
        self.computed = dict.fromkeys(LENGTHS, 0)

    @torch.no_grad()
    def run(self) -> torch.Tensor:
        logits = {r: [] for r in LENGTHS}
        for step in SCHEDULE:
            qsl, seq_lens, tables, slots, positions, ids = [0], [], [], [], [], []
            for r, n in step:
                start = self.computed[r]
                pos = torch.arange(start, start + n)
                positions.append(pos)
                ids.append(self.ids[r][start:start + n])
                table = self.tables[r]
                slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in pos.tolist()]
                tables.append(table + [0] * (self.width - len(table)))
                qsl.append(qsl[-1] + n)
                seq_lens.append(start + n)
            metadata = AttentionMetadata(
                query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                block_tables=torch.tensor(tables, dtype=torch.int32),
                slot_mapping=torch.tensor(slots, dtype=torch.int64),
                max_query_len=max(n for _, n in step), max_seq_len=max(seq_lens))
            positions = torch.cat(positions)
            if self.mrope:  # text-only M-RoPE: the three rows are equal
                positions = positions.expand(3, -1).contiguous()
            out = self.model.compute_logits(self.model(torch.cat(ids), positions, self.kv_caches, metadata))
            for (r, n), chunk in zip(step, out.split([n for _, n in step])):
                logits[r].append(chunk.float())
                self.computed[r] += n
        return torch.cat([torch.cat(logits[r]) for r in LENGTHS])


_models: dict = {}


def load(family, dtype):
    key = (family, dtype)
    if key not in _models:
        path = tiny_checkpoint(family)
        _models[key] = get_router(path).model_cls.from_pretrained(path, dtype=dtype)
    return _models[key]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_decoder_family_on_fia_kernels_matches_fp32_cpu(fake_npu, family):
    with use_platform("cpu"):
        reference = MultiRunner(load(family, torch.float32), family).run()
    scale = reference.abs().max().item()
    layers = load(family, torch.float32).get_language_model().config.num_hidden_layers
    for dtype in (torch.float16, torch.bfloat16):
        model = load(family, dtype)
        fake_npu.module.calls.clear()
        with on_kernels(npu_fia_kernels):
            fia = MultiRunner(model, family).run()
        calls = dict(fake_npu.module.calls)
        with on_kernels(npu_kernels):
            atb = MultiRunner(model, family).run()
        assert calls.get(FIA) == layers * STEPS and calls.get(SCATTER) == layers * STEPS, calls
        assert not any(calls.get(op) for op in ATB_ATTENTION_OPS), calls
        assert calls.get("npu_rms_norm") and calls.get("npu_rotary_mul") and calls.get("npu_swiglu")
        eps = EPS[dtype]
        to_reference = (fia - reference).abs().max().item()
        to_atb = (fia - atb).abs().max().item()
        assert to_reference <= 8 * eps * scale, (dtype, to_reference / (eps * scale))
        assert to_atb <= 2 * eps * scale, (dtype, to_atb / (eps * scale))

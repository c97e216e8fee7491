"""Multi-LoRA rows inside the captured CPU decode step (models/native_decode.py) and the native
grouped shrink / expand kernel (csrc/lora_kernels.c, docs/lora.md): the kernel against a float64
reference; a decode step with adapted rows runs captured, gives each row its merged reference's
greedy tokens, and equals the eager adapted step (the eager layers through the same kernel, and
through the torch ops) within float32 tolerance."""

from __future__ import annotations

import pytest
import torch

from atb_plugin import LLM, LoRARequest, SamplingParams
from atb_plugin.lora import layers as lora_layers
from atb_plugin.models import native_decode
from atb_plugin.ops import cpu_native
from atb_plugin.testing.lora_adapters import make_adapter
from atb_plugin.testing.tiny import tiny_checkpoint
from tests.test_lora import _adapters, merged_references

PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a b c d e f g h i j", "one two three",
           "x y z", "sphinx of black quartz judge my vow"]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)

# Captured vs eager through the torch ops (mm / addmm_ per adapter): the same float32 products
# summed in another order. Each delta's sums carry ~K * 2^-24 relative rounding (K <= 128 here),
# which 2 layers and the final norm carry into the log-probabilities at ~1e-6 of their size
# (measured: 1.9e-6 on this model; the merged checkpoints, W + s * B @ A rounded to float32
# weights, 2.9e-6 from the captured step); 1e-4 leaves room and is still far below any adapter's
# effect (these move log-probabilities by up to 0.86).
LOGPROB_TOL = 1e-4


@pytest.fixture
def library():
    library = cpu_native.linear_library(torch.device("cpu"))
    if library is None:
        pytest.skip("the native CPU kernels are unavailable here")
    return library


def _reference(a, bs, rank, x, row_slots, y):
    """y + each row's adapter in float64, and the same sum over absolute values (the error bound's
    scale)."""
    want, scale = y.double().clone(), y.double().abs()
    column = 0
    for j, b in enumerate(bs):
        width = b.shape[2]
        for r, slot in enumerate(row_slots.tolist()):
            if slot < 0:
                continue
            a_j, b_j = a[slot, j * rank:(j + 1) * rank].double(), b[slot].double()
            want[r, column:column + width] += (x[r].double() @ a_j.T) @ b_j
            scale[r, column:column + width] += (x[r].double().abs() @ a_j.abs().T) @ b_j.abs()
        column += width
    return want, scale


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("in_features, widths, rank, rows", [
    (64, [64, 32, 32], 16, 20),   # qkv-like: 3 slices
    (100, [37], 5, 16),           # K, width and rank that are no multiples of the vector width
    (48, [70, 130], 3, 40),       # gate_up-like: 2 slices
])
def test_kernel_equals_a_float64_reference(library, threads, in_features, widths, rank, rows):
    generator = torch.Generator().manual_seed(rows)
    slots = 3
    a = torch.randn(slots, len(widths) * rank, in_features, generator=generator)
    bs = [torch.randn(slots, rank, width, generator=generator) for width in widths]
    x = torch.randn(rows, in_features, generator=generator)
    y = torch.randn(rows, sum(widths), generator=generator)
    # Runs of one slot (sorted, as the runner orders them: tiles of 1 to 8 rows), then a run of 9
    # (two tiles) and a few out of order, base rows between.
    row_slots = torch.tensor(sorted(torch.randint(-1, slots, (rows - 12,), generator=generator).tolist())
                             + [1] * 9 + [2, -1, 0], dtype=torch.int32)
    want, scale = _reference(a, bs, rank, x, row_slots, y)
    got = y.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_native.lora_apply(library, cpu_native.lora_slots(a, bs), rank, x, row_slots, got)
    finally:
        torch.set_num_threads(before)
    # Float32 sums of n products: |error| <= n * 2^-24 * sum |terms| (shrink K terms, expand rank).
    bound = (in_features + rank + 2) * 2.0 ** -24 * scale
    assert ((got.double() - want).abs() <= bound).all()
    assert torch.equal(got[row_slots < 0], y[row_slots < 0])  # base rows untouched


def test_kernel_refuses_what_it_cannot_read(library):
    a, b = torch.zeros(2, 4, 8), [torch.zeros(2, 4, 16)]
    assert "float32" in cpu_native.lora_slots(a.double(), b)
    assert "slices" in cpu_native.lora_slots(torch.zeros(2, 4 * 4, 8), [torch.zeros(2, 4, 16)] * 4)
    with pytest.raises(ValueError, match="lora_apply"):
        cpu_native.lora_apply(library, cpu_native.lora_slots(a, b), 4, torch.zeros(3, 8), torch.zeros(2, dtype=torch.int32),
                              torch.zeros(3, 16))


def test_the_structs_match_the_c_header(library, tmp_path, monkeypatch):
    """``LoRASlots`` / ``DecodeLoRA`` against ``lora_linear`` / ``decode_lora`` (the same check
    tests/test_cpu_kernel_map.py makes of the plan's other structs; ``decode_model``'s new field is
    in its list)."""
    from tests import test_cpu_kernel_map as kernel_map

    monkeypatch.setattr(kernel_map, "STRUCTS", {"lora_linear": cpu_native.LoRASlots,
                                                "decode_lora": cpu_native.DecodeLoRA})
    monkeypatch.setattr(kernel_map, "_constants", lambda: {"LORA_MAX_SLICES": cpu_native.LORA_MAX_SLICES})
    kernel_map.test_the_ctypes_structs_and_constants_match_the_c_header(library, tmp_path)


# -- the engine ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Four adapters of different ranks (one with rank / alpha patterns, one rsLoRA on attention,
    one on the MLP alone with an odd rank) and each one's merged checkpoint's greedy outputs."""
    base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("lora-native")
    adapters = {**_adapters(base, root), "d": make_adapter(root / "d", base, r=3, lora_alpha=5, seed=4, target_modules=(
        "gate_proj", "up_proj", "down_proj"))}
    references = merged_references(base, adapters, root, lambda llm: _outputs(llm.generate(PROMPTS, PARAMS)))
    return base, adapters, references


def _outputs(outputs):
    return [o.outputs[0] for o in outputs]


def _request(adapters, name):
    return None if name is None else LoRARequest(name, " abcd".index(name), str(adapters[name]))


@pytest.fixture
def adapted_calls(monkeypatch):
    """Each captured step's (rows, whether it held adapted rows)."""
    calls = []
    original = native_decode.NativeDecodeStep.__call__

    def counting(self, embeds, *args, **kwargs):
        calls.append((embeds.shape[0], self.lora_rows is not None and self.lora_rows.row_slots is not None))
        return original(self, embeds, *args, **kwargs)

    monkeypatch.setattr(native_decode.NativeDecodeStep, "__call__", counting)
    return calls


def _generate(base, adapters, names, **config):
    with LLM(base, block_size=4, enable_lora=True, max_loras=4, max_lora_rank=16, **config) as llm:
        return llm.engine.runner.decode_capture, _outputs(
            llm.generate(PROMPTS[:len(names)], PARAMS, lora_request=[_request(adapters, n) for n in names]))


def _assert_close(got, want, tol):
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        for ge, we in zip(g.logprobs, w.logprobs, strict=True):
            assert ge.top_token_ids == we.top_token_ids
            assert max(abs(x - y) for x, y in zip(ge.top_logprobs, we.top_logprobs)) <= tol


MIXES = {"one adapter": ["a", "a", "a"], "four mixed and base rows": ["a", None, "b", "c", "d", None]}


@pytest.mark.parametrize("mix", MIXES)
def test_captured_step_with_adapted_rows_gives_the_merged_references(setup, adapted_calls, mix):
    base, adapters, references = setup
    names = MIXES[mix]
    outcome, got = _generate(base, adapters, names)
    assert outcome == "captured"
    # Every decode step after the first (prefill) ran captured, with its adapted rows in it.
    assert [call for call in adapted_calls if call[1]] == [(len(names), True)] * (PARAMS.max_tokens - 1)
    for i, (name, output) in enumerate(zip(names, got)):
        assert output.token_ids == references[name][i].token_ids, (mix, i, name)
        assert references[name][i].token_ids != references[None][i].token_ids or name is None
    # The merged checkpoints' log-probabilities too, within what merging's rounding leaves.
    _assert_close(got, [references[n][i] for i, n in enumerate(names)], LOGPROB_TOL)


def test_captured_equals_the_eager_adapted_step(setup, adapted_calls, monkeypatch):
    base, adapters, _ = setup
    names = MIXES["four mixed and base rows"]
    _, captured = _generate(base, adapters, names)
    assert any(adapted for _, adapted in adapted_calls)
    calls = len(adapted_calls)
    outcome, eager = _generate(base, adapters, names, enforce_eager=True)
    assert outcome == "off (enforce_eager)" and len(adapted_calls) == calls
    # The eager layers call the same kernel on the same rows: the same sums in the same order.
    _assert_close(captured, eager, 0.0)
    # The eager layers through the torch ops instead (the path off the CPU): the same products
    # summed in another order.
    original = lora_layers.LoRALinear.__init__

    def torch_ops(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self._native = "off for the test"

    monkeypatch.setattr(lora_layers.LoRALinear, "__init__", torch_ops)
    outcome, torch_eager = _generate(base, adapters, names)
    assert outcome == "captured" and len(adapted_calls) == calls  # adapted steps could not run captured
    _assert_close(captured, torch_eager, LOGPROB_TOL)


def test_w8a8_base_with_adapted_rows_captured_equals_eager(setup, adapted_calls):
    """A quantized base (dynamic W8A8: int8 rows in the plan) with float adapters after it."""
    base, adapters, _ = setup
    names = MIXES["four mixed and base rows"]
    _, captured = _generate(base, adapters, names, quantization="w8a8")
    assert any(adapted for _, adapted in adapted_calls)
    _, eager = _generate(base, adapters, names, quantization="w8a8", enforce_eager=True)
    _assert_close(captured, eager, 0.0)  # the int8 layers' captured step is bit-identical, the adapters' too

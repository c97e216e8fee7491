"""Packed linear layers on the CPU (atb_plugin.ops.packed_linear): oneDNN's packed weights and the
native kernels' column panels give the same products as ``nn.Linear`` up to float32 summation
order, are swapped in after loading without growing memory (a tied head's copy aside), and
leave the engine's greedy output unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from atb_plugin import LLM, SamplingParams
from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.worker import load_model
from atb_plugin.ops import cpu_native
from atb_plugin.models.linear import pack_linear_layers
from atb_plugin.ops.packed_linear import PackedLinear, PanelLinear, packable_dtypes
from atb_plugin.testing.tiny import tiny_checkpoint

pytestmark = pytest.mark.skipif(torch.float32 not in packable_dtypes(), reason="PyTorch built without oneDNN")


def native_available() -> bool:
    return cpu_native.library_for(torch.float32, torch.device("cpu")) is not None


@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (3, 5, 96), (0, 96)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("layer", [PackedLinear, PanelLinear])
def test_a_packed_layer_computes_what_nn_linear_does(shape, bias, layer):
    torch.manual_seed(0)
    dense = nn.Linear(96, 40, bias=bias)
    packed = layer(dense.weight, dense.bias)
    x = torch.randn(shape)
    with torch.inference_mode():
        # float32 products of 96 terms summed in another order: ~1e-6 relative, far below 1e-5.
        torch.testing.assert_close(packed(x), dense(x), rtol=1e-5, atol=1e-5)
    assert packed(x).shape == dense(x).shape
    # A column slice (non-contiguous rows) is read as it is, like nn.Linear does.
    wide = torch.randn(4, 128)[:, :96]
    torch.testing.assert_close(packed(wide), dense(wide), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 32, 100])
@pytest.mark.parametrize("out_features", [64, 200, 576])
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_a_panel_layer_matches_a_float64_product(rows, out_features, kernels, monkeypatch):
    """Row counts around the kernel's 6-row tiles, whole and partial 64-column panels, the
    prefetch of the next panel (several panels, several tiles); the native kernel and the torch
    fallback over the same panels. Tolerance: float32 sums of 300 terms, ~1e-6 relative."""
    if kernels == "native" and not native_available():
        pytest.skip("the native CPU kernels do not build here")
    monkeypatch.setenv(cpu_native.KERNELS_ENV, kernels)
    torch.manual_seed(rows * 1000 + out_features)
    weight, bias = torch.randn(out_features, 300), torch.randn(out_features)
    x = torch.randn(rows, 300)
    layer = PanelLinear(weight, bias)
    expected = x.double() @ weight.double().t() + bias.double()
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


def test_the_panel_kernel_refuses_what_does_not_fit():
    if not native_available():
        pytest.skip("the native CPU kernels do not build here")
    library = cpu_native.library_for(torch.float32, torch.device("cpu"))
    panels = cpu_native.weight_panels(torch.randn(100, 32))
    with pytest.raises(ValueError, match="float32 rows of 32"):
        cpu_native.linear(library, torch.randn(3, 31), panels, 100, None)  # K 31 for 32
    with pytest.raises(ValueError, match="float32 rows of 32"):
        cpu_native.linear(library, torch.randn(3, 32, dtype=torch.float64), panels, 100, None)
    with pytest.raises(ValueError, match="cannot hold 129 outputs"):  # more outputs than two panels hold
        cpu_native.check_panels(panels, 129, None)
    with pytest.raises(ValueError, match="cannot hold 64 outputs"):  # a whole panel of padding
        cpu_native.check_panels(panels, 64, None)
    with pytest.raises(ValueError, match="cannot hold"):
        cpu_native.check_panels(panels.transpose(1, 2), 100, None)
    with pytest.raises(ValueError, match="a bias of 100"):
        cpu_native.check_panels(panels, 100, torch.zeros(100))
    cpu_native.check_panels(panels, 100, cpu_native.padded_bias(torch.zeros(100), panels))


def test_packing_swaps_every_linear_and_copies_only_a_shared_weight():
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 50, bias=False))
    tied = nn.Linear(16, 50, bias=False)
    tied.weight = model[0].weight  # an LM head sharing the embedding (tied word embeddings)
    model.append(tied)
    summary = pack_linear_layers(model)
    assert summary.packed == 3 and summary.skipped == 0
    assert summary.copied_bytes == 50 * 16 * 4  # the tied one only
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model[0], nn.Embedding) and model[0].weight.shape == (50, 16)  # the embedding kept
    assert not any("packed" in name for name in model.state_dict())  # the checkpoint's names only


def test_a_dtype_onednn_does_not_pack_stays_dense():
    model = nn.Sequential(nn.Linear(8, 8).to(torch.float16))
    summary = pack_linear_layers(model)
    assert summary.packed == 0 and summary.skipped == 1 and type(model[0]) is nn.Linear


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # tied head, own head
def test_the_engine_loads_packed_weights_and_greedy_output_is_unchanged(family):
    config = EngineConfig(model=str(tiny_checkpoint(family)), block_size=4)
    model, _ = load_model(config, torch.device("cpu"))
    expected = PanelLinear if native_available() else PackedLinear  # float32 on this CPU
    heads = [m for m in model.modules() if isinstance(m, expected)]
    assert heads and not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.get_language_model().lm_head, expected)

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = ["hello world", "the quick brown fox jumps", "a"]
    outputs = {}
    for pack in (True, False):
        with LLM(tiny_checkpoint(family), block_size=4, pack_weights=pack) as llm:
            outputs[pack] = [o.outputs[0] for o in llm.generate(prompts, params)]
    for packed, dense in zip(outputs[True], outputs[False]):
        assert packed.token_ids == dense.token_ids
        for a, b in zip(packed.logprobs, dense.logprobs):
            assert a.top_token_ids == b.top_token_ids
            assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-4)


def test_pack_weights_must_be_a_bool():
    with pytest.raises(ValueError, match="pack_weights must be a bool"):
        EngineConfig(model=str(tiny_checkpoint("qwen2")), pack_weights="no")

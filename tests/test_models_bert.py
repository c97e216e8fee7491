"""BERT (all-MiniLM-L6-v2 layout) on the tiny checkpoint: a batch of sequences of different
lengths packed into one row with ``cu_seqlens`` gives, for each sequence, transformers'
``BertModel`` last hidden states run on that sequence alone; the pooler too; the NPU kernels
(simulated torch_npu) give the CPU path's result. Weights load with
nothing missing or unexpected (the legacy ``embeddings.position_ids`` buffer is accepted).

Tolerance 1e-5 (fp32, two layers; observed ~1e-6)."""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file, save_file

from atb_plugin.models.bert import BertModel
from atb_plugin.models.weights import WeightLoadingError
from atb_plugin.testing.tiny import tiny_checkpoint
from tests.helpers import copy_checkpoint, model_pair

TOLERANCE = 1e-5
LENGTHS = (9, 3, 17)


pytestmark = pytest.mark.usefixtures("atb_kernel_set")


@pytest.fixture(scope="module")
def path():
    return tiny_checkpoint("bert")


@pytest.fixture(scope="module")
def pair(path):
    return model_pair(path)


@pytest.fixture(scope="module")
def ours(pair):
    model = pair[0]
    assert isinstance(model, BertModel)
    return model


@pytest.fixture(scope="module")
def reference(pair):
    return pair[1]


def batch(vocab: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, vocab, (n,), generator=generator) for n in LENGTHS]
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return sequences, cu_seqlens


def test_packed_batch_matches_transformers_per_sequence(ours, reference):
    sequences, cu = batch(ours.config.vocab_size)
    with torch.no_grad():
        got = ours(torch.cat(sequences), cu)
        pooled = ours.pooled_output(got, cu)
    assert got.shape == (sum(LENGTHS), ours.config.hidden_size)
    for index, sequence in enumerate(sequences):
        with torch.no_grad():
            expected = reference(sequence[None])
        rows = got[cu[index]:cu[index + 1]]
        assert (rows - expected.last_hidden_state[0]).abs().max() <= TOLERANCE, f"sequence {index}"
        assert (pooled[index] - expected.pooler_output[0]).abs().max() <= TOLERANCE


def test_token_type_ids(ours, reference):
    sequences, cu = batch(ours.config.vocab_size, seed=1)
    types = [torch.cat([torch.zeros(n // 2, dtype=torch.long), torch.ones(n - n // 2, dtype=torch.long)])
             for n in LENGTHS]
    with torch.no_grad():
        got = ours(torch.cat(sequences), cu, token_type_ids=torch.cat(types))
        for index, (sequence, kinds) in enumerate(zip(sequences, types)):
            expected = reference(sequence[None], token_type_ids=kinds[None]).last_hidden_state[0]
            assert (got[cu[index]:cu[index + 1]] - expected).abs().max() <= TOLERANCE


def test_packing_does_not_leak_between_sequences(ours):
    """A sequence's states do not depend on its neighbours (positions restart, attention is per segment)."""
    sequences, cu = batch(ours.config.vocab_size, seed=2)
    with torch.no_grad():
        packed = ours(torch.cat(sequences), cu)
        alone = ours(sequences[2], torch.tensor([0, LENGTHS[2]]))
    assert (packed[cu[2]:] - alone).abs().max() <= 1e-6


def test_weights_and_checkpoint_names(ours, path):
    assert ours.accepts_weight("embeddings.position_ids")
    assert ours.accepts_weight("encoder.layer.0.attention.self.query.weight")
    assert ours.accepts_weight("bert.encoder.layer.0.attention.self.key.bias")  # BertFor* checkpoints' prefix
    assert not ours.accepts_weight("cls.predictions.bias")  # a head this model does not have
    assert not ours.accepts_weight("encoder.layer.0.attention.self.query.scale")
    assert ours.pooler is not None
    # The model's own state dict (fused qkv, as the decoder allows too) loads back completely.
    copy = BertModel(ours.config)
    assert copy.load_weights(ours.state_dict().items()) == set(dict(copy.named_parameters()))
    assert all(torch.equal(a, b) for a, b in zip(copy.state_dict().values(), ours.state_dict().values()))


def test_missing_unexpected_and_no_pooler(path, tmp_path):
    copy_checkpoint(path, tmp_path)
    state = load_file(str(path / "model.safetensors"))
    without_pooler = {k: v for k, v in state.items() if not k.startswith("pooler.")}
    save_file(without_pooler, str(tmp_path / "model.safetensors"))
    model = BertModel.from_pretrained(tmp_path)
    assert model.pooler is None
    with pytest.raises(ValueError, match="no pooler"):
        model.pooled_output(torch.zeros(3, 32), torch.tensor([0, 3]))

    broken = dict(state)
    broken.pop("encoder.layer.1.attention.self.value.bias")
    broken["encoder.layer.1.attention.self.extra.weight"] = torch.zeros(2)
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadingError, match=(
            r"missing from the checkpoint: encoder\.layer\.1\.attention\.self\.qkv\.bias.*"
            r"not used by the model: encoder\.layer\.1\.attention\.self\.extra\.weight")):
        BertModel.from_pretrained(tmp_path)


def test_bad_inputs(ours):
    with pytest.raises(ValueError, match="cu_seqlens"):
        ours(torch.zeros(5, dtype=torch.long), torch.tensor([0, 4]))
    too_long = ours.config.max_position_embeddings + 1
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        ours(torch.zeros(too_long, dtype=torch.long), torch.tensor([0, too_long]))


def test_npu_path_equals_the_cpu_path(ours):
    """The packed batch through the NPU kernels (simulated torch_npu): unpadded flash attention."""
    from atb_plugin.platform import use_platform
    from atb_plugin.testing import fake_torch_npu

    sequences, cu = batch(ours.config.vocab_size, seed=3)
    with torch.no_grad():
        cpu = ours(torch.cat(sequences), cu)
        # About the packing, not precision: fp32 on the simulated NPU, opted in explicitly.
        with fake_torch_npu.install(allow_fp32_attention=True) as fake, use_platform("npu"):
            npu = ours(torch.cat(sequences), cu)
            calls = dict(fake.module.calls)
    assert calls["_npu_flash_attention_unpad"] == ours.config.num_hidden_layers, calls
    assert (npu - cpu).abs().max() <= TOLERANCE

"""Weights moved into transparent huge pages (atb_plugin/ops/huge_pages.py): the same values at
new addresses inside one advised mapping, shared tensors moved once, views and small tensors left
where they are, and the switch and its refusals."""

from __future__ import annotations

import mmap

import pytest
import torch
from torch import nn

from atb_plugin.ops import huge_pages
from atb_plugin.ops.huge_pages import HUGE_PAGES_ENV, move_weights_to_huge_pages

needs_thp = pytest.mark.skipif(getattr(mmap, "MADV_HUGEPAGE", None) is None
                               or huge_pages.thp_mode() in (None, "never"), reason="no transparent huge pages here")


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.big = nn.Linear(256, 512)  # weight 512 KiB (float32), bias 2 KiB
        self.other = nn.Linear(512, 256, bias=False)
        self.tied = nn.Linear(256, 512, bias=False)
        self.tied.weight = self.big.weight  # one Parameter held by two modules
        self.int8 = nn.Parameter(torch.randint(-127, 128, (1024, 300), generator=gen, dtype=torch.int8),
                                 requires_grad=False)
        self.register_buffer("panels", torch.randn(300, 257, generator=gen).to(torch.bfloat16))
        whole = torch.randn(2, 256, 256, generator=gen)
        self.register_buffer("view", whole[1])  # a view into a larger storage: stays put


@needs_thp
def test_large_weights_move_into_one_advised_mapping_with_the_same_values(monkeypatch):
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    model = Model()
    before = {name: t.clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    addresses = {name: t.data_ptr() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    summary = move_weights_to_huge_pages(model, min_bytes=64 << 10)
    moved = {"big.weight", "other.weight", "int8", "panels"}
    assert summary.moved == len(moved) and summary.reason == ""
    assert summary.moved_bytes == sum(before[name].nbytes for name in moved)
    now = dict([*model.named_parameters(), *model.named_buffers()])
    for name, tensor in now.items():
        assert torch.equal(tensor, before[name]) and tensor.dtype == before[name].dtype
        assert (tensor.data_ptr() != addresses[name]) == (name in moved), name
    assert isinstance(model.big.weight, nn.Parameter) and model.tied.weight is model.big.weight
    starts = sorted(now[name].data_ptr() for name in moved)
    assert starts[0] % huge_pages.HUGE_PAGE == 0  # the mapping's first huge page holds the first weight
    assert starts[-1] - starts[0] < summary.moved_bytes + 4096 * len(moved)  # one mapping, packed in order
    x = torch.randn(3, 256)
    torch.testing.assert_close(model.big(x), x @ before["big.weight"].T + before["big.bias"], rtol=0, atol=0)


def test_the_switch_and_where_nothing_moves(monkeypatch):
    model = Model()
    monkeypatch.setenv(HUGE_PAGES_ENV, "off")
    assert move_weights_to_huge_pages(model).reason == f"{HUGE_PAGES_ENV}=off"
    monkeypatch.setenv(HUGE_PAGES_ENV, "always")
    with pytest.raises(ValueError, match=f"{HUGE_PAGES_ENV}='always': expected one of auto, off"):
        move_weights_to_huge_pages(model)
    monkeypatch.setenv(HUGE_PAGES_ENV, "auto")
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    assert "THP mode: never" in move_weights_to_huge_pages(model).reason
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    address = model.int8.data_ptr()
    assert move_weights_to_huge_pages(model, min_bytes=1 << 30).reason == f"no weight of {1 << 30} bytes or more"
    assert model.int8.data_ptr() == address


def test_an_unknown_setting_fails_the_engine_config(monkeypatch):
    from atb_plugin.engine.config import EngineConfig
    from atb_plugin.testing.tiny import tiny_checkpoint

    monkeypatch.setenv(HUGE_PAGES_ENV, "yes")
    with pytest.raises(ValueError, match=f"{HUGE_PAGES_ENV}='yes': expected one of auto, off"):
        EngineConfig(model=str(tiny_checkpoint("qwen2")), device="cpu")

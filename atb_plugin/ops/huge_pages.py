"""A CPU model's large weights moved into memory the kernel backs with transparent huge pages.

Why: a decode step reads every weight once, from DRAM, in order; on 4 KiB pages that stream
misses the TLB every 4 KiB (a 135 MB int8 SmolLM2 step: ~33,000 page walks) and the hardware
prefetchers restart at every page. In 2 MiB pages the same kernels stream faster
(benchmarks/RESULTS.md, "Low precision": huge pages). Linux gives anonymous memory huge pages
only where ``madvise(MADV_HUGEPAGE)`` asks for them when THP is in its ``madvise`` mode (a common
default), and torch's allocator never asks; so the weights are copied, once, into one anonymous
mapping advised before its first touch, and each tensor is re-pointed at its copy.

Which tensors: parameters and buffers on the CPU of at least ``MIN_BYTES`` that own their whole
storage (a view into a larger storage stays where it is: moving it would keep both copies).
Tensors that are the same object, or hold the same storage, get the same copy. It runs after
packing and before anything records a weight's address (the captured decode step), at load.
Where the kernel has no ``MADV_HUGEPAGE`` (not Linux) or THP is ``never``, nothing moves; nor
with ``ATB_PLUGIN_HUGE_PAGES=off`` (``auto``, the default: move where THP allows).
"""

from __future__ import annotations

import logging
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MIN_BYTES = 64 << 10  # smaller ones (scales, norms) are read in a few cache lines: left where they are
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE_PAGES_ENV = "ATB_PLUGIN_HUGE_PAGES"
HUGE_PAGES_CHOICES = ("auto", "off")


@dataclass(frozen=True)
class HugePageSummary:
    moved: int = 0  # tensors now in the advised mapping
    moved_bytes: int = 0
    reason: str = ""  # why nothing moved, if nothing did


def thp_mode() -> str | None:
    """The kernel's THP mode ("always", "madvise", "never"), or None where it has no THP."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    return next((word[1:-1] for word in text.split() if word.startswith("[")), None)


def _page_padded(size: int) -> int:
    return -(-size // 4096) * 4096


def _owns_storage(tensor: torch.Tensor) -> bool:
    return (tensor.layout == torch.strided and tensor.device.type == "cpu" and tensor.is_contiguous()
            and tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.nbytes)


def choice() -> str:
    """``ATB_PLUGIN_HUGE_PAGES`` ("auto" when unset); ValueError naming the choices otherwise."""
    value = os.environ.get(HUGE_PAGES_ENV) or "auto"
    if value not in HUGE_PAGES_CHOICES:
        raise ValueError(f"{HUGE_PAGES_ENV}={value!r}: expected one of {', '.join(HUGE_PAGES_CHOICES)}")
    return value


def move_weights_to_huge_pages(model: nn.Module, min_bytes: int = MIN_BYTES) -> HugePageSummary:
    """Copy ``model``'s large weights into one ``MADV_HUGEPAGE`` mapping and point them at it
    (module docstring). The values are unchanged, bit for bit."""
    if choice() == "off":
        return HugePageSummary(reason=f"{HUGE_PAGES_ENV}=off")
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    mode = thp_mode()
    if advice is None or mode in (None, "never"):
        return HugePageSummary(reason=f"transparent huge pages unavailable (THP mode: {mode})")
    groups: dict[int, list[torch.Tensor]] = {}  # storage address -> the tensors on it
    for tensor in [*model.parameters(), *model.buffers()]:  # each object once
        if tensor.nbytes >= min_bytes and _owns_storage(tensor):
            groups.setdefault(tensor.data_ptr(), []).append(tensor)
    if not groups:
        return HugePageSummary(reason=f"no weight of {min_bytes} bytes or more")
    sizes = [group[0].nbytes for group in groups.values()]
    # Private: shared anonymous memory is shmem, whose huge pages follow another setting.
    region = mmap.mmap(-1, sum(map(_page_padded, sizes)) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(advice)
    arena = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive while any view does
    offset = -arena.data_ptr() % HUGE_PAGE  # start on a huge-page boundary
    for group, size in zip(groups.values(), sizes):
        block = arena[offset:offset + size]
        offset += _page_padded(size)
        block.copy_(group[0].detach().reshape(-1).view(torch.uint8))
        for tensor in group:  # tensors on one storage stay on one (each as its own dtype and shape)
            tensor.data = block.view(tensor.dtype).view(tensor.shape)
    summary = HugePageSummary(moved=sum(map(len, groups.values())), moved_bytes=sum(sizes))
    logger.info("weights in transparent huge pages (THP %s): %d tensors, %.1f MiB", mode, summary.moved,
                summary.moved_bytes / 2**20)
    return summary


__all__ = ["HugePageSummary", "choice", "move_weights_to_huge_pages", "thp_mode"]

"""Tensor parallelism of this process: its rank, the group's size, and the collectives the
sharded layers call.

A process joins at most one tensor-parallel group, once (``init_tensor_parallel``, called by an
engine rank before it builds its model shard) and leaves it on shutdown
(``destroy_tensor_parallel``). Models read ``tp_rank()`` / ``tp_size()`` while they are built,
as vLLM's layers do; outside a group (the in-process TP = 1 engine, tests, tools) the size is 1
and every collective here is the identity, so single-device code pays nothing.

The backend is the platform's (``Platform.dist_backend``: gloo on the CPU, nccl on CUDA, hccl on
Ascend). Sharding rules (which dimension each layer splits, how KV heads are replicated when
there are fewer than ranks, vocabulary padding) are in docs/architecture.md, "Tensor parallelism".
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["TPShard", "all_gather", "all_reduce", "destroy_tensor_parallel", "divide", "init_tensor_parallel",
           "kv_heads_per_rank", "tp_rank", "tp_size"]


@dataclass(frozen=True)
class _Group:
    rank: int
    size: int


_group = _Group(0, 1)


def init_tensor_parallel(rank: int, size: int, backend: str, init_method: str, timeout_s: float) -> None:
    """Join the tensor-parallel group (the default process group: a rank belongs to one engine).
    Every rank must call it with the same ``size``, ``backend`` and ``init_method``; it returns
    when all have joined, or raises after ``timeout_s`` naming the rendezvous."""
    global _group
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a process group")
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as error:  # noqa: BLE001 - a rendezvous failure is re-raised with its context
        raise RuntimeError(f"rank {rank} of {size} could not join the {backend} process group at {init_method} "
                           f"within {timeout_s:.0f} s: {error}") from error
    _group = _Group(rank, size)


def destroy_tensor_parallel() -> None:
    global _group
    if dist.is_initialized():
        dist.destroy_process_group()
    _group = _Group(0, 1)


def tp_rank() -> int:
    return _group.rank


def tp_size() -> int:
    return _group.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the ranks (in place); ``x`` itself at size 1."""
    if _group.size > 1:
        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' ``x`` concatenated along ``dim``, in rank order; ``x`` itself at size 1."""
    if _group.size == 1:
        return x
    x = x.contiguous()
    pieces = [torch.empty_like(x) for _ in range(_group.size)]
    dist.all_gather(pieces, x)
    return torch.cat(pieces, dim=dim)


def divide(total: int, parts: int, what: str) -> int:
    """``total / parts``; a ValueError naming both numbers and the fix when it does not divide."""
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({parts}): choose a "
                         f"tensor_parallel_size that divides {total}")
    return total // parts


def kv_heads_per_rank(num_kv_heads: int, parts: int) -> int:
    """KV heads each of ``parts`` ranks holds: an even split, or with fewer KV heads than ranks
    one head per rank, each replicated on ``parts / num_kv_heads`` ranks; a ValueError naming
    both numbers when neither works."""
    if num_kv_heads % parts if num_kv_heads >= parts else parts % num_kv_heads:
        raise ValueError(f"num_key_value_heads ({num_kv_heads}) and tensor_parallel_size ({parts}): the KV heads "
                         "must split evenly over the ranks, or (when fewer) divide tensor_parallel_size to be "
                         "replicated")
    return max(1, num_kv_heads // parts)


@dataclass(frozen=True)
class TPShard:
    """The part of a checkpoint tensor one rank holds: ``length`` entries of dimension ``dim``
    from ``start``. ``length`` may fall short of the parameter's size there (the padded last
    shard of a vocabulary), the rest of the parameter is then zero. ``zero``: the rank holds
    zeros instead (a row-parallel bias, added once by rank 0 before the all-reduce sums)."""

    dim: int
    start: int
    length: int
    zero: bool = False

    @classmethod
    def column(cls, rows: int) -> "TPShard":
        """A column-parallel linear's weight or bias: this rank's ``rows`` output features."""
        return cls(0, _group.rank * rows, rows)

    @classmethod
    def row(cls, kind: str, columns: int, out_features: int) -> "TPShard":
        """A row-parallel linear: this rank's ``columns`` input features of the weight; the bias
        whole on rank 0 and zero elsewhere, so that the all-reduce adds it once."""
        if kind == "bias":
            return cls(0, 0, out_features, zero=_group.rank != 0)
        return cls(1, _group.rank * columns, columns)

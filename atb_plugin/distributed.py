"""Tensor parallelism of this process: its rank, the group's size, and the collectives the
sharded layers call.

A process joins at most one tensor-parallel group, once (``init_tensor_parallel``, called by an
engine rank before it builds its model shard) and leaves it on shutdown
(``destroy_tensor_parallel``). Models read ``tp_rank()`` / ``tp_size()`` while they are built,
as vLLM's layers do; outside a group (the in-process TP = 1 engine, tests, tools) the size is 1
and every collective here is the identity, so single-device code pays nothing.

The backend is the platform's (``Platform.dist_backend``: gloo on the CPU, nccl on CUDA, hccl on
Ascend). CPU ranks of one node (``same_node``) all-reduce and all-gather through a shared-memory
exchange (``shm.exchange``) instead of gloo, which costs a millisecond or more per call over
loopback TCP on a busy machine, two calls per layer per step; gloo stays for what does not fit
the exchange's slots, and on CPUs where the exchange cannot order its writes. Sharding rules (which dimension each layer splits, how KV heads are replicated when
there are fewer than ranks, vocabulary padding) are in docs/architecture.md, "Tensor parallelism".
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shm import exchange as shm_exchange

__all__ = ["TPShard", "all_gather", "all_gather_object", "all_reduce", "destroy_tensor_parallel", "divide",
           "expert_parallel", "init_tensor_parallel", "kv_heads_per_rank", "native_exchange", "tp_rank", "tp_size"]


#: Bytes of one rank's exchange slot: a decode step's hidden states (256 x 4096 fp32) or a
#: 32-request step's logits share; larger tensors (long prefills) go through the backend.
EXCHANGE_SLOT_BYTES = 4 << 20


@dataclass(frozen=True)
class _Group:
    rank: int
    size: int
    exchange: shm_exchange.ShmExchange | None = None
    timeout_s: float = 0.0
    expert_parallel: bool = False


_group = _Group(0, 1)


def init_tensor_parallel(rank: int, size: int, backend: str, init_method: str, timeout_s: float,
                         same_node: bool = True, expert_parallel: bool = False) -> None:
    """Join the tensor-parallel group (the default process group: a rank belongs to one engine).
    Every rank must call it with the same ``size``, ``backend``, ``init_method``, ``same_node``
    and ``expert_parallel`` (MoE layers built afterwards split their experts over the group
    instead of slicing every expert: ``models/moe.py``); it returns when all have joined, or
    raises after ``timeout_s`` naming the rendezvous."""
    global _group
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a process group")
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as error:  # noqa: BLE001 - a rendezvous failure is re-raised with its context
        raise RuntimeError(f"rank {rank} of {size} could not join the {backend} process group at {init_method} "
                           f"within {timeout_s:.0f} s: {error}") from error
    use_exchange = backend == "gloo" and same_node and size > 1 and shm_exchange.supported()
    _group = _Group(rank, size, _open_exchange(rank, size) if use_exchange else None, timeout_s, expert_parallel)


def _open_exchange(rank: int, size: int) -> shm_exchange.ShmExchange:
    """Rank 0 creates the segment and sends its name; once every rank has mapped it, rank 0
    removes the name, so no file outlives the group however its processes end."""
    mine = shm_exchange.ShmExchange.create(rank, size, EXCHANGE_SLOT_BYTES) if rank == 0 else None
    name = [mine.name if mine else None]
    dist.broadcast_object_list(name, src=0)
    if mine is None:
        mine = shm_exchange.ShmExchange.attach(name[0], rank, size, EXCHANGE_SLOT_BYTES)
    dist.barrier()
    if rank == 0:
        mine.unlink()
    dist.barrier()  # gone for every rank when the group is ready
    return mine


def destroy_tensor_parallel() -> None:
    global _group
    if _group.exchange is not None:
        _group.exchange.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    _group = _Group(0, 1)


def tp_rank() -> int:
    return _group.rank


def tp_size() -> int:
    return _group.size


def expert_parallel() -> bool:
    """Whether this group splits MoE experts across its ranks (``--enable-expert-parallel``)."""
    return _group.expert_parallel


def native_exchange() -> tuple[shm_exchange.ShmExchange, float] | None:
    """This rank's shared-memory exchange and the group's timeout (seconds), for a collective run
    from native code on the same segment (the captured decode step's all-reduce:
    models/native_decode.py); None outside a group or where the group has no exchange."""
    return None if _group.exchange is None else (_group.exchange, _group.timeout_s)


def all_gather_object(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order, through the backend (a one-time
    agreement, not a per-step collective); ``[obj]`` at size 1."""
    if _group.size == 1:
        return [obj]
    gathered = [None] * _group.size
    dist.all_gather_object(gathered, obj)
    return gathered


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the ranks (in place); ``x`` itself at size 1. Every rank gets the
    same bits: the exchange adds the ranks' tensors in rank order on each of them."""
    if _group.size == 1:
        return x
    pieces = _exchanged(x)
    if pieces is None:
        dist.all_reduce(x)
        return x
    total = torch.add(pieces[0], pieces[1])
    for piece in pieces[2:]:
        total += piece
    return x.copy_(total.view(x.shape))


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' ``x`` concatenated along ``dim``, in rank order; ``x`` itself at size 1."""
    if _group.size == 1:
        return x
    x = x.contiguous()
    pieces = _exchanged(x)
    if pieces is None:
        pieces = [torch.empty_like(x) for _ in range(_group.size)]
        dist.all_gather(pieces, x)
    return torch.cat([piece.view(x.shape) for piece in pieces], dim=dim)


def _exchanged(x: torch.Tensor) -> list[torch.Tensor] | None:
    """Every rank's ``x`` through the shared-memory exchange (flat views, valid until the next
    collective), or None where the group has none or ``x`` does not fit its slot. Every rank
    decides alike: their tensors have the same shape."""
    exchange = _group.exchange
    if exchange is None or x.device.type != "cpu" or x.numel() * x.element_size() > exchange.slot_bytes:
        return None
    payload = x.detach().contiguous().view(-1).view(torch.uint8).numpy()
    return [torch.from_numpy(view).view(x.dtype) for view in exchange.exchange(payload, _group.timeout_s)]


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

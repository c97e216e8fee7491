"""Native CPU kernels: a small C library (``csrc/cpu_kernels.c``) built on first use.

Why: on the CPU the host's dispatch cost per torch op is paid for each of the tens of ops of a
layer, every step (benchmarks/RESULTS.md, bench_engine "Third round"), and the torch decode
attention gathers every request's KV blocks into a padded copy (``index_select``) before SDPA
reads it again. The library has one call for each of: decode attention over the blocks in place
(what vLLM's CPU backend and the NPU's paged-attention op do), RMSNorm, rotary and SiLU-and-mul
(4 to 8 torch ops each), and the linear layers over weights laid out in column panels
(``PanelLinear`` in ``packed_linear.py``), whose reads of the next panel overlap the arithmetic
on the current one. Measured in ``benchmarks/RESULTS.md`` (bench_engine, "Third round").

How it is built: the machine's C compiler (``$CC``, else ``cc``) with ``-O3 -march=native
-fopenmp``; the shared library is cached under ``${XDG_CACHE_HOME:-~/.cache}/atb-plugin/kernels``
under a name hashed from the source, the flags, the compiler's version and this CPU's
instruction-set flags (a library built for one CPU is never loaded on another), written under a
temporary name and renamed, so processes that build at once never load half a file. OpenMP
resolves to the ``libgomp.so.1`` torch has already loaded: one thread pool, the caller's
``torch.get_num_threads()`` threads.

Which path runs: ``ATB_PLUGIN_CPU_KERNELS`` = ``auto`` (default: the library where it builds,
else the torch ops after one warning naming why), ``native`` (the library, or an error),
``torch``. The library takes float32 only: other dtypes and CUDA tensors always take the torch
ops. Each kernel is checked against the torch path and a float64 reference in
tests/test_cpu_native.py and tests/test_platform_and_ops.py.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

KERNELS_ENV = "ATB_PLUGIN_CPU_KERNELS"
CHOICES = ("auto", "native", "torch")
SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
# No -ffast-math: linked into a shared library it would switch the whole process to flushing
# denormals. These let the compiler reorder the float sums (vectorised dot products) and no more.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
          "-fassociative-math", "-fno-signed-zeros")

_lock = threading.Lock()
_loaded: dict[str, object] = {}  # "library" -> the bound ctypes library, or "error" -> why it is unavailable


class NativeKernelError(RuntimeError):
    """The library was asked for (``ATB_PLUGIN_CPU_KERNELS=native``) but cannot be built or loaded."""


def choice() -> str:
    value = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{KERNELS_ENV}={value!r}: expected one of {', '.join(CHOICES)}")
    return value


def library_for(dtype: torch.dtype, device: torch.device):
    """The bound library for tensors of ``dtype`` on ``device`` (CPU float32) when the choice
    allows it, else None (the caller runs its torch ops)."""
    if dtype != torch.float32 or device.type != "cpu":
        return None
    wanted = choice()
    if wanted == "torch":
        return None
    library, error = _load()
    if library is None and wanted == "native":
        raise NativeKernelError(f"{KERNELS_ENV}=native, but the native CPU kernels are unavailable: {error}")
    return library


def _load():
    if _loaded:  # the hot path (every op of every step): no lock once decided
        return _loaded.get("library"), _loaded.get("error")
    with _lock:
        if not _loaded:
            try:
                _loaded["library"] = _bind(ctypes.CDLL(str(_build())))
            except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
                _loaded["error"] = str(exc)
                logger.warning("native CPU kernels unavailable (%s); using the slower torch ops. Set %s=torch "
                               "to silence this.", exc, KERNELS_ENV)
        return _loaded.get("library"), _loaded.get("error")


_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_SIGNATURES = {  # name: (restype, argtypes), as in csrc/cpu_kernels.c
    "paged_decode_f32": (_INT, [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _F32, _INT]),
    "rms_norm_f32": (None, [_PTR, _I64, _PTR, _PTR, _I64, _I64, _F32, _INT]),
    "rotary_f32": (None, [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT]),
    "silu_and_mul_f32": (None, [_PTR, _I64, _PTR, _I64, _I64, _INT]),
    "argmax_f32": (None, [_PTR, _I64, _I64, _I64, _PTR, _INT]),
    "linear_f32": (None, [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _INT]),
    "decode_scratch_floats": (_I64, [_PTR, _I64]),
    "decode_step_f32": (_INT, [_PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _INT]),
}


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    for name, (restype, argtypes) in _SIGNATURES.items():
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes
    return library


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _build() -> Path:
    compiler = shlex.split(os.environ.get("CC") or "cc")
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except FileNotFoundError as exc:
        raise RuntimeError(f"no C compiler ({' '.join(compiler)}): install gcc or set CC") from exc
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(CFLAGS).encode(), version.encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    target = base / "atb-plugin" / "kernels" / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    os.close(fd)
    try:
        done = subprocess.run([*compiler, *CFLAGS, str(SOURCE), "-o", partial, "-lm"], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(compiler)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    logger.info("built the native CPU kernels: %s", target)
    return target


# The decode kernel works in 16-float vectors; other head sizes take SDPA (torch_kernels).
DECODE_HEAD_DIM_MULTIPLE = 16


def paged_decode(library, query, key_cache, value_cache, block_tables, seq_lens, max_block: int, scale: float):
    """``(B, H, D)`` float32 queries, one per request, over the requests' cached K/V, D a multiple
    of ``DECODE_HEAD_DIM_MULTIPLE``. ``block_tables`` ``(B, W)`` int32 and ``seq_lens`` ``(B,)``
    int32 (contiguous, CPU), with ``max_block`` the largest block id they use (checked here against
    the cache: the kernel trusts its indices)."""
    batch, heads, head_dim = query.shape
    num_blocks, block_size, kv_heads, cache_dim = key_cache.shape
    if not (query.dtype == key_cache.dtype == value_cache.dtype == torch.float32):
        raise ValueError(f"the CPU decode kernel takes float32, got {query.dtype} / {key_cache.dtype}")
    if (cache_dim != head_dim or head_dim % DECODE_HEAD_DIM_MULTIPLE or heads % kv_heads
            or value_cache.shape != key_cache.shape):
        raise ValueError(f"query {tuple(query.shape)} does not fit the cache {tuple(key_cache.shape)}")
    if max_block >= num_blocks:
        raise IndexError(f"block table names block {max_block}, the cache has {num_blocks}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("the CPU decode kernel needs contiguous caches")
    query = query.contiguous()
    out = torch.empty_like(query)
    failed = library.paged_decode_f32(query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                                      block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
                                      out.data_ptr(), batch, heads, kv_heads, head_dim, block_size, scale,
                                      torch.get_num_threads())
    if failed:
        raise MemoryError("the CPU decode kernel could not allocate its scratch buffer")
    return out


# Columns per weight panel of linear_f32 (csrc/cpu_kernels.c: the layout is drawn there).
PANEL = 64


def weight_panels(weight: torch.Tensor) -> torch.Tensor:
    """A float32 ``(N, K)`` weight as ``(ceil(N / PANEL), K, PANEL)`` column panels (contiguous;
    the columns past N are zeros): ``panels[p][k][j] = weight[p * PANEL + j][k]``."""
    out_features, in_features = weight.shape
    padded = -(-out_features // PANEL) * PANEL
    full = torch.zeros((padded, in_features), dtype=torch.float32)
    full[:out_features] = weight
    return full.view(padded // PANEL, PANEL, in_features).transpose(1, 2).contiguous()


def padded_bias(bias: torch.Tensor | None, panels: torch.Tensor) -> torch.Tensor | None:
    """The bias as ``linear`` takes it: float32, one value per panel column (zeros past N)."""
    if bias is None:
        return None
    full = torch.zeros(panels.shape[0] * PANEL, dtype=torch.float32)
    full[:bias.numel()] = bias
    return full


def check_panels(panels: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> None:
    """What ``linear`` trusts about its weight, checked once when a layer is made: float32
    contiguous ``weight_panels`` for ``out_features`` outputs, a ``padded_bias`` or None."""
    if (panels.dtype != torch.float32 or panels.dim() != 3 or panels.shape[2] != PANEL
            or not panels.is_contiguous() or not (panels.shape[0] - 1) * PANEL < out_features <= panels.shape[0] * PANEL):
        raise ValueError(f"panels {tuple(panels.shape)} {panels.dtype} cannot hold {out_features} outputs")
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() != panels.shape[0] * PANEL
                             or not bias.is_contiguous()):
        raise ValueError(f"a bias of {bias.numel()} ({bias.dtype}) for {panels.shape[0]} panels")


def linear(library, x: torch.Tensor, panels: torch.Tensor, out_features: int,
           bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + b`` for float32 ``x`` ``(..., K)``, with W as ``weight_panels`` made it and the
    bias as ``padded_bias`` made it (or None), both passed through ``check_panels`` beforehand
    (this runs for every layer of every step, so it checks only ``x``)."""
    if x.dtype != torch.float32 or x.shape[-1] != panels.shape[1]:
        raise ValueError(f"linear: x {tuple(x.shape)} {x.dtype} for float32 rows of {panels.shape[1]}")
    rows, stride = _rows(x)
    out = torch.empty((*x.shape[:-1], out_features), dtype=torch.float32)
    library.linear_f32(rows.data_ptr(), rows.shape[0], panels.shape[1], stride, panels.data_ptr(), out_features,
                       None if bias is None else bias.data_ptr(), out.data_ptr(), out_features,
                       torch.get_num_threads())
    return out


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` as rows over its last dim with unit stride, and the row stride (a copy only when the
    leading dims cannot be flattened into one stride)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # keeps the unit stride
    return rows, rows.stride(0)


def rms_norm(library, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows, stride = _rows(x)
    weight = weight.to(torch.float32).contiguous()
    if weight.numel() != x.shape[-1]:
        raise ValueError(f"RMSNorm weight of {weight.numel()} for rows of {x.shape[-1]}")
    out = torch.empty(x.shape, dtype=torch.float32)
    library.rms_norm_f32(rows.data_ptr(), stride, weight.data_ptr(), out.data_ptr(), rows.shape[0], rows.shape[1],
                         eps, torch.get_num_threads())
    return out


def apply_rotary(library, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``(T, H, D)`` (any token / head strides, unit stride within a head), cos / sin ``(T, D)``."""
    tokens, heads, head_dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous()
    if cos.shape != (tokens, head_dim) or sin.shape != cos.shape or head_dim % 2:
        raise ValueError(f"rotary: x {tuple(x.shape)} with cos {tuple(cos.shape)} / sin {tuple(sin.shape)}")
    out = torch.empty((tokens, heads, head_dim), dtype=torch.float32)
    library.rotary_f32(x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                       tokens, heads, head_dim, torch.get_num_threads())
    return out


def silu_and_mul(library, x: torch.Tensor) -> torch.Tensor:
    rows, stride = _rows(x)
    width = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], width), dtype=torch.float32)
    library.silu_and_mul_f32(rows.data_ptr(), stride, out.data_ptr(), rows.shape[0], width, torch.get_num_threads())
    return out



def argmax(library, x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for float32 ``(rows, width)``: the first index of each row's maximum
    (the first NaN where a row holds one, as torch), int64."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"argmax: x {tuple(x.shape)} {x.dtype}, expected float32 (rows, width > 0)")
    rows, stride = _rows(x)
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    library.argmax_f32(rows.data_ptr(), stride, rows.shape[0], rows.shape[1], out.data_ptr(), torch.get_num_threads())
    return out

# -- the captured decode step (decode_step_f32; built from a model by models/native_decode.py) --------

class DecodeLayer(ctypes.Structure):
    """One decoder layer's addresses, as ``decode_layer`` in csrc/cpu_kernels.c."""
    _fields_ = [(name, _PTR) for name in ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "gate_up", "down",
                                          "key_cache", "value_cache")]


class DecodeModel(ctypes.Structure):
    """The decoder's sizes and its layers, as ``decode_model`` in csrc/cpu_kernels.c."""
    _fields_ = [("num_layers", _I64), ("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64),
                ("intermediate", _I64), ("block_size", _I64), ("eps", _F32), ("scale", _F32),
                ("layers", ctypes.POINTER(DecodeLayer)), ("final_norm", _PTR)]


def decode_scratch(library, model: DecodeModel, rows: int) -> torch.Tensor:
    """The activations' scratch area ``decode_step`` needs for up to ``rows`` requests."""
    return torch.empty(library.decode_scratch_floats(ctypes.addressof(model), rows), dtype=torch.float32)


def decode_step(library, model: DecodeModel, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                slots: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                scratch: torch.Tensor) -> torch.Tensor:
    """Every layer of one decode step and the final norm: ``(rows, hidden)`` embeddings in, the
    final hidden states out. The caller (``NativeDecodeStep``) has checked every input against
    the model and the caches: the kernel trusts its indices and sizes."""
    out = torch.empty_like(embeds)
    failed = library.decode_step_f32(ctypes.addressof(model), embeds.data_ptr(), out.data_ptr(), embeds.shape[0],
                                     cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), block_tables.data_ptr(),
                                     block_tables.stride(0), seq_lens.data_ptr(), scratch.data_ptr(),
                                     torch.get_num_threads())
    if failed:
        raise MemoryError("the CPU decode kernel could not allocate its scratch buffer")
    return out

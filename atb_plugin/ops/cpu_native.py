"""Native CPU kernels: a small C library (``csrc/``) built on first use.

Why: on the CPU the host's dispatch cost per torch op is paid for each of the tens of ops of a
layer, every step (benchmarks/RESULTS.md, bench_engine "Third round"), and the torch decode
attention gathers every request's KV blocks into a padded copy (``index_select``) before SDPA
reads it again. The library has one call for each of: decode attention over the blocks in place
(what vLLM's CPU backend and the NPU's paged-attention op do), RMSNorm, rotary and SiLU-and-mul
(4 to 8 torch ops each), and the linear layers over weights laid out in column panels
(``PanelLinear`` in ``packed_linear.py``), whose reads of the next panel overlap the arithmetic
on the current one. Measured in ``benchmarks/RESULTS.md`` (bench_engine, "Third round").

How it is built: first a small probe (``csrc/cpu_probe.c``) runs, which tries each instruction
set that matters here (``FEATURES``: AVX2, AVX-512, AVX-512 BF16 and VNNI, AVX-VNNI, AMX) in a
forked child, so that a set the CPUID flags claim but this VM or process may not execute (an XCR0
state left disabled, AMX without its arch_prctl permission) is reported missing instead of killing
the process with SIGILL. The library is then built by the machine's C compiler (``$CC``, else
``cc``; ``CFLAGS``: ``-O3 -fopenmp``, no ``-ffast-math``), file by file (``UNITS``;
docs/architecture.md, "Native CPU kernels", maps them): the common files (the calls below, the one
int8 driver, the dispatch table) with the sets the probe found (``_isa_flags``: ``-mavx2 -mfma
-mf16c``, plus ``-mavx512f -mavx512bw -mavx512dq -mavx512vl`` where AVX-512 executes, and
``-mtune=native``), each ``isa_*.c`` file with its own set's flags whatever the probe says, so one
library holds every variant. When it loads, ``cpu_set_features`` hands the probe's answer to the
dispatch table (``csrc/dispatch.c``), which fills each kernel slot with the best variant whose
sets all executed (``kernel_map`` says which). Never ``-march=native`` on x86-64: it enables
whatever CPUID lists, which is exactly what the probe cannot trust (a library built with it where
the probe says AVX-512 is off could execute AVX-512 anywhere the compiler chose to). Other
architectures build the common files and the portable variant with ``-march=native``. The shared
library is cached under ``${XDG_CACHE_HOME:-~/.cache}/atb-plugin/kernels`` under a name hashed
from every file of ``csrc/`` (sources and headers), the flags (so the probe's answer), the
compiler's version and this CPU's CPUID flags (a library built for one CPU is never loaded on
another), with the probe's answer beside them (``kernels-probe/``), linked under a temporary name
and renamed, so processes that build at once never load half a file. OpenMP resolves to the
``libgomp.so.1`` torch has already loaded: one thread pool, the caller's
``torch.get_num_threads()`` threads.

Which path runs: ``ATB_PLUGIN_CPU_KERNELS`` = ``auto`` (default: the library where it builds, else
the torch ops after one warning naming why), ``native`` (the library, or an error), ``torch``;
after it, comma-separated, a float linear form per weight dtype may be pinned (``linear_forms``:
``auto,bfloat16=onednn``), which the calibration then takes instead of measuring that dtype
(``ops/calibration.py``). The
eager elementwise and attention calls take float32 tensors: other dtypes and CUDA tensors take the
torch ops (``library_for``). The linear kernels also take bfloat16 weights (``linear_bf16``, with
float32 or bfloat16 activations) and int8 weights (``w8a16_linear``, ``w8a8_dynamic_linear``),
reached through ``linear_library`` (tests/test_cpu_native_lowp.py checks them). The captured
decode step (``decode_step``) runs float32 activations over any of those weight formats and a
float32 or bfloat16 KV cache. Each kernel is checked against the torch path and a float64
reference in tests/test_cpu_native.py and tests/test_platform_and_ops.py.
``ATB_PLUGIN_CPU_ISA`` (a comma-separated subset of ``FEATURES``, or ``none``) limits the
instruction sets to fewer than the probe found (the base flags and the table both follow it);
``set_features`` limits the table alone, at run time. tests/test_cpu_kernel_map.py checks the
table, each variant and the structs shared with C.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import os
import shlex
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

KERNELS_ENV = "ATB_PLUGIN_CPU_KERNELS"
CHOICES = ("auto", "native", "torch")
# The forms a float linear weight takes on the CPU (ops/packed_linear.py: the native kernels' panels,
# oneDNN's packed layout, the dense checkpoint layout) and the weight dtypes they are chosen for; a
# form per dtype is measured at start (ops/calibration.py) unless ATB_PLUGIN_CPU_KERNELS pins it.
LINEAR_FORMS = ("panels", "onednn", "dense")
LINEAR_FORM_DTYPES = ("float32", "bfloat16")
CSRC = Path(__file__).with_name("csrc")
PROBE_SOURCES = (CSRC / "cpu_probe.c", CSRC / "isa_amx.c")  # the probe runs isa_amx.c's tile test
# No -ffast-math: linked into a shared library it would switch the whole process to flushing
# denormals. These let the compiler reorder the float sums (vectorised dot products) and no more.
# -Wno-psabi: the 64-byte vector type of the float kernels warns where AVX-512 is off; it never
# crosses the library's interface.
CFLAGS = ("-O3", "-fopenmp", "-fPIC", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
          "-fno-signed-zeros", "-Wno-psabi")
# What cpu_probe.c tries, in the order of the library's FEATURE_* bits (csrc/cpu_kernels.h).
FEATURES = ("avx2", "avx512", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
# Limits the features the library is built for and its kernels use (a comma-separated subset of
# FEATURES, or "none": baseline x86-64), as if the probe had found no more: to take a slower
# variant on purpose, e.g. to compare them, or to steer clear of a set.
ISA_ENV = "ATB_PLUGIN_CPU_ISA"
_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl")
# The library's files and each one's instruction-set flags on x86-64 (docs/architecture.md, "Native
# CPU kernels": the kernel map). None: the library's base, what the probe found (_isa_flags); the
# isa_*.c files hold the variants of the dispatch table (csrc/dispatch.c), each compiled for its own
# set whatever the probe says, so one library holds them all and the table picks what executes.
# Elsewhere only the base files and isa_portable.c are built, all with -march=native.
UNITS = {"cpu_kernels.c": None, "int8_driver.c": None, "dispatch.c": None, "lora_kernels.c": None, "moe_kernels.c": None,
         "tp_allreduce.c": None, "isa_portable.c": (),
         "isa_avx2.c": _AVX2, "isa_avx512.c": _AVX512, "isa_avx_vnni.c": (*_AVX2, "-mavxvnni"),
         "isa_avx512_vnni.c": (*_AVX512, "-mavx512vnni"), "isa_avx512_bf16.c": (*_AVX512, "-mavx512bf16"),
         "isa_amx.c": ()}
_X86_ONLY = ("isa_avx2.c", "isa_avx512.c", "isa_avx_vnni.c", "isa_avx512_vnni.c", "isa_avx512_bf16.c", "isa_amx.c")

_lock = threading.Lock()
_loaded: dict[str, object] = {}  # "library" -> the bound ctypes library, or "error" -> why it is unavailable


class NativeKernelError(RuntimeError):
    """The library was asked for (``ATB_PLUGIN_CPU_KERNELS=native``) but cannot be built or loaded."""


def choice() -> str:
    value = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if value in CHOICES:  # the hot path (read by every op): the plain choice
        return value
    return _parse_choice(value)[0]


def linear_forms() -> dict[str, str]:
    """The float linear forms ``ATB_PLUGIN_CPU_KERNELS`` pins, weight dtype name -> form (of
    ``LINEAR_FORMS``); the dtypes it leaves out are chosen by measurement (ops/calibration.py)."""
    value = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    return {} if value in CHOICES else _parse_choice(value)[1]


def _parse_choice(value: str) -> tuple[str, dict[str, str]]:
    """``ATB_PLUGIN_CPU_KERNELS``: one of CHOICES (default auto), and after it, comma-separated, a
    float linear form per weight dtype (``native,bfloat16=onednn``)."""
    library, forms = "auto", {}
    expected = (f"expected one of {', '.join(CHOICES)}, optionally followed by a linear form per weight dtype "
                f"(e.g. 'auto,bfloat16=panels'; dtypes {', '.join(LINEAR_FORM_DTYPES)}, forms {', '.join(LINEAR_FORMS)})")
    for position, item in enumerate(part.strip() for part in value.split(",")):
        dtype, _, form = item.partition("=")
        if position == 0 and item in CHOICES:
            library = item
        elif dtype.strip() in LINEAR_FORM_DTYPES and form.strip() in LINEAR_FORMS and dtype.strip() not in forms:
            forms[dtype.strip()] = form.strip()
        else:
            raise ValueError(f"{KERNELS_ENV}={value!r}: {expected}; {item!r} is neither (or repeats a dtype)")
    if library == "torch" and "panels" in forms.values():
        raise ValueError(f"{KERNELS_ENV}={value!r}: the panels form runs on the native kernels, which 'torch' "
                         f"switches off")
    return library, forms


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


def linear_library(device: torch.device):
    """The bound library for the linear kernels of every weight format (float32 / bfloat16
    panels, int8 rows) on ``device`` when the choice allows it, else None; as ``library_for``."""
    return library_for(torch.float32, device)


def features() -> dict[str, bool]:
    """What the probe found this process may execute (empty before the library loads or where it
    did not build), limited by ``ATB_PLUGIN_CPU_ISA``."""
    _load()
    return dict(_loaded.get("features", {}))


def set_features(library, names) -> int:
    """Refill the dispatch table from ``names`` alone (of FEATURES, each one the probe found):
    returns the mask set. For tests and benchmarks comparing the variants; ``features()`` is the
    default. The common code keeps the flags it was built with (``_isa_flags``)."""
    probed = _loaded.get("features", {})
    missing = [n for n in names if not probed.get(n)]
    if missing:
        raise ValueError(f"{missing} did not execute in the probe ({probed})")
    return library.cpu_set_features(sum(1 << FEATURES.index(n) for n in names))


def _load():
    if _loaded:  # the hot path (every op of every step): no lock once decided
        return _loaded.get("library"), _loaded.get("error")
    with _lock:
        if not _loaded:
            try:
                compiler = _compiler()  # one `cc --version` for the probe's key and the library's
                probed = _limit(_probe(compiler))
                library = _bind(ctypes.CDLL(str(_build(probed, compiler))))
                library.cpu_set_features(sum(1 << FEATURES.index(n) for n, ok in probed.items() if ok))
                _loaded["features"] = probed
                _loaded["library"] = library
            except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
                _loaded["error"] = str(exc)
                logger.warning("native CPU kernels unavailable (%s); using the slower torch ops. Set %s=torch "
                               "to silence this.", exc, KERNELS_ENV)
        return _loaded.get("library"), _loaded.get("error")


_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_SIGNATURES = {  # name: (restype, argtypes), as in csrc/ (cpu_kernels.c, int8_driver.c, dispatch.c)
    "paged_decode_f32": (_INT, [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _F32, _INT]),
    "rms_norm_f32": (None, [_PTR, _I64, _PTR, _PTR, _I64, _I64, _F32, _INT]),
    "rotary_f32": (None, [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT]),
    "silu_and_mul_f32": (None, [_PTR, _I64, _PTR, _I64, _I64, _INT]),
    "argmax_f32": (None, [_PTR, _I64, _I64, _I64, _PTR, _INT]),
    "linear_f32": (None, [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _INT]),
    "decode_scratch_floats": (_I64, [_PTR, _I64]),
    "decode_step_f32": (_INT, [_PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _INT]),
    "moe_scratch_floats": (_I64, [_I64, _I64, _I64, _I64, _I64]),
    "moe_experts_f32": (None, [_PTR, _PTR, _I64, _I64, _I64, _I64, _INT, _PTR, _PTR, _I64, _PTR, _PTR, _INT]),
    "linear_bf16w": (_INT, [_PTR, _INT, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _INT, _I64, _I64, _INT]),
    "cpu_set_features": (_INT, [_INT]),
    "cpu_kernel_slot": (ctypes.c_char_p, [_INT]),
    "cpu_kernel_variant": (ctypes.c_char_p, [_INT]),
    "w8a8_variant": (_INT, []),
    "w8a16_linear_f32": (_INT, [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _INT]),
    "quantize_rows_s8": (None, [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR]),
    "w8a8_dynamic_linear_f32": (_INT, [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _INT]),
    "lora_apply_f32": (_INT, [_PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64, _INT]),
    "tp_all_reduce_f32": (_INT, [_PTR, _PTR, _I64]),
}


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    for name, (restype, argtypes) in _SIGNATURES.items():
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes
    return library


def cpuinfo_line(keys: tuple[str, ...]) -> str | None:
    """The first line of /proc/cpuinfo starting with one of ``keys`` (None: no such line, or no
    /proc/cpuinfo)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(keys):
                return line
    except OSError:
        pass
    return None


def _cpu_flags() -> str:
    return cpuinfo_line(("flags", "Features")) or os.uname().machine


def _compiler() -> tuple[list[str], str]:
    compiler = shlex.split(os.environ.get("CC") or "cc")
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except FileNotFoundError as exc:
        raise RuntimeError(f"no C compiler ({' '.join(compiler)}): install gcc or set CC") from exc
    return compiler, version


def _run(command: list[str], compiler: list[str]) -> None:
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(compiler)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")


def _compile(compiler: list[str], flags: list[str], sources: list[Path], target: Path) -> None:
    """``sources`` (C files, or objects to link) compiled into ``target``, written under a
    temporary name and renamed, so processes that build at once never load half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    os.close(fd)
    try:
        _run([*compiler, *flags, *map(str, sources), "-o", partial, "-lm"], compiler)
        os.chmod(partial, 0o755)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _source_digest() -> bytes:
    """Every file of csrc/ (sources and headers), by name and content: a change to any of them
    makes a new library and probe."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".c", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.digest()


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "atb-plugin" / "kernels"


def _probe_dir() -> Path:
    """The probe program and each library's probed features (beside, not in, the libraries' folder)."""
    return _cache_dir().with_name("kernels-probe")


def _probe(compiler: tuple[list[str], str]) -> dict[str, bool]:
    """Each of FEATURES: whether its instructions ran in a child process (csrc/cpu_probe.c). The
    probe program is built once (cached like the library) and run at every load: a few
    milliseconds, and the answer is this process's, not one a migrated VM once had."""
    if not _x86():
        return {}
    compiler, version = compiler
    key = hashlib.sha256(b"\0".join([_source_digest(), version.encode()])).hexdigest()[:16]
    program = _probe_dir() / f"cpu_probe-{key}"
    try:
        if not program.exists():
            _compile(compiler, ["-O1"], list(PROBE_SOURCES), program)
        done = subprocess.run([str(program)], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"exit status {done.returncode}: {done.stderr.strip()[-500:]}")
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        # Without an answer, nothing beyond the baseline is assumed: slower kernels, never SIGILL.
        logger.warning("the CPU feature probe failed (%s); building the native kernels for baseline x86-64", exc)
        return {name: False for name in FEATURES}
    found = dict(line.split() for line in done.stdout.splitlines() if line.strip())
    return {name: found.get(name) == "1" for name in FEATURES}


def _limit(probed: dict[str, bool]) -> dict[str, bool]:
    """``probed`` less what ``ATB_PLUGIN_CPU_ISA`` leaves out (unset: all of it)."""
    wanted = os.environ.get(ISA_ENV, "").strip().lower()
    if not wanted:
        return probed
    names = set() if wanted == "none" else {n.strip() for n in wanted.split(",") if n.strip()}
    unknown = names - set(FEATURES)
    if unknown:
        raise ValueError(f"{ISA_ENV}={wanted!r}: unknown {sorted(unknown)}; expected a subset of {', '.join(FEATURES)}")
    return {name: ok and name in names for name, ok in probed.items()}


def _x86() -> bool:
    return os.uname().machine in ("x86_64", "amd64")


def _isa_flags(probed: dict[str, bool]) -> list[str]:
    """The compiler's instruction-set flags for the library's base files (UNITS: None): on x86-64
    only what the probe saw execute (module docstring: why not -march=native there)."""
    if not _x86():
        return ["-march=native"]
    sets = _AVX512 if probed.get("avx2") and probed.get("avx512") else _AVX2 if probed.get("avx2") else ()
    return ["-mtune=native", *sets]


def _unit_flags(probed: dict[str, bool]) -> dict[str, list[str]]:
    """Each file of the library that this architecture builds, with its instruction-set flags."""
    if not _x86():
        return {name: ["-march=native"] for name in UNITS if name not in _X86_ONLY}
    return {name: _isa_flags(probed) if sets is None else ["-mtune=native", *sets] for name, sets in UNITS.items()}


def _build(probed: dict[str, bool], compiler: tuple[list[str], str]) -> Path:
    """The library: each file compiled to an object with its own flags (UNITS), then linked
    (``compiler``: ``_compiler()``'s command and version)."""
    compiler, version = compiler
    units = _unit_flags(probed)
    described = " ".join(f"{name}:{','.join(flags)}" for name, flags in units.items())
    key = hashlib.sha256(b"\0".join([_source_digest(), " ".join(CFLAGS).encode(), described.encode(),
                                     version.encode(), _cpu_flags().encode()])).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="atb-kernels-") as objects, \
                ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            built = [Path(objects) / f"{Path(name).stem}.o" for name in units]
            commands = [[*compiler, *CFLAGS, *flags, "-c", str(CSRC / name), "-o", str(obj)]
                        for (name, flags), obj in zip(units.items(), built)]
            list(pool.map(lambda command: _run(command, compiler), commands))  # raises the first failure
            _compile(compiler, ["-shared", "-fopenmp"], built, target)
        _probe_dir().mkdir(parents=True, exist_ok=True)
        (_probe_dir() / f"{target.stem}.features").write_text("".join(f"{n} {int(ok)}\n" for n, ok in probed.items()))
        logger.info("built the native CPU kernels: %s (%s)", target, described)
    return target


def kernel_map() -> dict[str, str]:
    """Which variant each slot of the library's dispatch table holds (csrc/dispatch.c), e.g.
    ``{"rms_norm": "avx512", "w8a8_block": "avx512_vnni", ...}``; empty where the library did not
    load. It follows ``features()`` (and ``set_features``)."""
    library, _ = _load()
    if library is None:
        return {}
    slots = {}
    for index in itertools.count():
        name = library.cpu_kernel_slot(index)
        if name is None:
            return slots
        slots[name.decode()] = library.cpu_kernel_variant(index).decode()


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


# From this many rows on the bfloat16 dot-product kernel rounds a float32 x to bfloat16 instead of
# splitting it in two (csrc/cpu_kernels.h: where the arithmetic, not the weights' bandwidth, bounds it).
DOT_SPLIT_ROWS = 8


def dot_rounds(rows: int, x_dtype: torch.dtype, dot_rows: int) -> bool:
    """Whether ``linear_bf16`` with ``dot_rows`` rounds ``rows`` rows of ``x_dtype`` to bfloat16 on
    the way in (its error bound is then a bfloat16 input's: ops/calibration.py checks it so)."""
    return x_dtype == torch.bfloat16 or (0 < dot_rows <= rows and rows >= DOT_SPLIT_ROWS)


# Columns per weight panel of linear_f32 (csrc/cpu_kernels.h; csrc/float_kernels.h draws the layout).
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


def weight_panels_bf16(weight: torch.Tensor) -> torch.Tensor:
    """An ``(N, K)`` weight (any float dtype; rounded to bfloat16 as ``.to(torch.bfloat16)`` does)
    as ``(ceil(N / PANEL), ceil(K / 2), PANEL, 2)`` bfloat16 panels, contiguous:
    ``panels[p][k // 2][j][k % 2] = weight[p * PANEL + j][k]``, zeros past N and past K. Half the
    bytes of ``weight_panels``; ``linear_bf16`` reads them (csrc/float_kernels.h draws the layout)."""
    out_features, in_features = weight.shape
    padded = -(-out_features // PANEL) * PANEL
    steps = -(-in_features // 2)
    full = torch.zeros((padded, 2 * steps), dtype=torch.bfloat16)
    full[:out_features, :in_features] = weight
    return full.view(padded // PANEL, PANEL, steps, 2).transpose(1, 2).contiguous()


def check_panels_bf16(panels: torch.Tensor, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
    """``check_panels`` for ``weight_panels_bf16``."""
    if (panels.dtype != torch.bfloat16 or panels.dim() != 4 or panels.shape[2:] != (PANEL, 2)
            or not panels.is_contiguous() or panels.shape[1] != -(-in_features // 2)
            or not (panels.shape[0] - 1) * PANEL < out_features <= panels.shape[0] * PANEL):
        raise ValueError(f"bfloat16 panels {tuple(panels.shape)} {panels.dtype} cannot hold ({out_features}, "
                         f"{in_features})")
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() != panels.shape[0] * PANEL
                             or not bias.is_contiguous()):
        raise ValueError(f"a bias of {bias.numel()} ({bias.dtype}) for {panels.shape[0]} panels")


def linear_bf16(library, x: torch.Tensor, panels: torch.Tensor, in_features: int, out_features: int,
                bias: torch.Tensor | None, dot_rows: int = 0) -> torch.Tensor:
    """``x @ W.T + b`` for ``x`` ``(..., K)`` float32 or bfloat16 (the result has ``x``'s dtype),
    W as ``weight_panels_bf16`` made it, the bias as ``padded_bias`` made it (or None), checked
    beforehand by ``check_panels_bf16``. Products and sums in float32; a bfloat16 result is rounded
    once at the end, to nearest even. From ``dot_rows`` rows on (0: never) the bfloat16
    dot-product kernel computes it (``bf16_dot_variant``), else the widening one. The dot products
    take ``x`` in bfloat16: a float32 ``x`` of fewer than ``DOT_SPLIT_ROWS`` rows enters as a
    bfloat16 part and a bfloat16 remainder (carried to 2^-18 of itself, inside the float32 sums'
    bound), from there on rounded to bfloat16 (``dot_rounds``)."""
    if x.dtype not in (torch.float32, torch.bfloat16) or x.shape[-1] != in_features:
        raise ValueError(f"linear_bf16: x {tuple(x.shape)} {x.dtype} for float32 / bfloat16 rows of {in_features}")
    rows, stride = _rows(x)
    out = torch.empty((*x.shape[:-1], out_features), dtype=x.dtype)
    half = x.dtype == torch.bfloat16
    failed = library.linear_bf16w(rows.data_ptr(), int(half), rows.shape[0], in_features, stride, panels.data_ptr(),
                                  out_features, None if bias is None else bias.data_ptr(), out.data_ptr(), int(half),
                                  out_features, dot_rows, torch.get_num_threads())
    if failed:
        raise MemoryError("the bfloat16 linear kernel could not allocate its scratch buffer")
    return out


def bf16_dot_variant() -> str | None:
    """The variant holding the bfloat16 dot-product kernel (``linear_bf16`` with ``dot_rows``) where
    it runs on instructions made for it (``avx512_bf16``), else None: the portable C one that fills
    the slot elsewhere is a reference for the tests, never a contender (ops/calibration.py)."""
    variant = kernel_map().get("linear_bf16_dot")
    return None if variant in (None, "portable") else variant


def _int8_operands(op: str, x: torch.Tensor, weight: torch.Tensor, per_channel: dict):
    """``x`` as float32 rows with unit stride (and its row stride), after checking the int8
    kernels' operands: int8 contiguous ``(out, in)`` weight, float32 contiguous ``(out,)`` vectors."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.device.type != "cpu":
        raise ValueError(f"{op}: x must be float32 / bfloat16 / float16 on the CPU, got {x.dtype} {x.device}")
    if weight.dtype != torch.int8 or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"{op}: weight must be contiguous int8 (out, in), got {weight.dtype} {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
    for name, tensor in per_channel.items():
        if tensor is not None and (tensor.dtype != torch.float32 or tuple(tensor.shape) != (weight.shape[0],)
                                   or not tensor.is_contiguous()):
            raise ValueError(f"{op}: {name} must be contiguous float32 ({weight.shape[0]},), got {tensor.dtype} "
                             f"{tuple(tensor.shape)}")
    return _rows(x.to(torch.float32))


def w8a16_linear(library, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ ((weight + offset[:, None]) * scale[:, None]).T + bias`` for ``x`` ``(..., in)`` float32
    (bfloat16 / float16 are widened first; the result has ``x``'s dtype), ``weight`` int8
    ``(out, in)`` as the checkpoint holds it, ``scale`` / ``offset`` / ``bias`` float32 ``(out,)``
    (offset, bias optional). The int8 weights are widened to float32 in registers; float32 sums,
    computed as ``scale * (x . w + offset * sum(x)) + bias``."""
    rows, stride = _int8_operands("w8a16_linear", x, weight, {"scale": scale, "offset": offset, "bias": bias})
    out = torch.empty((rows.shape[0], weight.shape[0]), dtype=torch.float32)
    failed = library.w8a16_linear_f32(rows.data_ptr(), rows.shape[0], weight.shape[1], stride, weight.data_ptr(),
                                      weight.shape[0], scale.data_ptr(), None if offset is None else offset.data_ptr(),
                                      None if bias is None else bias.data_ptr(), out.data_ptr(), weight.shape[0],
                                      torch.get_num_threads())
    if failed:
        raise MemoryError("the W8A16 kernel could not allocate its scratch buffer")
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def quantize_per_token(library, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``(rows, in)`` float32 -> ``(q int8 (rows, in), s float32 (rows,))`` as
    ``w8a8_dynamic_linear`` quantizes its input: ``s = max|row| / 127``, ``q = clamp(round(row /
    s), -128, 127)`` rounding half to even (a row of zeros: s = 0, q = 0)."""
    rows, stride = _rows(x.to(torch.float32))
    q = torch.empty(rows.shape, dtype=torch.int8)
    s = torch.empty(rows.shape[0], dtype=torch.float32)
    library.quantize_rows_s8(rows.data_ptr(), rows.shape[0], rows.shape[1], stride, q.data_ptr(), rows.shape[1],
                             s.data_ptr())
    return q, s


def w8a8_dynamic_linear(library, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """``(q @ weight.T) * s[:, None] * weight_scale[None, :] + bias`` with ``q, s`` each row of ``x``
    quantized as ``quantize_per_token`` does and the int8 product summed exactly in int32
    (AVX2 maddubs without saturation, or VNNI where the probe allows: ``features()``). ``x``
    ``(..., in)`` float32 (bfloat16 / float16 widened first; the result has ``x``'s dtype),
    ``weight`` int8 ``(out, in)``, ``weight_scale`` / ``bias`` float32 ``(out,)``."""
    rows, stride = _int8_operands("w8a8_dynamic_linear", x, weight, {"weight_scale": weight_scale, "bias": bias})
    out = torch.empty((rows.shape[0], weight.shape[0]), dtype=torch.float32)
    failed = library.w8a8_dynamic_linear_f32(rows.data_ptr(), rows.shape[0], weight.shape[1], stride,
                                             weight.data_ptr(), weight.shape[0], weight_scale.data_ptr(),
                                             None if bias is None else bias.data_ptr(), out.data_ptr(),
                                             weight.shape[0], torch.get_num_threads())
    if failed:
        raise MemoryError("the W8A8 kernel could not allocate its scratch buffer")
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


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

# What a DecodeLinear's weight holds, as LINEAR_* in csrc/cpu_kernels.h (tests/test_cpu_kernel_map.py compares).
LINEAR_F32, LINEAR_BF16, LINEAR_W8A16, LINEAR_W8A8_DYNAMIC = range(4)


class DecodeLinear(ctypes.Structure):
    """One linear layer of the plan, as ``decode_linear`` in csrc/cpu_kernels.h: ``format`` (a
    ``LINEAR_*``), the weight (float32 / bfloat16 panels, or int8 rows), the float32 bias,
    per-channel scale and offset (int8 only), each NULL where absent, and for bfloat16 panels the
    rows from which the dot-product kernel runs (``dot_rows``, 0: never; ``linear_bf16``)."""
    _fields_ = [("format", _I64), *((name, _PTR) for name in ("weight", "bias", "scale", "offset")),
                ("dot_rows", _I64)]


_LINEAR_WEIGHT_DTYPES = {LINEAR_F32: torch.float32, LINEAR_BF16: torch.bfloat16, LINEAR_W8A16: torch.int8,
                         LINEAR_W8A8_DYNAMIC: torch.int8}


@dataclass(frozen=True)
class LinearOperands:
    """A linear layer as the captured decode step reads it: ``format`` (a ``LINEAR_*``) and the
    CPU tensors its kernel takes, as the eager call passes them: panels and a ``padded_bias``
    (``linear`` / ``linear_bf16``), or int8 ``(out, in)`` rows with float32 ``(out,)`` scale,
    offset (W8A16) and bias (``w8a16_linear`` / ``w8a8_dynamic_linear``). Checked when made: the
    kernel trusts them."""
    format: int
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    dot_rows: int = 0  # bfloat16 panels: as ``linear_bf16`` takes it
    # From this many rows on the layer serves from another form (packed_linear.SplitLinear), which the
    # plan cannot hold: the captured step then runs fewer requests (0: none).
    batch_rows: int = 0

    def __post_init__(self):
        if _LINEAR_WEIGHT_DTYPES.get(self.format) != self.weight.dtype:
            raise ValueError(f"linear format {self.format} with a {self.weight.dtype} weight")
        int8 = self.format in (LINEAR_W8A16, LINEAR_W8A8_DYNAMIC)
        if int8 and (self.scale is None or (self.offset is None) != (self.format == LINEAR_W8A8_DYNAMIC)):
            raise ValueError(f"linear format {self.format}: scale, and an offset for W8A16 only")
        rows = self.weight.shape[0]
        for name, tensor in (("weight", self.weight), ("bias", self.bias), ("scale", self.scale),
                             ("offset", self.offset)):
            if tensor is None:
                continue
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise ValueError(f"linear {name}: {tensor.device} tensor, contiguous={tensor.is_contiguous()}")
            if name != "weight" and (tensor.dtype != torch.float32 or (int8 and tensor.shape != (rows,))):
                raise ValueError(f"linear {name} {tuple(tensor.shape)} {tensor.dtype} for {rows} float32 outputs")


class DecodeMoe(ctypes.Structure):
    """A sparse MLP of the plan, as ``decode_moe`` in csrc/cpu_kernels.h: sizes, the router, the
    stacked float32 experts ``w13`` / ``w2`` read in place (``models/moe.py``'s ``FusedExperts``),
    and the shared expert with its gate (``shared_intermediate`` 0: none)."""
    _fields_ = [("num_experts", _I64), ("top_k", _I64), ("intermediate", _I64), ("renormalize", _I64),
                ("router", DecodeLinear), ("w13", _PTR), ("w2", _PTR), ("shared_intermediate", _I64),
                *((name, DecodeLinear) for name in ("shared_gate_up", "shared_down", "shared_gate"))]


class DecodeLayer(ctypes.Structure):
    """One decoder layer's addresses, as ``decode_layer`` in csrc/cpu_kernels.h (``q_norm`` /
    ``k_norm``: Qwen3's per-head norms, NULL: none; ``moe``: a sparse MLP, NULL: dense)."""
    _fields_ = [("input_norm", _PTR), ("post_norm", _PTR),
                *((name, DecodeLinear) for name in ("qkv", "o", "gate_up", "down")),
                ("key_cache", _PTR), ("value_cache", _PTR), ("q_norm", _PTR), ("k_norm", _PTR),
                ("moe", ctypes.POINTER(DecodeMoe))]


# Output slices of one LoRA-wrapped layer at most (q / k / v), as LORA_MAX_SLICES in csrc/cpu_kernels.h.
LORA_MAX_SLICES = 3


class LoRASlots(ctypes.Structure):
    """One LoRA-wrapped linear layer's adapter slots, as ``lora_linear`` in csrc/cpu_kernels.h
    (csrc/lora_kernels.c: the layouts): ``a`` (slots, slices * rank, in), per slice ``b`` (slots,
    rank, width) and its width. Made by ``lora_slots``."""
    _fields_ = [("a", _PTR), ("b", _PTR * LORA_MAX_SLICES), ("widths", _I64 * LORA_MAX_SLICES), ("slices", _I64)]


class DecodeLoRA(ctypes.Structure):
    """A captured decode step's adapters, as ``decode_lora`` in csrc/cpu_kernels.h: the slots'
    rank, each row's slot (int32, -1: the base model), the shrink's scratch, and 4 ``LoRASlots``
    per decoder layer."""
    _fields_ = [("rank", _I64), ("row_slots", _PTR), ("h", _PTR), ("linears", ctypes.POINTER(LoRASlots))]


class DecodeTP(ctypes.Structure):
    """This rank's place in its tensor-parallel group's shared-memory exchange, as ``decode_tp``
    in csrc/cpu_kernels.h: the segment's address (``shm.exchange.ShmExchange.address``), the
    rank, the group's size, the slots' bytes, how long a rank waits for another (seconds);
    ``failed_peer`` is the C side's answer when a collective fails."""
    _fields_ = [("segment", _PTR), ("rank", _I64), ("size", _I64), ("slot_bytes", _I64), ("timeout_s", ctypes.c_double),
                ("failed_peer", _I64)]


# tp_all_reduce_f32's / decode_step_f32's failures of the group, as TP_* in csrc/cpu_kernels.h.
TP_PEER_EXITED, TP_TIMED_OUT, TP_PEER_ABORTED = 2, 3, 4


class DecodeModel(ctypes.Structure):
    """The decoder's sizes and its layers, as ``decode_model`` in csrc/cpu_kernels.h (``kv_bf16``:
    the KV caches hold bfloat16, else float32; ``lora``: NULL, or the step's adapters; ``tp``:
    NULL, or this rank's tensor-parallel exchange, the sizes then being this rank's shard)."""
    _fields_ = [("num_layers", _I64), ("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64),
                ("intermediate", _I64), ("block_size", _I64), ("kv_bf16", _I64), ("eps", _F32), ("scale", _F32),
                ("layers", ctypes.POINTER(DecodeLayer)), ("final_norm", _PTR), ("lora", ctypes.POINTER(DecodeLoRA)),
                ("tp", ctypes.POINTER(DecodeTP))]


def lora_slots(a: torch.Tensor, b: list[torch.Tensor]) -> LoRASlots | str:
    """``a`` (slots, slices * rank, in) and each slice's ``b`` (slots, rank, width) as
    ``lora_apply`` and the captured step read them (their addresses: the tensors must stay alive
    and unmoved), or why they cannot be: float32 contiguous CPU tensors of matching sizes."""
    slots, rows, _ = a.shape
    rank = rows // max(len(b), 1)
    if not 1 <= len(b) <= LORA_MAX_SLICES or rows != rank * len(b):
        return f"{len(b)} output slices of A's {rows} rows (at most {LORA_MAX_SLICES})"
    for t in (a, *b):
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            return f"adapter slots {t.dtype} on {t.device} (contiguous={t.is_contiguous()}), not float32 CPU"
    if any(t.dim() != 3 or t.shape[:2] != (slots, rank) for t in b):
        return f"B slots {[tuple(t.shape) for t in b]} for A {tuple(a.shape)}"
    return LoRASlots(a.data_ptr(), (_PTR * LORA_MAX_SLICES)(*(t.data_ptr() for t in b)),
                     (_I64 * LORA_MAX_SLICES)(*(t.shape[2] for t in b)), len(b))


def lora_apply(library, slots: LoRASlots, rank: int, x: torch.Tensor, row_slots: torch.Tensor,
               out: torch.Tensor) -> None:
    """``out`` (rows, sum of the slices' widths) float32 += each row's adapter applied to ``x``
    (rows, in) float32 (csrc/lora_kernels.c), for ``row_slots`` (rows,) int32 (-1: nothing added;
    every other value a slot of ``slots``, which the caller guarantees: the kernel trusts it)."""
    rows, in_features = x.shape
    width = sum(slots.widths[:slots.slices])
    if (x.dtype != torch.float32 or out.dtype != torch.float32 or out.shape != (rows, width) or out.stride(1) != 1
            or x.stride(1) != 1 or row_slots.dtype != torch.int32 or row_slots.shape != (rows,)
            or not row_slots.is_contiguous()):
        raise ValueError(f"lora_apply: x {tuple(x.shape)} {x.dtype}, out {tuple(out.shape)} {out.dtype}, "
                         f"row_slots {tuple(row_slots.shape)} {row_slots.dtype} for outputs of {width}")
    h = torch.empty(rows * slots.slices * rank, dtype=torch.float32)
    if library.lora_apply_f32(ctypes.addressof(slots), rank, x.data_ptr(), rows, in_features, x.stride(0),
                              row_slots.data_ptr(), h.data_ptr(), out.data_ptr(), out.stride(0),
                              torch.get_num_threads()):
        raise MemoryError("the LoRA kernel could not allocate its tile list")


def decode_scratch(library, model: DecodeModel, rows: int) -> torch.Tensor:
    """The activations' scratch area ``decode_step`` needs for up to ``rows`` requests."""
    return torch.empty(library.decode_scratch_floats(ctypes.addressof(model), rows), dtype=torch.float32)


def decode_step(library, model: DecodeModel, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                slots: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                scratch: torch.Tensor) -> torch.Tensor:
    """Every layer of one decode step and the final norm: ``(rows, hidden)`` embeddings in, the
    final hidden states out. The caller (``NativeDecodeStep``) has checked every input against
    the model and the caches: the kernel trusts its indices and sizes. Float32 in and out."""
    out = torch.empty_like(embeds)
    failed = library.decode_step_f32(ctypes.addressof(model), embeds.data_ptr(), out.data_ptr(), embeds.shape[0],
                                     cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), block_tables.data_ptr(),
                                     block_tables.stride(0), seq_lens.data_ptr(), scratch.data_ptr(),
                                     torch.get_num_threads())
    if failed:
        raise tp_failure(model.tp.contents, failed) if failed > 1 else MemoryError(
            "the CPU decode kernel could not allocate its scratch buffer")
    return out


def tp_failure(tp: DecodeTP, failed: int) -> Exception:
    """The error a failed native collective (``failed``: TP_*) raises in this rank, naming the
    rank it waited for, as the Python exchange names it (shm/exchange.py)."""
    peer, rank = tp.failed_peer, tp.rank
    if failed == TP_TIMED_OUT:
        return TimeoutError(f"tensor-parallel rank {peer} did not reach the collective within {tp.timeout_s:.0f} s "
                            f"(rank {rank} waited, in the captured decode step)")
    what = "exited" if failed == TP_PEER_EXITED else "failed its step"
    return RuntimeError(f"tensor-parallel rank {peer} {what} while rank {rank} waited for it in a collective "
                        "(the captured decode step)")


def tp_all_reduce(library, tp: DecodeTP, x: torch.Tensor) -> torch.Tensor:
    """``x`` (contiguous float32 CPU) summed over the group in place, by the captured step's
    all-reduce (csrc/tp_allreduce.c): one round of the group's exchange, as
    ``distributed.all_reduce`` makes one."""
    if x.dtype != torch.float32 or not x.is_contiguous() or x.numel() * 4 > tp.slot_bytes:
        raise ValueError(f"tp_all_reduce: {x.dtype} {tuple(x.shape)} (contiguous={x.is_contiguous()}) for slots of "
                         f"{tp.slot_bytes} bytes")
    failed = library.tp_all_reduce_f32(ctypes.addressof(tp), x.data_ptr(), x.numel())
    if failed:
        raise tp_failure(tp, failed)
    return x


def moe_experts(library, x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                top_k: int, renormalize: bool) -> torch.Tensor:
    """``ops.fused_moe(x, router_logits, w13, w2, top_k, renormalize)`` for float32 tensors on one
    rank, by the captured step's native grouped experts (csrc/moe_kernels.c): for the tests and
    benchmarks/bench_moe.py (the model runs it only inside the captured decode step)."""
    rows, hidden = x.shape
    experts, _, width = w13.shape
    tensors = [t.contiguous() for t in (x, router_logits, w13, w2)]
    if any(t.dtype != torch.float32 for t in tensors) or router_logits.shape != (rows, experts) or \
            w2.shape != (experts, width // 2, hidden) or w13.shape[1] != hidden or not 1 <= top_k <= experts:
        raise ValueError(f"moe_experts: x {tuple(x.shape)}, logits {tuple(router_logits.shape)}, w13 "
                         f"{tuple(w13.shape)}, w2 {tuple(w2.shape)} (float32), top_k {top_k}")
    scratch = torch.empty(library.moe_scratch_floats(rows, hidden, experts, top_k, width // 2), dtype=torch.float32)
    out = torch.empty_like(tensors[0])
    library.moe_experts_f32(*(t.data_ptr() for t in tensors[:2]), rows, hidden, experts, top_k, int(renormalize),
                            tensors[2].data_ptr(), tensors[3].data_ptr(), width // 2, out.data_ptr(),
                            scratch.data_ptr(), torch.get_num_threads())
    return out

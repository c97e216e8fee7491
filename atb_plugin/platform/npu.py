"""Ascend NPU: torch_npu kernels (ATB or fused-infer-attention), hccl for torch.distributed.

The only module that imports ``torch_npu`` (lazily: it cannot even import without CANN). Others,
``atb_plugin.ops.npu_kernels`` included, reach it through ``torch_npu()``.

A simulated NPU (``atb_plugin.testing.fake_torch_npu``) carries ``FAKE_DEVICE = "cpu"``: it has no
device memory, so ``device()`` returns that device instead of ``npu:i``. A real torch_npu has no
such attribute.

What the platform allows (checked at start-up by ``check_engine_config``, from
``torch_npu.npu.get_device_name()``):

- chips: Atlas A2 (``Ascend910B*``) and A3 (``Ascend910_93*``) run the fused-infer-attention
  kernel set (``atb_plugin.ops.npu_fia_kernels``) by default, other chips the ATB set
  (``atb_plugin.ops.npu_kernels``); ``ATB_PLUGIN_NPU_KERNELS=atb|fia`` picks one. Ascend 310P
  (Atlas 300I inference cards) is refused: its attention ops need the NZ KV-cache layout, which is
  not implemented;
- dtype: the attention ops take float16 / bfloat16 only; ``auto`` is bfloat16 on A2/A3, float16
  on chips without bfloat16 (310B, the first-generation 910); float32 is refused;
- KV block size: 128 by default; the ATB set takes multiples of 16 up to 128 with
  ``block_size * head_size <= 128 * 128`` (its split-fuse chunked-prefill attention), the FIA set
  multiples of 128 up to 512;
- libraries: the ops the kernel set calls exist on torch_npu, and the ATB ones load (CANN's NNAL
  package, ``source .../nnal/atb/set_env.sh``).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from dataclasses import dataclass
from types import ModuleType

import torch

from atb_plugin.platform.base import DeviceGraphs, Platform

KERNELS_ENV = "ATB_PLUGIN_NPU_KERNELS"
KERNEL_SETS = {"atb": "atb_plugin.ops.npu_kernels", "fia": "atb_plugin.ops.npu_fia_kernels"}
# torch_npu functions each kernel set calls (checked at start-up: a missing one is a clear error).
KERNEL_SET_OPS = {
    "atb": ("_npu_reshape_and_cache", "_npu_paged_attention", "_npu_paged_attention_splitfuse",
            "_npu_flash_attention", "_npu_flash_attention_unpad", "npu_rms_norm", "npu_rotary_mul",
            "npu_swiglu"),
    "fia": ("npu_scatter_pa_kv_cache", "npu_fused_infer_attention_score", "_npu_flash_attention",
            "_npu_flash_attention_unpad", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu"),
}
BF16_CHIP_PREFIXES = ("Ascend910B", "Ascend910_93")  # Atlas A2, Atlas A3
UNSUPPORTED_CHIP_PREFIXES = ("Ascend310P",)
# KV block-size rules live with the kernels that need them (each kernel module's
# BLOCK_SIZE_MULTIPLE / MAX_BLOCK_SIZE, and npu_kernels' MAX_SPLITFUSE_BLOCK_ELEMS): the start-up
# check reads them there, so it cannot drift from what the kernels enforce.
DEFAULT_BLOCK_SIZE = 128
ATB_INSTALL_HINT = ("install CANN's ATB library (the NNAL package) matching this CANN / torch_npu and source "
                    "its environment (source /usr/local/Ascend/nnal/atb/set_env.sh) before starting")


def torch_npu() -> ModuleType:
    """The ``torch_npu`` module (raises ImportError where CANN / torch_npu are missing)."""
    module = sys.modules.get("torch_npu")
    return module if module is not None else importlib.import_module("torch_npu")


def unavailable_reason() -> str | None:
    """Why no NPU can be used here, or None when one can."""
    try:
        module = torch_npu()
    except Exception as exc:  # noqa: BLE001 - any failure to load CANN means "no NPU here"
        return f"torch_npu does not import ({type(exc).__name__}: {exc})"
    try:
        if not module.npu.is_available():
            return "torch_npu imports but torch_npu.npu.is_available() is False"
        if module.npu.device_count() < 1:
            return "torch_npu imports but reports no device"
    except Exception as exc:  # noqa: BLE001 - a broken runtime is no NPU either
        return f"torch_npu's runtime query failed ({type(exc).__name__}: {exc})"
    return None


def chip_name() -> str:
    """``torch_npu.npu.get_device_name()``: ``Ascend910B4``, ``Ascend910_9392``, ``Ascend310P3``..."""
    return str(torch_npu().npu.get_device_name())


def supports_bf16(name: str) -> bool:
    return name.startswith(BF16_CHIP_PREFIXES)


def default_kernel_set(name: str) -> str:
    return "fia" if name.startswith(BF16_CHIP_PREFIXES) else "atb"


def kernel_set(name: str | None = None) -> str:
    """``ATB_PLUGIN_NPU_KERNELS`` when set (``atb`` or ``fia``), else the chip's default."""
    chosen = os.environ.get(KERNELS_ENV, "").strip().lower()
    if chosen:
        if chosen not in KERNEL_SETS:
            raise ValueError(f"{KERNELS_ENV}={chosen!r}: expected one of {', '.join(KERNEL_SETS)} "
                             "(atb: ATB PagedAttention ops; fia: npu_fused_infer_attention_score)")
        return chosen
    return default_kernel_set(chip_name() if name is None else name)


def _load_atb_library() -> None:
    """Load torch_npu's ATB op library (``torch.ops.atb``) now instead of at the first call: a
    missing or mismatched NNAL raises here (OSError from torch_npu, naming libatb.so)."""
    try:
        torch.ops.atb._npu_paged_attention  # noqa: B018 - registered already?
        return
    except Exception:  # noqa: BLE001 - not registered yet
        pass
    try:
        atb_ops = importlib.import_module("torch_npu.op_plugin.atb._atb_ops")
    except ImportError:
        atb_ops = None
    register = getattr(atb_ops, "_register_atb_extensions", None)
    if register is not None:
        register()
    else:  # a torch_npu that loads ATB some other way: at least libatb.so must load
        import ctypes

        ctypes.CDLL("libatb.so")


def missing_ops_reason(module: ModuleType, ops: tuple[str, ...], kernels: str) -> str | None:
    """Why ``module`` (a torch_npu) cannot run the kernel set ``kernels``, or None."""
    version = getattr(module, "__version__", "?")
    missing = [op for op in ops if not callable(getattr(module, op, None))]
    if missing:
        if any(op.startswith("_npu_") for op in missing):  # the ATB ops (torch_npu's op_plugin/atb)
            fix = f"use a torch_npu with CANN's ATB ops (pip install .[npu]) and {ATB_INSTALL_HINT}"
        else:
            fix = (f"use a newer torch_npu and CANN (pip install .[npu]) or another kernel set "
                   f"({KERNELS_ENV}={'atb' if kernels == 'fia' else 'fia'})")
        return f"torch_npu {version} lacks {', '.join(missing)}, which the {kernels!r} NPU kernel set calls; {fix}"
    if getattr(module, "FAKE_DEVICE", None) is not None or not any(op.startswith("_npu_") for op in ops):
        return None  # the simulation computes its ops itself; the set uses no ATB op
    try:
        _load_atb_library()
    except Exception as exc:  # noqa: BLE001 - whatever the loader raises, name it
        return (f"torch_npu {version} cannot load the ATB op library (torch.ops.atb: "
                f"{type(exc).__name__}: {exc}); {ATB_INSTALL_HINT}")
    return None


_kernels_lock = threading.Lock()
_kernels_cache: tuple[tuple, str] | None = None  # (env value, torch_npu, its get_device_name) -> module name


@dataclass(frozen=True)
class NpuPlatform(Platform):
    name: str = "npu"
    device_type: str = "npu"
    dist_backend: str = "hccl"
    visible_devices_env: str | None = "ASCEND_RT_VISIBLE_DEVICES"
    kernels_module: str = KERNEL_SETS["atb"]

    def is_available(self) -> bool:
        return unavailable_reason() is None

    def is_simulated(self) -> bool:
        """True when the loaded torch_npu is the CPU simulation (``FAKE_DEVICE`` set)."""
        return getattr(sys.modules.get("torch_npu"), "FAKE_DEVICE", None) is not None

    def device(self, index: int = 0) -> torch.device:
        fake_device = getattr(torch_npu(), "FAKE_DEVICE", None)
        if fake_device is not None:
            return torch.device(fake_device)
        return torch.device(self.device_type, index)

    def device_graphs(self) -> DeviceGraphs:
        """ACL graphs: ``torch_npu.npu.NPUGraph`` (the simulated NPU's: ``testing/fake_npu_graph.py``)."""
        return DeviceGraphs(torch_npu().npu, "NPUGraph")

    def default_cudagraph_mode(self) -> str:
        # The simulation replays a graph by re-running its ops in Python: no launch cost to save,
        # seconds of capture per engine. Tests ask for graphs explicitly.
        return "NONE" if self.is_simulated() else "FULL_DECODE_ONLY"

    # --- kernels -----------------------------------------------------------------------------------

    def chip_name(self) -> str:
        return chip_name()

    def kernel_set(self) -> str:
        """``atb`` or ``fia`` (``ATB_PLUGIN_NPU_KERNELS``, else ``fia`` on A2/A3, ``atb`` elsewhere)."""
        return kernel_set()

    def kernels_module_name(self) -> str:
        # Asked for on every op: the answer is cached per (env value, torch_npu, chip query).
        global _kernels_cache
        module = torch_npu()
        key = (os.environ.get(KERNELS_ENV), id(module), getattr(module.npu, "get_device_name", None))
        cached = _kernels_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        name = KERNEL_SETS[kernel_set()]
        with _kernels_lock:
            _kernels_cache = (key, name)
        return name

    # --- engine configuration -------------------------------------------------------------------

    def check_environment(self) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"no usable NPU: {reason}")
        name = chip_name()
        if name.startswith(UNSUPPORTED_CHIP_PREFIXES):
            raise RuntimeError(
                f"{name} (Ascend 310P, Atlas 300I inference cards) is not supported yet: its attention ops "
                "need the NZ (FRACTAL_NZ) KV-cache layout and float16, which atb-plugin does not implement; "
                "run on an Atlas A2 (Ascend910B) or A3 (Ascend910_93) card")
        chosen = kernel_set(name)
        try:
            kernels = importlib.import_module(KERNEL_SETS[chosen])
        except ImportError as exc:
            raise RuntimeError(f"the {chosen!r} NPU kernel set ({KERNEL_SETS[chosen]}) does not import "
                               f"({type(exc).__name__}: {exc}); set {KERNELS_ENV}=atb or fia") from exc
        del kernels  # imported only to prove it imports
        reason = missing_ops_reason(torch_npu(), KERNEL_SET_OPS[chosen], chosen)
        if reason is not None:
            raise RuntimeError(reason)


    def default_dtype(self) -> str:
        return "bfloat16" if supports_bf16(chip_name()) else "float16"

    def check_dtype(self, dtype: str) -> None:
        if dtype == "float32":
            raise ValueError("EngineConfig.dtype = 'float32' is not supported on the NPU: use --dtype bfloat16 "
                             "or float16 (the ATB attention ops take fp16/bf16 only); --dtype auto picks "
                             "the chip's best")
        if dtype == "bfloat16" and not supports_bf16(name := chip_name()):
            raise ValueError(f"EngineConfig.dtype = 'bfloat16': {name} has no bfloat16 (only Atlas A2/A3, "
                             "Ascend910B / Ascend910_93, do): use --dtype float16 (or auto)")

    def _block_size_rule(self, head_size: int | None) -> tuple[int, int, str]:
        """(multiple of, at most, the rule in words) for the selected kernel set."""
        chosen = kernel_set()
        kernels = importlib.import_module(KERNEL_SETS[chosen])
        multiple, limit = kernels.BLOCK_SIZE_MULTIPLE, kernels.MAX_BLOCK_SIZE
        ops = "ATB PagedAttention" if chosen == "atb" else "npu_fused_infer_attention_score page attention"
        why = f"a multiple of {multiple} in [{multiple}, {limit}] ({chosen!r} kernel set: {ops}"
        max_elements = getattr(kernels, "MAX_SPLITFUSE_BLOCK_ELEMS", None)
        if head_size and max_elements:
            splitfuse = max_elements // head_size // multiple * multiple
            if splitfuse < limit:
                limit = max(multiple, splitfuse)
                why = (f"a multiple of {multiple} in [{multiple}, {limit}] ({chosen!r} kernel set: ATB split-fuse "
                       f"attention needs block_size * head_size <= {max_elements}; head_size is "
                       f"{head_size}")
        return multiple, limit, why + ")"

    def default_block_size(self, head_size: int | None = None) -> int:
        multiple, limit, _ = self._block_size_rule(head_size)
        return max(multiple, min(DEFAULT_BLOCK_SIZE, limit))

    def check_block_size(self, block_size: int, head_size: int | None = None) -> None:
        multiple, limit, why = self._block_size_rule(head_size)
        if block_size % multiple or not multiple <= block_size <= limit:
            raise ValueError(f"EngineConfig.block_size = {block_size}: the NPU's paged-attention ops need {why}; "
                             f"the default is {self.default_block_size(head_size)}")

    def device_count(self) -> int:
        return torch_npu().npu.device_count()

    def bind_device(self, index: int) -> None:
        torch_npu().npu.set_device(index)

    # --- memory: torch_npu's caching allocator (the simulated NPU's tensors live in host memory) ---

    def total_memory(self) -> int | None:
        return None if self.is_simulated() else torch_npu().npu.mem_get_info()[1]

    def reset_peak_memory(self) -> None:
        if self.is_simulated():
            return super().reset_peak_memory()
        torch_npu().npu.synchronize()
        torch_npu().npu.reset_peak_memory_stats()

    def memory_in_use(self) -> int:
        if self.is_simulated():
            return super().memory_in_use()
        torch_npu().npu.synchronize()
        return torch_npu().npu.memory_allocated()

    def peak_memory(self) -> int:
        if self.is_simulated():
            return super().peak_memory()
        torch_npu().npu.synchronize()  # ops still queued have not allocated yet
        return torch_npu().npu.max_memory_allocated()

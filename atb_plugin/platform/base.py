"""``Platform``: which device, distributed backend and op kernels a process uses, and which engine
configurations (dtype, KV block size) its kernels can run."""

from __future__ import annotations

import importlib
import resource
from dataclasses import dataclass
from types import ModuleType

import torch

DTYPES = ("float32", "float16", "bfloat16")


def host_memory() -> tuple[int, int]:
    """``(resident bytes now, peak resident bytes)`` of this process: VmRSS / VmHWM from
    /proc/self/status; where there is no /proc, both are getrusage's peak (Linux: KiB)."""
    try:
        with open("/proc/self/status", encoding="ascii") as file:
            fields = dict(line.split(":", 1) for line in file if line.startswith(("VmRSS", "VmHWM")))
        return int(fields["VmRSS"].split()[0]) << 10, int(fields["VmHWM"].split()[0]) << 10
    except (OSError, KeyError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
        return peak, peak


def reset_host_peak() -> bool:
    """Restart VmHWM at the current VmRSS (Linux >= 4.0: "5" to /proc/self/clear_refs). False where
    that is refused: the peak then includes whatever came before (an over-estimate, never under)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as file:
            file.write("5")
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class DeviceGraphs:
    """A device's graph API, which torch.cuda and torch_npu.npu spell alike: ``graph_class``
    (``CUDAGraph`` / ``NPUGraph``) with ``replay()``, the ``graph(g, pool=...)`` capture context,
    ``graph_pool_handle()`` (one memory pool shared by every captured size), ``Stream()``."""

    module: ModuleType
    graph_class: str

    def new_graph(self):
        return getattr(self.module, self.graph_class)()

    def capture(self, graph, pool):
        return self.module.graph(graph, pool=pool)

    def pool_handle(self):
        return self.module.graph_pool_handle()

    def stream(self):
        return self.module.Stream()

    def synchronize(self) -> None:
        self.module.synchronize()


@dataclass(frozen=True)
class Platform:
    """Contract: ``name`` in {npu, cuda, cpu}; ``device(i)`` the torch device tensors go to;
    ``dist_backend`` for ``torch.distributed``; ``visible_devices_env`` the variable that selects
    cards; ``kernels`` the module implementing every op in ``atb_plugin.ops`` (named by
    ``kernels_module_name()``).

    Start-up checks (``EngineConfig`` calls ``check_engine_config`` once, so an illegal setting
    fails before any model is loaded, never at the first forward): ``resolve_dtype("auto")`` is
    the platform's dtype, ``default_block_size(head_size)`` its KV block size.
    ``captures_decode_step``: decode-only steps can replay the CPU's native decode plan there
    (``DecoderForCausalLM.capture_decode_step``); ``device_graphs()``: the device-graph API
    decode steps are captured with (NPU, CUDA: ``engine/graph_runner.py``), None elsewhere."""

    name: str
    device_type: str
    dist_backend: str
    visible_devices_env: str | None
    kernels_module: str
    captures_decode_step: bool = False

    @property
    def kernels(self) -> ModuleType:
        # Read on every op call: keep the module, re-import only when the chosen name changes
        # (the NPU's kernel set can be switched by ATB_PLUGIN_NPU_KERNELS, e.g. between tests).
        name = self.kernels_module_name()
        module = self.__dict__.get("_kernels")
        if module is None or module.__name__ != name:
            module = importlib.import_module(name)
            object.__setattr__(self, "_kernels", module)  # a cache, not state: frozen otherwise
        return module

    def kernels_module_name(self) -> str:
        return self.kernels_module

    def device(self, index: int = 0) -> torch.device:
        return torch.device(self.device_type, index) if self.device_type != "cpu" else torch.device("cpu")

    def device_graphs(self) -> DeviceGraphs | None:
        return None

    def default_cudagraph_mode(self) -> str:
        """``compilation_config.cudagraph_mode`` when none is given (engine/compilation_config.py)."""
        return "FULL_DECODE_ONLY"

    def is_available(self) -> bool:
        raise NotImplementedError

    # --- engine configuration ------------------------------------------------------------------

    def default_dtype(self) -> str:
        return "float32"

    def measured_dtype(self, dtype: str, layers: list[tuple[int, int]], checkpoint_dtype: str | None,
                       threads: int) -> tuple[str, str]:
        """``dtype="auto"`` for a model whose linear layers are ``layers`` (``(out, in)`` each) and
        whose checkpoint holds ``checkpoint_dtype``, served by ``threads`` threads: ``dtype``
        (``default_dtype()``), unless this platform measures another faster (the CPU:
        ``ops.calibration.auto_dtype``); and why."""
        return dtype, "this platform's default"

    def resolve_dtype(self, dtype: str) -> str:
        """``"auto"`` -> ``default_dtype()``; an explicit dtype is checked and returned."""
        if dtype == "auto":
            return self.default_dtype()
        if dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype = {dtype!r}: expected auto or one of {', '.join(DTYPES)}")
        self.check_dtype(dtype)
        return dtype

    def check_dtype(self, dtype: str) -> None:
        """Raise ValueError when this platform's kernels cannot run ``dtype``."""

    def default_block_size(self, head_size: int | None = None) -> int:
        return 16

    def check_block_size(self, block_size: int, head_size: int | None = None) -> None:
        """Raise ValueError (naming field, value and valid range) when the kernels refuse it."""

    def check_environment(self) -> None:
        """Raise RuntimeError when the runtime cannot serve at all (libraries missing, unsupported chip)."""

    def check_engine_config(self, dtype: str, block_size: int | None,
                            head_size: int | None = None) -> tuple[str, int]:
        """Check the environment, resolve ``dtype`` (``"auto"``) and ``block_size`` (``None``)
        and check both against this platform's op rules; returns ``(dtype, block_size)``."""
        self.check_environment()
        dtype = self.resolve_dtype(dtype)
        if block_size is None:
            block_size = self.default_block_size(head_size)
        self.check_block_size(block_size, head_size)
        return dtype, block_size

    # --- the loaded model ----------------------------------------------------------------------

    def prepare_model(self, model) -> None:
        """Ready the loaded model (its linear layers already finished by their methods:
        ``models/linear.py``) for this platform, before the memory profile and the first step:
        the CPU moves its weights to huge pages and builds its kernels; nothing by default."""

    # --- tensor parallelism -------------------------------------------------------------------

    def device_count(self) -> int | None:
        """Devices a tensor-parallel engine may spread its ranks over; None: no limit (CPU ranks
        share the host's cores)."""
        return None

    def bind_device(self, index: int) -> None:
        """Make device ``index`` this process's current device (a rank process, before it loads
        its shard); nothing where there is one host."""

    # --- memory (the start-up profile, atb_plugin.engine.memory_profile, sizes the KV cache) ------

    def total_memory(self) -> int | None:
        """Bytes of device memory the KV cache is sized from; None where there is none (CPU, the
        simulated NPU): there the KV budget is explicit (``EngineConfig.kv_cache_bytes``)."""
        return None

    def reset_peak_memory(self) -> None:
        """Start a new peak for ``peak_memory`` (here: the process's resident memory)."""
        reset_host_peak()

    def memory_in_use(self) -> int:
        """Bytes the process holds now: device memory allocated by torch on a device platform,
        resident host memory here."""
        return host_memory()[0]

    def peak_memory(self) -> int:
        """The most ``memory_in_use`` reached since ``reset_peak_memory``."""
        return host_memory()[1]

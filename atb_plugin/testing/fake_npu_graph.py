"""The simulated NPU's graph mode: ``torch.npu.NPUGraph`` (ACL graph) and the task-group parameter
update torch_npu exposes, on CPU tensors, at least as strict as the real device.

Installed by ``fake_torch_npu.install()`` on ``torch_npu.npu`` (which is ``torch.npu``):
``NPUGraph``, ``graph(g, pool=None, stream=None, capture_error_mode="global")``,
``graph_pool_handle()``, ``graph_task_group_begin(stream)`` / ``graph_task_group_end(stream)``
(-> a handle), ``graph_task_update_begin(stream, handle)`` / ``graph_task_update_end(stream)``,
``Stream``, ``current_stream()``, ``stream(s)``, ``ExternalEvent``. Sources of the contract
(read, not copied): torch_npu's ``NPUGraph.h`` / ``graphs.py`` and vllm-ascend's
``compilation/acl_graph.py`` and ``attention/attention_v1.py`` (the canonical caller: the
attention op launched as ``.out`` with a workspace inside a task group at capture, its host
lengths re-launched between ``graph_task_update_begin/end`` before each replay).

How it is simulated. A capture records what the device would run, in order: every aten op of
the captured code (a ``TorchDispatchMode``: its function, its argument objects, its outputs) and
every ``torch_npu`` op as one kernel (the op's own arithmetic is not recorded, as a kernel's inner
loops are not). ``replay()`` runs the record again over the same tensor objects: views are
not recomputed (they still alias the recorded memory), in-place and ``out=`` ops run again,
functional ops run again and their results are copied into the tensors they produced at capture
(the graph's pool), collectives run again and are waited on. So replay reads whatever the
inputs hold now, as the device would, and nothing the host computed at capture changes.

What the real graph would get wrong silently or crash on, the fake refuses (``GraphCaptureError``
during capture, ``GraphReplayError`` at replay):

- a host sync inside capture: ``.item()``, ``bool()`` / ``int()`` of a device tensor,
  ``.tolist()``, ``.numpy()``, ``.cpu()``, ``npu.synchronize()``, or a kernel reporting one
  (``npu.note_host_sync``). Host tensors (``HOST_MARK``: lengths the ATB / FIA ops read on the
  host) may be read; what is computed from host tensors only stays on the host, unrecorded;
- a tensor allocated outside the graph's pool fed to a device op inside capture: host data
  (``torch.tensor(...)``, ``torch.as_tensor``, ``torch.from_numpy``: its values would be baked
  in at capture) or a host tensor passed where the op reads device memory;
- an op with host parameters (``SymInt[]`` lengths, host length tensors) outside a task group:
  no update could ever reach them; ``npu_fused_infer_attention_score`` without ``.out`` and a
  workspace, ``_npu_paged_attention`` without a workspace (they size scratch memory at launch);
- at replay: an input tensor whose address changed since capture (``set_`` / ``resize_``), a
  task group with host parameters not updated since the last replay, and stale metadata: a
  block table / slot mapping / length tensor an attention or cache op reads, or any tensor it
  was computed from inside the graph, not written since the last replay (``_version``).

``graph_stats()`` (on the handle ``install()`` returns) counts captures and replays.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from atb_plugin.testing import fake_fia_ops
from atb_plugin.testing.fake_torch_npu import HOST_MARK, NpuOpError

# Per op: the arguments that are per-step metadata (device tensors the runner must refresh in its
# static buffers before every replay).
METADATA_ARGS = {
    "npu_fused_infer_attention_score.out": ("block_table",),
    "npu_scatter_pa_kv_cache": ("slot_mapping",),
    "_npu_reshape_and_cache": ("slot_indices",),
    "_npu_paged_attention": ("block_table",),
}
# Ops that allocate their workspace at launch from host data: refused inside capture unless given
# one (what vllm-ascend's graph path passes).
NEEDS_WORKSPACE = ("_npu_paged_attention", "npu_fused_infer_attention_score.out")
# Host-side queries that allocate: not kernels, nothing to replay.
WORKSPACE_QUERIES = ("_npu_fused_infer_attention_score_get_max_workspace", "_npu_paged_attention_get_workspace")
EAGER_ONLY = {"npu_fused_infer_attention_score": "npu_fused_infer_attention_score.out with a workspace from "
                                                 "_npu_fused_infer_attention_score_get_max_workspace"}
_HOST_SYNC_OPS = {"aten::_local_scalar_dense", "aten::item"}
_HOST_DATA_FACTORIES = {"aten::lift_fresh", "aten::lift_fresh_copy"}
_NO_REPLAY_FACTORIES = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
                        "aten::new_empty_strided"}
_HOST_FUNCTIONS = ("tolist", "numpy", "cpu", "item")
_FROM_HOST = (torch.tensor, torch.as_tensor, torch.from_numpy, torch.asarray, torch.frombuffer)


class GraphCaptureError(NpuOpError):
    """What the captured code did that a real ACL graph capture cannot hold."""


class GraphReplayError(NpuOpError):
    """A replay that would read stale or moved memory on the device."""


def is_host(t) -> bool:
    return isinstance(t, torch.Tensor) and bool(getattr(t, HOST_MARK, False))


def _mark_host(tree) -> None:
    for t in pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            setattr(t, HOST_MARK, True)


def _address(t: torch.Tensor) -> int | None:
    """``t.data_ptr()``; None for tensors without storage (oneDNN's packed weights: opaque, never moved)."""
    try:
        return t.data_ptr()
    except RuntimeError:
        return None


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _op_kind(func) -> str:
    schema = func._schema
    if func.namespace == "c10d":
        return "collective"
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "inplace"
    if any(r.alias_info is not None for r in schema.returns):
        return "view"
    return "functional"


class _Node:
    __slots__ = ("name", "fn", "args", "kwargs", "outputs", "kind", "host_params", "updated", "group", "named")

    def __init__(self, name, fn, args, kwargs, outputs, kind):
        self.name, self.fn, self.args, self.kwargs, self.outputs, self.kind = name, fn, args, kwargs, outputs, kind
        self.host_params: dict = {}
        self.updated = False
        self.group = None
        self.named: dict = {}


class TaskGroupHandle:
    """What ``graph_task_group_end`` returns: the kernels launched in the group, updatable."""

    def __init__(self, graph: "FakeNPUGraph", nodes: list[_Node]):
        self.graph, self.nodes = graph, nodes


class _Runtime:
    """Shared state of one installed fake: the capturing graph, the open update, the counters."""

    def __init__(self):
        self.capturing: FakeNPUGraph | None = None
        self.updating: TaskGroupHandle | None = None
        self.updated_in_this_update = 0
        self.captures = 0
        self.replays = 0


class _DispatchRecorder(TorchDispatchMode):
    def __init__(self, graph: "FakeNPUGraph"):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.graph._paused:  # inside a torch_npu kernel: its own arithmetic is not recorded
            return func(*args, **(kwargs or {}))
        return self.graph._on_aten(func, args, kwargs or {})


class _FunctionGuard(TorchFunctionMode):
    """Host reads that never reach the dispatcher (``tolist``, ``numpy``, ``cpu`` of a CPU-backed
    tensor) and host data entering through factories."""

    def __init__(self, graph: "FakeNPUGraph"):
        super().__init__()
        self.graph = graph

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.graph._paused:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in _HOST_FUNCTIONS and args and isinstance(args[0], torch.Tensor) and not is_host(args[0]):
            raise GraphCaptureError(f"host sync inside graph capture: Tensor.{name}() of a device tensor "
                                    f"{tuple(args[0].shape)} {args[0].dtype} (the device would have to stop; "
                                    "read host copies prepared before capture, or keep the value on the device)")
        result = func(*args, **kwargs)
        if func in _FROM_HOST:
            _mark_host(result)
        return result


class FakeNPUGraph:
    """``torch.npu.NPUGraph``: ``capture_begin(pool=None, capture_error_mode="global")``,
    ``capture_end()``, ``replay()``, ``reset()``, ``pool()``, ``enable_debug_mode()``."""

    _pools = itertools.count(1)

    def __init__(self, runtime: _Runtime):
        self._runtime = runtime
        self._nodes: list[_Node] = []
        self._internal: set[int] = set()  # id() of tensors produced inside the capture (held by nodes)
        self._external: dict[int, tuple[torch.Tensor, int]] = {}  # id -> (tensor, data_ptr at capture)
        self._sources: dict[int, frozenset[int]] = {}  # id of a produced tensor -> external ids it reads
        self._versions: dict[int, int] = {}  # external id -> _version at the last capture end / replay
        self._open_group: list[_Node] | None = None
        self._modes: contextlib.ExitStack | None = None
        self._captured = False
        self._pool = None
        self._paused = 0

    # -- capture -----------------------------------------------------------------------------------

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        if self._runtime.capturing is not None:
            raise GraphCaptureError("capture_begin: another graph is being captured")
        if self._captured:
            raise GraphCaptureError("capture_begin: this graph was captured already (reset() it first)")
        self._pool = pool if pool is not None else (0, next(self._pools))
        self._runtime.capturing = self
        self._modes = contextlib.ExitStack()
        self._modes.enter_context(_FunctionGuard(self))
        self._modes.enter_context(_DispatchRecorder(self))

    def _stop_recording(self) -> None:
        if self._modes is not None:
            self._modes.close()
            self._modes = None
        if self._runtime.capturing is self:
            self._runtime.capturing = None

    def capture_end(self) -> None:
        self._stop_recording()
        if self._open_group is not None:
            raise GraphCaptureError("capture_end: a task group is still open (graph_task_group_end missing)")
        for node in self._nodes:
            if node.host_params and node.group is None:
                raise GraphCaptureError(
                    f"{node.name} was captured with host parameters ({', '.join(node.host_params)}) outside a task "
                    "group: no update could reach them, every replay would reuse the capture's values "
                    "(wrap it in graph_task_group_begin/end and update it before each replay)")
        self._captured = True
        self._runtime.captures += 1
        self._versions = {key: t._version for key, (t, _) in self._external.items()}
        for node in self._nodes:
            node.updated = False

    def abort(self) -> None:
        """Leave a failed capture (the ``graph`` context's exit on an exception)."""
        self._stop_recording()
        self._open_group = None
        self.reset()

    def reset(self) -> None:
        self._nodes, self._internal, self._external, self._sources = [], set(), {}, {}
        self._captured = False

    def pool(self):
        return self._pool

    def enable_debug_mode(self) -> None:
        """Nothing to add: the fake always checks."""

    # -- what the capture sees ----------------------------------------------------------------------

    def _reads(self, tensors, what: str) -> frozenset[int]:
        """The external sources of ``tensors`` read by a device op; records new external inputs."""
        sources = set()
        for t in tensors:
            key = id(t)
            if key in self._internal:
                sources |= self._sources.get(key, frozenset())
                continue
            if is_host(t):
                raise GraphCaptureError(
                    f"{what} reads a host tensor {tuple(t.shape)} {t.dtype} inside graph capture: memory "
                    "allocated outside the graph's pool (host data would be copied once, at capture); fill a "
                    "static device buffer before capture and read that")
            if key not in self._external:
                self._external[key] = (t, _address(t))
            sources.add(key)
        return frozenset(sources)

    def _produced(self, outputs, sources: frozenset[int]) -> None:
        for t in _tensors(outputs):
            self._internal.add(id(t))
            self._sources[id(t)] = sources

    def _on_aten(self, func, args, kwargs):
        name = func._schema.name
        inputs = _tensors((args, kwargs))
        if name in _HOST_SYNC_OPS:
            if inputs and all(is_host(t) for t in inputs):
                return func(*args, **kwargs)
            raise GraphCaptureError(f"host sync inside graph capture: {func} (.item() / bool() / int() of a device "
                                    "tensor) would stop the device; decide on the host from host copies")
        if name in _HOST_DATA_FACTORIES:
            result = func(*args, **kwargs)
            _mark_host(result)
            return result
        if inputs and all(is_host(t) for t in inputs):  # host arithmetic: runs now, not in the graph
            result = func(*args, **kwargs)
            _mark_host(result)
            return result
        sources = self._reads(inputs, str(func))
        result = func(*args, **kwargs)
        node = _Node(str(func), func, args, kwargs, result, _op_kind(func))
        self._nodes.append(node)
        self._produced(result, sources)
        return result

    def on_npu_op(self, name: str, fn, args: tuple, kwargs: dict):
        """A ``torch_npu`` op called while this graph captures: checked, run once, recorded."""
        if name in EAGER_ONLY:
            raise GraphCaptureError(f"{name} inside graph capture: use {EAGER_ONLY[name]}")
        if name in WORKSPACE_QUERIES:  # a host-side size query and an allocation from the graph's pool
            self._paused += 1
            try:
                result = fn(*args, **kwargs)
            finally:
                self._paused -= 1
            self._produced(result, frozenset())
            return result
        if name in NEEDS_WORKSPACE and kwargs.get("workspace") is None:
            raise GraphCaptureError(f"{name} inside graph capture needs workspace=... (it would allocate its "
                                    "workspace at launch from the host lengths of capture)")
        host_params, device_inputs = {}, []
        for key, value in itertools.chain(((f"#{i}", a) for i, a in enumerate(args)), kwargs.items()):
            if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and not isinstance(v, bool)
                                                                   for v in value):
                host_params[key] = list(value)
            elif is_host(value):
                host_params[key] = value.clone()
                setattr(host_params[key], HOST_MARK, True)
            else:
                device_inputs += _tensors(value)
        sources = self._reads(device_inputs, name)
        self._paused += 1
        try:
            result = fn(*args, **kwargs)
        finally:
            self._paused -= 1
        node = _Node(name, fn, args, kwargs, result, "npu")
        node.named = inspect.signature(fn).bind(*args, **kwargs).arguments
        node.host_params = host_params
        self._nodes.append(node)
        self._produced(result, sources)
        if self._open_group is not None:
            node.group = True
            self._open_group.append(node)
        return result

    def group_begin(self) -> None:
        if self._open_group is not None:
            raise GraphCaptureError("graph_task_group_begin: a task group is already open")
        self._open_group = []

    def group_end(self) -> TaskGroupHandle:
        if self._open_group is None:
            raise GraphCaptureError("graph_task_group_end without graph_task_group_begin")
        nodes, self._open_group = self._open_group, None
        if not nodes:
            raise GraphCaptureError("graph_task_group_end: the task group launched no kernel")
        return TaskGroupHandle(self, nodes)

    # -- replay -------------------------------------------------------------------------------------

    def _check_before_replay(self) -> None:
        for t, address in self._external.values():
            if _address(t) != address:
                raise GraphReplayError(
                    f"replay: an input {tuple(t.shape)} {t.dtype} moved since capture ({address or 0:#x} -> "
                    f"{_address(t) or 0:#x}); the graph reads the old address. Copy new data into the captured "
                    "buffers instead of replacing them")
        for node in self._nodes:
            if node.host_params and not node.updated:
                raise GraphReplayError(
                    f"replay: stale metadata: {node.name}'s host parameters ({', '.join(node.host_params)}) were not "
                    "updated since the last replay (graph_task_update_begin/end before every replay)")
            for arg in METADATA_ARGS.get(node.name, ()):
                value = node.named.get(arg)
                if not isinstance(value, torch.Tensor):
                    continue
                sources = (self._sources.get(id(value), frozenset()) if id(value) in self._internal
                           else frozenset({id(value)}))
                for key in sources:
                    t = self._external[key][0]
                    if t._version == self._versions.get(key):
                        raise GraphReplayError(
                            f"replay: stale metadata: {node.name}'s {arg} reads a {tuple(t.shape)} {t.dtype} buffer "
                            "not written since the last replay; refresh the static metadata before replay")

    def replay(self) -> None:
        if not self._captured:
            raise GraphReplayError("replay() of a graph that was never captured")
        if self._runtime.capturing is not None:
            raise GraphReplayError("replay() while a graph is being captured")
        if self._runtime.updating is not None:
            raise GraphReplayError("replay() inside graph_task_update_begin/end: end the update first")
        self._check_before_replay()
        for node in self._nodes:
            self._run(node)
        self._versions = {key: t._version for key, (t, _) in self._external.items()}
        for node in self._nodes:
            node.updated = False
        self._runtime.replays += 1

    @staticmethod
    def _run(node: _Node) -> None:
        if node.kind == "view" or (node.kind == "functional" and node.fn._schema.name in _NO_REPLAY_FACTORIES):
            return
        args, kwargs = node.args, node.kwargs
        if node.host_params:
            args = tuple(node.host_params.get(f"#{i}", a) for i, a in enumerate(args))
            kwargs = {k: node.host_params.get(k, v) for k, v in kwargs.items()}
        result = node.fn(*args, **kwargs)
        if node.kind == "collective":
            work = result[1] if isinstance(result, tuple) and len(result) > 1 else None
            if work is not None:
                torch._C._distributed_c10d.Work.unbox(work).wait()
            return
        if node.kind in ("functional", "npu"):
            for recorded, fresh in zip(_tensors(node.outputs), _tensors(result)):
                if recorded is not fresh:
                    recorded.copy_(fresh)


class FakeGraphApi:
    """The graph part of ``torch_npu.npu`` for one installed fake (see the module docstring)."""

    def __init__(self):
        self.runtime = _Runtime()
        api = self

        class NPUGraph(FakeNPUGraph):
            def __init__(self):
                super().__init__(api.runtime)

        self.NPUGraph = NPUGraph

    # graphs
    def graph_pool_handle(self):
        return (0, next(FakeNPUGraph._pools))

    @contextlib.contextmanager
    def graph(self, npu_graph: FakeNPUGraph, pool=None, stream=None, capture_error_mode: str = "global"):
        npu_graph.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
        try:
            yield npu_graph
        except BaseException:
            npu_graph.abort()
            raise
        npu_graph.capture_end()

    def synchronize(self, device=None) -> None:
        if self.runtime.capturing is not None:
            raise GraphCaptureError("host sync inside graph capture: synchronize()")

    def is_current_stream_capturing(self) -> bool:
        return self.runtime.capturing is not None

    # task groups
    def graph_task_group_begin(self, stream) -> None:
        self._capturing("graph_task_group_begin").group_begin()

    def graph_task_group_end(self, stream) -> TaskGroupHandle:
        return self._capturing("graph_task_group_end").group_end()

    def graph_task_update_begin(self, stream, handle: TaskGroupHandle) -> None:
        if self.runtime.capturing is not None:
            raise GraphCaptureError("graph_task_update_begin during a capture")
        if self.runtime.updating is not None:
            raise NpuOpError("graph_task_update_begin: an update is already open")
        if not isinstance(handle, TaskGroupHandle):
            raise NpuOpError(f"graph_task_update_begin: not a task group handle: {handle!r}")
        self.runtime.updating, self.runtime.updated_in_this_update = handle, 0

    def graph_task_update_end(self, stream) -> None:
        handle = self.runtime.updating
        if handle is None:
            raise NpuOpError("graph_task_update_end without graph_task_update_begin")
        self.runtime.updating = None
        if self.runtime.updated_in_this_update != len(handle.nodes):
            raise NpuOpError(f"graph_task_update_end: the group holds {len(handle.nodes)} kernel(s), "
                             f"{self.runtime.updated_in_this_update} were re-launched to update it")

    def update_npu_op(self, name: str, args: tuple, kwargs: dict) -> None:
        """An op launched between ``graph_task_update_begin/end``: it replaces the host parameters
        of the next kernel of the group; its device arguments must be the captured ones."""
        handle, index = self.runtime.updating, self.runtime.updated_in_this_update
        if index >= len(handle.nodes):
            raise NpuOpError(f"{name}: more kernels launched in the update than the task group holds")
        node = handle.nodes[index]
        if node.name != name:
            raise NpuOpError(f"task update: the group's kernel {index} is {node.name}, the update launched {name}")
        given = dict(itertools.chain(((f"#{i}", a) for i, a in enumerate(args)), kwargs.items()))
        captured = dict(itertools.chain(((f"#{i}", a) for i, a in enumerate(node.args)), node.kwargs.items()))
        if set(given) != set(captured):
            raise NpuOpError(f"task update of {name}: arguments {sorted(set(given) ^ set(captured))} differ from the "
                             "captured launch")
        for key, value in given.items():
            if key in node.host_params:
                new = list(value) if isinstance(value, (list, tuple)) else value.clone()
                if isinstance(new, torch.Tensor):
                    setattr(new, HOST_MARK, True)
                node.host_params[key] = new
                continue
            old = captured[key]
            same = ([_address(a) for a in _tensors(value)] == [_address(a) for a in _tensors(old)]
                    if _tensors(old) or _tensors(value) else value == old)
            if not same:
                raise NpuOpError(f"task update of {name}: {key} differs from the captured launch; an update may "
                                 "change host parameters only (device tensors are the graph's addresses)")
        node.updated = True
        self.runtime.updated_in_this_update += 1

    def _capturing(self, what: str) -> FakeNPUGraph:
        if self.runtime.capturing is None:
            raise NpuOpError(f"{what} outside graph capture")
        return self.runtime.capturing

    # streams and events (ordering is trivial on the host)
    class Stream:
        def __init__(self, device=None, priority: int = 0):
            self.device = device

        def wait_stream(self, other) -> None:
            pass

        def synchronize(self) -> None:
            pass

    class ExternalEvent:
        def wait(self, stream) -> None:
            pass

        def reset(self, stream) -> None:
            pass

        def record(self, stream) -> None:
            pass

    def current_stream(self, device=None):
        return self._default_stream

    _default_stream = Stream()

    @contextlib.contextmanager
    def stream(self, stream):
        yield stream

    def stats(self) -> dict:
        return {"captures": self.runtime.captures, "replays": self.runtime.replays}


# --------------------------------------------------------------------------------------------
# the graph-path ops (schemas: npu_schemas.txt, its graph-mode block)
# --------------------------------------------------------------------------------------------


def _workspace_bytes(query) -> int:
    """The simulated scratch size: float32 per query element (the real ops ask ATB / aclnn)."""
    return max(1, query.numel() * 4)


def _check_workspace(op: str, workspace, query) -> None:
    if workspace is None:
        return
    if not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.uint8 or workspace.dim() != 1:
        raise NpuOpError(f"{op}: workspace must be the 1-D uint8 tensor its get-workspace op returned")
    if workspace.numel() < _workspace_bytes(query):
        raise NpuOpError(f"{op}: workspace of {workspace.numel()} bytes, the launch needs {_workspace_bytes(query)}")


def _npu_fused_infer_attention_score_get_max_workspace(query, key, value, **options):
    """``_npu_fused_infer_attention_score_get_max_workspace(<the arguments of
    npu_fused_infer_attention_score>) -> Tensor``: the workspace a ``.out`` launch with these
    shapes needs, for any lengths up to the ones given (uint8, 1-D). Allocated before the launch so
    that a graph holds it."""
    return torch.empty(_workspace_bytes(query), dtype=torch.uint8, device=query.device)


_npu_fused_infer_attention_score_get_max_workspace.__signature__ = inspect.signature(
    fake_fia_ops.npu_fused_infer_attention_score)


def _npu_paged_attention_get_workspace(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value,
                                       block_table, context_lens, out):
    """``_npu_paged_attention_get_workspace(Tensor query, Tensor key_cache, Tensor value_cache, int
    num_kv_heads, int num_heads, float scale_value, Tensor block_table, Tensor context_lens,
    Tensor(a!) out) -> Tensor``: ATB PagedAttention's workspace for these shapes (uint8, 1-D)."""
    return torch.empty(_workspace_bytes(query), dtype=torch.uint8, device=query.device)


def npu_fused_infer_attention_score_out(query, key, value, *, workspace=None, out, **options):
    """``torch_npu.npu_fused_infer_attention_score.out(..., bool softmax_lse_flag=False, Tensor?
    workspace=None, Tensor[] out) -> (Tensor, Tensor)`` (the wheel's binding; the op's registered
    schema names the two outputs ``attention_out`` and ``softmax_lse``): the op written
    into ``out`` (``attention_out`` the query's shape and dtype; ``softmax_lse`` filled when
    ``softmax_lse_flag``, else left as given, e.g. vllm-ascend's 1-element placeholder), with the
    scratch memory ``workspace`` (from ``_npu_fused_infer_attention_score_get_max_workspace``)."""
    op = "npu_fused_infer_attention_score.out"
    if not (isinstance(out, (list, tuple)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        raise NpuOpError(f"{op}: out must be [attention_out, softmax_lse]")
    attention_out, softmax_lse = out
    if attention_out.shape != query.shape or attention_out.dtype != query.dtype or not attention_out.is_contiguous():
        raise NpuOpError(f"{op}: attention_out must be a contiguous {tuple(query.shape)} {query.dtype} tensor")
    _check_workspace(op, workspace, query)
    result, lse = fake_fia_ops.npu_fused_infer_attention_score(query, key, value, **options)
    attention_out.copy_(result)
    if options.get("softmax_lse_flag"):
        if softmax_lse.shape != lse.shape:
            raise NpuOpError(f"{op}: softmax_lse must be {tuple(lse.shape)} with softmax_lse_flag")
        softmax_lse.copy_(lse)
    return attention_out, softmax_lse


_fia_parameters = list(inspect.signature(fake_fia_ops.npu_fused_infer_attention_score).parameters.values())
npu_fused_infer_attention_score_out.__signature__ = inspect.Signature(_fia_parameters + [
    inspect.Parameter("workspace", inspect.Parameter.KEYWORD_ONLY, default=None),
    inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY)])

# Registered on the fake module beside fake_torch_npu.OPS; ``OUT_VARIANTS`` are reached as
# ``torch_npu.<op>.out``.
GRAPH_OPS = (_npu_fused_infer_attention_score_get_max_workspace, _npu_paged_attention_get_workspace)
OUT_VARIANTS = {"npu_fused_infer_attention_score": npu_fused_infer_attention_score_out}


__all__ = ["GRAPH_OPS", "OUT_VARIANTS", "FakeGraphApi", "FakeNPUGraph", "GraphCaptureError", "GraphReplayError", "METADATA_ARGS",
           "TaskGroupHandle", "is_host"]

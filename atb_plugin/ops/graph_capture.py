"""What the op kernels need while a device graph (NPU ACL graph, CUDA graph) is captured.

A captured step replays the device work recorded at capture: what a kernel decided on the host
then (a length list, whether a slot is padding) is frozen. So while ``capture(graph_params)`` is
active the kernels take their graph path: no host reads of device tensors, every buffer they
write allocated once, and whatever the attention op reads on the host (the NPU ops'
``actual_seq_lengths`` / ``context_lens``) launched inside a task group whose handle the kernel
leaves here as an update task. Before each replay the graph runner
(``atb_plugin/engine/graph_runner.py``) refreshes the static metadata buffers and calls
``GraphParams.update(metadata)``, which re-launches those ops with this step's host lengths
(torch_npu's ``graph_task_update_begin/end``; vllm-ascend's ``update_attn_params``).

Rules the graph path relies on (the runner guarantees them): one metadata object per captured
batch size, viewing the runner's static buffers; every slot valid (padded rows write the null
block, never -1); its host copies (``query_start_loc_cpu``, ``seq_lens_cpu``) are host tensors
whose values are this step's when ``update`` runs.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

_current: contextvars.ContextVar["GraphParams | None"] = contextvars.ContextVar("atb_plugin_graph_params",
                                                                                  default=None)


class GraphUnsupported(RuntimeError):
    """A kernel cannot run this step inside a graph (the runner falls back to eager)."""


class GraphParams:
    """One captured graph's update tasks and the scratch memory its kernels hold.

    ``tasks``: callables ``(metadata, stream)`` re-launching an op with this step's host
    parameters; ``workspaces``: per key, the workspace one launch sized at capture (shared by every
    layer's launch of the same shapes, as vllm-ascend shares one per batch size)."""

    def __init__(self, update_stream=None):
        self.tasks: list[Callable] = []
        self.workspaces: dict = {}
        self.update_stream = update_stream

    def workspace(self, key, make: Callable):
        if key not in self.workspaces:
            self.workspaces[key] = make()
        return self.workspaces[key]

    def add_task(self, task: Callable) -> None:
        self.tasks.append(task)

    def update(self, metadata) -> None:
        """Re-launch every task with ``metadata``'s host values (before each replay)."""
        for task in self.tasks:
            task(metadata, self.update_stream)


def capturing() -> GraphParams | None:
    """The graph being captured in this context, or None (eager)."""
    return _current.get()


@contextlib.contextmanager
def capture(params: GraphParams):
    """Kernels called inside take their graph path and leave their update tasks in ``params``."""
    token = _current.set(params)
    try:
        yield params
    finally:
        _current.reset(token)


__all__ = ["GraphParams", "GraphUnsupported", "capture", "capturing"]

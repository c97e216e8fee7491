"""Executors: how the engine core runs its model, on one device or on tensor-parallel ranks.

``base`` is the driver every backend shares (the two-stage start, calls on every rank, the
failure latch, shutdown, ``RankFailed``); the backends each import only ``base`` from here:

- ``uniproc``: TP = 1, the model in the core's own process;
- ``multiproc`` (``mp``): one rank process per device on this node, over a typed socket channel;
- ``ray``: ranks as Ray actors, on any node of a Ray cluster.

``make_executor`` picks one from the config; nothing in this package imports this module.
"""

from __future__ import annotations

from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.executor.base import Executor, RankFailed

__all__ = ["Executor", "RankFailed", "make_executor"]


def make_executor(config: EngineConfig) -> Executor:
    # The backends load when picked: Ray is an optional dependency, and a rank process (run as
    # ``python -m atb_plugin.engine.executor.multiproc``) must not have imported its own module
    # through this package first.
    if config.distributed_executor_backend == "ray":
        from atb_plugin.engine.executor.ray import RayExecutor

        return RayExecutor(config)
    if config.tensor_parallel_size == 1:
        from atb_plugin.engine.executor.uniproc import UniprocExecutor

        return UniprocExecutor(config)
    from atb_plugin.engine.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config)

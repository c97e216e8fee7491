"""``UniprocExecutor`` (TP = 1): the model on one device, in the engine core's own process.

The ``Worker`` is called directly — no extra process, no copy: the runner reads the scheduler's
own request objects. Its errors are the caller's as they are (a KV budget too small is a
``ValueError`` naming the fix, not a rank failure).
"""

from __future__ import annotations

import torch

from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.executor.base import Executor
from atb_plugin.engine.worker import Worker

__all__ = ["UniprocExecutor"]


class UniprocExecutor(Executor):
    """TP = 1: the worker lives here, the only rank."""

    def __init__(self, config: EngineConfig):
        torch.set_num_threads(config.num_threads)  # the engine owns the intra-op threads
        self.worker = Worker(config)
        super().__init__(config)
        self.runner = self.worker.runner

    def _start_ranks(self) -> None:
        pass

    def _rpc(self, method: str, args: tuple, what: str, leader_only: bool) -> list:
        return [getattr(self.worker, method)(*args)]

    def _stop_ranks(self, graceful: bool) -> None:
        self.worker.shutdown()

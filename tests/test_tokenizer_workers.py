"""The tokenizer pool's workers as the service starts them: one compute thread each (the cores
belong to the engine, docs/architecture.md "Threads"), whatever the machine has."""

from __future__ import annotations

import asyncio

from atb_plugin.engine.config import EngineConfig
from atb_plugin.frontend.tokenizer_pool import ChatJob, StatsJob, TokenizerPool, WorkerSettings
from atb_plugin.testing.tiny import tiny_checkpoint
from input_builders.media_config import MediaConfig


def test_workers_keep_one_compute_thread_and_build_ids():
    async def run():
        pool = TokenizerPool(WorkerSettings(EngineConfig(model=str(tiny_checkpoint("qwen2_vl"))), MediaConfig()), 2, None,
                             on_worker_death=lambda index, reason: None)
        await pool.start()
        try:
            replies = [await pool.call(StatsJob(), worker=worker) for worker in pool._workers]
            _, _, ids = await pool.call(ChatJob("r", [{"role": "user", "content": "hi"}]))
            return [stats for _, _, stats in replies], ids
        finally:
            await pool.shutdown()

    stats, ids = asyncio.run(run())
    assert [s["compute_threads"] for s in stats] == [1, 1]
    assert ids and min(ids) >= 0


def test_a_stuck_worker_is_killed_replaced_and_reported_by_the_health_check():
    import os
    import signal
    import time

    import pytest

    from atb_plugin.frontend.errors import RequestError

    async def run():
        pool = TokenizerPool(WorkerSettings(EngineConfig(model=str(tiny_checkpoint("qwen2"))), MediaConfig()), 1, None,
                             on_worker_death=lambda index, reason: None, stuck_after_s=1.0)
        await pool.start()
        try:
            first = pool._workers[0].process
            os.kill(first.pid, signal.SIGSTOP)  # a worker that never answers again
            start = time.monotonic()
            call = asyncio.ensure_future(pool.call(StatsJob()))
            await asyncio.sleep(1.5)
            problem = pool.health_problem()  # owes a reply for over the limit, or already being replaced
            with pytest.raises(RequestError, match="died while preparing"):
                await call
            waited = time.monotonic() - start
            while pool.health_problem() is not None:  # the replacement starts
                await asyncio.sleep(0.1)
            _, _, ids = await pool.call(ChatJob("r", [{"role": "user", "content": "hi"}]))
            return problem, waited, first.exitcode, ids
        finally:
            await pool.shutdown()

    problem, waited, exitcode, ids = asyncio.run(run())
    assert problem is not None and waited < 5.0
    assert exitcode == -signal.SIGKILL
    assert ids and min(ids) >= 0

"""The tokenizer pool's workers as the service starts them: one compute thread each (the cores
belong to the engine, docs/architecture.md "Threads"), whatever the machine has."""

from __future__ import annotations

import asyncio

from atb_plugin.engine.config import EngineConfig
from atb_plugin.frontend.tokenizer_pool import ChatJob, StatsJob, TokenizerPool, WorkerSettings
from atb_plugin.testing.tiny import tiny_checkpoint
from input_builders.media import MediaConfig


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

"""The shared-memory exchange under CPU tensor parallelism (``shm.exchange``): real processes, a
real segment. Every member reads every member's payload of every round (many rounds, so both
parities wrap many times, with members racing ahead of each other); the collectives of
``atb_plugin.distributed`` built on it give the same bits as gloo's; a member that dies is an
error naming it in the others, not a hang; no segment file is left at any point after set-up."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import socket
import time

import numpy as np
import pytest

from shm import exchange as shm_exchange

pytestmark = pytest.mark.skipif(not shm_exchange.supported(), reason="the exchange needs x86-64's store order")


def _files() -> list[str]:
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith("atbx_"))


def _member(rank: int, size: int, name: str, rounds: int, queue) -> None:
    try:
        ex = shm_exchange.ShmExchange.attach(name, rank, size, 4096)
        rng = random.Random(rank)
        seen = []
        for k in range(rounds):
            if rng.random() < 0.05:
                time.sleep(0.001)  # members fall behind and race ahead
            n = 1 + (k * 37) % 4000
            payload = np.full(n, (rank * 31 + k) % 251, dtype=np.uint8)
            views = ex.exchange(payload, timeout_s=30)
            seen.append(all(len(v) == n and (v == (r * 31 + k) % 251).all() for r, v in enumerate(views)))
        queue.put((rank, all(seen)))
        ex.close()
    except BaseException as error:  # noqa: BLE001 - reported to the test
        queue.put((rank, repr(error)))


def test_every_member_reads_every_payload_of_every_round():
    size, rounds = 3, 400
    host = shm_exchange.ShmExchange.create(0, size, 4096)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    members = [ctx.Process(target=_member, args=(rank, size, host.name, rounds, queue)) for rank in (1, 2)]
    for member in members:
        member.start()
    try:
        ok = []
        for k in range(rounds):
            n = 1 + (k * 37) % 4000
            views = host.exchange(np.full(n, k % 251, dtype=np.uint8), timeout_s=60)
            ok.append(all((v == (r * 31 + k) % 251).all() for r, v in enumerate(views)))
        assert all(ok)
        assert sorted(queue.get(timeout=60) for _ in members) == [(1, True), (2, True)]
    finally:
        for member in members:
            member.join(30)
        host.unlink()
        host.close()
    assert _files() == []


def _dies(name: str) -> None:
    ex = shm_exchange.ShmExchange.attach(name, 1, 2, 64)
    ex.exchange(np.zeros(8, np.uint8), timeout_s=30)
    os._exit(3)  # gone before the second round


def test_a_member_that_dies_is_an_error_naming_it():
    host = shm_exchange.ShmExchange.create(0, 2, 64)
    process = mp.get_context("spawn").Process(target=_dies, args=(host.name,))
    process.start()
    try:
        host.exchange(np.zeros(8, np.uint8), timeout_s=30)
        with pytest.raises(RuntimeError, match=rf"rank 1 \(pid {process.pid}\) exited while rank 0 waited"):
            host.exchange(np.zeros(8, np.uint8), timeout_s=30)
    finally:
        process.join(30)
        host.unlink()
        host.close()
    assert process.exitcode == 3 and _files() == []


def test_wrong_arguments_are_refused():
    with pytest.raises(ValueError, match="size >= 2"):
        shm_exchange.ShmExchange.create(0, 1, 64)
    with pytest.raises(ValueError, match="multiple of 64"):
        shm_exchange.ShmExchange.create(0, 2, 100)
    with pytest.raises(ValueError, match="not an exchange segment name"):
        shm_exchange.ShmExchange.attach("psm_abcd", 1, 2, 64)
    host = shm_exchange.ShmExchange.create(0, 2, 64)
    try:
        with pytest.raises(ValueError, match="does not fit a slot of 64"):
            host.exchange(np.zeros(65, np.uint8), timeout_s=1)
        with pytest.raises(ValueError, match="does not have the size"):
            shm_exchange.ShmExchange.attach(host.name, 1, 2, 128)
    finally:
        host.unlink()
        host.close()
    assert _files() == []


def _collectives(rank: int, size: int, port: int, queue) -> None:
    import torch

    from atb_plugin import distributed

    try:
        results = {}
        for mode in ("exchange", "gloo"):
            distributed.init_tensor_parallel(rank, size, "gloo", f"tcp://127.0.0.1:{port + (mode == 'gloo')}", 60,
                                             same_node=mode == "exchange")
            assert (distributed._group.exchange is not None) == (mode == "exchange")
            if mode == "exchange":
                results["files_while_running"] = _files()
            gen = torch.Generator().manual_seed(rank)
            out = []
            for shape, dtype in (((1, 576), torch.float32), ((32, 576), torch.bfloat16), ((3, 7), torch.float32),
                                 ((1100, 1024), torch.float32)):  # the last does not fit a slot: gloo in both modes
                x = torch.randn(shape, generator=gen).to(dtype)
                out.append(distributed.all_reduce(x.clone()))
                out.append(distributed.all_gather(x, dim=-1))
                out.append(distributed.all_gather(x, dim=0))
            results[mode] = out
            distributed.destroy_tensor_parallel()
        same = all(torch.equal(a, b) for a, b in zip(results["exchange"], results["gloo"]))
        queue.put((rank, same, results["files_while_running"], [t.sum().item() for t in results["exchange"]]))
    except BaseException as error:  # noqa: BLE001 - reported to the test
        queue.put((rank, repr(error), None, None))


def _free_port_pair() -> int:
    while True:
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port


@pytest.mark.slow  # two spawned ranks, two process groups
def test_the_collectives_through_it_equal_gloo_bit_for_bit():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port_pair()
    ranks = [ctx.Process(target=_collectives, args=(rank, 2, port, queue)) for rank in range(2)]
    for rank in ranks:
        rank.start()
    try:
        results = sorted(queue.get(timeout=240) for _ in ranks)
    finally:
        for rank in ranks:
            rank.join(30)
    assert [r[1] for r in results] == [True, True], results
    assert [r[2] for r in results] == [[], []]  # unlinked once both had mapped it
    assert results[0][3] == results[1][3]  # the same bits on both ranks
    assert _files() == []

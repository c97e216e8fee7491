"""The reaper removes a dead instance's segments and nothing else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from multiprocessing import shared_memory

import numpy as np

import shm
from shm.process import ProcessIdentity, _start_time
from shm.segment import (
    HEADER_SIZE,
    list_segment_names,
    marker_name,
    segment_name,
    unlink_segment,
    write_segment,
)
from tests.helpers import REPO_ROOT, run_python, shm_path


def names_of(instance_id: str) -> set[str]:
    return {n for n in list_segment_names() if n.startswith("psm_" + instance_id)}


def crashed_instance() -> tuple[str, set[str]]:
    """A store in another process that puts two arrays and dies without closing."""
    result = run_python("""
        import os, numpy as np, shm
        store = shm.ShmStore()
        store.put(np.ones((3, 4), np.float32), key="a", request_id="r")
        store.put(np.ones(5, np.int64), key="b")
        print(store.instance_id, flush=True)
        os._exit(0)  # no close(), no finalizers: like a SIGKILL
    """)
    assert result.returncode == 0, result.stderr
    instance_id = result.stdout.strip()
    names = names_of(instance_id)
    assert len(names) == 3  # marker + two segments
    return instance_id, names


def test_new_store_reaps_a_dead_instance():
    instance_id, names = crashed_instance()
    with shm.ShmStore() as store:
        assert set(store.reaped) >= names
    assert names_of(instance_id) == set()


def test_reaper_spares_live_instances_and_other_programs():
    dead_id, dead_names = crashed_instance()
    # A live instance in another process, blocked on stdin until we let it go.
    live = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, numpy as np, shm\n"
            "store = shm.ShmStore(shm.ShmStoreConfig(reap_on_start=False))\n"
            "store.put(np.ones(4, np.float32), request_id='r')\n"
            "print(store.instance_id, flush=True)\n"
            "sys.stdin.read()\n"
            "store.close()\n"
        )],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )
    live_id = live.stdout.readline().strip()
    python_default = shared_memory.SharedMemory(create=True, size=64)  # psm_<8 hex>: not ours
    lookalike = segment_name("0000", 1)  # our naming pattern, foreign bytes
    with open(shm_path(lookalike), "wb") as foreign:
        foreign.write(b"\x01" * (HEADER_SIZE + 8))
    try:
        with shm.ShmStore(shm.ShmStoreConfig(reap_on_start=False)) as own:
            own.put(np.ones(2, np.float32), request_id="r")
            reaped = shm.reap_orphans()
            assert set(reaped) == dead_names
            assert len(names_of(live_id)) == 2  # its marker and its segment
            assert len(names_of(own.instance_id)) == 2
        assert os.path.exists(shm_path(python_default.name.lstrip("/")))
        assert os.path.exists(shm_path(lookalike))
    finally:
        live.communicate("", timeout=30)
        python_default.close()
        python_default.unlink()
        unlink_segment(lookalike)
    assert names_of(live_id) == set() and names_of(dead_id) == set()


def dead_owner_with_a_live_pid() -> ProcessIdentity:
    """Our own pid with another start time: the pid was reused, the original owner is gone."""
    me = ProcessIdentity.current()
    return ProcessIdentity(me.pid, me.start_time + 1)


def test_a_reused_pid_does_not_keep_a_dead_instance_alive():
    impostor = dead_owner_with_a_live_pid()
    assert not impostor.is_alive() and ProcessIdentity.current().is_alive()
    instance_id = "pAsm"
    write_segment(marker_name(instance_id), None, instance_id, impostor)
    write_segment(segment_name(instance_id, 0), np.zeros(3, np.float32), instance_id, impostor)
    reaped = shm.reap_orphans()
    assert set(reaped) == {marker_name(instance_id), segment_name(instance_id, 0)}


def test_an_unfinished_write_is_reaped_only_for_a_known_dead_instance():
    dead = dead_owner_with_a_live_pid()
    dead_instance, unknown_instance = "dEAd", "nw00"
    write_segment(marker_name(dead_instance), None, dead_instance, dead)
    torn = [segment_name(dead_instance, 9), segment_name(unknown_instance, 9)]
    for name in torn:  # created, never committed: no header
        with open(shm_path(name), "wb") as partial:
            partial.write(b"\x00" * 256)
    try:
        reaped = shm.reap_orphans()
        assert set(reaped) == {marker_name(dead_instance), torn[0]}
        assert os.path.exists(shm_path(torn[1]))  # no marker says its owner is dead: spared
    finally:
        for name in torn:
            unlink_segment(name)


def test_killed_process_is_dead():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        identity = ProcessIdentity(child.pid, _start_time(child.pid))
        assert identity.is_alive()
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        assert not identity.is_alive()
    finally:
        child.kill()
        child.wait()


def test_reap_command_line():
    instance_id, names = crashed_instance()
    listed = run_python("import runpy, sys; sys.argv = ['shm', 'list']; runpy.run_module('shm', run_name='__main__')")
    assert f"psm_{instance_id}  pid" in listed.stdout and "(DEAD)" in listed.stdout
    reaped = run_python("import runpy, sys; sys.argv = ['shm', 'reap']; runpy.run_module('shm', run_name='__main__')")
    assert reaped.returncode == 0, reaped.stderr
    assert names <= set(reaped.stdout.split())
    assert names_of(instance_id) == set()

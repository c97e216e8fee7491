"""``AdoptedSegments``: a dead instance's segments that running requests still read.

A store's process can die while requests it built are still running (a media worker killed for a
job that overran its decode budget). Their segments must outlive it until those requests end, or
a preemption's recompute would find them gone. The process that knows the requests (the server's
API process) adopts them::

    adopt(instance, {lease key: names}) ── the instance's marker now names this process: the reaper
                                           spares the instance; its other segments are unlinked now
    release(lease key)                  ── names no other adopted lease holds are unlinked; the last
                                           one's release unlinks the marker too
    close()                             ── unlinks all that is left (also at exit)

The segments themselves are not rewritten: their headers still name the instance that wrote them,
which is what readers verify (``read_array``'s instance check). If this process dies in turn, the
marker names a dead owner and the next reaper removes the lot.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Hashable, Iterable, Mapping

from shm.process import ProcessIdentity
from shm.segment import list_segment_names, marker_name, parse_name, take_over_marker, unlink_segment

logger = logging.getLogger("shm")


def _unlink_all(refs: dict, instances: dict, owner_pid: int) -> None:
    """Finalizer: runs on close(), garbage collection or interpreter exit; never touches self."""
    if os.getpid() != owner_pid:
        return  # a forked child exiting: the segments are its parent's
    for name in list(refs):
        unlink_segment(name)
    refs.clear()
    for instance_id in list(instances):
        unlink_segment(marker_name(instance_id))
    instances.clear()


class AdoptedSegments:
    """The segments of dead instances held for the leases (any hashable key) still using them.

    Thread-safe.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._names: dict[Hashable, list[str]] = {}  # lease key -> its segments
        self._refs: dict[str, int] = {}  # segment -> adopted leases holding it
        self._instances: dict[str, int] = {}  # instance id -> its segments still held
        self._finalizer = weakref.finalize(self, _unlink_all, self._refs, self._instances, os.getpid())

    def adopt(self, instance_id: str, leases: Mapping[Hashable, Iterable[str]]) -> bool:
        """Keep the segments of ``leases`` (names of ``instance_id``, whose process is dead) until
        each lease is released; unlink the instance's other segments. False when the instance was
        reaped already: its segments are gone."""
        leases = {key: sorted({name for name in names if _instance_of(name) == instance_id})
                  for key, names in leases.items()}
        kept = {name for names in leases.values() for name in names}
        if kept:  # else nothing to keep: the next reaper removes the instance
            if not take_over_marker(instance_id, ProcessIdentity.current()):
                logger.warning("shm: instance %s was reaped before it could be adopted", instance_id)
                return False
            present = {name for name in list_segment_names() if _instance_of(name) == instance_id}
            for name in present - kept:
                unlink_segment(name)  # cached, or a write the dead process never finished
            missing = sorted(kept - present)
            if missing:
                logger.warning("shm: adopted segments of instance %s were already gone: %s", instance_id, missing)
        with self._lock:
            for key, names in leases.items():
                self._names[key] = names
                for name in names:
                    self._refs[name] = self._refs.get(name, 0) + 1
            if kept:
                self._instances[instance_id] = self._instances.get(instance_id, 0) + len(kept)
        return True

    def holds(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._names

    def release(self, key: Hashable) -> bool:
        """End adopted lease ``key``: unlink what no other adopted lease holds (and a marker whose
        segments are all gone). False if ``key`` is not an adopted lease."""
        with self._lock:
            names = self._names.pop(key, None)
            if names is None:
                return False
            victims = []
            for name in names:
                self._refs[name] -= 1
                if self._refs[name]:
                    continue
                del self._refs[name]
                victims.append(name)
                instance_id = _instance_of(name)
                self._instances[instance_id] -= 1
                if not self._instances[instance_id]:
                    del self._instances[instance_id]
                    victims.append(marker_name(instance_id))
        for name in victims:  # markers last: a reaper then never sees a marker-less segment of ours
            unlink_segment(name)
        return True

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._refs)

    def close(self) -> None:
        """Unlink every adopted segment and marker. Idempotent."""
        with self._lock:
            self._names.clear()
            self._finalizer()


def _instance_of(name: str) -> str | None:
    parsed = parse_name(name)
    return None if parsed is None or parsed[1] else parsed[0]

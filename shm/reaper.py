"""Unlink segments left behind by dead atb-plugin instances (a crash, a SIGKILL).

Only names that follow our scheme are looked at, only headers with our magic are believed, and a
segment is removed only when its owner process (pid + start time) is gone. Segments of live
instances and of other programs are never touched.
"""

from __future__ import annotations

from shm.errors import ShmHandleError
from shm.segment import list_segment_names, parse_name, read_header, unlink_segment


def reap_orphans() -> list[str]:
    """Unlink every segment (and instance marker) owned by a dead instance; return their names."""
    names = list_segment_names()
    live_instances: set[str] = set()
    dead_instances: set[str] = set()
    for name in names:
        instance_id, is_marker = parse_name(name)
        if not is_marker:
            continue
        try:
            header = read_header(name)
        except ShmHandleError:
            continue  # not ours, or a marker still being written
        if header.instance_id != instance_id:
            continue
        (live_instances if header.owner.is_alive() else dead_instances).add(instance_id)

    reaped = []
    for name in names:
        instance_id, is_marker = parse_name(name)
        if is_marker or instance_id in live_instances:
            continue
        try:
            header = read_header(name)
        except ShmHandleError:
            # No valid header: a write cut short. Ours to remove only if its instance is known dead.
            if instance_id in dead_instances and unlink_segment(name):
                reaped.append(name)
            continue
        if header.instance_id == instance_id and not header.owner.is_alive():
            if unlink_segment(name):
                reaped.append(name)
    for instance_id in sorted(dead_instances):
        name = "psm_" + instance_id
        if unlink_segment(name):
            reaped.append(name)
    return reaped

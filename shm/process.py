"""Who owns a segment: a pid plus the process start time, so a recycled pid is not mistaken for
the original owner (the reaper must never spare a dead instance's segments because an unrelated
process now has the same pid, nor reap a live instance's)."""

from __future__ import annotations

import os
from dataclasses import dataclass


def _stat_fields(pid: int) -> list[bytes] | None:
    """Fields 3.. of /proc/PID/stat (state first), or None where there is no such entry."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            stat = stat_file.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself contain spaces or ')'.
    return stat[stat.rindex(b")") + 2:].split()


def _start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22), or None."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[19])


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start_time: int  # 0 where /proc is unavailable: then only the pid is compared

    @classmethod
    def current(cls) -> "ProcessIdentity":
        return cls(os.getpid(), _start_time(os.getpid()) or 0)

    def is_alive(self) -> bool:
        if self.pid <= 0:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # exists, owned by another user
        fields = _stat_fields(self.pid)
        if fields is None:
            return True  # no /proc here: kill() found the pid, so rather spare than reap
        if fields[0] in (b"Z", b"X"):
            return False  # exited, only waiting to be collected by its parent
        return self.start_time == 0 or int(fields[19]) == self.start_time

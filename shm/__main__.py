"""Operator commands: ``python -m shm list`` shows atb-plugin segments in /dev/shm with their
owners; ``python -m shm reap`` unlinks those whose owner process is gone."""

from __future__ import annotations

import argparse

from shm.errors import ShmHandleError
from shm.reaper import reap_orphans
from shm.segment import list_segment_names, parse_name, read_header


def _list() -> None:
    for name in list_segment_names():
        try:
            header = read_header(name)
        except ShmHandleError as error:
            print(f"{name}  ?  {error}")
            continue
        kind = "marker" if parse_name(name)[1] else f"{header.dtype} {list(header.shape)}"
        state = "live" if header.owner.is_alive() else "DEAD"
        print(f"{name}  pid {header.owner.pid} ({state})  {kind}  {header.payload_nbytes} bytes")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m shm", description=__doc__)
    parser.add_argument("command", choices=["list", "reap"])
    args = parser.parse_args()
    if args.command == "list":
        _list()
    else:
        reaped = reap_orphans()
        print("\n".join(reaped) if reaped else "nothing to reap")


if __name__ == "__main__":
    main()

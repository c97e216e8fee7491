"""Media for ranks on another node than the engine core (docs/architecture.md, "Multi-node ranks on Ray").

``/dev/shm`` is per node: a rank placed on another machine cannot open the segments the frontend
wrote next to the engine core. For such ranks the core reads the arrays itself, once per step,
and ships them inside the step (``SchedulerOutput.shipped_media``); the remote rank's runner
reads the handles from there instead of from shared memory. Ranks on the core's node keep the
zero-copy shared-memory path.

A handle the core could not read is shipped as the reason (a string): the remote rank then fails
that request with the same message a local rank gets from ``shm``, so every rank of the group
agrees on which requests failed and none of them runs a step the others skip.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

import numpy as np

import shm

#: ``(NAME, SHAPE)`` slot values -> the array they name, or why it could not be read.
ShippedMedia = dict[tuple[int, int], "np.ndarray | str"]
#: ``read(name_value, shape_value, expected_instance) -> array``: how a runner reloads a block.
MediaReader = Callable[[int, int, "str | Collection[str] | None"], np.ndarray]


def read_shared_memory(name_value: int, shape_value: int, expected_instance) -> np.ndarray:
    """The zero-copy path: a copy-on-write view of the segment (the model may not write into
    shared pages)."""
    return shm.read_array(name_value, shape_value, expected_instance=expected_instance, writable=True)


def media_handles(prompt_ids: Iterable[int]) -> list[tuple[int, int]]:
    """The ``(NAME, SHAPE)`` pair of every media block in a prompt: every block starts with a run
    of metadata ids (< 0, docs/wire-format.md) whose first two are NAME and SHAPE, and blocks never
    share a run (placeholders, >= 0, follow each block's metadata)."""
    ids = np.asarray(list(prompt_ids), dtype=np.int64)
    negative = ids < 0
    starts = np.flatnonzero(negative & ~np.concatenate(([False], negative[:-1])))
    return [(int(ids[s]), int(ids[s + 1])) for s in starts if s + 1 < len(ids) and ids[s + 1] < 0]


def ship(prompts: Iterable[tuple[list[int], "str | Collection[str] | None"]]) -> ShippedMedia:
    """Read every block of ``prompts`` (each ``(prompt ids, the shm instances it may read)``) from
    this node's shared memory into owned arrays (pickled into the step); a handle that does not
    read is kept as its error message."""
    shipped: ShippedMedia = {}
    for prompt_ids, instances in prompts:
        for handle in media_handles(prompt_ids):
            if handle in shipped:
                continue
            try:
                shipped[handle] = np.array(shm.read_array(*handle, expected_instance=instances))
            except shm.ShmHandleError as error:
                shipped[handle] = str(error)
    return shipped


def shipped_reader(shipped: ShippedMedia | None) -> MediaReader:
    """A runner's reader over what the core shipped with the step: the array (a private copy), or
    ``shm.ShmHandleError`` with the core's message (or saying the core shipped nothing for it)."""

    def read(name_value: int, shape_value: int, expected_instance) -> np.ndarray:
        found = (shipped or {}).get((name_value, shape_value))
        if found is None:
            raise shm.ShmHandleError("this rank runs on another node than the engine core and the step "
                                     "carried no pixels for this handle")
        if isinstance(found, str):
            raise shm.ShmHandleError(found)
        return found

    return read

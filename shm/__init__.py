"""Shared-memory transport: the only code in atb-plugin that touches shared memory.

- codec: int64 encodings of segment names and shapes, value-identical to MindIE-LLM's
  ``atb_llm/utils/shm_utils.py`` (``encode_shm_name_to_int64`` and friends);
- segment: the segment format (header + payload), writing, and zero-copy read-only reading
  (``read_array``);
- store: ``ShmStore``, one per service instance: dedup by key, leases per request, LRU of
  unleased segments, cleanup on close;
- reaper: removes segments of dead instances;
- adoption: ``AdoptedSegments``, a dead instance's segments kept for the requests still reading
  them, by the process that adopts them.

Depends on the standard library and numpy only.
"""

from shm.adoption import AdoptedSegments
from shm.codec import (
    ALPHABET,
    MAX_NAME_CHARS,
    SHAPE_WIDTHS,
    decode_shape_from_int64,
    decode_shm_name_from_int64,
    encode_shape_to_int64,
    encode_shm_name_to_int64,
)
from shm.errors import ShmHandleError, ShmStoreFullError
from shm.reaper import reap_orphans
from shm.segment import SegmentPayload, ShmReader, list_segment_names, read_array
from shm.store import ShmHandle, ShmStore, ShmStoreConfig

__all__ = [
    "ALPHABET",
    "AdoptedSegments",
    "MAX_NAME_CHARS",
    "SHAPE_WIDTHS",
    "SegmentPayload",
    "ShmHandle",
    "ShmHandleError",
    "ShmReader",
    "ShmStore",
    "ShmStoreConfig",
    "ShmStoreFullError",
    "decode_shape_from_int64",
    "decode_shm_name_from_int64",
    "encode_shape_to_int64",
    "encode_shm_name_to_int64",
    "list_segment_names",
    "reap_orphans",
    "read_array",
]

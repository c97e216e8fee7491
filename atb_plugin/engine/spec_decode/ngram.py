"""``NgramProposer``: prompt lookup decoding. The last n tokens of a sequence (n from
``prompt_lookup_max`` down to ``prompt_lookup_min``) are looked up earlier in the sequence; the
tokens that followed their earliest occurrence are the drafts. Vectorised with numpy: one
comparison of the sequence's sliding windows against the suffix per n, no loop per token."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min <= max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, request_ids: Sequence[str], token_ids: Sequence[Sequence[int]],
                max_drafts: Sequence[int]) -> list[list[int]]:
        return [self.propose_one(np.asarray(ids, dtype=np.int64), k) if k > 0 else []
                for ids, k in zip(token_ids, max_drafts)]

    def propose_one(self, tokens: np.ndarray, k: int) -> list[int]:
        """At most ``k`` drafts after ``tokens`` (1-D int64). The earliest occurrence gives the
        longest continuation to copy; a continuation stops short of any media handle (negative
        id): a placeholder is never proposed."""
        length = tokens.shape[0]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n:]
            if (suffix < 0).any():
                continue  # a media handle never starts a match: its block is not text to repeat
            # Window i is tokens[i:i + n], followed by tokens[i + n]; the suffix itself is excluded.
            windows = sliding_window_view(tokens[:length - 1], n)
            # Whole windows are compared only where their first token matches: comparing every
            # window was most of a call's time on a long sequence (it runs per request per step).
            starts = np.flatnonzero(windows[:, 0] == suffix[0])
            hits = starts[(windows[starts] == suffix).all(axis=1)]
            if hits.size == 0:
                continue
            start = int(hits[0]) + n
            drafts = tokens[start:start + k]
            media = np.flatnonzero(drafts < 0)
            if media.size:
                drafts = drafts[:media[0]]
            return drafts.tolist()
        return []

"""N-gram prompt lookup over a request's own tokens.

Runs in worker processes. The longest suffix of the tokens (``max_n`` down to ``min_n`` long)
that also occurs earlier is looked up; the tokens that followed its first occurrence are the
draft. Text that quotes its input (code edits, retrieval answers, summaries) continues the way
the quoted passage did, so the draft is often right, and a lookup costs no model call.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the first earlier occurrence of the longest matching
    suffix of ``tokens`` (1-D ints); [] when no suffix of ``min_n`` tokens or more recurs.

    The first occurrence rather than the latest: in a copy, the latest is usually inside the
    text being written, whose continuation is what is being guessed. O(len(tokens) * n) numpy
    work per length tried; no Python loop over tokens.
    """
    num_tokens = len(tokens)
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        # Windows starting at 0 .. num_tokens - n - 1: every n-gram but the suffix itself.
        windows = sliding_window_view(tokens[:-1], n)
        matches = np.flatnonzero((windows == tokens[num_tokens - n :]).all(axis=1))
        if matches.size:
            start = int(matches[0]) + n
            return tokens[start : start + k].tolist()
    return []

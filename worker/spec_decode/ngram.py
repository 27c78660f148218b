"""N-gram prompt lookup over a request's own tokens.

Runs in worker processes. The longest suffix of the tokens (``max_n`` down to ``min_n`` long)
that also occurs earlier is looked up; the tokens that followed its first occurrence are the
draft. Text that quotes its input (code edits, retrieval answers, summaries) continues the way
the quoted passage did, so the draft is often right, and a lookup costs no model call.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the first earlier occurrence of the longest matching
    suffix of ``tokens`` (1-D ints); [] when no suffix of ``min_n`` tokens or more recurs.

    The first occurrence rather than the latest: in a copy, the latest is usually inside the
    text being written, whose continuation is what is being guessed.

    The search is a byte-string search of the suffix's bytes in the earlier tokens' bytes
    (a hit must start on a token's first byte): C-speed substring search, a few microseconds on
    a 900-token copy prompt where comparing every window with numpy took ~28.
    """
    longest = min(max_n, len(tokens) - 1)
    width = tokens.itemsize
    data = tokens.tobytes()
    earlier = data[:-width]  # a match must end before the suffix's own last token
    for n in range(longest, max(min_n, 1) - 1, -1):
        suffix = data[len(data) - n * width :]
        at = earlier.find(suffix)
        while at >= 0 and at % width:
            at = earlier.find(suffix, at + 1)
        if at >= 0:
            start = at // width + n
            return tokens[start : start + k].tolist()
    return []

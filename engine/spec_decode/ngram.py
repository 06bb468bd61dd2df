"""n-gram prompt lookup: drafts for a request from its own tokens, no weights. The longest suffix of the
request's tokens (prompt_lookup_max tokens, down to prompt_lookup_min) that occurred earlier proposes the
tokens that followed that occurrence (the latest one). Pays where the answer copies from the prompt: edits,
summaries, code with repeated names."""
from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` draft tokens after `tokens` (int64 [L]); none where no suffix of at least `min_n` tokens
    occurred before. Candidates are the earlier positions of the last token, so the cost is one pass over
    the tokens plus a few comparisons per candidate."""
    length = len(tokens)
    if length < min_n + 1 or k <= 0:
        return []
    candidates = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])  # where an occurrence would end
    if not len(candidates):
        return []
    # matched[i]: how many tokens, back from candidate i, equal the suffix (1: the last token only).
    matched = np.ones(len(candidates), dtype=np.int64)
    alive = np.ones(len(candidates), dtype=bool)
    for back in range(1, max_n):
        before = candidates - back
        alive &= before >= 0
        if not alive.any():
            break
        same = np.zeros(len(candidates), dtype=bool)
        same[alive] = tokens[before[alive]] == tokens[length - 1 - back]
        alive &= same
        matched += alive
    best = matched.max()
    if best < min_n:
        return []
    end = candidates[np.flatnonzero(matched == best)[-1]]  # the latest of the longest matches
    return tokens[end + 1:end + 1 + k].tolist()

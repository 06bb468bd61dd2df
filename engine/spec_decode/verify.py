"""Which drafted tokens a verify step keeps.

Every drafter here drafts deterministically (n-gram lookup now; greedy MTP and EAGLE heads later), so the
draft distribution q is one token with probability 1. The target then samples each of the k + 1 positions
exactly as a step without speculation would sample that output position: the same processors (temperature,
top-k/top-p/min-p, penalties over the output so far including the earlier drafts, min-tokens suppression)
and the same per-position seed (engine/kernels/sampling.py `step_seed`). A draft is kept while the target's
token equals it; the first disagreement emits the target's token and ends the run; when every draft is kept,
the target's token after the last one is the bonus.

This is rejection sampling for a one-token q: a draft x is kept with probability p(x) = min(1, p(x) / q(x)),
and a rejected position emits a token drawn from p without x, which is (p - q)+ normalised. So the output has
the target's distribution exactly, greedy requests get the tokens of a run without speculation, and seeded
requests get the very tokens their seed gives without speculation (each position is drawn with the seed of its
output index), whatever was drafted."""
from __future__ import annotations


def num_accepted(sampled: list[int], drafts: list[int]) -> int:
    """How many leading drafts the target's tokens (one per drafted position, plus one) agree with."""
    count = 0
    for target, draft in zip(sampled, drafts):
        if target != draft:
            break
        count += 1
    return count


def emitted_tokens(sampled: list[int], drafts: list[int]) -> list[int]:
    """The tokens a verify step appends: the kept drafts, then the target's token after them (len >= 1)."""
    assert len(sampled) == len(drafts) + 1, (len(sampled), len(drafts))
    return sampled[:num_accepted(sampled, drafts) + 1]

"""The lockstep of data-parallel ranks whose MoE layers exchange tokens: before each step, every DP rank's
engine says whether it has work, how many tokens its step runs and how it can run it (a decode graph,
prompt-step graphs, or only eagerly), and all take the largest of each. Then every rank steps (one with
nothing to run steps a dummy batch), the MoE exchanges of all ranks pad to the same token count, and all
replay the decode graph of one size, or all replay the prompt-step chain of one bucket, or all run eagerly
(engine/runner/cuda_graphs.py step_path); a rank that stops stops all. While all are idle, nobody steps
and the device stays idle.

The agreement is one all-reduce of four integers among the DP leaders over gloo, made after the step is
scheduled and before it is launched, while the device still runs the step launched before (the engine
runs one step ahead on GPUs): its cost is host time that overlaps device time. `stats()` says what it cost.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

IDLE, BUSY, STOP = 0, 1, 2
# How a rank can run its step, in the order the group falls back: every rank takes the largest.
DECODE_GRAPH, PROMPT_GRAPHS, EAGER = 0, 1, 2


@dataclass(frozen=True)
class StepAgreement:
    status: int       # IDLE: no rank has work; BUSY: every rank steps; STOP: some rank stops, so all do
    num_tokens: int   # the most tokens any DP rank runs in this step
    mode: int         # DECODE_GRAPH, PROMPT_GRAPHS (some rank's step is not decode-only) or EAGER (some rank
                      # has no graph for its step): every rank runs the step that way

    @property
    def eager(self) -> bool:
        return self.mode == EAGER


class Lockstep:
    def __init__(self) -> None:
        self.num_votes = 0
        self.total_s = 0.0
        self.slowest_s = 0.0

    def agree(self, status: int, num_tokens: int, mode: int, without_prompt_graphs: bool = False) -> StepAgreement:
        """`without_prompt_graphs`: this rank has no prompt-step graphs (their capture failed), so a step the
        others would run from them runs eagerly on every rank."""
        from engine.parallel import dp_agree
        started = time.perf_counter()
        agreed = dp_agree([status, num_tokens, mode, int(without_prompt_graphs)])
        if agreed[2] == PROMPT_GRAPHS and agreed[3]:
            agreed[2] = EAGER
        elapsed = time.perf_counter() - started
        self.num_votes += 1
        self.total_s += elapsed
        self.slowest_s = max(self.slowest_s, elapsed)
        return StepAgreement(agreed[0], agreed[1], agreed[2])

    def stats(self) -> dict:
        return {"lockstep_votes": self.num_votes,
                "lockstep_vote_us_mean": 1e6 * self.total_s / self.num_votes if self.num_votes else 0.0,
                "lockstep_vote_us_max": 1e6 * self.slowest_s}

"""The lockstep of data-parallel ranks whose MoE layers exchange tokens: before each step, every DP rank's
engine says whether it has work, how many tokens its step runs and whether it must run eagerly, and all
take the largest of each. Then every rank steps (one with nothing to run steps a dummy batch), the MoE
exchanges of all ranks pad to the same token count, and all replay CUDA graphs of one size or all run
eagerly; a rank that stops stops all. While all are idle, nobody steps and the device stays idle.

The agreement is one all-reduce of three integers among the DP leaders over gloo, made after the step is
scheduled and before it is launched, while the device still runs the step launched before (the engine
runs one step ahead on GPUs): its cost is host time that overlaps device time. `stats()` says what it cost.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

IDLE, BUSY, STOP = 0, 1, 2


@dataclass(frozen=True)
class StepAgreement:
    status: int       # IDLE: no rank has work; BUSY: every rank steps; STOP: some rank stops, so all do
    num_tokens: int   # the most tokens any DP rank runs in this step
    eager: bool       # some DP rank runs this step eagerly (a prefill, or a batch above the graphs), so all do


class Lockstep:
    def __init__(self) -> None:
        self.num_votes = 0
        self.total_s = 0.0
        self.slowest_s = 0.0

    def agree(self, status: int, num_tokens: int, eager: bool) -> StepAgreement:
        from engine.parallel import dp_agree
        started = time.perf_counter()
        agreed = dp_agree([status, num_tokens, int(eager)])
        elapsed = time.perf_counter() - started
        self.num_votes += 1
        self.total_s += elapsed
        self.slowest_s = max(self.slowest_s, elapsed)
        return StepAgreement(agreed[0], agreed[1], bool(agreed[2]))

    def stats(self) -> dict:
        return {"lockstep_votes": self.num_votes,
                "lockstep_vote_us_mean": 1e6 * self.total_s / self.num_votes if self.num_votes else 0.0,
                "lockstep_vote_us_max": 1e6 * self.slowest_s}

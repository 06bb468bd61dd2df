"""A request continued on this engine after the engine that ran it failed (atom_ray's data-parallel failover):
what it had already delivered to its client, sample by sample.

The engine takes the delivered tokens as outputs already generated, exactly as after a preemption: they are
prefilled with the prompt (prefix caching reuses whatever blocks this engine has), and everything that
counts outputs counts them too: the seed of each output position (engine.kernels.sampling.step_seed),
the repetition, frequency and presence penalties, min_tokens, max_tokens, stop strings (the text of the
delivered tokens is rebuilt, so a stop string that starts before the resume is found) and a grammar (which
takes the delivered tokens before the first new one). So a greedy or seeded sample continues with the
tokens an undisturbed run draws; the continuation's outputs carry only what is new."""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class ResumedSample:
    index: int  # its place among the request's n samples
    token_ids: tuple[int, ...]  # output tokens already delivered
    num_sent_chars: int = 0  # characters of their text already delivered (text held back is not)


@dataclass(frozen=True)
class ResumeState:
    """The samples to continue; a request's samples that are not listed had finished."""
    samples: tuple[ResumedSample, ...]

    @property
    def max_num_tokens(self) -> int:
        """The most tokens any sample already has: what its prefill adds to the prompt."""
        return max((len(sample.token_ids) for sample in self.samples), default=0)

    def check(self, n: int, vocab_size: int) -> None:
        """Refuse, saying what is wrong, a state that does not fit a request of `n` samples."""
        indices = [sample.index for sample in self.samples]
        if not indices or len(set(indices)) != len(indices) or not all(0 <= i < n for i in indices):
            raise InvalidRequestError(f"a resumed request continues distinct samples among its n={n}, not {indices}")
        for sample in self.samples:
            bad = [t for t in sample.token_ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(f"resumed token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
            if sample.num_sent_chars < 0:
                raise InvalidRequestError("a resumed sample's num_sent_chars must be >= 0")

"""What the DPCoordinator keeps per live request so that another DP rank can continue it when its own fails:
the prompt's token ids, the sampling parameters and, per sample, the token ids and the characters of text
delivered to the client, whether it finished (token ids and counts only: no KV, no logits). From that it
builds the continuation (engine/resume.py) and rewrites the continuation's outputs so that the client sees
one stream: no second prompt, the first cache hit, metrics that span the whole request. The Serve replicas
keep the same record per stream, for failover across replicas (deployments/replica_failover.py)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.outputs import RequestMetrics
from engine.resume import ResumedSample, ResumeState
from engine.sampling_params import SamplingParams

from atom_ray.coordinator import CompletionDelta, OutputDelta


@dataclass
class SampleRecord:
    token_ids: list[int] = field(default_factory=list)
    num_chars: int = 0
    finished: bool = False


@dataclass
class RequestRecord:
    prompt: object  # as the client sent it, until its first output brings the prompt's token ids
    params: SamplingParams
    samples: dict[int, SampleRecord]
    prompt_token_ids: list[int] | None = None
    started: bool = False  # its first output (prompt ids, prompt logprobs, metrics) went to the client
    num_cached_tokens: int = 0  # the prefix-cache hit of its first prefill, as the client was told
    metrics: RequestMetrics | None = None  # from its first output (clock of the rank that ran it)
    first_output_at: float | None = None  # this actor's time.monotonic() at its first output
    num_resumes: int = 0
    resumed_at: float | None = None  # when its latest rank failure was detected, until its next output
    arrived_resumed: bool = False  # it came as a continuation (a replica's engine failed, deployments/)

    @classmethod
    def new(cls, prompt, params: SamplingParams, resume: ResumeState | None = None) -> "RequestRecord":
        """`resume`: the request arrives as a continuation; what its samples delivered before counts as
        delivered here too, and the samples it does not list had finished."""
        if resume is None:
            return cls(prompt, params, {index: SampleRecord() for index in range(params.n)})
        listed = {sample.index: sample for sample in resume.samples}
        samples = {index: SampleRecord(list(listed[index].token_ids), listed[index].num_sent_chars) if index in listed
                   else SampleRecord(finished=True) for index in range(params.n)}
        return cls(prompt, params, samples, arrived_resumed=True)

    @property
    def num_delivered_tokens(self) -> int:
        return max(len(sample.token_ids) for sample in self.samples.values())

    def continuation(self) -> tuple[object, SamplingParams, ResumeState | None]:
        """(prompt, params, resume) that continue this request on another rank. Before its first output it is
        simply sent again; after, its unfinished samples resume from what they delivered, and the prompt's
        logprobs (delivered with the first output) are not computed again."""
        if not self.started and not self.arrived_resumed:
            return self.prompt, self.params, None
        params = self.params if self.params.prompt_logprobs is None else \
            dataclasses.replace(self.params, prompt_logprobs=None)
        resumed = tuple(ResumedSample(index, tuple(sample.token_ids), sample.num_chars)
                        for index, sample in sorted(self.samples.items()) if not sample.finished)
        prompt = self.prompt_token_ids if self.prompt_token_ids is not None else self.prompt
        return prompt, params, ResumeState(resumed)

    def record(self, delta: OutputDelta, now: float) -> OutputDelta:
        """Take note of what `delta` delivers; returns it as the client must see it."""
        for change in delta.completions:
            sample = self.samples[change.index]
            sample.token_ids.extend(change.new_token_ids)
            sample.num_chars += len(change.new_text)
            sample.finished = sample.finished or change.finish_reason is not None
        if not self.started:
            self.started = True
            self.prompt, self.prompt_token_ids = None, delta.prompt_token_ids
            self.num_cached_tokens, self.metrics, self.first_output_at = delta.num_cached_tokens, delta.metrics, now
            return delta
        if not self.num_resumes:
            return delta
        return dataclasses.replace(delta, prompt_token_ids=None, prompt_logprobs=None,
                                   num_cached_tokens=self.num_cached_tokens,
                                   metrics=self._whole_request_metrics(delta, now))

    def _whole_request_metrics(self, delta: OutputDelta, now: float) -> RequestMetrics | None:
        """A continuation's last output carries the first rank's arrival, scheduling and first-token times,
        and a last token that many seconds after the first (measured here: the ranks' clocks may differ)."""
        if not delta.finished or delta.metrics is None:
            return None  # its first output's metrics are the continuation's own: the client has the real ones
        if self.metrics is None or self.metrics.first_token_time is None:
            return delta.metrics
        last = self.metrics.first_token_time + (now - self.first_output_at)
        return dataclasses.replace(self.metrics, last_token_time=last, finished_time=last,
                                   num_preemptions=max(self.metrics.num_preemptions, delta.metrics.num_preemptions))

    def failure(self, request_id: str, message: str) -> OutputDelta:
        """The last output of a request that could not be resumed: its unfinished samples end with 'error'."""
        ends = [CompletionDelta(index, "", [], None, "error", None)
                for index, sample in sorted(self.samples.items()) if not sample.finished]
        return OutputDelta(request_id, ends, True, self.num_cached_tokens, error=message)

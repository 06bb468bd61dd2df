"""Turns sampled tokens into RequestOutputs: incremental detokenization, stop strings, logprobs, and
the fan-in of a request's n samples."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine.core.request import Request
from engine.core.scheduler_output import LogprobsLists, RunnerOutput
from engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from engine.resume import ResumedSample
from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Sample:
    """State of one of a request's n samples (one scheduler request)."""
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    holdback: int  # characters withheld from streaming while they could start a stop string
    completion: CompletionOutput
    num_sent_chars: int = 0
    num_sent_tokens: int = 0


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: dict[str, _Sample]
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    finished_samples: set[str] = field(default_factory=set)
    error: str | None = None  # why the request failed alone, if it did


@dataclass
class StepResults:
    outputs: list[RequestOutput] = field(default_factory=list)
    stop_hits: list[tuple[str, str]] = field(default_factory=list)  # (sample id, stop string)
    failed_sample_ids: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self.parent_of: dict[str, str] = {}  # sample (scheduler) request id -> parent id

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    samples: dict[str, SamplingParams], arrival_time: float,
                    resumed: dict[str, ResumedSample] | None = None) -> None:
        """`resumed`: the samples of a resumed request (engine/resume.py), each with what it had delivered;
        their state is rebuilt from it (the text of the delivered tokens for stop strings, and how much of
        it was sent), and their outputs carry only what comes after."""
        states = {}
        for index, (sample_id, params) in enumerate(samples.items()):
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens) \
                if self.tokenizer is not None else None
            holdback = 0 if params.include_stop_str_in_output or not params.stop else max(map(len, params.stop)) - 1
            logprobs = [] if params.logprobs is not None else None
            delivered = resumed.get(sample_id) if resumed is not None else None
            state = _Sample(index if delivered is None else delivered.index, params, detokenizer, holdback,
                            CompletionOutput(index=index if delivered is None else delivered.index,
                                             logprobs=logprobs))
            if delivered is not None:
                self._restore(state, delivered)
            states[sample_id] = state
            self.parent_of[sample_id] = request_id
        prompt_logprobs = [None] if next(iter(samples.values())).prompt_logprobs is not None else None
        self.parents[request_id] = _Parent(request_id, prompt, prompt_token_ids, states,
                                           RequestMetrics(arrival_time), prompt_logprobs)

    @staticmethod
    def _restore(sample: _Sample, delivered: ResumedSample) -> None:
        """A resumed sample's tokens and text as they were when its first engine failed, all marked sent but
        the text that engine still held back."""
        completion = sample.completion
        completion.token_ids = list(delivered.token_ids)
        if sample.detokenizer is not None:
            completion.text = "".join(sample.detokenizer.add(token_id) for token_id in delivered.token_ids)
        sample.num_sent_tokens = len(completion.token_ids)
        sample.num_sent_chars = min(delivered.num_sent_chars, len(completion.text))

    def sample_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.samples) if parent is not None else []

    def remove(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        for sample_id in parent.samples if parent is not None else ():
            self.parent_of.pop(sample_id, None)

    def process(self, updated: list[Request], output: RunnerOutput) -> StepResults:
        """The outputs of the requests that changed, the samples that a stop string ended and those of the
        requests whose output could not be produced (the caller finishes both kinds in the scheduler). A
        request whose processing raises fails alone: its output says so and the others carry on."""
        now = time.monotonic()
        changed: dict[str, _Parent] = {}
        results = StepResults()
        for sample_id, lists in output.prompt_logprobs.items():
            parent = self.parents.get(self.parent_of.get(sample_id, ""))
            if parent is not None and parent.prompt_logprobs is not None and parent.error is None:
                try:
                    parent.prompt_logprobs.extend(self._to_position_logprobs(lists))
                except Exception as exc:
                    self._fail(parent, exc, results)
        for request in updated:
            parent = self.parents.get(self.parent_of.get(request.request_id, ""))
            if parent is None or parent.error is not None:
                continue
            sample = parent.samples[request.request_id]
            if sample.completion.finished:
                continue
            if request.error is not None:  # its grammar failed, or refused a sampled token
                self._fail(parent, RuntimeError(request.error), results)
                continue
            try:
                stop = self._add_tokens(sample, request)
                if sample.params.logprobs is not None and request.request_id in output.logprobs:
                    sample.completion.logprobs.extend(
                        self._to_position_logprobs(output.logprobs[request.request_id]))
            except Exception as exc:
                self._fail(parent, exc, results)
                continue
            if stop is not None:
                results.stop_hits.append((request.request_id, stop))
                sample.completion.finish_reason, sample.completion.stop_reason = "stop", stop
            elif request.status.finished:
                sample.completion.finish_reason = request.finish_reason
                sample.completion.stop_reason = request.stop_reason
            if sample.completion.finished:
                parent.finished_samples.add(request.request_id)
            self._update_metrics(parent, request, now)
            changed[parent.request_id] = parent
        results.outputs += [self._emit(parent) for parent in changed.values() if parent.error is None]
        return results

    def _fail(self, parent: _Parent, exc: Exception, results: StepResults) -> None:
        """One request's output could not be produced: it ends with an error (all its samples), alone."""
        logger.error("request %s failed while its output was produced", parent.request_id, exc_info=exc)
        parent.error = f"{type(exc).__name__}: {exc}"
        for sample_id, sample in parent.samples.items():
            if not sample.completion.finished:
                sample.completion.finish_reason = "error"
                parent.finished_samples.add(sample_id)
        results.failed_sample_ids.extend(parent.samples)
        results.outputs.append(self._emit(parent))

    def finish_aborted(self, request_id: str) -> RequestOutput | None:
        """The final output of an aborted request (samples that had not finished say 'abort'); the
        request is forgotten afterwards."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for sample_id, sample in parent.samples.items():
            if not sample.completion.finished:
                sample.completion.finish_reason = "abort"
                parent.finished_samples.add(sample_id)
        return self._emit(parent)

    def _add_tokens(self, sample: _Sample, request: Request) -> str | None:
        completion, params = sample.completion, sample.params
        new_ids = request.output_token_ids[len(completion.token_ids):]
        for token_id in new_ids:
            completion.token_ids.append(token_id)
            if sample.detokenizer is None:
                continue
            piece = sample.detokenizer.add(token_id)
            if not piece:
                continue
            completion.text += piece
            if params.stop and len(completion.token_ids) >= params.min_tokens:
                stop = self._find_stop(completion, params, len(piece))
                if stop is not None:
                    return stop
        return None

    @staticmethod
    def _find_stop(completion: CompletionOutput, params: SamplingParams, piece_len: int) -> str | None:
        text = completion.text
        for stop in params.stop:
            start = max(0, len(text) - piece_len - len(stop) + 1)
            position = text.find(stop, start)
            if position >= 0:
                end = position + len(stop) if params.include_stop_str_in_output else position
                completion.text = text[:end]
                return stop
        return None

    def _to_position_logprobs(self, lists: LogprobsLists) -> list[PositionLogprobs]:
        positions = []
        for token_ids, values, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
            entry = {}
            for k, (token_id, value) in enumerate(zip(token_ids, values)):
                if k > 0 and token_id in entry:
                    continue
                decoded = self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else None
                entry[token_id] = Logprob(value, rank if k == 0 else k, decoded)
            positions.append(entry)
        return positions

    @staticmethod
    def _update_metrics(parent: _Parent, request: Request, now: float) -> None:
        metrics = parent.metrics
        metrics.first_scheduled_time = metrics.first_scheduled_time or request.first_scheduled_time
        metrics.first_token_time = metrics.first_token_time or now
        metrics.last_token_time = now
        metrics.num_preemptions = max(metrics.num_preemptions, request.num_preemptions)
        parent.num_cached_tokens = max(parent.num_cached_tokens, request.num_cached_tokens)

    def _emit(self, parent: _Parent) -> RequestOutput:
        finished = len(parent.finished_samples) == len(parent.samples)
        outputs = []
        for sample in parent.samples.values():
            completion = sample.completion
            visible = len(completion.text) if completion.finished else max(
                sample.num_sent_chars, len(completion.text) - sample.holdback)
            completion.new_text = completion.text[sample.num_sent_chars:visible]
            completion.new_token_ids = completion.token_ids[sample.num_sent_tokens:]
            sample.num_sent_chars, sample.num_sent_tokens = visible, len(completion.token_ids)
            # A snapshot: the state keeps growing, outputs already handed out must not.
            outputs.append(CompletionOutput(
                completion.index, completion.text, list(completion.token_ids), completion.finish_reason,
                completion.stop_reason, None if completion.logprobs is None else list(completion.logprobs),
                completion.new_text, completion.new_token_ids))
        if finished:
            parent.metrics.finished_time = time.monotonic()
            self.remove(parent.request_id)
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs, finished,
                             parent.prompt_logprobs, parent.num_cached_tokens, parent.metrics, parent.error)

"""What the engine hands back for a request: one CompletionOutput per sample (n of them), each with its
cumulative text and tokens plus what the last step added (for streaming)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str | None = None


# One entry per position: token id -> Logprob (the chosen token plus the top-k alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (the request failed alone)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[PositionLogprobs] | None = None
    # What the last step added (text held back while it might still become a stop string).
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # first entry None (no context)
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None  # set (with finish_reason "error") when this request failed alone in a step

    # The first (usually only) completion's fields, for the common n=1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> list[PositionLogprobs] | None:
        return self.outputs[0].logprobs


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: the last cumulative state, with every delta joined."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    merged = []
    for completion in last.outputs:
        parts = [c for o in outputs for c in o.outputs if c.index == completion.index]
        merged.append(CompletionOutput(
            completion.index, completion.text, completion.token_ids, completion.finish_reason,
            completion.stop_reason, completion.logprobs, "".join(p.new_text for p in parts),
            [t for p in parts for t in p.new_token_ids]))
    return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids, merged, last.finished,
                         last.prompt_logprobs, last.num_cached_tokens, last.metrics, last.error)


def drain_merged(queue, first):
    """`first` merged with every RequestOutput already waiting in the asyncio queue behind it (an
    exception stays queued for the next read)."""
    batch = [first]
    while not queue.empty() and not batch[-1].finished:
        item = queue._queue[0]  # peek: exceptions are left for the caller's next get()
        if isinstance(item, BaseException):
            break
        batch.append(queue.get_nowait())
    return merge_outputs(batch)

"""What both generation endpoints share: checks done before the engine sees a request (model, health,
prompt length), and running the engine requests as a JSON response or as a server-sent-event stream."""
from __future__ import annotations

import json
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from engine.sampling_params import SamplingParams

from .errors import OpenAIError, bad_request, engine_unavailable, from_exception, model_not_found
from .metrics import AppMetrics
from .streams import Admission, ClientDisconnected, EngineRequests, Ticket, resolve, until_disconnected

# nginx's code for "the client closed the connection before the response"; nobody reads it, but logs do.
CLIENT_CLOSED_REQUEST = 499
DONE_EVENT = "data: [DONE]\n\n"

OutputStream = AsyncIterator[tuple[int, RequestOutput]]


def sse_event(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


@dataclass(slots=True)
class ChoiceProgress:
    """What a streamed choice has sent so far. Outputs carry cumulative logprobs; only new ones are sent."""
    sent_tokens: int = 0
    started: bool = False
    done: bool = False

    def new_logprobs(self, completion: CompletionOutput) -> list[PositionLogprobs]:
        return completion.logprobs[self.sent_tokens:self.sent_tokens + len(completion.new_token_ids)]


@dataclass
class ServingContext:
    client: object  # the AsyncLLM interface: generate, abort, stats, tokenizer, max_model_len, is_healthy
    served_model_name: str
    metrics: AppMetrics
    admission: Admission

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    async def is_healthy(self) -> bool:
        value = self.client.is_healthy
        return bool(await resolve(value() if callable(value) else value))

    async def check_ready(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise model_not_found(model)
        if not await self.is_healthy():
            raise engine_unavailable()

    def check_context(self, prompt_tokens: int, max_tokens: int | None, prompt_param: str,
                      max_tokens_param: str = "max_tokens") -> None:
        """Refuse what cannot fit the context window, as OpenAI does, instead of silently truncating."""
        limit = self.max_model_len
        if prompt_tokens >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but the {prompt_param} has "
                f"{prompt_tokens} tokens, which leaves no room for a completion. Shorten the {prompt_param}.",
                prompt_param)
        if max_tokens is not None and prompt_tokens + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {prompt_param}, {max_tokens} for "
                f"the completion). Reduce the {prompt_param} or {max_tokens_param}.", max_tokens_param)

    def check_token_ids(self, token_ids: list[int]) -> None:
        vocab_size = getattr(self.client.tokenizer, "vocab_size", None)
        if vocab_size is not None:
            bad = [t for t in token_ids if not 0 <= t < vocab_size]
            if bad:
                raise bad_request(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                                  "prompt")

    @asynccontextmanager
    async def admitted(self, model: str | None, num_sequences: int):
        """Checks the model and the engine's health, then holds `num_sequences` of the in-flight limit while
        the request is prepared (tokenized); `run` takes the ticket over, and releases it at the end."""
        await self.check_ready(model)
        ticket = self.admission.admit(num_sequences)
        try:
            yield ticket
        except BaseException:
            ticket.release()
            raise

    async def run(self, ticket: Ticket, raw_request: Request, arrival_time: float, prompts: list[list[int]],
                  params: SamplingParams, response_id: str, stream: bool,
                  respond: Callable[[list[RequestOutput]], BaseModel],
                  stream_events: Callable[[OutputStream], AsyncIterator[str]]) -> Response:
        """Send the prompts to the engine. Non-streaming: `respond(final outputs, one per prompt)` becomes
        the JSON body. Streaming: `stream_events(outputs)` yields the SSE events; the first output is awaited
        here so that a request the engine refuses still gets an error status rather than a broken stream."""
        request_ids = [response_id] if len(prompts) == 1 else [f"{response_id}-{i}" for i in range(len(prompts))]
        engine = EngineRequests(self.client, prompts, params, request_ids, self.metrics, arrival_time)
        handed_to_stream = False
        try:
            if not stream:
                finals = await until_disconnected(raw_request, _final_outputs(engine, len(prompts)))
                return Response(respond(finals).model_dump_json(), media_type="application/json")
            outputs = engine.outputs()

            async def first_output() -> tuple[int, RequestOutput]:
                return await anext(outputs)

            first = await until_disconnected(raw_request, first_output())
            response = _EventStreamResponse(stream_events(_prepend(first, outputs)), engine, ticket.release)
            handed_to_stream = True
            return response
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as exc:
            return from_exception(exc).response()
        finally:
            if not handed_to_stream:
                engine.abort()  # before any await (see EngineRequests.abort)
                ticket.release()
                await engine.close()


async def _final_outputs(engine: EngineRequests, num_prompts: int) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * num_prompts
    async for index, output in engine.outputs():
        if output.finished:
            finals[index] = output
    assert all(final is not None for final in finals), "an engine stream ended without a finished output"
    return finals


async def _prepend(first: tuple[int, RequestOutput], rest: OutputStream) -> OutputStream:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


def error_event(exc: BaseException) -> str:
    """A failure after the stream started: the status is already sent, so the error goes in the stream
    (OpenAI's clients raise it)."""
    error = exc if isinstance(exc, OpenAIError) else from_exception(exc)
    return f"data: {json.dumps(error.body().model_dump())}\n\n"


class _EventStreamResponse(StreamingResponse):
    """A server-sent-event stream that aborts its engine requests and frees its in-flight slot however it
    ends: completed, client gone (the stream task is cancelled), or a failed send."""

    def __init__(self, events: AsyncIterator[str], engine: EngineRequests, on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._engine = engine
        self._on_close = on_close
        # A response that is dropped without being sent (its handler cancelled between returning it and
        # sending it) still aborts its requests when it is collected.
        weakref.finalize(self, engine.abort)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # First what needs no await: in a cancelled task (the client left through Serve's proxy) every
            # await below may raise at once, and an abort placed after one was skipped, leaving the request
            # running with its KV blocks.
            self._engine.abort()
            self._on_close()
            try:
                await self.body_iterator.aclose()
            finally:
                await self._engine.close()


async def run_guarded(handler: Awaitable[Response]) -> Response:
    """Every failure inside a request becomes OpenAI's error body; nothing escapes to other requests."""
    try:
        return await handler
    except Exception as exc:
        return from_exception(exc).response()

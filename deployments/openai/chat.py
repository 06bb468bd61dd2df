"""POST /v1/chat/completions: messages (and tools) through the model's chat template to assistant replies, whole
or streamed as chat.completion.chunk events; tool calls and reasoning read from the output (chat_output.py)."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from engine.errors import InvalidRequestError
from engine.outputs import CompletionOutput, RequestOutput

from .chat_output import ChatOutputReader, ChatParsers
from .errors import bad_request
from .logprobs import chat_logprobs
from .protocol import ChatCompletionRequest
from .responses import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
                        ChatLogprobs, DeltaMessage, UsageInfo)
from .serving import DONE_EVENT, ChoiceProgress, OutputStream, ServingContext, error_event, sse_event
from .tool_calls import forced_params, plan_tools, render_prompt, template_kwargs, template_messages


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, raw_request: Request,
                                 parsers: ChatParsers | None = None) -> Response:
    arrival_time = time.monotonic()
    max_tokens = body.requested_max_tokens
    params = await body.to_sampling_params_async(max_tokens, body.engine_logprobs)
    tools = plan_tools(body)
    if tools.constraint is not None:  # the schema's check may take milliseconds: off the event loop
        params = await asyncio.to_thread(forced_params, params, tools)
    async with ctx.admitted(body.model, params.n) as ticket:
        _refuse_media(ctx, body)
        messages = template_messages(body.messages)
        kwargs = template_kwargs(tools, body.chat_template_kwargs)
        tokenizer = ctx.client.tokenizer
        try:  # off the event loop: templating and tokenizing a long conversation must not stall other streams
            prompt, token_ids = await asyncio.to_thread(render_prompt, tokenizer, messages, kwargs)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), "messages") from None
        if not token_ids:
            raise bad_request("The messages render to an empty prompt", "messages")
        ctx.check_context(len(token_ids), max_tokens, "messages",
                          "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
        reader_args = (parsers or ChatParsers(), tools, params, tokenizer, prompt, body.chat_template_kwargs)
        if getattr(params, "structured_outputs", None) is not None:  # a constraint after the reasoning is checked
            reader = await asyncio.to_thread(ChatOutputReader, *reader_args)
        else:
            reader = ChatOutputReader(*reader_args)
        response = _ChatResponder(ctx, body, len(token_ids), f"chatcmpl-{uuid.uuid4().hex}", reader)
        return await ctx.run(ticket, raw_request, arrival_time, [token_ids], reader.params, response.id, body.stream,
                             response.full, response.events)


def _refuse_media(ctx: ServingContext, body: ChatCompletionRequest) -> None:
    """No model served here takes images, audio or video: refused by name, never dropped silently."""
    for index, message in enumerate(body.messages):
        if message.media_kinds:
            raise bad_request(f"this server serves the text stack of {ctx.served_model_name} only; "
                              f"{message.media_kinds[0]} input is not supported", f"messages.{index}.content")


class _ChatResponder:
    def __init__(self, ctx: ServingContext, body: ChatCompletionRequest, num_prompt_tokens: int,
                 response_id: str, reader: ChatOutputReader) -> None:
        self.ctx = ctx
        self.reader = reader
        self.body = body
        self.num_prompt_tokens = num_prompt_tokens
        self.id = response_id
        self.created = int(time.time())
        self.num_top_logprobs = body.top_logprobs or 0

    def _logprobs(self, positions, token_ids: list[int]) -> ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        return ChatLogprobs(content=chat_logprobs(positions, token_ids, self.num_top_logprobs))

    def full(self, finals: list[RequestOutput]) -> ChatCompletionResponse:
        (output,) = finals
        choices = []
        for completion in output.outputs:
            message, finish_reason = AssistantMessage(content=completion.text), completion.finish_reason
            if self.reader.active:
                parts, finish_reason = self.reader.message(completion)
                message = AssistantMessage(content=parts.content, reasoning_content=parts.reasoning_content,
                                           tool_calls=parts.tool_calls)
            choices.append(ChatChoice(index=completion.index, message=message,
                                      logprobs=self._logprobs(completion.logprobs, completion.token_ids),
                                      finish_reason=finish_reason, stop_reason=completion.stop_reason))
        num_completion_tokens = sum(len(completion.token_ids) for completion in output.outputs)
        usage = UsageInfo.of(self.num_prompt_tokens, num_completion_tokens)
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.ctx.served_model_name,
                                      choices=choices, usage=usage)

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
        return sse_event(ChatCompletionChunk(id=self.id, created=self.created, model=self.ctx.served_model_name,
                                             choices=choices, usage=usage))

    async def events(self, outputs: OutputStream) -> AsyncIterator[str]:
        progress = [ChoiceProgress() for _ in range(self.body.n)]
        num_completion_tokens = 0
        try:
            yield self._chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                               for i in range(self.body.n)])
            async for _, output in outputs:
                choices = []
                for completion in output.outputs:
                    if progress[completion.index].done:  # later outputs of the request repeat a finished sample
                        continue
                    num_completion_tokens += len(completion.new_token_ids)
                    choice = self._step_choice(progress[completion.index], completion)
                    if choice is not None:
                        choices.append(choice)
                if choices:
                    yield self._chunk(choices)
            if self.body.include_usage_in_stream:
                yield self._chunk([], UsageInfo.of(self.num_prompt_tokens, num_completion_tokens))
        except Exception as exc:
            yield error_event(exc)
        yield DONE_EVENT

    def _step_choice(self, progress: ChoiceProgress, completion: CompletionOutput) -> ChatChunkChoice | None:
        """The chunk choice for one sample's step; None when there is nothing to send yet."""
        new_token_ids = completion.new_token_ids
        logprobs = None
        if self.body.logprobs and new_token_ids:
            logprobs = self._logprobs(progress.new_logprobs(completion), new_token_ids)
        progress.sent_tokens += len(new_token_ids)
        progress.done = completion.finished
        delta, finish_reason = DeltaMessage(content=completion.new_text or None), completion.finish_reason
        if self.reader.active:
            parts, called = self.reader.delta(completion)
            finish_reason = self.reader.finish_reason(finish_reason, called)
            delta = DeltaMessage() if parts is None else DeltaMessage(
                content=parts.content, reasoning_content=parts.reasoning_content, tool_calls=parts.tool_calls)
        if delta == DeltaMessage() and not completion.finished and logprobs is None:
            return None  # text held back (a possible stop string, a partial character, a parser's marker)
        return ChatChunkChoice(index=completion.index, delta=delta, logprobs=logprobs,
                               finish_reason=finish_reason, stop_reason=completion.stop_reason)

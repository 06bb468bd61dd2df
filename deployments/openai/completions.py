"""POST /v1/completions: one or several prompts (text or token ids) to text completions, whole or streamed.
With several prompts and n samples each, choice index = prompt index * n + sample index."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from engine.outputs import CompletionOutput, RequestOutput

from .errors import bad_request
from .logprobs import CompletionLogprobsBuilder
from .protocol import CompletionRequest
from .responses import CompletionChoice, CompletionChunk, CompletionResponse, UsageInfo
from .serving import DONE_EVENT, ChoiceProgress, OutputStream, ServingContext, error_event, sse_event


@dataclass
class _Prompt:
    text: str | None  # None for a token-id prompt until echo needs its text
    token_ids: list[int]


async def create_completion(ctx: ServingContext, body: CompletionRequest, raw_request: Request) -> Response:
    arrival_time = time.monotonic()
    echo_logprobs = body.logprobs if body.echo else None
    params = await body.to_sampling_params_async(body.max_tokens, body.logprobs, prompt_logprobs=echo_logprobs)
    async with ctx.admitted(body.model, len(body.prompts) * params.n) as ticket:
        # Off the event loop: a large prompt must not hold up the other requests' streams.
        prompts = await asyncio.to_thread(_prepare_prompts, ctx, body)
        response = _CompletionResponder(ctx, body, prompts, f"cmpl-{uuid.uuid4().hex}")
        return await ctx.run(ticket, raw_request, arrival_time, [p.token_ids for p in prompts], params, response.id,
                             body.stream, response.full, response.events)


def _prepare_prompts(ctx: ServingContext, body: CompletionRequest) -> list[_Prompt]:
    prompts = [_tokenize(ctx, prompt, body.max_tokens) for prompt in body.prompts]
    if body.echo:
        for prompt in prompts:
            if prompt.text is None:
                prompt.text = ctx.client.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
    return prompts


def _tokenize(ctx: ServingContext, prompt: str | list[int], max_tokens: int | None) -> _Prompt:
    if isinstance(prompt, str):
        result = _Prompt(prompt, ctx.client.tokenizer.encode(prompt))
    else:
        ctx.check_token_ids(prompt)
        result = _Prompt(None, prompt)
    if not result.token_ids:
        raise bad_request("The prompt is empty; send at least one token", "prompt")
    ctx.check_context(len(result.token_ids), max_tokens, "prompt")
    return result


def _prompt_positions(prompt_logprobs: list | None, num_prompt_tokens: int) -> list:
    """One entry per prompt token; the engine's first is None (the first token has no context). The engine
    bypasses the prefix cache for requests with prompt logprobs, so every position is scored."""
    return prompt_logprobs if prompt_logprobs is not None else [None] * num_prompt_tokens


class _CompletionResponder:
    """Builds the response of one completions request from the engine outputs of its prompts."""

    def __init__(self, ctx: ServingContext, body: CompletionRequest, prompts: list[_Prompt], response_id: str):
        self.ctx = ctx
        self.body = body
        self.prompts = prompts
        self.id = response_id
        self.created = int(time.time())
        self.num_prompt_tokens = sum(len(p.token_ids) for p in prompts)

    def _logprobs_builder(self) -> CompletionLogprobsBuilder:
        return CompletionLogprobsBuilder(self.ctx.client.tokenizer)

    def _echo(self, builder: CompletionLogprobsBuilder | None, prompt: _Prompt, output: RequestOutput) -> str:
        """The prompt's text, and its logprobs into `builder`, for a choice that echoes it."""
        if builder is not None:
            builder.extend(_prompt_positions(output.prompt_logprobs, len(prompt.token_ids)), prompt.token_ids)
        return prompt.text

    def full(self, finals: list[RequestOutput]) -> CompletionResponse:
        choices, num_completion_tokens = [], 0
        for prompt_index, (prompt, output) in enumerate(zip(self.prompts, finals)):
            for completion in output.outputs:
                builder = self._logprobs_builder() if self.body.logprobs is not None else None
                text = self._echo(builder, prompt, output) if self.body.echo else ""
                if builder is not None:
                    builder.extend(completion.logprobs, completion.token_ids)
                choices.append(CompletionChoice(
                    index=prompt_index * self.body.n + completion.index, text=text + completion.text,
                    logprobs=builder.take() if builder is not None else None,
                    finish_reason=completion.finish_reason, stop_reason=completion.stop_reason))
                num_completion_tokens += len(completion.token_ids)
        choices.sort(key=lambda choice: choice.index)
        return CompletionResponse(id=self.id, created=self.created, model=self.ctx.served_model_name,
                                  choices=choices, usage=UsageInfo.of(self.num_prompt_tokens, num_completion_tokens))

    async def events(self, outputs: OutputStream) -> AsyncIterator[str]:
        n = self.body.n
        progress = [ChoiceProgress() for _ in range(len(self.prompts) * n)]
        builders = [self._logprobs_builder() for _ in progress] if self.body.logprobs is not None else None
        num_completion_tokens = 0
        try:
            async for prompt_index, output in outputs:
                choices = []
                for completion in output.outputs:
                    index = prompt_index * n + completion.index
                    if progress[index].done:  # later outputs of the request repeat a finished sample
                        continue
                    num_completion_tokens += len(completion.new_token_ids)
                    builder = builders[index] if builders is not None else None
                    choice = self._step_choice(index, progress[index], builder, completion, output)
                    if choice is not None:
                        choices.append(choice)
                if choices:
                    yield sse_event(CompletionChunk(id=self.id, created=self.created,
                                                    model=self.ctx.served_model_name, choices=choices))
            if self.body.include_usage_in_stream:
                yield sse_event(CompletionChunk(
                    id=self.id, created=self.created, model=self.ctx.served_model_name, choices=[],
                    usage=UsageInfo.of(self.num_prompt_tokens, num_completion_tokens)))
        except Exception as exc:
            yield error_event(exc)
        yield DONE_EVENT

    def _step_choice(self, index: int, progress: ChoiceProgress, builder: CompletionLogprobsBuilder | None,
                     completion: CompletionOutput, output: RequestOutput) -> CompletionChoice | None:
        """The chunk choice for one sample's step; None when there is nothing to send yet."""
        text = completion.new_text
        if not progress.started:
            progress.started = True
            if self.body.echo:
                text = self._echo(builder, self.prompts[index // self.body.n], output) + text
        if builder is not None:
            builder.extend(progress.new_logprobs(completion), completion.new_token_ids)
        progress.sent_tokens += len(completion.new_token_ids)
        progress.done = completion.finished
        logprobs = builder.take() if builder is not None else None
        if not text and not completion.finished and (logprobs is None or not logprobs.tokens):
            return None  # tokens whose text is held back (a possible stop string, a partial character)
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=completion.finish_reason,
                                stop_reason=completion.stop_reason)

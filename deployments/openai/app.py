"""The OpenAI-compatible FastAPI app over an engine client (the in-process AsyncLLM or the Ray client).
It keeps no global state and starts no loop, so Ray Serve can mount it and a process can build several."""
from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import Response

from .chat import create_chat_completion
from .chat_output import ChatParsers
from .completions import create_completion
from .errors import engine_unavailable, install_error_handlers
from .guard import DEFAULT_MAX_REQUEST_BODY_BYTES, RequestGuard
from .messages import MessagesRoute, create_message
from .messages_protocol import MessagesRequest, error_body
from .metrics import AppMetrics
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses import ModelCard, ModelList
from .serving import ServingContext, run_guarded
from .streams import Admission, resolve


def build_openai_app(client, served_model_name: str, max_pending_sequences: int = 256, api_key: str | None = None,
                     max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES, tool_call_parser: str = "auto",
                     reasoning_parser: str = "auto", model_config=None) -> FastAPI:
    """`client` offers AsyncLLM's interface: generate(prompt, params, request_id), abort(request_id), stats(),
    tokenizer, max_model_len, is_healthy. At most `max_pending_sequences` sequences (prompts x n) are in
    flight; a request past that gets 429 with Retry-After, one that could never fit 400. With `api_key`,
    every /v1/ route needs `Authorization: Bearer <api_key>` or `x-api-key: <api_key>` (as Anthropic's clients
    send it); /health and /metrics stay open. `tool_call_parser` and `reasoning_parser` name how chat completions
    (and /v1/messages, which runs on them) read tool calls and reasoning from the output ("auto": the model's
    own, from `model_config` (its HF config) and the tokenizer's chat template; "none": off)."""
    if max_pending_sequences < 1:
        raise ValueError(f"max_pending_sequences must be at least 1 (got {max_pending_sequences})")
    if max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes must be at least 1 (got {max_request_body_bytes})")
    ctx = ServingContext(client, served_model_name, AppMetrics(), Admission(max_pending_sequences))
    chat_template = getattr(getattr(getattr(client, "tokenizer", None), "hf", None), "chat_template", None)
    parsers = ChatParsers.resolve(tool_call_parser, reasoning_parser, model_config,
                                  chat_template if isinstance(chat_template, str) else None)
    ctx.metrics.track_admission(lambda: ctx.admission.in_flight)
    # strict_content_type=False: a JSON body without a Content-Type header (curl -d ...) still parses.
    app = FastAPI(title="atom-ray OpenAI-compatible API", strict_content_type=False)
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_request_body_bytes,
                       error_bodies={"/v1/messages": error_body})
    install_error_handlers(app)
    app.state.serving = ctx

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw_request: Request) -> Response:
        return await run_guarded(create_completion(ctx, body, raw_request))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request) -> Response:
        return await run_guarded(create_chat_completion(ctx, body, raw_request, parsers))

    async def messages(body: MessagesRequest, raw_request: Request) -> Response:
        return await create_message(ctx, body, raw_request, parsers)

    # Anthropic's Messages API, over the chat path, with Anthropic's error bodies (MessagesRoute).
    app.router.add_api_route("/v1/messages", messages, methods=["POST"], route_class_override=MessagesRoute)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, root=served_model_name,
                                         max_model_len=ctx.max_model_len)])

    @app.get("/health")
    async def health() -> Response:
        if not await ctx.is_healthy():
            return engine_unavailable().response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            # In a thread: the in-process engine's stats() waits for the running step to end.
            stats = await resolve(await asyncio.to_thread(client.stats))
        except Exception:  # a dead engine still gets its app-side metrics scraped
            stats = {}
        body, content_type = ctx.metrics.render(stats)
        return Response(body, media_type=content_type)

    return app


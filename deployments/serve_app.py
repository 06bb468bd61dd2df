"""Ray Serve application: each replica runs one engine instance (a Coordinator and its rank actors) behind
the OpenAI-compatible FastAPI app, and answers Python handle calls from other Ray jobs. A request whose
engine fails continues on another replica or the restarted engine (deployments/replica_failover.py).

`serve deploy`/`serve run` configs name the builder: `import_path: deployments.serve_app:build_app` with
`args` as in `AppConfig` below (see deployments/configs/).
"""
from __future__ import annotations

import logging
import os
from typing import Any, AsyncIterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from ray import serve

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams

from atom_ray.serving import API_KEY_ENV, exposure_warning
from deployments.openai.chat_output import check_parser_names
from deployments.openai.guard import DEFAULT_MAX_REQUEST_BODY_BYTES
from deployments.replica_router import ROUTER_CLASS

logger = logging.getLogger(__name__)

_ENGINE_STATE_KEYS = ("num_running", "num_waiting", "engine_restarts", "replica_resumed_requests",
                      "replica_failed_resumes", "replica_resume_latency_s_sum", "replica_resume_latency_s_max",
                      "peer_continuations")


DEFAULT_DEPLOYMENT = {
    # The engine batches internally; Serve's default of 5 ongoing requests per replica would starve it.
    "max_ongoing_requests": 1024,
    # The replica only relays requests; its rank actors reserve the cores and GPUs.
    "ray_actor_options": {"num_cpus": 0},
    # A replica's shutdown stops its engine in a few seconds; Serve need not wait its default 20 s.
    "graceful_shutdown_timeout_s": 5,
    "graceful_shutdown_wait_loop_s": 1,
    # Serve's routing, except that a request continued after its engine failed goes to another replica.
    "request_router_config": {"request_router_class": ROUTER_CLASS},
}


class AppConfig(BaseModel):
    """`args` of a serve config."""
    model_config = ConfigDict(extra="forbid")

    model: str = "smollm2-135m"
    served_model_name: str | None = None
    engine_args: dict[str, Any] = Field(default_factory=dict)
    cpus_per_rank: int | None = Field(default=None, ge=1)
    gpus_per_rank: float = Field(default=1.0, gt=0, le=1)  # 0.5: two TP ranks per GPU (numerics checks, slow)
    accelerator_type: str | None = None  # e.g. AMD-Instinct-MI355X-OAM: ranks only on such GPUs
    placement_timeout_s: float = Field(default=600.0, gt=0)
    # Sequences (prompts x n) in flight at once; more get 429, a request larger than this alone 400.
    max_pending_sequences: int = Field(default=256, ge=1)
    max_request_body_bytes: int = Field(default=DEFAULT_MAX_REQUEST_BODY_BYTES, ge=1)
    # The OpenAI API key (every /v1/ route then needs `Authorization: Bearer <key>`). Unset: the replica's
    # ATOM_RAY_API_KEY environment variable, which keeps the key out of the config file.
    api_key: str | None = Field(default=None, min_length=1)
    # Refuse to start without a key: for deployments reachable from other machines.
    require_api_key: bool = False
    # Failed engine restarts in a row before the replica reports itself unhealthy (Serve then replaces it).
    max_engine_restarts: int = Field(default=5, ge=0)
    # When the engine under a request fails, the request continues on another replica or, with none, on this
    # replica's restarted engine, if one takes it within this many seconds; else it ends with an error. An
    # engine start is the model load (minutes for the largest models): raise it where one replica serves
    # them. 0: no failover, the request fails at once.
    resume_timeout_s: float = Field(default=120.0, ge=0)
    # How /v1/chat/completions reads tool calls (tool_choice auto) and reasoning out of the model's text: vLLM's
    # parser names (hermes, qwen3_coder, deepseek_v3, kimi_k2, glm45, openai, ...; docs/AGENTIC.md), "auto" for
    # the model's own (from its config and chat template), "none" for plain text.
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    deployment_config: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known_parsers(self) -> "AppConfig":
        check_parser_names(self.tool_call_parser, self.reasoning_parser)
        return self

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    def resolved_api_key(self) -> str | None:
        key = self.api_key or os.environ.get(API_KEY_ENV) or None
        if key is None and self.require_api_key:
            raise ValueError(f"this application requires an API key (require_api_key: true): set {API_KEY_ENV} "
                             "in the environment of the Ray nodes, or api_key in the app args")
        return key


@serve.deployment
@serve.ingress()
class OpenAIServer:
    def __init__(self, config: dict) -> None:
        import atom_ray
        from atom_ray.supervisor import SupervisedEngine
        from deployments.replica_failover import ReplicaFailover
        self.config = AppConfig(**config)
        self.api_key = self.config.resolved_api_key()
        _warn_if_exposed_without_key(self.api_key)
        self.engine = SupervisedEngine(
            lambda: atom_ray.start(self.config.model, cpus_per_rank=self.config.cpus_per_rank,
                                   gpus_per_rank=self.config.gpus_per_rank,
                                   accelerator_type=self.config.accelerator_type,
                                   placement_timeout_s=self.config.placement_timeout_s, **self.config.engine_args),
            max_restarts=self.config.max_engine_restarts)
        self._peers: tuple | None = None
        self.failover = ReplicaFailover(self.engine, self.config.resume_timeout_s, self._peer_handle)

    def __serve_build_asgi_app__(self):
        from deployments.openai.app import build_openai_app
        return build_openai_app(self.failover, self.config.name, self.config.max_pending_sequences, self.api_key,
                                self.config.max_request_body_bytes, tool_call_parser=self.config.tool_call_parser,
                                reasoning_parser=self.config.reasoning_parser, model_config=self._model_config())

    def _model_config(self):
        """The model's HF config, from which the "auto" parsers are chosen (None: no parser is chosen)."""
        if "auto" not in (self.config.tool_call_parser, self.config.reasoning_parser):
            return None
        from engine.loader import resolve_model
        args = self.config.engine_args
        try:
            return resolve_model(self.config.model, args.get("load_format", "auto"), args.get("hf_overrides")).hf_config
        except Exception as exc:  # the engine read it already; a failure here costs the auto choice only
            logger.warning("no model config for the auto tool-call and reasoning parsers: %s", exc)
            return None

    async def generate_stream(self, request: dict) -> AsyncIterator[dict]:
        """For handle calls: {"prompt": str | [ids]} or {"messages": [...]}, plus SamplingParams fields.
        Yields {"text", "token_ids", "finish_reason"} deltas."""
        prompt, params = self._parse(request)
        async for output in self.failover.generate(prompt, params):
            completion = output.outputs[0]
            yield {"text": completion.new_text, "token_ids": completion.new_token_ids,
                   "finish_reason": completion.finish_reason}

    async def generate(self, request: dict) -> dict:
        """For handle calls: the whole completion at once."""
        prompt, params = self._parse(request)
        output = None
        async for output in self.failover.generate(prompt, params):
            pass
        return {"text": output.text, "token_ids": output.token_ids, "finish_reason": output.finish_reason,
                "usage": {"prompt_tokens": len(output.prompt_token_ids), "completion_tokens": len(output.token_ids)}}

    async def rank_process_ids(self) -> list[tuple[str, int]]:
        """For handle calls: (node address, pid) of each tensor-parallel rank of this replica's engine."""
        return await self.engine.handle.coordinator.rank_process_ids.remote()

    async def engine_state(self) -> dict:
        """For handle calls: this replica (its tag), whether its engine serves, its ranks' processes, its
        running and waiting sequences, its engine restarts and its failover counters."""
        stats = self.failover.stats()
        pids = await self.rank_process_ids() if self.engine.is_healthy else []
        return {"replica": serve.get_replica_context().replica_tag, "serving": self.engine.is_healthy,
                "rank_process_ids": pids, **{key: stats.get(key) for key in _ENGINE_STATE_KEYS}}

    async def resume_stream(self, request: dict, avoid_replica: str | None = None) -> AsyncIterator[list]:
        """Called by another replica whose engine failed under a request (deployments/replica_failover.py;
        the router reads `avoid_replica`): runs its continuation here, streaming output deltas back."""
        stream = self.failover.resume_stream(request)
        try:
            async for deltas in stream:
                yield deltas
        finally:  # the caller gave up (or took the request elsewhere): the engine stops it at once
            await stream.aclose()

    def _peer_handle(self) -> tuple:
        """(a handle to this deployment, this replica's tag): where failed requests are continued."""
        if self._peers is None:
            context = serve.get_replica_context()
            self._peers = (serve.get_deployment_handle(context.deployment, context.app_name), context.replica_tag)
        return self._peers

    def check_health(self) -> None:
        """Serve's check: a replica whose engine is restarting stays (it answers 503 meanwhile); one whose
        restarts failed is replaced."""
        if self.engine.failed is not None:
            raise RuntimeError(f"the engine could not be restarted: {self.engine.failed}")

    def _parse(self, request: dict):
        """A handle call's request, checked as the HTTP API checks it (the engine's SamplingParams bounds)."""
        if not isinstance(request, dict):
            raise InvalidRequestError(f"a request is a dict with 'prompt' or 'messages', not {type(request).__name__}")
        request = dict(request)
        if "messages" in request:
            prompt = self.engine.tokenizer.encode_chat(request.pop("messages"))
        elif "prompt" in request:
            prompt = request.pop("prompt")
        else:
            raise InvalidRequestError("a request needs 'prompt' or 'messages'")
        return prompt, SamplingParams.from_dict(request)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # the cluster may already be going away
                pass


def _warn_if_exposed_without_key(api_key: str | None) -> None:
    """Best effort: Serve's HTTP host is read through its private client (no public API says it)."""
    if api_key is not None:
        return
    try:
        from ray.serve.context import _get_global_client
        host = _get_global_client().http_config.host
    except Exception:  # an internal API that moved: no warning rather than no replica
        return
    warning = exposure_warning(host, api_key)
    if warning:
        logger.warning(warning)


def build_app(args: dict) -> serve.Application:
    """The builder that serve configs name. Invalid args fail here with a message naming the field."""
    try:
        config = AppConfig(**(args or {}))
    except ValidationError as exc:
        raise ValueError(f"invalid atom-ray app args: {exc}") from None
    EngineConfig.from_kwargs(config.model, **config.engine_args)  # engine arguments checked before deploying
    config.resolved_api_key()  # a required key missing here is missing on the replicas too, most likely
    options = {**DEFAULT_DEPLOYMENT, **config.deployment_config}
    return OpenAIServer.options(**options).bind(config.model_dump())

"""Ray Serve application: each replica runs one engine instance (a Coordinator and its rank actors) behind
the OpenAI-compatible FastAPI app, and answers Python handle calls from other Ray jobs.

`serve deploy`/`serve run` configs name the builder: `import_path: deployments.serve_app:build_app` with
`args` as in `AppConfig` below (see deployments/configs/).
"""
from __future__ import annotations

from typing import Any, AsyncIterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams

DEFAULT_DEPLOYMENT = {
    # The engine batches internally; Serve's default of 5 ongoing requests per replica would starve it.
    "max_ongoing_requests": 1024,
    # The replica only relays requests; its rank actors reserve the cores and GPUs.
    "ray_actor_options": {"num_cpus": 0},
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
    max_pending_requests: int = Field(default=256, ge=1)
    deployment_config: dict[str, Any] = Field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


@serve.deployment
@serve.ingress()
class OpenAIServer:
    def __init__(self, config: dict) -> None:
        import atom_ray
        self.config = AppConfig(**config)
        self.engine = atom_ray.start(self.config.model, cpus_per_rank=self.config.cpus_per_rank,
                                     gpus_per_rank=self.config.gpus_per_rank,
                                     accelerator_type=self.config.accelerator_type,
                                     placement_timeout_s=self.config.placement_timeout_s, **self.config.engine_args)

    def __serve_build_asgi_app__(self):
        from deployments.openai.app import build_openai_app
        return build_openai_app(self.engine.client, self.config.name, self.config.max_pending_requests)

    async def generate_stream(self, request: dict) -> AsyncIterator[dict]:
        """For handle calls: {"prompt": str | [ids]} or {"messages": [...]}, plus SamplingParams fields.
        Yields {"text", "token_ids", "finish_reason"} deltas."""
        prompt, params = self._parse(request)
        async for output in self.engine.client.generate(prompt, params):
            completion = output.outputs[0]
            yield {"text": completion.new_text, "token_ids": completion.new_token_ids,
                   "finish_reason": completion.finish_reason}

    async def generate(self, request: dict) -> dict:
        """For handle calls: the whole completion at once."""
        prompt, params = self._parse(request)
        output = None
        async for output in self.engine.client.generate(prompt, params):
            pass
        return {"text": output.text, "token_ids": output.token_ids, "finish_reason": output.finish_reason,
                "usage": {"prompt_tokens": len(output.prompt_token_ids), "completion_tokens": len(output.token_ids)}}

    def check_health(self) -> None:
        if not self.engine.client.is_healthy:
            raise RuntimeError("engine is not healthy")

    def _parse(self, request: dict):
        request = dict(request)
        if "messages" in request:
            prompt = self.engine.tokenizer.encode_chat(request.pop("messages"))
        elif "prompt" in request:
            prompt = request.pop("prompt")
        else:
            raise ValueError("a request needs 'prompt' or 'messages'")
        return prompt, SamplingParams(**request)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # the cluster may already be going away
                pass


def build_app(args: dict) -> serve.Application:
    """The builder that serve configs name. Invalid args fail here with a message naming the field."""
    try:
        config = AppConfig(**(args or {}))
    except ValidationError as exc:
        raise ValueError(f"invalid atom-ray app args: {exc}") from None
    EngineConfig.from_kwargs(config.model, **config.engine_args)  # engine arguments checked before deploying
    options = {**DEFAULT_DEPLOYMENT, **config.deployment_config}
    return OpenAIServer.options(**options).bind(config.model_dump())

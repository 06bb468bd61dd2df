"""atom-ray's engine shard: one rank's model, scheduler, KV cache and kernels. Never imports Ray."""
from engine.config import ConfigError, EngineConfig
from engine.llm import LLM
from engine.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams, SamplingParamsError

__all__ = [
    "LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
    "ConfigError", "InvalidRequestError", "SamplingParamsError", "RequestFailedError", "EngineDeadError",
]

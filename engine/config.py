"""Engine configuration: one typed object, validated once at construction (vLLM's names where they exist)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
KERNEL_BACKENDS = ("auto", "torch", "triton", "aiter")
TP_REDUCE_DTYPES = ("auto", "float32", "model")
RESIDUAL_DTYPES = ("auto", "float32", "model")
DEVICES = ("auto", "cpu", "cuda")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
KV_CACHE_SCALES = ("auto", "tensor", "token")
QUANTIZATIONS = ("fp8", "fp8_tensor", "fp8_channel", "fp8_block", "mxfp4")
EXPERT_EXCHANGES = ("auto", "allgather", "all_to_all", "mori")  # engine.parallel.all_to_all.make_all_to_all


class ConfigError(ValueError):
    """A user-supplied engine argument is invalid; the message names the field."""


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    # Tokens per step (decodes first, then prefill chunks). None: per device, 8192 on GPUs and 512 on CPU,
    # where a step of 8192 prompt tokens would stall every running stream for a minute.
    max_num_batched_tokens: int | None = None
    # A prefill with more tokens left than this is "long": decodes and short prefills go first each step,
    # and the oldest long prefill keeps this many tokens of the budget. None: half of max_num_batched_tokens.
    long_prefill_token_threshold: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    # Data parallelism: this many engine instances (each with its own scheduler, KV cache and whole attention
    # weights, of tensor_parallel_size ranks each) behind one coordinator that routes requests among them.
    data_parallel_size: int = 1
    # Expert parallelism for MoE models: experts split across all data_parallel_size x tensor_parallel_size
    # ranks (whole experts per rank) instead of every rank holding a slice of every expert.
    enable_expert_parallel: bool = False
    # How expert-parallel MoE layers exchange tokens, in buffers sized by the step's padded token count:
    # "allgather" (all-gather the group's tokens, reduce-scatter the results), "all_to_all" (a padded
    # all-to-all with a fixed capacity per destination), "mori" (AMD's MORI kernels, ROCm), "auto" (MORI
    # with the aiter backend where it fits, else the form measured faster for the step's size).
    expert_exchange: str = "auto"
    # Tokens per expert and per EP rank are reported over windows of this many steps (engine stats,
    # /metrics, benchmarks); 0 turns the counting off (it costs a few small kernels per MoE layer and step).
    expert_load_window: int = 64
    seed: int = 0
    load_format: str = "auto"
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    kernel_backend: str = "auto"
    device: str = "auto"
    enforce_eager: bool = False
    # Steps with prompt tokens replayed from piecewise CUDA graphs (engine/runner/prompt_graphs.py) where the
    # model's attention layers allow it: "on", "off", or "auto" (on for mixture-of-experts models, whose
    # prompt steps are bound by their kernel launches; off for dense ones, where they were measured slower
    # offline: docs/BENCHMARKS.md). Decode-only steps have their own graphs either way.
    cuda_graph_prompt_steps: str = "auto"
    # Row-parallel partial products summed across ranks in float32 and rounded once, as one GPU's GEMM
    # rounds its sum, or in the activations' dtype ("model": half the bytes, one more rounding per rank).
    # "auto": float32 on GPUs (their BLAS writes float32 directly), the model's dtype on CPU.
    tp_reduce_dtype: str = "auto"
    # The residual stream (the running sum that each attention and MLP block adds to) in float32, or in the
    # activations' dtype ("model"; also "auto"). float32 brings half-precision logits closer to float32 ones
    # and TP=2's greedy tokens closer to TP=1's, at a small cost in speed: see docs/ARCHITECTURE.md.
    residual_dtype: str = "auto"
    # The step watchdog: a step may run this many seconds longer than twice the slowest step so far (the
    # first, which may compile kernels, four times this) before the engine is declared dead. 0: no watchdog.
    step_timeout_s: float = 30.0
    hf_overrides: dict = field(default_factory=dict)
    # Quantize a full-precision checkpoint's linear layers and experts as they load: "fp8" (= "fp8_channel":
    # per-channel weights, dynamic per-token activations), "fp8_tensor", "fp8_block" (128x128), "mxfp4"
    # (weight-only). None: as the checkpoint is (a quantized checkpoint's quantization_config is followed).
    quantization: str | None = None
    # "auto": the KV cache in the activations' dtype. "fp8" (= "fp8_e4m3"): keys and values stored as FP8
    # e4m3 (e4m3fnuz on MI300X), half the bytes of bf16, dequantized by the attention kernels.
    kv_cache_dtype: str = "auto"
    # An FP8 cache's scales: "tensor" (one per layer for keys, one for values: the checkpoint's k_scale /
    # v_scale, else 1.0), "token" (computed per token and KV head as they are written), "auto" ("tensor"
    # where the checkpoint has KV scales, else "token").
    kv_cache_scales: str = "auto"
    # Speculative decoding (engine/spec_decode): vLLM's speculative_config, as a mapping or a
    # SpeculativeConfig (a mapping is turned into one); None: off.
    speculative_config: Any = None

    def __post_init__(self) -> None:
        from engine.spec_decode.config import SpeculativeConfig
        self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        self._check(isinstance(self.model, str) and self.model != "", "model", "must be a non-empty string")
        self._check(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}")
        self._check(self.load_format in LOAD_FORMATS, "load_format", f"must be one of {LOAD_FORMATS}")
        self._check(self.kernel_backend in KERNEL_BACKENDS, "kernel_backend", f"must be one of {KERNEL_BACKENDS}")
        self._check(self.device in DEVICES, "device", f"must be one of {DEVICES}")
        self._check(self.tp_reduce_dtype in TP_REDUCE_DTYPES, "tp_reduce_dtype", f"must be one of {TP_REDUCE_DTYPES}")
        self._check(self.residual_dtype in RESIDUAL_DTYPES, "residual_dtype", f"must be one of {RESIDUAL_DTYPES}")
        self._check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}")
        self._check(self.quantization is None or self.quantization in QUANTIZATIONS, "quantization",
                    f"must be one of {QUANTIZATIONS} or None")
        self._check(self.kv_cache_scales in KV_CACHE_SCALES, "kv_cache_scales", f"must be one of {KV_CACHE_SCALES}")
        self._check(self.expert_exchange in EXPERT_EXCHANGES, "expert_exchange", f"must be one of {EXPERT_EXCHANGES}")
        self._check(isinstance(self.expert_load_window, int) and not isinstance(self.expert_load_window, bool)
                    and self.expert_load_window >= 0, "expert_load_window",
                    "must be a number of steps >= 0 (0 turns the counting off)")
        self._positive_int("max_num_seqs")
        self._positive_int("block_size")
        self._positive_int("tensor_parallel_size")
        self._positive_int("data_parallel_size")
        self._optional_positive_int("max_model_len")
        self._optional_positive_int("max_num_batched_tokens")
        self._optional_positive_int("long_prefill_token_threshold")
        self._optional_positive_int("num_kv_blocks")
        self._optional_positive_int("kv_cache_memory_bytes")
        self._check(self.block_size <= 1024 and self.block_size & (self.block_size - 1) == 0,
                    "block_size", "must be a power of two no larger than 1024")
        self._check(isinstance(self.gpu_memory_utilization, (int, float))
                    and 0.0 < self.gpu_memory_utilization <= 1.0,
                    "gpu_memory_utilization", "must be a number in (0, 1]")
        self._check(isinstance(self.seed, int) and not isinstance(self.seed, bool), "seed", "must be an integer")
        self._check(isinstance(self.step_timeout_s, (int, float)) and not isinstance(self.step_timeout_s, bool)
                    and 0 <= self.step_timeout_s < float("inf"), "step_timeout_s",
                    "must be a number of seconds >= 0 (0 turns the watchdog off)")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "enable_expert_parallel"):
            self._check(isinstance(getattr(self, name), bool), name, "must be true or false")
        self._check(self.cuda_graph_prompt_steps in ("auto", "on", "off"), "cuda_graph_prompt_steps",
                    "must be 'auto', 'on' or 'off'")
        self._check(isinstance(self.hf_overrides, dict), "hf_overrides", "must be a mapping")
        if (self.max_num_batched_tokens is not None and self.max_model_len is not None
                and not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len):
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}) with enable_chunked_prefill=False: long prompts could never be "
                "scheduled. Raise max_num_batched_tokens or enable chunked prefill.")
        if self.long_prefill_token_threshold is not None and not self.enable_chunked_prefill:
            raise ConfigError("long_prefill_token_threshold needs enable_chunked_prefill: without it a prompt "
                              "is prefilled whole")

    @property
    def fp8_kv_cache(self) -> bool:
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")

    @property
    def lockstep(self) -> bool:
        """Whether the DP ranks must step together: their MoE layers exchange tokens in every forward pass
        (for a model with experts; LLMEngine checks that it has some)."""
        return self.data_parallel_size > 1 and self.enable_expert_parallel

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        unknown = sorted(set(kwargs) - set(cls.field_names()))
        if unknown:
            raise ConfigError(f"unknown engine argument(s) {unknown}; valid ones are {cls.field_names()}")
        return cls(model=model, **kwargs)

    def _check(self, ok: bool, name: str, requirement: str) -> None:
        if not ok:
            raise ConfigError(f"EngineConfig.{name} {requirement} (got {getattr(self, name)!r})")

    def _positive_int(self, name: str) -> None:
        value = getattr(self, name)
        self._check(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                    name, "must be a positive integer")

    def _optional_positive_int(self, name: str) -> None:
        if getattr(self, name) is not None:
            self._positive_int(name)

"""Qwen3 (dense): the Llama decoder with per-head RMSNorm on queries and keys before RoPE."""
from __future__ import annotations

import torch

from engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config, residual_dtype: torch.dtype | None = None) -> None:
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen3 with use_sliding_window=true is not supported")
        super().__init__(config, residual_dtype)

    @staticmethod
    def attention_flags(config, bias: bool) -> dict:
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}

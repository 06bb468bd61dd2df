"""Qwen2 / Qwen2.5: the Llama decoder with a bias on the Q, K and V projections (none on the output)."""
from __future__ import annotations

import torch

from engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config, residual_dtype: torch.dtype | None = None) -> None:
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen2 with use_sliding_window=true is not supported")
        super().__init__(config, residual_dtype)

    @staticmethod
    def attention_flags(config, bias: bool) -> dict:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}

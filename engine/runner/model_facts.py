"""What the kernel backends decide their ops on, read from a model's config once at start-up
(engine.kernels.registry.ModelFacts), and the op table that results."""
from __future__ import annotations

import torch

from engine import kernels
from engine.config import EngineConfig
from engine.models.llama import layer_attention_shape
from engine.parallel import get_parallel_state


def model_facts(hf_config, config: EngineConfig, dtype: torch.dtype) -> kernels.ModelFacts:
    """What the kernel backends decide their ops on (engine.kernels.registry.ModelFacts)."""
    from engine.loader.quant_plan import resolve_quant_plan
    plan = resolve_quant_plan(hf_config, config.quantization)
    text = getattr(hf_config, "text_config", None) or hf_config
    heads = getattr(text, "num_attention_heads", 1) or 1
    # (head size, KV heads) of every attention layer (they differ by layer in Gemma 4).
    shapes = {layer_attention_shape(text, i) for i in range(getattr(text, "num_hidden_layers", 1))}
    window = getattr(text, "sliding_window", None)
    uses_window = bool(window) and getattr(text, "use_sliding_window", True) is not False
    mla = {}
    if getattr(text, "kv_lora_rank", None):
        from engine.layers.linear import shard_range
        state = get_parallel_state()
        mla = dict(mla_heads=shard_range(heads, state.tp_size, state.tp_rank)[1],
                   mla_entry=(int(text.kv_lora_rank), int(text.qk_rope_head_dim)))
    extras = (("attention sinks",) if getattr(text, "model_type", None) == "gpt_oss" else ()) + \
        (("logit soft-capping",) if getattr(text, "attn_logit_softcapping", None) else ())
    epilogue = ("expert biases and gpt-oss's activation" if getattr(text, "model_type", None) == "gpt_oss"
                else "GELU-tanh experts" if getattr(text, "enable_moe_block", False) else None)
    return kernels.ModelFacts(**mla, clamped_experts=getattr(text, "swiglu_limit", None) is not None,
                              expert_epilogue=epilogue, head_sizes=tuple(sorted({size for size, _ in shapes})),
                              gqa_ratios=tuple(sorted({heads // max(kv, 1) for _, kv in shapes})),
                              sliding_window=uses_window, attention_extras=extras,
                              block_size=config.block_size, dtype=dtype,
                              fp8_kv_cache=config.fp8_kv_cache, kv_cache_scales=config.kv_cache_scales,
                              linear_quant=plan.default_linear if plan else None,
                              experts_quant=plan.default_experts if plan else None)


def format_op_table(backend: kernels.KernelBackend) -> str:
    """The op -> implementation table, one aligned line per op."""
    rows = backend.table()
    width = max(len(op) for op, _ in rows)
    return "\n".join(f"  {op:<{width}}  {impl}" for op, impl in rows)

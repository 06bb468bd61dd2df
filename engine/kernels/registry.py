"""Kernel backends and the choice between them.

A backend is a table: operation name -> function, plus its attention backend. Choosing one happens once,
at start-up: operations the chosen backend lacks, or declines for this model (`declines`: AITER's
attention kernels need head size 128, for example), fall back to the Triton backend where it can run,
else to the torch reference; each fallback is logged then, and `KernelBackend.table()` lists what runs, so
no request ever discovers a missing kernel.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.kernels.quant import QuantScheme

logger = logging.getLogger(__name__)

# Every operation a layer may call through `engine.kernels.ops`.
OPS = (
    "gemm",                 # (x, weight[N,K], bias|None) -> x @ weight.T + bias
    "gemm_float32",         # (x, weight[N,K]) -> x @ weight.T in float32, unrounded (TP partial sums, logits)
    "rms_norm",             # (x, weight, eps) -> normalised x, in the weight's dtype
    "fused_add_rms_norm",   # (x, residual, weight, eps) -> (normalised x + residual in the weight's dtype,
                            #   x + residual in the residual's dtype); x (possibly a float32 reduced sum) is
                            #   first rounded to the weight's dtype, as one device's GEMM rounds its output
    "rms_norm_variant",     # (x, weight|None, eps, style) -> normalised x in x's dtype; style "offset" (1 + w),
                            #   "float32" (w applied in float32), "none" (no weight), "llama" (= rms_norm)
    "fused_add_rms_norm_variant",  # (x, residual, weight|None, eps, style) -> (rms_norm_variant(x + residual),
                            #   x + residual), x rounded to the residual's dtype first; "llama" = fused_add_rms_norm
    "rms_norm_gated",       # (x, gate, weight, eps) -> w * norm(x) * silu(gate) (Gated DeltaNet's output norm)
    "rotary_embedding",     # (positions, q, k, cos_sin_cache, is_neox) -> (q, k), may be in place
    "silu_and_mul",         # (x[..., 2I]) -> silu(x[..., :I]) * x[..., I:]
    "gelu_tanh_and_mul",    # (x[..., 2I]) -> gelu_tanh(x[..., :I]) * x[..., I:] (Gemma's gated MLP)
    "gated_gemm",           # (x, weight[2I,K], bias|None) -> silu_and_mul(gemm(x, weight, bias)): the MLP's gate/up
    "sample",               # (logits[B,V] fp32, SamplingTensors) -> token ids [B] int64
    # Gated DeltaNet (engine/kernels/torch/gdn.py states the contracts), over a ragged batch with state slots:
    "causal_conv1d",        # (x[T,C], weight[C,K], conv_state[S,C,K-1]|None, metadata) -> silu(conv) [T,C]
    "gated_delta_rule",     # (q, k [T,H,dk], v [T,H,dv], g, beta [T,H], state[S,H,dk,dv] fp32|None, metadata)
                            #   -> o [T,H,dv]; states updated in place
    # Mixture of experts (engine/kernels/torch/moe.py states the contracts):
    "moe_topk_softmax",     # (logits[T,E] fp32, top_k, renormalize) -> (weights[T,k] fp32, ids[T,k] int32)
    "moe_grouped_topk",     # (logits, top_k, renormalize, num_groups, topk_groups, scoring, bias|None,
                            #   routed_scaling_factor) -> (weights, ids)
    "fused_experts",        # (x[T,H], w13[E,2I,H], w2[E,H,I], weights[T,k] fp32, ids[T,k] int32, -1 = none)
                            #   -> [T,H]: the weighted sum of each token's experts' MLPs
    "moe_route_mask",       # (weights, ids, first_row, valid: Tensor[1]|int|None, counts[E+1]|None) -> (weights,
                            #   ids) with padding rows (first_row + i >= valid) routed nowhere; counts += pairs
    "moe_local_slots",      # (routing[R,2k] fp32: global ids then weights, expert_start, num_local, counts|None)
                            #   -> (local ids[R,k] int32, weights[R,k] fp32); counts += the global pairs
    # Quantized weights (engine/kernels/quant.py states the formats; engine/kernels/torch/quant.py the maths).
    # An op may carry `prepare(qw) -> None`, run once per weight after loading to fill qw.prepared with the
    # layout its kernels read (see `prepare_quantized`).
    "gemm_fp8_tensor",      # (x[...,K], qw: QuantizedWeight, bias|None, out_dtype=None) -> [...,N]
    "gemm_fp8_channel",     #   the same for each scheme
    "gemm_fp8_block",
    "gemm_mxfp4",
    "gemm_int4_group",
    "fused_experts_fp8",    # (x, w13: QuantizedWeight [E,2I,H], w2: QuantizedWeight [E,H,I], weights, ids)
    "fused_experts_mxfp4",  #   -> [T,H], as fused_experts
    "fused_experts_int4",
    # Multi-head latent attention (engine/kernels/mla.py states the contracts):
    "mla_attention",        # (q_nope[T,H,N], q_pe[T,H,R], latent[T,L], k_pe[T,R], kv_cache, metadata, weights: MLAWeights,
                            #   scale, block_size, kv_quant: KVCacheQuant | None = None) -> [T,H,V]: writes the
                            #   step's latent entries (FP8 with kv_quant's per-tensor scale), then attends
    "mla_sparse_attention", # (q[T,H,D], kv_cache [..., D] entries, slots[T,K] int (-1: none), scale, v_dim,
                            #   kv_quant=None) -> (out[T,H,v_dim] in q's dtype, lse[T,H] fp32): each query over
                            #   its listed entries
)


def prepare_quantized(op: Callable, qw) -> None:
    """Let `op`'s backend derive the layout its kernels read from a loaded quantized weight (once)."""
    prepare = getattr(op, "prepare", None)
    if prepare is not None:
        prepare(qw)

# name -> module that defines BACKEND (a KernelBackend) and available(device) -> str | None (why not).
BACKEND_MODULES = {
    "torch": "engine.kernels.torch",
    "triton": "engine.kernels.triton",
    "aiter": "engine.kernels.aiter",
}


@dataclass(frozen=True)
class ModelFacts:
    """What a backend may need to know about the model to decide, once, what it serves."""
    head_sizes: tuple[int, ...] = ()
    gqa_ratios: tuple[int, ...] = ()        # query heads per KV head, per attention layer kind
    sliding_window: bool = False
    attention_extras: tuple[str, ...] = ()  # what attention does beyond a window: "attention sinks", ...
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    fp8_kv_cache: bool = False
    kv_cache_scales: str = "auto"
    # The schemes most linear layers and most routed experts are quantized with (None: unquantized), so a
    # backend declines a quantized op at start-up, in the kernel table, rather than layer by layer.
    linear_quant: QuantScheme | None = None
    experts_quant: QuantScheme | None = None
    # Multi-head latent attention: query heads per rank and the latent entry (kv_lora_rank, qk_rope_head_dim).
    mla_heads: int | None = None
    mla_entry: tuple[int, int] | None = None
    clamped_experts: bool = False  # routed experts with a clamped SwiGLU (DeepSeek-V4's swiglu_limit)
    expert_epilogue: str | None = None  # experts with biases or another activation: which (gpt-oss, Gemma 4)


@dataclass
class KernelBackend:
    name: str
    ops: dict[str, Callable] = field(default_factory=dict)
    attention: type | None = None  # an AttentionBackend subclass
    # (op name or "attention", facts) -> why this backend cannot serve it for this model, or None.
    declines: Callable[[str, ModelFacts], str | None] | None = None
    # op (or "attention") -> what runs it, for the start-up table (filled by `resolve`).
    sources: dict[str, str] = field(default_factory=dict)

    def table(self) -> list[tuple[str, str]]:
        """(op, implementation) for every op and the attention backend: what this process runs."""
        rows = [(op, self.sources.get(op, describe(self.ops.get(op)))) for op in OPS]
        return rows + [("attention", self.sources.get("attention", describe(self.attention)))]


def describe(fn) -> str:
    """A kernel's name for tables: its `kernel` attribute (e.g. "aiter.pa_fwd_asm"), else module.function."""
    if fn is None:
        return "-"
    kernel = getattr(fn, "kernel", None)
    if kernel:
        return kernel
    name = getattr(fn, "__qualname__", getattr(fn, "__name__", type(fn).__name__))
    return f"{fn.__module__.removeprefix('engine.kernels.')}.{name}"


class BackendUnavailable(ValueError):
    """The requested kernel backend cannot run on this machine; the message says why (a user's choice that
    cannot be met: a ValueError, as every configuration error)."""


def _load(name: str):
    return importlib.import_module(BACKEND_MODULES[name])


def unavailable_reason(name: str, device: torch.device) -> str | None:
    try:
        module = _load(name)
    except ImportError as exc:
        return f"its module could not be imported ({exc})"
    return module.available(device)


def choose_backend_name(requested: str, device: torch.device) -> str:
    """'auto' picks aiter on ROCm with AITER installed, triton on other GPUs, torch on CPU."""
    if requested != "auto":
        reason = unavailable_reason(requested, device)
        if reason is not None:
            raise BackendUnavailable(f"kernel_backend={requested!r} cannot run on {device}: {reason}")
        return requested
    if device.type == "cuda":
        candidates = ["aiter", "triton"] if torch.version.hip else ["triton"]
        for name in candidates:
            if unavailable_reason(name, device) is None:
                return name
    return "torch"


def fallback_backend_name(name: str, device: torch.device) -> str:
    """Where a backend's missing or declined ops go: Triton where it runs (and is not the backend itself),
    else the torch reference."""
    if name != "triton" and unavailable_reason("triton", device) is None:
        return "triton"
    return "torch"


def resolve(requested: str, device: torch.device, facts: ModelFacts | None = None) -> KernelBackend:
    """The chosen backend with every missing or declined operation filled in from the fallback backend."""
    name = choose_backend_name(requested, device)
    backend = _load(name).BACKEND
    facts = facts or ModelFacts()
    if name == "torch":
        return KernelBackend(name, dict(backend.ops), backend.attention,
                             sources={"attention": describe(backend.attention)})
    fallback_name = fallback_backend_name(name, device)
    fallback = resolve(fallback_name, device, facts) if fallback_name != "torch" else _load("torch").BACKEND
    table, sources, missing = {}, {}, []
    for op in (*OPS, "attention"):
        impl = backend.attention if op == "attention" else backend.ops.get(op)
        reason = "not implemented" if impl is None else (backend.declines(op, facts) if backend.declines else None)
        if reason is None:
            chosen, sources[op] = impl, describe(impl)
        else:
            chosen = fallback.attention if op == "attention" else fallback.ops[op]
            sources[op] = f"{describe(chosen)} ({fallback_name} fallback: {reason})"
            (missing.append(op) if reason == "not implemented"
             else logger.info("kernel backend %s: %s runs on %s: %s", name, op, fallback_name, reason))
        if op == "attention":
            attention = chosen
        else:
            table[op] = chosen
    if missing:
        logger.info("kernel backend %s: using %s for %s", name, fallback_name, ", ".join(missing))
    return KernelBackend(name, table, attention, sources=sources)

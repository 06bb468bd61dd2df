"""Kernel backends and the choice between them.

A backend is a table: operation name -> function, plus its attention backend. Choosing one happens once,
at start-up: operations the chosen backend lacks fall back to the torch reference and are logged then,
so no request ever discovers a missing kernel.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

logger = logging.getLogger(__name__)

# Every operation a layer may call through `engine.kernels.ops`.
OPS = (
    "gemm",                 # (x, weight[N,K], bias|None) -> x @ weight.T + bias
    "gemm_float32",         # (x, weight[N,K]) -> x @ weight.T in float32, unrounded (TP partial sums, logits)
    "rms_norm",             # (x, weight, eps) -> normalised x, in the weight's dtype
    "fused_add_rms_norm",   # (x, residual, weight, eps) -> (normalised x + residual in the weight's dtype,
                            #   x + residual in the residual's dtype); x (possibly a float32 reduced sum) is
                            #   first rounded to the weight's dtype, as one device's GEMM rounds its output
    "rotary_embedding",     # (positions, q, k, cos_sin_cache, is_neox) -> (q, k), may be in place
    "silu_and_mul",         # (x[..., 2I]) -> silu(x[..., :I]) * x[..., I:]
    "gated_gemm",           # (x, weight[2I,K], bias|None) -> silu_and_mul(gemm(x, weight, bias)): the MLP's gate/up
    "sample",               # (logits[B,V] fp32, SamplingTensors) -> token ids [B] int64
    # Mixture of experts (engine/kernels/torch/moe.py states the contracts):
    "moe_topk_softmax",     # (logits[T,E] fp32, top_k, renormalize) -> (weights[T,k] fp32, ids[T,k] int32)
    "moe_grouped_topk",     # (logits, top_k, renormalize, num_groups, topk_groups, scoring, bias|None,
                            #   routed_scaling_factor) -> (weights, ids)
    "fused_experts",        # (x[T,H], w13[E,2I,H], w2[E,H,I], weights[T,k] fp32, ids[T,k] int32, -1 = none)
                            #   -> [T,H]: the weighted sum of each token's experts' MLPs
)

# name -> module that defines BACKEND (a KernelBackend) and available(device) -> str | None (why not).
BACKEND_MODULES = {
    "torch": "engine.kernels.torch",
    "triton": "engine.kernels.triton",
    "aiter": "engine.kernels.aiter",
}


@dataclass
class KernelBackend:
    name: str
    ops: dict[str, Callable] = field(default_factory=dict)
    attention: type | None = None  # an AttentionBackend subclass


class BackendUnavailable(RuntimeError):
    """The requested kernel backend cannot run on this machine; the message says why."""


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


def resolve(requested: str, device: torch.device) -> KernelBackend:
    """The chosen backend with every missing operation filled in from the torch reference."""
    name = choose_backend_name(requested, device)
    backend = _load(name).BACKEND
    if name == "torch":
        return backend
    reference = _load("torch").BACKEND
    missing = [op for op in OPS if op not in backend.ops]
    if missing:
        logger.info("kernel backend %s: using the torch reference for %s", name, ", ".join(missing))
    table = {op: backend.ops.get(op, reference.ops[op]) for op in OPS}
    return KernelBackend(name, table, backend.attention or reference.attention)

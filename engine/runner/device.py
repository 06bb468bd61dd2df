"""Which device and dtype a runner uses."""
from __future__ import annotations

from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(requested: str) -> torch.device:
    if requested == "cpu":
        return torch.device("cpu")
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' was requested but torch sees no GPU")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(requested: str, hf_config, device: torch.device) -> torch.dtype:
    """'auto': the checkpoint's 16-bit dtype if it has one; float32 checkpoints (and GGUF) run in
    bfloat16 where the hardware computes it natively, else float32."""
    if requested != "auto":
        return _DTYPES[requested]
    # transformers 5 calls it `dtype` (and warns on `torch_dtype`); 4.x only has `torch_dtype`.
    attributes = vars(hf_config)
    checkpoint = attributes.get("dtype") or attributes.get("torch_dtype")
    if isinstance(checkpoint, str):
        checkpoint = _DTYPES.get(checkpoint)
    if checkpoint in (torch.bfloat16, torch.float16):
        if device.type == "cpu" and not cpu_has_bf16():
            return torch.float32
        return checkpoint
    if device.type == "cuda" or cpu_has_bf16():
        return torch.bfloat16
    return torch.float32


def resolve_residual_dtype(requested: str, model_dtype: torch.dtype) -> torch.dtype:
    """The residual stream's dtype: "float32", or the model's ("model", and "auto": a float32 stream costs
    1-2 % of batch-1 decode and 5 % of offline throughput on an H100, see docs/BENCHMARKS.md)."""
    return torch.float32 if requested == "float32" else model_dtype

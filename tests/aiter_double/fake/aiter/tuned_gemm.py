"""tgemm.mm: the bf16/fp16 GEMM with optional per-tensor FP8 (scale_a, scale_b).

Untuned shapes (all of them here) take the real wrapper's torch fallback: F.linear for 16-bit inputs
(rounded to the input dtype, then cast to otype), and for FP8 inputs
(inp @ weights^T) * scale_a * scale_b + bias in float32, rounded to otype (default: inp.dtype).
"""
from typing import Optional

import torch
from torch import Tensor

from .utility import dtypes
from ._double.recording import recorded


class TunedGemm:
    """bf16/fp16 with per tensor fp8 quant"""

    def __init__(self):
        self.extensions_created = False

    @recorded("tgemm.mm")
    def mm(
        self,
        inp: Tensor,
        weights: Tensor,
        bias: Optional[Tensor] = None,
        otype: Optional[torch.dtype] = None,
        scale_a: Optional[Tensor] = None,
        scale_b: Optional[Tensor] = None,
        scale_c: Optional[Tensor] = None,
    ):
        flat = inp.reshape(-1, inp.shape[-1])
        if inp.dtype == dtypes.fp8:
            scale_a = torch.ones(1) if scale_a is None else scale_a
            scale_b = torch.ones(1) if scale_b is None else scale_b
            out = (flat.float() @ weights.float().t()) * scale_a.float().reshape(-1, 1) * scale_b.float().reshape(1, -1)
            if bias is not None:
                out = out + bias.float()
            out = out.to(otype or inp.dtype)
        elif inp.dtype in (dtypes.bf16, dtypes.fp16, dtypes.fp32):
            out = torch.nn.functional.linear(flat, weights, bias)
            if otype is not None:
                out = out.to(otype)
        else:
            raise RuntimeError(f"tgemm.mm: unsupported input dtype {inp.dtype} (fp8 is {dtypes.fp8})")
        return out.view(*inp.shape[:-1], weights.shape[0])


tgemm = TunedGemm()

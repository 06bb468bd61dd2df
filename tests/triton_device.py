"""Where the Triton kernel tests run: compiled on a CUDA GPU, else under TRITON_INTERPRET=1 on CPU
(tests/engine/kernels/conftest.py sets it before any kernel module is imported); a test module that imports
this is skipped without Triton, or with neither a GPU nor the interpreter."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if INTERPRETED:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("no GPU and TRITON_INTERPRET is off", allow_module_level=True)
ON_GPU = DEVICE == "cuda"


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference, relative to the largest expected value (same shape and dtype asserted)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual.shape, expected.shape)
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max())


def check_quantized_graph_replay(qw, x, w13, w2, h, weights, ids, new_routing) -> None:
    """A quantized GEMM and fused experts captured in one CUDA graph give, replayed on new inputs (new
    activations, and `new_routing`'s (weights, ids)), what eager calls give on those inputs."""
    from engine.kernels.triton import moe_quant, quant
    quant.gemm_quantized(x, qw), moe_quant.fused_experts_quantized(h, w13, w2, weights, ids)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = quant.gemm_quantized(x, qw)
        out = moe_quant.fused_experts_quantized(h, w13, w2, weights, ids)
    x.copy_(torch.randn_like(x))
    h.copy_(torch.randn_like(h))
    new_weights, new_ids = new_routing
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.testing.assert_close(y, quant.gemm_quantized(x, qw))
    torch.testing.assert_close(out, moe_quant.fused_experts_quantized(h, w13, w2, weights, ids))

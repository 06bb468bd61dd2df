"""The TMA probe's skinny GEMM (benchmarks/tma_gemv_probe.py) computes x W^T, so its timings compare like
with like (under the interpreter on CPU, on Hopper GPUs with TMA)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from benchmarks.tma_gemv_probe import tma_skinny_gemm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.skipif(DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9, reason="TMA needs sm_90+")
@pytest.mark.parametrize("rows, n, block_n", [(1, 64, 32), (3, 96, 32), (5, 128, 64)])
def test_tma_skinny_gemm_matches_torch(rows, n, block_n):
    torch.manual_seed(rows)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x = torch.randn(rows, 256, device=DEVICE, dtype=dtype)
    w = torch.randn(n, 256, device=DEVICE, dtype=dtype)
    got = tma_skinny_gemm(x, w, block_n, 64, 2)
    torch.testing.assert_close(got.float(), x.float() @ w.float().T, rtol=2e-2, atol=2e-1)

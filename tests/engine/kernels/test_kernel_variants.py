"""The benchmark's earlier kernel sequences (benchmarks/kernel_variants.py) really are the earlier
sequences: same results as the current kernels, through the old launches."""
from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("triton")

from benchmarks import kernel_variants  # noqa: E402
from engine.kernels import ops  # noqa: E402
from engine.kernels.attention import CommonAttentionMetadata  # noqa: E402
from engine.kernels.triton import gemv, pdl  # noqa: E402
from engine.kernels.triton.attention import TritonAttentionBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def restore(monkeypatch):
    """Every attribute a variant patches, put back after the test."""
    for name in ("forward", "build_metadata"):
        monkeypatch.setattr(TritonAttentionBackend, name, inspect.getattr_static(TritonAttentionBackend, name))
    monkeypatch.setattr(gemv, "PREFETCH_BYTES_PER_ROW", gemv.PREFETCH_BYTES_PER_ROW)
    for name in ("gemm", "gated_gemm"):
        monkeypatch.setattr(ops, name, getattr(ops, name))
    monkeypatch.setenv("ATOM_RAY_TRITON_PDL", "1")
    yield
    pdl._supported.cache_clear()


def one_prefill(tokens: int = 5) -> CommonAttentionMetadata:
    return CommonAttentionMetadata(
        num_seqs=1, num_decodes=0, num_tokens=tokens,
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([tokens], dtype=torch.int32, device=DEVICE),
        block_table=torch.tensor([[0]], dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.arange(tokens, device=DEVICE), max_query_len=tokens, max_seq_len=tokens,
        query_start_loc_cpu=[0, tokens], seq_lens_cpu=[tokens], num_computed_tokens_cpu=[0])


def test_unfused_rope_gives_the_fused_result(restore):
    common = one_prefill()
    table = torch.randn(16, 64, device=DEVICE)
    q, k, v = (torch.randn(5, h, 64, device=DEVICE) for h in (4, 2, 2))
    rope = (torch.arange(5, device=DEVICE), table, True)
    caches = [torch.zeros(TritonAttentionBackend.kv_cache_shape(1, 16, 2, 64), device=DEVICE) for _ in range(2)]
    metadata = TritonAttentionBackend.build_metadata(common, 16)
    fused = TritonAttentionBackend.forward(q.clone(), k.clone(), v, caches[0], metadata, 0.125, 16, rope)
    kernel_variants.unfused_rope()
    unfused = TritonAttentionBackend.forward(q.clone(), k.clone(), v, caches[1], metadata, 0.125, 16, rope)
    torch.testing.assert_close(unfused, fused)
    torch.testing.assert_close(caches[1], caches[0])


def test_separate_silu_and_mul_gives_the_fused_result_through_separate_ops(restore, monkeypatch):
    """The gate/up GEMM and the SiLU-and-mul run as the table's two operations again."""
    from engine.kernels import triton as triton_backend
    for name, op in triton_backend.BACKEND.ops.items():
        monkeypatch.setattr(ops, name, op)
    calls = []
    monkeypatch.setattr(ops, "silu_and_mul", lambda y: calls.append(y.shape) or triton_backend.BACKEND.ops["silu_and_mul"](y))
    x = torch.randn(3, 64, device=DEVICE).to(torch.bfloat16)
    weight = torch.randn(96, 64, device=DEVICE).to(torch.bfloat16)
    fused = ops.gated_gemm(x, weight)
    kernel_variants.separate_silu_and_mul()
    separate = ops.gated_gemm(x, weight)
    assert calls[-1] == (3, 96), "SiLU-and-mul ran as its own operation on the GEMM's output"
    torch.testing.assert_close(separate.float(), fused.float(), rtol=3e-2, atol=0.5)


def test_long_decode_splits_and_prefetch_and_pdl_switches(restore):
    kernel_variants.long_decode_splits()
    assert TritonAttentionBackend.build_metadata(one_prefill(), 16).min_split_tokens == 256
    kernel_variants.no_l2_prefetch()
    assert gemv.PREFETCH_BYTES_PER_ROW == 0
    kernel_variants.pdl_off()
    if DEVICE == "cuda":
        assert pdl.launch_options(torch.zeros(1, device="cuda")) == {"USE_PDL": False}
    assert set(kernel_variants.KERNEL_VARIANTS) >= {"pdl-off", "blas-gemm", "unfused-rope", "long-decode-splits",
                                                      "separate-silu-and-mul"}

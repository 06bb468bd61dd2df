"""The benchmark's earlier kernel sequences (benchmarks/kernel_variants.py) really are the earlier
sequences: same results as the current kernels, through the old launches."""
from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("triton")

from benchmarks import kernel_variants  # noqa: E402
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


def test_long_decode_splits_and_prefetch_and_pdl_switches(restore):
    kernel_variants.long_decode_splits()
    assert TritonAttentionBackend.build_metadata(one_prefill(), 16).min_split_tokens == 256
    kernel_variants.no_l2_prefetch()
    assert gemv.PREFETCH_BYTES_PER_ROW == 0
    kernel_variants.pdl_off()
    if DEVICE == "cuda":
        assert pdl.launch_options(torch.zeros(1, device="cuda")) == {"USE_PDL": False}
    assert set(kernel_variants.KERNEL_VARIANTS) >= {"pdl-off", "blas-gemm", "unfused-rope", "long-decode-splits"}

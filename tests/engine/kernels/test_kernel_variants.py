"""The benchmark's earlier kernel sequences (benchmarks/kernel_variants.py) really are the earlier
sequences: same results as the current kernels, through the old launches."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

pytest.importorskip("triton")

from benchmarks import kernel_variants  # noqa: E402
from engine.kernels import ops  # noqa: E402
from engine.kernels.attention import CommonAttentionMetadata  # noqa: E402
from engine.kernels.triton import attention, decode_attention, gemv, pdl  # noqa: E402
from engine.kernels.triton.attention import TritonAttentionBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def restore(monkeypatch):
    """Every attribute a variant patches, put back after the test."""
    for name in ("forward", "build_metadata"):
        monkeypatch.setattr(TritonAttentionBackend, name, inspect.getattr_static(TritonAttentionBackend, name))
    monkeypatch.setattr(gemv, "PREFETCH_BYTES_PER_ROW", gemv.PREFETCH_BYTES_PER_ROW)
    monkeypatch.setattr(gemv, "PREFETCH_BUDGET_BYTES", gemv.PREFETCH_BUDGET_BYTES)
    monkeypatch.setattr(gemv, "PREFETCH_BYTES_PER_ROW_FOR", gemv.PREFETCH_BYTES_PER_ROW_FOR)
    monkeypatch.setattr(gemv, "PREFETCH_BYTES_PER_ROW_BY_DEVICE", gemv.PREFETCH_BYTES_PER_ROW_BY_DEVICE)
    monkeypatch.setattr(gemv, "preferred_tiles", gemv.preferred_tiles)
    monkeypatch.setattr(gemv, "NUM_WARPS", gemv.NUM_WARPS)
    monkeypatch.setattr(gemv, "_fitted", {})
    monkeypatch.setattr(decode_attention, "FUSED_DECODE", decode_attention.FUSED_DECODE)
    monkeypatch.setattr(decode_attention, "decode_plan", decode_attention.decode_plan)
    for name in ("gemm", "gated_gemm", "sample"):
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


class Recorded:
    """A Triton kernel whose launches are noted by name."""
    def __init__(self, kernel, name: str, launched: list) -> None:
        self.kernel, self.name, self.launched = kernel, name, launched

    def __getitem__(self, grid):
        self.launched.append(self.name)
        return self.kernel[grid]


def test_separate_decode_kernels_give_the_fused_result_through_three_launches(restore, monkeypatch):
    """A decode-only step with a rotation: the fused kernel's output and cache, through the rotary cache
    write, the split-K decode and its reduction."""
    launched = []
    for module, name in ((decode_attention, "_fused_decode_kernel"), (attention, "_rope_cache_write_kernel"),
                         (decode_attention, "_decode_kernel"), (decode_attention, "_decode_reduce_kernel")):
        monkeypatch.setattr(module, name, Recorded(getattr(module, name), name, launched))
    q, k, v = (torch.randn(2, h, 64, device=DEVICE) for h in (4, 2, 2))
    rope = (torch.tensor([40, 100], device=DEVICE), torch.randn(128, 64, device=DEVICE), True)
    caches = [torch.randn(TritonAttentionBackend.kv_cache_shape(14, 16, 2, 64), device=DEVICE)]
    caches.append(caches[0].clone())
    common = CommonAttentionMetadata(
        num_seqs=2, num_decodes=2, num_tokens=2,
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([41, 101], dtype=torch.int32, device=DEVICE),
        block_table=torch.arange(14, dtype=torch.int32, device=DEVICE).view(2, 7),
        slot_mapping=torch.tensor([2 * 16 + 8, 13 * 16 + 4], device=DEVICE), max_query_len=1, max_seq_len=101,
        query_start_loc_cpu=[0, 1, 2], seq_lens_cpu=[41, 101], num_computed_tokens_cpu=[40, 100])

    def step(cache):
        metadata = dataclasses.replace(TritonAttentionBackend.build_metadata(common, 16), num_sms=64,
                                       min_split_tokens=16)
        return TritonAttentionBackend.forward(q.clone(), k, v, cache, metadata, 0.125, 16, rope)
    fused = step(caches[0])
    assert launched == ["_fused_decode_kernel"]
    kernel_variants.separate_decode_kernels()
    separate = step(caches[1])
    assert launched[1:] == ["_rope_cache_write_kernel", "_decode_kernel", "_decode_reduce_kernel"]
    torch.testing.assert_close(separate, fused)
    assert torch.equal(caches[1], caches[0])


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
    kernel_variants.KERNEL_VARIANTS["l2-budget-16m"]()
    assert [gemv.prefetch_lines(n, 4096, 2) * 128 for n in (4096, 6144, 28672)] == [4096, 2048, 512]
    kernel_variants.KERNEL_VARIANTS["l2-per-row"]()
    assert gemv.prefetch_lines(28672, 4096, 2) * 128 == gemv.PREFETCH_BYTES_PER_ROW
    assert gemv.prefetch_lines(64, 32, 2) == 0, "never more than the row, here under one line"
    kernel_variants.KERNEL_VARIANTS["o-prefetch-8k"]()
    assert gemv.prefetch_lines(4096, 4096, 2) * 128 == 8192 and gemv.prefetch_lines(4096, 14336, 2) * 128 == 2048
    shapes = ((6144, 4096), (4096, 4096), (4096, 14336), (28672, 4096))
    assert [gemv.preferred_tiles(n, k, 2, 132) for n, k in shapes] == [(512, 4, 1)] * 4
    kernel_variants.KERNEL_VARIANTS["qkv-split2"]()
    assert [gemv.preferred_tiles(n, k, 2, 132) for n, k in shapes] == [(256, 4, 2)] + [(512, 4, 1)] * 3
    kernel_variants.KERNEL_VARIANTS["thin-k256-s5"]()
    assert [gemv.preferred_tiles(n, k, 2, 132) for n, k in shapes] == [(256, 5, 1)] * 2 + [(512, 4, 1)] * 2
    kernel_variants.no_l2_prefetch()
    assert gemv.PREFETCH_BYTES_PER_ROW == 0 and gemv.prefetch_lines(4096, 4096, 2) == 0
    assert gemv.PREFETCH_BYTES_PER_ROW_BY_DEVICE == {}, "a prefetch variant applies on every GPU model"
    kernel_variants.pdl_off()
    if DEVICE == "cuda":
        assert pdl.launch_options(torch.zeros(1, device="cuda")) == {"USE_PDL": False}
    assert set(kernel_variants.KERNEL_VARIANTS) >= {"pdl-off", "blas-gemm", "unfused-rope", "long-decode-splits",
                                                      "separate-silu-and-mul", "separate-decode-kernels"}


def test_plan_length_splits_give_every_sequence_the_plans_split_length(restore):
    """A plan made for a 4096-token context: each sequence now spreads its own context over the splits
    (minimum one tile); the variant makes the plan's split length every sequence's minimum again."""
    common = dataclasses.replace(one_prefill(), num_decodes=1, max_seq_len=4096, seq_lens_cpu=[4096])
    metadata = dataclasses.replace(TritonAttentionBackend.build_metadata(common, 16), num_sms=64, min_split_tokens=16)
    assert metadata.max_decode_seq_len == 4096
    num_splits, min_tiles = decode_attention.decode_plan(metadata, 8, 64)
    plan_length = -(-4096 // 64 // num_splits)
    assert min_tiles == 1 and plan_length > 1
    kernel_variants.plan_length_splits()
    assert decode_attention.decode_plan(dataclasses.replace(metadata, _decode_plans={}), 8, 64) == (num_splits, plan_length)


def _patched_state() -> tuple:
    import os
    return (dict(ops.__dict__), decode_attention.decode_plan, decode_attention.FUSED_DECODE,
            gemv.PREFETCH_BYTES_PER_ROW, gemv.PREFETCH_BUDGET_BYTES, gemv.PREFETCH_BYTES_PER_ROW_FOR, gemv.preferred_tiles, gemv.NUM_WARPS,
            inspect.getattr_static(TritonAttentionBackend, "forward"),
            inspect.getattr_static(TritonAttentionBackend, "build_metadata"), os.environ.get("ATOM_RAY_TRITON_PDL"))


def test_restore_undoes_every_variant(restore):
    """`gpu_perf --alternate` puts the current kernels back between variant runs."""
    state = kernel_variants.snapshot()
    before = _patched_state()
    for apply in kernel_variants.KERNEL_VARIANTS.values():
        apply()
    kernel_variants.restore(state)
    assert _patched_state() == before


def test_the_prefetch_per_row_is_the_gpu_models_measured_value(restore, monkeypatch):
    monkeypatch.setattr(gemv, "_device_name", lambda index: {0: "NVIDIA H200", 1: "NVIDIA H100 80GB HBM3"}[index])
    assert gemv.device_prefetch_bytes_per_row(torch.device("cuda", 0)) == 4096
    assert gemv.device_prefetch_bytes_per_row(torch.device("cuda", 1)) == gemv.PREFETCH_BYTES_PER_ROW == 2048
    assert gemv.device_prefetch_bytes_per_row(torch.device("cpu")) == 2048
    assert gemv.prefetch_lines(6144, 4096, 2, bytes_per_row=4096) * 128 == 4096
    kernel_variants.KERNEL_VARIANTS["l2-prefetch-2k"]()
    assert gemv.device_prefetch_bytes_per_row(torch.device("cuda", 0)) == 2048, "the variant wins on an H200 too"

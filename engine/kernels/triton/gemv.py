"""A skinny GEMM for decode-sized batches (a few rows against a large weight): y = x W^T (+ bias), and
for the MLP's merged gate/up projection silu(gate) * up in its epilogue.

Weight-bandwidth bound: each program streams a [BLOCK_N, K] slab of W through a software pipeline and
multiplies it with the whole batch of rows (padded to one 16-row tile) on the tensor cores.

Measured on an H100 (`benchmarks/gemm_bench.py`, Llama-3.1-8B projections, weights never L2-resident): 1.02x
to 1.15x cuBLAS at 1 and 16 rows for every projection, up to 3117 GB/s (the LM head) against 3037 GB/s for
a plain `sum` read of 1 GiB. Larger batches are compute-shaped and stay on the BLAS.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.torch import ops as torch_ops
from engine.kernels.triton import ops, pdl
from engine.kernels.triton.common import dot


@triton.jit
def _prefetch_l2(ptrs):
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                        USE_PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr):
    pid = tl.program_id(0)
    j = tl.arange(0, BLOCK_N)
    if GATED:
        # The program's tile holds BLOCK_N/2 gate rows and the matching up rows of the merged weight.
        n_out = N // 2
        features = pid * (BLOCK_N // 2) + j % (BLOCK_N // 2)
        w_index = features + (j // (BLOCK_N // 2)) * n_out
        col_mask = features < n_out
    else:
        w_index = pid * BLOCK_N + j
        col_mask = w_index < N
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + w_index.to(tl.int64)[:, None] * stride_wn
    if USE_PDL:
        if PREFETCH_LINES > 0:
            # While the previous kernel finishes: pull the start of this program's weight rows into L2
            # (no kernel writes weights, so reading them before the wait cannot race).
            starts = tl.arange(0, PREFETCH_LINES) * LINE
            ptrs = tl.where(col_mask[:, None] & (starts < K)[None, :], w_rows + starts[None, :], w_ptr)
            _prefetch_l2(ptrs)
        pdl.enter()
    row_mask = (rows < M)[:, None]
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = ((k + ks) < K)[None, :]
        x = tl.load(x_rows + k + ks[None, :], mask=row_mask & k_mask, other=0.0)
        w = tl.load(w_rows + k + ks[None, :], mask=col_mask[:, None] & k_mask, other=0.0)
        acc += dot(x, tl.trans(w), UPCAST)
    if HAS_BIAS:
        acc += tl.load(b_ptr + w_index, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_dtype = y_ptr.dtype.element_ty
    if GATED:
        # silu(gate) * up, each rounded to the activation dtype as the separate GEMM and SiLU-and-mul are.
        acc = acc.to(out_dtype).to(tl.float32)
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_dtype).to(tl.float32)
        cols = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :], (silu * up).to(out_dtype),
                 mask=(rows[:, None] < M) & (cols < n_out)[None, :])
    else:
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + w_index[None, :], acc.to(out_dtype),
                 mask=(rows[:, None] < M) & col_mask[None, :])


MAX_ROWS = 16  # the kernel takes up to 128 rows; the backend uses it where it measured faster than the BLAS
# Under programmatic dependent launch, each program prefetches this much of each of its weight rows into L2
# before waiting for the previous kernel (0: off).
PREFETCH_BYTES_PER_ROW = 2048
# When set: a budget for the whole launch instead, spread over its weight rows (a power-of-two number of
# 128-byte lines per row, at most the row): thin projections prefetch more of each row, wide ones less.
PREFETCH_BUDGET_BYTES: int | None = None


def prefetch_lines(n: int, k: int, element_size: int) -> int:
    """128-byte lines of each weight row that a program prefetches into L2 before its wait (0: none)."""
    per_row = PREFETCH_BYTES_PER_ROW if PREFETCH_BUDGET_BYTES is None else PREFETCH_BUDGET_BYTES // n
    lines = min(per_row, k * element_size) // 128
    return triton.next_power_of_2(lines + 1) // 2 if lines > 0 else 0  # the largest power of two <= lines


def _candidate_tiles(n: int, k: int, element_size: int):
    """Tiles in order of preference. First those that measured best or within a few per cent of best in
    the H100 sweeps of the Llama-3.1-8B projections at TP=1 and TP=2 (bf16, up to 16 rows): 32 output
    features per program, long K tiles for long or tall weights, five pipeline stages. Then shorter K tiles
    and fewer stages, for GPUs with less shared memory and for more rows."""
    block_k, stages = (512 if k >= 8192 or n >= 12288 else 256), 5
    if element_size > 2:  # fp32 is not a speed path
        block_k, stages = 128, 3
    while block_k >= 64:
        for num_stages in (stages, stages - 1):
            yield dict(block_n=32, block_k=block_k, num_stages=num_stages, num_warps=4)
        block_k //= 2
    yield dict(block_n=32, block_k=64, num_stages=2, num_warps=4)


_fitted: dict[tuple, dict] = {}  # (N, K, dtype, row tile, gated, out dtype, device) -> the first candidate that launched


def _launch_fitted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool,
                   out_dtype: torch.dtype | None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    key = (weight.shape[0], weight.shape[1], x.dtype, max(16, triton.next_power_of_2(rows)), gated, out_dtype, x.device)
    tiles = _fitted.get(key)
    if tiles is not None:
        return skinny_gemm(x, weight, bias, **tiles, gated=gated, out_dtype=out_dtype)
    error = None
    for tiles in _candidate_tiles(weight.shape[0], weight.shape[1], x.element_size()):
        try:  # a launch whose buffers do not fit this GPU's shared memory fails before it runs
            out = skinny_gemm(x, weight, bias, **tiles, gated=gated, out_dtype=out_dtype)
        except triton.runtime.errors.OutOfResources as exc:
            error = exc
            continue
        _fitted[key] = tiles
        return out
    raise error


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                block_n: int | None = None, block_k: int = 256, num_stages: int = 4, num_warps: int = 4, *,
                gated: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for x [..., K] with at most 128 rows and weight [N, K] (contiguous rows). With
    gated, the weight is a merged [gate; up] projection and y = silu(gate) * up, [..., N / 2]. y is in
    out_dtype (default: x's). Without tile sizes: the preferred tiles that fit this GPU (found at the first
    call of each shape, then kept)."""
    assert not (gated and out_dtype not in (None, x.dtype)), "the gated epilogue rounds to x's dtype"
    if block_n is None:
        return _launch_fitted(x, weight, bias, gated, out_dtype)
    k = x.shape[-1]
    rows = x.reshape(-1, x.shape[-1])
    m, n = rows.shape[0], weight.shape[0]
    assert m <= 128 and weight.shape[1] == k and weight.stride(1) == 1, (x.shape, weight.shape)
    assert not gated or (n % 2 == 0 and block_n % 2 == 0), (n, block_n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n_out = n // 2 if gated else n
    out = torch.empty(m, n_out, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n_out)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        rows, weight, bias if bias is not None else weight, out, m, n, k, rows.stride(0), weight.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, GATED=gated, BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=x.dtype != torch.float32 and x.device.type == "cpu",
        num_stages=num_stages, num_warps=num_warps, PREFETCH_LINES=prefetch_lines(n, k, weight.element_size()),
        LINE=128 // weight.element_size(), **pdl.launch_options(out))
    return out.view(*x.shape[:-1], n_out)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the skinny kernel serves this product: decode-sized half-precision batches on a GPU (the
    BLAS serves larger ones, and fp32, whose runs are the accuracy reference)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (0 < rows <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.stride(1) == 1 and x.is_cuda)


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The backend's GEMM: the skinny kernel where it serves, the BLAS otherwise."""
    if takes(x, weight):
        return skinny_gemm(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def gemm_float32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in float32, unrounded (a row-parallel rank's share): the skinny kernel stores its float32
    accumulator where it serves, the BLAS with a float32 output otherwise."""
    if takes(x, weight):
        return skinny_gemm(x, weight, out_dtype=torch.float32)
    return torch_ops.gemm_float32(x, weight)


def gated_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of a merged [gate; up] projection: in the skinny kernel's epilogue where it serves."""
    if takes(x, weight):
        return skinny_gemm(x, weight, bias, gated=True)
    return ops.silu_and_mul(torch.nn.functional.linear(x, weight, bias))

"""A skinny GEMM for decode-sized batches (a few rows against a large weight): y = x W^T (+ bias).

Weight-bandwidth bound: each program streams a [BLOCK_N, K] slab of W through a software pipeline and
multiplies it with the whole batch of rows (padded to one 16-row tile) on the tensor cores.

Measured on an H100 (`benchmarks/gemm_bench.py`, Llama-3.1-8B projections, weights never L2-resident): 1.02x
to 1.15x cuBLAS at 1 and 16 rows for every projection, up to 3117 GB/s (the LM head) against 3037 GB/s for
a plain `sum` read of 1 GiB. Larger batches are compute-shaped and stay on the BLAS.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels.triton import pdl


@triton.jit
def _mma(acc, x, w, UPCAST: tl.constexpr):
    if UPCAST:  # the interpreter multiplies half-precision bit patterns wrongly in tl.dot
        return acc + tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    elif x.dtype == tl.float32:
        return acc + tl.dot(x, tl.trans(w), input_precision="ieee")
    else:
        return acc + tl.dot(x, tl.trans(w))


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                        USE_PDL: tl.constexpr):
    if USE_PDL:
        pdl.enter()
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    col_mask = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    row_mask = (rows < M)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = ((k + ks) < K)[None, :]
        x = tl.load(x_rows + k + ks[None, :], mask=row_mask & k_mask, other=0.0)
        w = tl.load(w_rows + k + ks[None, :], mask=col_mask[:, None] & k_mask, other=0.0)
        acc = _mma(acc, x, w, UPCAST)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & col_mask[None, :])


MAX_ROWS = 16  # the kernel takes up to 64 rows; the backend uses it where it measured faster than the BLAS


@functools.lru_cache(maxsize=None)
def _shared_memory_bytes(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024


def default_config(n: int, k: int, element_size: int = 2, rows_tile: int = 16,
                   shared_memory: int = 227 * 1024) -> dict:
    """Tiles that measured best or within a few per cent of best in the H100 sweeps of the Llama-3.1-8B
    projections at TP=1 and TP=2 (bf16): 32 output features per program, long K tiles for long or tall
    weights, five pipeline stages; then K tiles and stages cut down until the pipeline's buffers (a
    weight and an activation tile per stage but the last) fit in `shared_memory`."""
    block_n, num_stages = 32, 5
    block_k = 512 if k >= 8192 or n >= 12288 else 256
    if element_size > 2:  # fp32 is not a speed path
        block_k, num_stages = 128, 3

    def buffers(block_k, stages):
        return (stages - 1) * (block_n + rows_tile) * block_k * element_size

    while buffers(block_k, num_stages) > shared_memory and block_k > 64:
        block_k //= 2
    while buffers(block_k, num_stages) > shared_memory and num_stages > 2:
        num_stages -= 1
    return dict(block_n=block_n, block_k=block_k, num_stages=num_stages, num_warps=4)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                block_n: int | None = None, block_k: int = 256, num_stages: int = 4,
                num_warps: int = 4) -> torch.Tensor:
    """x [..., K] with at most 64 rows, weight [N, K] (contiguous rows), bias [N] or None. Tile sizes
    default to `default_config` (fitted to this GPU's shared memory)."""
    if block_n is None:
        rows = x.numel() // x.shape[-1]
        config = default_config(weight.shape[0], weight.shape[1], x.element_size(),
                                max(16, triton.next_power_of_2(rows)),
                                _shared_memory_bytes(x.device.index) if x.is_cuda else 227 * 1024)
        return skinny_gemm(x, weight, bias, **config)
    k = x.shape[-1]
    rows = x.reshape(-1, x.shape[-1])
    m, n = rows.shape[0], weight.shape[0]
    assert m <= 64 and weight.shape[1] == k and weight.stride(1) == 1, (x.shape, weight.shape)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    upcast = x.dtype != torch.float32 and x.device.type == "cpu"
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        rows, weight, bias if bias is not None else weight, out, m, n, k, rows.stride(0), weight.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast, num_stages=num_stages, num_warps=num_warps,
        **pdl.launch_options(out))
    return out.view(*x.shape[:-1], n)


def _skinny_applies(x: torch.Tensor, weight: torch.Tensor, max_rows: int) -> bool:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (0 < rows <= max_rows and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.stride(1) == 1 and x.is_cuda)


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The backend's GEMM: the skinny kernel for decode-sized half-precision batches, the BLAS otherwise
    (and for fp32, whose runs are the accuracy reference)."""
    if _skinny_applies(x, weight, MAX_ROWS):
        return skinny_gemm(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


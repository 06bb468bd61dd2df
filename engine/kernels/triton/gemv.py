"""A skinny GEMM for decode-sized batches (a few rows against a large weight): y = x W^T (+ bias), and
for the MLP's merged gate/up projection silu(gate) * up in its epilogue.

Weight-bandwidth bound: each program streams a [BLOCK_N, K] slab of W (or, split-K, a slice of its K range)
through a software pipeline and multiplies it with the whole batch of rows (padded to one 16-row tile) on
the tensor cores.

Measured on an H100 (`benchmarks/gemm_bench.py`, Llama-3.1-8B projections, weights never L2-resident): 1.02x
to 1.15x cuBLAS at 1 and 16 rows for every projection with the 2026-11-22 tiles, up to 3117 GB/s (the LM
head) against 3037 GB/s for a plain `sum` read of 1 GiB; with the current tiles (`preferred_tiles`) at 1 row
1.04x-1.31x for gate/up, down and O (O: 12.7 us, 2637 GB/s). Larger batches are compute-shaped and stay
on the BLAS.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels.torch import ops as torch_ops
from engine.kernels.triton import ops, pdl, workspace
from engine.kernels.triton.common import dot


@triton.jit
def _prefetch_l2(ptrs):
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _epilogue(acc, b_ptr, y_ptr, pid, rows, M, n_out, w_index, col_mask, stride_ym,
              HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Bias, the gated product and the store of a finished [BLOCK_M, BLOCK_N] fp32 tile."""
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


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, counter_ptr, M, N, K, k_split,
                        stride_xm, stride_wn, stride_ym,
                        HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, UPCAST: tl.constexpr,
                        USE_PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr):
    """Grid (output tiles, SPLIT_K): each program multiplies its K range [split * k_split, + k_split)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    j = tl.arange(0, BLOCK_N)
    if GATED:
        # The program's tile holds BLOCK_N/2 gate rows and the matching up rows of the merged weight.
        n_out = N // 2
        features = pid * (BLOCK_N // 2) + j % (BLOCK_N // 2)
        w_index = features + (j // (BLOCK_N // 2)) * n_out
        col_mask = features < n_out
    else:
        n_out = N
        w_index = pid * BLOCK_N + j
        col_mask = w_index < N
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    k_begin = split * k_split
    k_end = tl.minimum(K, k_begin + k_split)
    w_rows = w_ptr + w_index.to(tl.int64)[:, None] * stride_wn
    if USE_PDL:
        if PREFETCH_LINES > 0:
            # While the previous kernel finishes: pull the start of this program's weight rows into L2
            # (no kernel writes weights, so reading them before the wait cannot race).
            starts = k_begin + tl.arange(0, PREFETCH_LINES) * LINE
            ptrs = tl.where(col_mask[:, None] & (starts < k_end)[None, :], w_rows + starts[None, :], w_ptr)
            _prefetch_l2(ptrs)
        pdl.enter()
    row_mask = (rows < M)[:, None]
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        k_mask = ((k + ks) < k_end)[None, :]
        x = tl.load(x_rows + k + ks[None, :], mask=row_mask & k_mask, other=0.0)
        w = tl.load(w_rows + k + ks[None, :], mask=col_mask[:, None] & k_mask, other=0.0)
        acc += dot(x, tl.trans(w), UPCAST)
    if SPLIT_K == 1:
        _epilogue(acc, b_ptr, y_ptr, pid, rows, M, n_out, w_index, col_mask, stride_ym,
                  HAS_BIAS, GATED, BLOCK_M, BLOCK_N)
    else:
        # Partials are [SPLIT_K, M, N] fp32. The split that arrives last sums them in split order (the same
        # bits whichever arrives last) and finishes the tile. Ordering as in decode_attention's fused kernel:
        # the barrier orders every thread's partial stores before the one thread's atomic, whose release at
        # GPU scope publishes them; the last arriver's acquire makes them visible, and it reads them from L2.
        part_mask = row_mask & col_mask[None, :]
        part_cols = rows.to(tl.int64)[:, None] * N + w_index[None, :]
        tl.store(part_ptr + split * M * N + part_cols, acc, mask=part_mask)
        tl.debug_barrier()
        counter = counter_ptr + pid
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + s * M * N + part_cols, mask=part_mask, other=0.0, cache_modifier=".cg")
            _epilogue(total, b_ptr, y_ptr, pid, rows, M, n_out, w_index, col_mask, stride_ym,
                      HAS_BIAS, GATED, BLOCK_M, BLOCK_N)
            tl.store(counter, 0)


MAX_ROWS = 16  # the kernel takes up to 128 rows; the backend uses it where it measured faster than the BLAS
# Under programmatic dependent launch, each program prefetches this much of each of its weight rows into L2
# before waiting for the previous kernel (0: off), unless PREFETCH_BYTES_PER_ROW_BY_DEVICE names the GPU.
PREFETCH_BYTES_PER_ROW = 2048
# Measured per GPU model (`gpu_perf latency --variant l2-prefetch-4k --alternate 2`, batch-1 decode of the
# Llama-3.1-8B shape, 2026-11-23): on an H200 4 KB gave 223.6 tok/s against 218.5 with 2 KB (+2.3 %; 8 KB
# -15 %); on an H100 4 KB gave +0.1 % (noise), so the H100 keeps 2 KB.
PREFETCH_BYTES_PER_ROW_BY_DEVICE: dict[str, int] = {"NVIDIA H200": 4096}
# When set: a budget for the whole launch instead, spread over its weight rows (a power-of-two number of
# 128-byte lines per row, at most the row): thin projections prefetch more of each row, wide ones less.
PREFETCH_BUDGET_BYTES: int | None = None
NUM_WARPS = 4  # of each skinny-GEMM program (4 measured best on the H100 in every sweep so far)
# Per weight shape (N, K): prefetch this much of each row instead (tuning probes; see kernel_variants).
PREFETCH_BYTES_PER_ROW_FOR: dict[tuple[int, int], int] = {}


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_prefetch_bytes_per_row(device: torch.device) -> int:
    """PREFETCH_BYTES_PER_ROW, or the value measured for this GPU model."""
    if device.type != "cuda":
        return PREFETCH_BYTES_PER_ROW
    index = device.index if device.index is not None else torch.cuda.current_device()
    return PREFETCH_BYTES_PER_ROW_BY_DEVICE.get(_device_name(index), PREFETCH_BYTES_PER_ROW)


def prefetch_lines(n: int, k: int, element_size: int, row_length: int | None = None,
                   bytes_per_row: int | None = None) -> int:
    """128-byte lines of each weight row that a program prefetches into L2 before its wait (0: none), for an
    [n, k] weight of which each program streams `row_length` (default: k) elements per row; `bytes_per_row`
    (default PREFETCH_BYTES_PER_ROW) is the device's share per row."""
    if bytes_per_row is None:
        bytes_per_row = PREFETCH_BYTES_PER_ROW
    per_row = bytes_per_row if PREFETCH_BUDGET_BYTES is None else PREFETCH_BUDGET_BYTES // n
    per_row = PREFETCH_BYTES_PER_ROW_FOR.get((n, k), per_row)
    lines = min(per_row, (row_length or k) * element_size) // 128
    return triton.next_power_of_2(lines + 1) // 2 if lines > 0 else 0  # the largest power of two <= lines


def preferred_tiles(n: int, k: int, element_size: int, num_sms: int) -> tuple[int, int, int]:
    """(K tile, pipeline stages, split) to try first. Measured on an H100 (`gemm_bench --split-sweep` and
    `--layer-chain --tile-rules`, `gpu_perf latency --alternate`, 2026-11-23, Llama-3.1-8B projections,
    bf16): 512-wide K tiles four stages deep stream every projection fastest, the thin QKV and O ones
    included (O: 12.7 us against 14.5 us with 256-wide tiles five deep; batch-1 decode +1.1 %). Split-K
    lost wherever it was tried in the engine: for the QKV projection alone (192 programs on 132
    multiprocessors) it won in isolation (19.7 against 21.1 us) but cost decode 1.7 %; for every projection
    with fewer programs than two per multiprocessor the layer's chain lost 2.7 %. So no split here; the
    kernel keeps it for other GPUs and shapes (`benchmarks/kernel_variants.py`: qkv-split2). Splitting the
    weights with at most one program per two multiprocessors (Qwen3-30B-A3B's output projection, 64 programs)
    did not pay either: batch-1 decode 272.8 tok/s unsplit against 269.8 split, H200, 2026-11-24
    (`small-n-split2`). fp32 is not a
    speed path: short tiles that fit anywhere."""
    if element_size > 2:
        return 128, 3, 1
    return 512, 4, 1


def _candidate_tiles(n: int, k: int, element_size: int, num_sms: int):
    """Tiles in order of preference: 32 output features per program (the best width in every H100 sweep of
    the Llama-3.1-8B projections at TP=1 and TP=2, up to 16 rows) with `preferred_tiles`' K tile, depth and
    split, then shallower pipelines and shorter K tiles, for GPUs with less shared memory and for more rows."""
    block_k, stages, split = preferred_tiles(n, k, element_size, num_sms)
    while block_k >= 64:
        for num_stages in (stages, stages - 1):
            yield dict(block_n=32, block_k=block_k, num_stages=num_stages, num_warps=NUM_WARPS, split=split)
        block_k //= 2
    yield dict(block_n=32, block_k=64, num_stages=2, num_warps=NUM_WARPS, split=split)


_fitted: dict[tuple, dict] = {}  # (N, K, dtype, row tile, gated, out dtype, device) -> the first candidate that launched


def _launch_fitted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool,
                   out_dtype: torch.dtype | None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    key = (weight.shape[0], weight.shape[1], x.dtype, max(16, triton.next_power_of_2(rows)), gated, out_dtype, x.device)
    tiles = _fitted.get(key)
    if tiles is not None:
        return skinny_gemm(x, weight, bias, **tiles, gated=gated, out_dtype=out_dtype)
    error = None
    for tiles in _candidate_tiles(weight.shape[0], weight.shape[1], x.element_size(), workspace.num_sms(x.device)):
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
                split: int = 1, gated: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for x [..., K] with at most 128 rows and weight [N, K] (contiguous rows). With
    gated, the weight is a merged [gate; up] projection and y = silu(gate) * up, [..., N / 2]. y is in
    out_dtype (default: x's). Without tile sizes: the preferred tiles that fit this GPU (found at the first
    call of each shape, then kept). `split` programs share each output tile's K range, the last of them to
    finish adding up the partial products in a fixed order (the same bits whichever finishes last)."""
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
    # Whole K tiles per split, and no split left without work.
    k_split = triton.cdiv(triton.cdiv(k, block_k), max(1, split)) * block_k
    split = triton.cdiv(k, k_split)
    tiles = triton.cdiv(n, block_n)
    if split > 1:
        partials = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        counters = workspace.arrival_counters(x.device, tiles)
    else:
        partials = counters = out  # unused
    _skinny_gemm_kernel[(tiles, split)](
        rows, weight, bias if bias is not None else weight, out, partials, counters, m, n, k, k_split,
        rows.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, GATED=gated,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
        UPCAST=x.dtype != torch.float32 and x.device.type == "cpu",
        num_stages=num_stages, num_warps=num_warps, PREFETCH_LINES=prefetch_lines(n, k, weight.element_size(), k_split, device_prefetch_bytes_per_row(x.device)),
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

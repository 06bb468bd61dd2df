"""GEMMs on quantized weights in Triton (formats: engine/kernels/quant.py; reference maths, the oracle:
engine/kernels/torch/quant.py), and the device functions the quantized experts (moe_quant.py) share.

By rows M of the product:
- M <= 16 (decode): weight-only. A skinny kernel streams each weight byte once, dequantizes it in registers
  (FP8 with its per-tensor / per-row / per-block scale, e2m1 with its e8m0 scales through `tl.dot_scaled`) and
  multiplies the unquantized activations; the reference also quantizes the activations, so the two differ by
  that rounding. The MXFP4 w4a4 scheme quantizes its activations here too (exactly as the reference). On
  Hopper, e4m3 becomes bf16 through integer operations (`e4m3_to_bf16`): Triton's own conversion is two
  conversion-unit instructions a value, the limit of this kernel at 1.6-2.2 TB/s before. FP8 weights at one
  row (batch-1 decode) take fp8_gemv's CUDA-core kernel instead (no 16-row MMA padding).
- M > 16 on a GPU with FP8 tensor cores (sm_89+): W8A8. fp8_tensor / fp8_channel run `torch._scaled_mm`
  (cuBLASLt per-tensor; CUTLASS row-wise on sm_90+, bf16 output) on activations quantized by a Triton kernel
  (activation_quant.py: per tensor, or per token); fp8_block is a Triton GEMM on activations quantized per token and K-block, each
  K tile's FP8 product scaled by a_scale[m, kb] * w_scale[nb, kb] (DeepSeek-style). Where _scaled_mm does not
  take the shape or output dtype, the same Triton W8A8 kernel serves every FP8 scheme.
- M > 16 elsewhere (no FP8 tensor cores, ROCm): the weight-only kernel with larger tiles.
- mxfp4 at any M: the same kernel on `tl.dot_scaled` (e2m1 weight against bf16/fp16 activations, or against
  MXFP4 activations for w4a4); fp32 activations are rounded to bf16 first in the weight-only variant.
- int4_group at any M: the same kernel, weight-only: each group's codes multiply the activations as integers
  in their dtype and the group's product takes its scales (int4.py).

Shape rules: fp8_block needs K-blocks of a multiple of 16 columns (128 in every checkpoint; each K tile is the
largest power of two dividing them, up to 128); mxfp4 needs K % 32 == 0 (the format's); int4_group whole groups
of a power of two of at least 32 columns. Nothing reads a device value on the host, and every shape follows
from the inputs' shapes, so decode steps on these ops can be captured in CUDA graphs.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from engine.kernels.quant import MXFP4_GROUP, QuantizedWeight
from engine.kernels.triton import fp8_gemv, gemv, int4, pdl, workspace
from engine.kernels.triton.activation_quant import ACT_FP8, ACT_MXFP4, quantize_activations
from engine.kernels.triton.common import dot

# Weight formats (the kernels' METHOD; their ACT: activation_quant.ACT_*).
TENSOR = tl.constexpr(0)
CHANNEL = tl.constexpr(1)
BLOCK = tl.constexpr(2)
MXFP4 = tl.constexpr(3)
INT4 = tl.constexpr(4)
METHOD_CODES = {"fp8_tensor": 0, "fp8_channel": 1, "fp8_block": 2, "mxfp4": 3, "int4_group": 4}

MAX_SKINNY_ROWS = 16
FAST_FP8_CONVERSION = True  # e4m3_to_bf16 in the weight-only kernels where the GPU takes it (off: `.to`)
ONE_ROW_GEMV = True  # FP8 products of one row on fp8_gemv's CUDA-core kernel (off: the skinny MMA kernel)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _sm90_cuda(device: torch.device) -> bool:
    """NVIDIA Hopper or later (e4m3_to_bf16's PTX), compiled (not the interpreter)."""
    if device.type != "cuda" or torch.version.hip or interpreted():
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


def fp8_tensor_cores(device: torch.device) -> bool:
    """Whether FP8 x FP8 products run on tensor cores here (sm_89+ CUDA; the interpreter emulates them).
    ROCm's FP8 is another format (e4m3fnuz), so it takes the weight-only path."""
    if device.type != "cuda":
        return interpreted()
    if torch.version.hip:
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 9)


# ---- device functions shared with moe_quant.py --------------------------------------------------------------


@triton.jit
def e4m3_to_bf16(w):
    """e4m3 -> bf16, exact, in three integer operations and one bf16 multiply per pair of values: each byte
    sign-extended into a 16-bit lane (prmt), shifted so that its exponent and mantissa bits land in bf16's and
    masked to those and the sign, which is the value times 2^-120 (subnormals included: bf16 keeps float32's
    exponent range), then scaled by 2^120. `.to(tl.bfloat16)` takes two conversions per value (e4m3x2 ->
    f16x2, f16 -> bf16) on the multiprocessors' slower conversion unit, which held the weight-streaming kernel
    near 1.6-2.2 TB/s on an H100. NVIDIA sm_90+ (mul.bf16x2)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 lo, hi, bias;
        mov.b32 bias, 0x7B807B80;
        prmt.b32 lo, $2, 0, 0x9180;
        prmt.b32 hi, $2, 0, 0xB3A2;
        shl.b32 lo, lo, 4;
        shl.b32 hi, hi, 4;
        and.b32 lo, lo, 0x87F087F0;
        and.b32 hi, hi, 0x87F087F0;
        mul.rn.bf16x2 $0, lo, bias;
        mul.rn.bf16x2 $1, hi, bias;
        }""", "=r,=r,r", [w.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def dequantize_to(w, dtype: tl.constexpr, FAST_FP8: tl.constexpr):
    """An e4m3 weight tile as `dtype` for a dot (through e4m3_to_bf16 where FAST_FP8 and dtype is bf16)."""
    if FAST_FP8 and dtype == tl.bfloat16:
        return e4m3_to_bf16(w)
    else:
        return w.to(dtype)


@triton.jit
def accumulate(acc, a, a_scale, w, w_scale, METHOD: tl.constexpr, ACT: tl.constexpr, UPCAST: tl.constexpr,
               FAST_FP8: tl.constexpr = False):
    """acc + a @ w for one K tile. a: [BM, BK] activations (ACT_NONE), e4m3 (ACT_FP8, a_scale [BM] fp32 for
    this K tile with BLOCK weights, else unused) or [BM, BK/2] packed e2m1 (ACT_MXFP4, a_scale [BM, BK/32]
    e8m0). w: [BK, BN] e4m3 (w_scale [BN] fp32 for this K tile with BLOCK, else unused) or [BK/2, BN] packed
    e2m1 (MXFP4, w_scale [BN, BK/32] e8m0). Per-tensor and per-row scales are applied by `scale_output`."""
    if METHOD == MXFP4:
        if ACT == ACT_MXFP4:
            return tl.dot_scaled(a, a_scale, "e2m1", w, w_scale, "e2m1", acc)
        elif a.dtype == tl.float16:
            return tl.dot_scaled(a, None, "fp16", w, w_scale, "e2m1", acc)
        else:
            return tl.dot_scaled(a.to(tl.bfloat16), None, "bf16", w, w_scale, "e2m1", acc)
    elif ACT == ACT_FP8:
        # Hopper's FP8 tensor cores accumulate with less than fp32 precision; Triton lets them run the whole
        # K range so unless told: promote to fp32 after every K tile (DeepSeek's remedy).
        product = tl.dot(a, w, max_num_imprecise_acc=a.shape[1])
        if METHOD == BLOCK:
            return acc + product * (a_scale[:, None] * w_scale[None, :])
        else:
            return acc + product
    else:
        if METHOD == BLOCK:
            return acc + dot(a, dequantize_to(w, a.dtype, FAST_FP8), UPCAST) * w_scale[None, :]
        else:
            return acc + dot(a, dequantize_to(w, a.dtype, FAST_FP8), UPCAST)


@triton.jit
def in_k(k, K):
    """k, or K's last column for a K sub-tile that starts past K (a wide tile on a short K): its operands load as
    zeros, and the FP8 block scale it multiplies them by must be read inside the scales, not past their end,
    where 0 x garbage can be NaN."""
    return tl.minimum(k, K - 1)


@triton.jit
def weight_scales(scale_ptr, features, feature_mask, k, K, stride_sn, METHOD: tl.constexpr,
                  BLOCK_SN: tl.constexpr, BLOCK_SK: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight scales of the K tile at k (of K) for `accumulate`: [BN] fp32 (BLOCK), [BN, BK/32] e8m0
    (MXFP4); scale_ptr (unused) otherwise. scale_ptr: the weight's (or expert's) scales, rows stride_sn
    apart."""
    if METHOD == MXFP4:
        groups = k // 32 + tl.arange(0, BLOCK_K // 32)
        return tl.load(scale_ptr + features.to(tl.int64)[:, None] * stride_sn + groups[None, :],
                       mask=feature_mask[:, None] & (groups < K // 32)[None, :], other=0)
    elif METHOD == BLOCK:
        return tl.load(scale_ptr + (features // BLOCK_SN).to(tl.int64) * stride_sn + in_k(k, K) // BLOCK_SK,
                       mask=feature_mask, other=0.0)
    else:
        return scale_ptr


@triton.jit
def activation_scales(scale_ptr, index, mask, k, K, METHOD: tl.constexpr, ACT: tl.constexpr, BLOCK_SK: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """The activation scales of the K tile at k (of K) for `accumulate`: [BM] fp32 (FP8 per K-block),
    [BM, BK/32] e8m0 (MXFP4); scale_ptr (unused) otherwise. index: each row's offset into scale_ptr."""
    if ACT == ACT_MXFP4:
        groups = k // 32 + tl.arange(0, BLOCK_K // 32)
        return tl.load(scale_ptr + index[:, None] + groups[None, :], mask=mask[:, None] & (groups < K // 32)[None, :],
                       other=0)
    elif ACT == ACT_FP8 and METHOD == BLOCK:
        return tl.load(scale_ptr + index + in_k(k, K) // BLOCK_SK, mask=mask, other=0.0)
    else:
        return scale_ptr


@triton.jit
def scale_output(acc, a_scale_ptr, rows, w_scale_ptr, cols, col_mask, METHOD: tl.constexpr, ACT: tl.constexpr):
    """The per-tensor or per-row weight scale (and with FP8 activations their per-tensor or per-token scale,
    a_scale_ptr[rows]), applied once to the finished accumulator."""
    if METHOD == TENSOR:
        acc = acc * tl.load(w_scale_ptr)
    elif METHOD == CHANNEL:
        acc = acc * tl.load(w_scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if ACT == ACT_FP8:
        if METHOD == TENSOR or METHOD == CHANNEL:
            acc = acc * tl.load(a_scale_ptr + rows)[:, None]
    return acc


@triton.jit
def _grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of this program, GROUP_M row tiles sweeping the columns together (L2 reuse)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, b_ptr, y_ptr, M, N, K,
                 stride_am, stride_asm, stride_wn, stride_wsn, stride_ym,
                 METHOD: tl.constexpr, ACT: tl.constexpr, BLOCK_SN: tl.constexpr, BLOCK_SK: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
                 PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr, K_STEPS: tl.constexpr = 1,
                 FAST_FP8: tl.constexpr = False):
    """y[M, N] = a[M, K] w[N, K]^T (+ bias), w quantized as METHOD says, a as ACT says: one [BLOCK_M, BLOCK_N]
    tile per program. Element offsets along K count values; packed e2m1 rows hold K/2 bytes. Each iteration
    streams BLOCK_K columns as K_STEPS sub-tiles of BLOCK_K / K_STEPS, each multiplied and scaled on its own:
    with BLOCK weights a sub-tile divides BLOCK_SK (lies in one scale block), so wide iterations keep as many
    weight bytes in flight as the other schemes while the block scales apply per sub-tile."""
    pid_m, pid_n = _grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    PACKED_W: tl.constexpr = 2 if METHOD == MXFP4 or METHOD == INT4 else 1
    PACKED_A: tl.constexpr = 2 if ACT == ACT_MXFP4 else 1
    w_rows = w_ptr + cols.to(tl.int64)[None, :] * stride_wn
    if USE_PDL:
        if PREFETCH_LINES > 0:
            # Before waiting on the previous kernel: the start of this program's weight rows into L2 (no kernel
            # writes weights, so reading them early cannot race).
            starts = tl.arange(0, PREFETCH_LINES) * LINE
            lines = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + starts[None, :]
            gemv._prefetch_l2(tl.where(col_mask[:, None] & (starts < K // PACKED_W)[None, :], lines, w_ptr))
        pdl.enter()
    a_rows = a_ptr + tl.where(row_mask, rows, 0).to(tl.int64)[:, None] * stride_am
    SUB_K: tl.constexpr = BLOCK_K // K_STEPS
    ka = tl.arange(0, SUB_K // PACKED_A)
    kw = tl.arange(0, SUB_K // PACKED_W)
    a_index = tl.where(row_mask, rows, 0) * stride_asm  # of each row's activation scales
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for step in tl.static_range(K_STEPS):
            k = k0 + step * SUB_K
            if METHOD == INT4:
                acc = int4.accumulate_int4(acc, a_rows, row_mask, w_rows,
                                           w_scale_ptr + cols.to(tl.int64)[None, :] * stride_wsn, col_mask, k, K,
                                           BLOCK_SK, SUB_K, UPCAST)
            else:
                a = tl.load(a_rows + k // PACKED_A + ka[None, :],
                            mask=row_mask[:, None] & (k // PACKED_A + ka < K // PACKED_A)[None, :], other=0.0)
                w = tl.load(w_rows + k // PACKED_W + kw[:, None],
                            mask=(k // PACKED_W + kw < K // PACKED_W)[:, None] & col_mask[None, :], other=0.0)
                a_scale = activation_scales(a_scale_ptr, a_index, row_mask, k, K, METHOD, ACT, BLOCK_SK, SUB_K)
                if METHOD == BLOCK and BLOCK_SN % BLOCK_N == 0:  # one scale block row: one scale, not a gather
                    w_scale = tl.zeros([BLOCK_N], dtype=tl.float32) + tl.load(
                        w_scale_ptr + (pid_n * BLOCK_N // BLOCK_SN).to(tl.int64) * stride_wsn + in_k(k, K) // BLOCK_SK)
                else:
                    w_scale = weight_scales(w_scale_ptr, cols, col_mask, k, K, stride_wsn, METHOD, BLOCK_SN,
                                            BLOCK_SK, SUB_K)
                acc = accumulate(acc, a, a_scale, w, w_scale, METHOD, ACT, UPCAST, FAST_FP8)
    acc = scale_output(acc, a_scale_ptr, a_index, w_scale_ptr, cols, col_mask, METHOD, ACT)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


# ---- the ops ---------------------------------------------------------------------------------------------------


def prepare(qw: QuantizedWeight) -> None:
    """Check a loaded weight against the kernels' shape rules (once, with a message that says what is wrong)
    and keep contiguous views of it and its scale in qw.prepared["triton"] (copies only where the loaded
    tensors were not contiguous)."""
    method = qw.scheme.method
    k = qw.in_features
    if method == "mxfp4" and k % MXFP4_GROUP:
        raise ValueError(f"MXFP4 weights need in_features % 32 == 0, not {k}")
    if method == "int4_group":
        int4.check_group(qw.scheme.block[1])
        if k % qw.scheme.block[1]:
            raise ValueError(f"int4 weights need in_features ({k}) to be whole groups of {qw.scheme.block[1]}")
    if method == "fp8_block" and qw.scheme.block[1] % 16:
        raise ValueError(f"the Triton FP8 block kernels need scale blocks of a multiple of 16 columns, not "
                         f"{qw.scheme.block}")
    qw.prepared["triton"] = (qw.weight.contiguous(), qw.scale.contiguous())


def operands(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, scale) as the kernels read them: prepared, or the loaded tensors where they are contiguous."""
    prepared = qw.prepared.get("triton")
    if prepared is None:
        prepare(qw)
        prepared = qw.prepared["triton"]
    return prepared


def block_k_within(block: tuple[int, int], block_k: int) -> int:
    """The largest K tile up to block_k that lies within one FP8 scale block (its columns, a power of two
    dividing the block's)."""
    return min(block_k, block[1] & -block[1])


# The decode launch's K tiles for FP8 weights (M <= 16, weight-only, 32 output features a program): (family,
# whether the launch is one wave: no more programs than multiprocessors) -> (K tile, sub-tiles, stages).
# fp8_block's sub-tiles are its scale blocks (128 columns in every checkpoint). Measured on an H100
# (`quant_gemm_bench`, Llama-3.1-8B projections, 2026-11-24): one-wave launches (O and down, 128 programs) run
# fastest with 1024-wide tiles three deep, launches of several waves (QKV, gate/up) with 512-wide ones, which
# lose 30-40 % with deeper pipelines.
SKINNY_FP8_TILES = {
    ("fp8", True): (1024, 2, 3), ("fp8", False): (512, 2, 4),
    ("fp8_block", True): (1024, 8, 3), ("fp8_block", False): (512, 4, 3),
}


def _skinny_tiles(method: str, block: tuple[int, int], element_size: int, n: int, num_sms: int) -> dict:
    """Tiles of the decode launch (M <= 16, weight-only), like gemv's: 32 output features per program, wide K
    tiles streamed through a pipeline (SKINNY_FP8_TILES). FP8 block scales apply per sub-tile of one scale
    block, so 128x128 blocks stream as wide tiles as the other schemes. float32 activations (not a speed
    path) take short tiles."""
    if method == "mxfp4":
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_stages=4, num_warps=4)
    if method == "int4_group":  # (unmeasured) mxfp4's tile; float32 activations take short K tiles
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256 if element_size <= 2 else 64, num_stages=4, num_warps=4)
    block_n = 32
    one_wave = triton.cdiv(n, block_n) <= num_sms
    block_k, steps, stages = SKINNY_FP8_TILES["fp8_block" if method == "fp8_block" else "fp8", one_wave]
    if method == "fp8_block":
        sub = block_k_within(block, block_k)
        steps = max(1, block_k // sub)
        block_k = sub * steps
    if element_size > 2:
        block_k, steps, stages = min(block_k // steps, 128), 1, 3
    return dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, K_STEPS=steps, num_stages=stages, num_warps=4)


def _large_tiles(m: int, method: str, block: tuple[int, int], act_fp8: bool) -> dict:
    """Tiles of the prefill launch: 64-row tiles up to 64 rows, 128 beyond (8 warps)."""
    block_m, warps = (64, 4) if m <= 64 else (128, 8)
    block_n, block_k = 128, 128 if act_fp8 or method == "mxfp4" else 64
    if method == "fp8_block":
        block_k = block_k_within(block, block_k)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_stages=3, num_warps=warps, GROUP_M=8)


# (launch keys) -> the pipeline depth that fitted this GPU's shared memory, found at the first launch
_fitted_stages: dict[tuple, int] = {}


def _launch(a, a_scale, weight, w_scale, bias, out, method: str, act, block: tuple[int, int], tiles: dict) -> None:
    """One _gemm_kernel launch; where the tiles' pipeline does not fit the GPU's shared memory (the depths are
    set for an H100's 228 KiB), a shallower one (a launch that does not fit fails before it runs)."""
    m, n = out.shape
    k = a.shape[1] * (2 if act == ACT_MXFP4.value else 1)
    tiles = dict(tiles)
    stages = tiles.pop("num_stages")
    key = (method, act, a.dtype, out.dtype, weight.dtype, bias is not None, tuple(tiles.items()), out.device)
    stages = _fitted_stages.get(key, stages)
    block_m, block_n = tiles["BLOCK_M"], tiles["BLOCK_N"]
    skinny = block_m == MAX_SKINNY_ROWS and m <= MAX_SKINNY_ROWS
    pdl_options = pdl.launch_options(out)
    fast_fp8 = FAST_FP8_CONVERSION and method.startswith("fp8") and _sm90_cuda(out.device)
    packed = 2 if method in ("mxfp4", "int4_group") else 1
    lines = gemv.prefetch_lines(n, k // packed, weight.element_size(), None,
                                gemv.device_prefetch_bytes_per_row(out.device)) if skinny else 0
    if a_scale is None:
        a_scale, stride_asm = w_scale, 0
    else:
        stride_asm = a_scale.stride(0) if a_scale.dim() == 2 else (1 if a_scale.numel() > 1 else 0)
    stride_wsn = w_scale.stride(0) if w_scale.dim() == 2 else 0
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    tiles.setdefault("GROUP_M", 1)
    while True:
        try:
            _gemm_kernel[grid](
                a, a_scale, weight, w_scale, bias if bias is not None else out, out, m, n, k,
                a.stride(0), stride_asm, weight.stride(0), stride_wsn, out.stride(0),
                METHOD=METHOD_CODES[method], ACT=act, BLOCK_SN=block[0], BLOCK_SK=block[1], HAS_BIAS=bias is not None,
                UPCAST=a.device.type == "cpu", PREFETCH_LINES=lines, LINE=128 // weight.element_size(),
                FAST_FP8=fast_fp8,
                num_stages=stages, **tiles, **pdl_options)
            break
        except triton.runtime.errors.OutOfResources:
            if stages <= 2:
                raise
            stages -= 1
    _fitted_stages[key] = stages


def _scaled_mm_serves(x: torch.Tensor, method: str, n: int, k: int, out_dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm takes this product: CUDA FP8 tensor cores, 16-aligned K and N; row-wise scales
    only on sm_90+ and with bf16 output."""
    if not x.is_cuda or torch.version.hip or k % 16 or n % 16:
        return False
    capability = _capability(x.device.index if x.device.index is not None else torch.cuda.current_device())
    if method == "fp8_tensor":
        return capability >= (8, 9)
    return method == "fp8_channel" and capability >= (9, 0) and out_dtype == torch.bfloat16


def _scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, method: str,
               bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    if method == "fp8_tensor":
        a_scale, b_scale = a_scale.reshape(()), w_scale.reshape(())
    else:
        b_scale = w_scale.view(1, -1)  # a_scale: per token, [M, 1]
    fused_bias = bias if bias is not None and bias.dtype == out_dtype and out_dtype != torch.float32 else None
    y = torch._scaled_mm(a, weight.t(), scale_a=a_scale, scale_b=b_scale, bias=fused_bias, out_dtype=out_dtype)
    if bias is not None and fused_bias is None:
        y = (y.float() + bias.float()).to(out_dtype)
    return y


def gemm_quantized(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """(x [..., K], weight [N, K] quantized, bias [N] | None) -> [..., N] in out_dtype (default x's): every
    scheme's `gemm_<method>` op (see the module docstring for the path each size takes)."""
    method, scheme = qw.scheme.method, qw.scheme
    weight, w_scale = operands(qw)
    k, n = x.shape[-1], qw.out_features
    assert k == qw.in_features, (x.shape, qw.weight.shape)
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out_dtype = out_dtype or x.dtype
    if m == 0:
        return torch.empty(*x.shape[:-1], n, dtype=out_dtype, device=x.device)
    skinny = m <= MAX_SKINNY_ROWS
    w8a8 = not skinny and method.startswith("fp8") and fp8_tensor_cores(x.device)
    a, a_scale, act = quantize_activations(rows, qw, w8a8)
    fp8_activations = act == ACT_FP8.value
    if fp8_activations and method in ("fp8_tensor", "fp8_channel") and _scaled_mm_serves(x, method, n, k, out_dtype):
        return _scaled_mm(a, a_scale, weight, w_scale, method, bias, out_dtype).view(*x.shape[:-1], n)
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if ONE_ROW_GEMV and fp8_gemv.takes(method, scheme.block, m):
        fast_fp8 = FAST_FP8_CONVERSION and _sm90_cuda(x.device)
        fp8_gemv.fp8_gemv(a, weight, w_scale, METHOD_CODES[method], scheme.block, bias, out, fast_fp8)
        return out.view(*x.shape[:-1], n)
    if skinny:
        tiles = _skinny_tiles(method, scheme.block, x.element_size(), n, workspace.num_sms(x.device))
    else:
        tiles = _large_tiles(m, method, scheme.block, fp8_activations)
    _launch(a, a_scale, weight, w_scale, bias, out, method, act, scheme.block, tiles)
    return out.view(*x.shape[:-1], n)


gemm_quantized.prepare = prepare

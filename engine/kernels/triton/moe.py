"""Mixture-of-experts ops in Triton: the routed experts' MLPs as two grouped GEMMs over the (token, expert)
pairs sorted by expert, and a fused softmax top-k router. Contracts and numerics: engine/kernels/torch/moe.py.

Nothing here reads a device value on the host, and every shape follows from the inputs' shapes alone, so a
decode step that calls these can be captured in a CUDA graph. Token and pair counts, which change from step
to step, are not specialized on (`do_not_specialize`): an eager step would otherwise compile a variant per
divisibility class the first time it met one (engine/kernels/triton/decode_attention.py says more).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.torch import moe as torch_moe
from engine.kernels.triton import pdl
from engine.kernels.triton.common import dot, gelu_tanh

# ---- routing ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_tokens"])
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_logits,
                         TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Softmax over each row's experts, then its top k by repeated arg-max (ties: the lower expert id)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    row_mask = rows < num_tokens
    # Rows past the end repeat the last row (their results are not stored), so no row is all -inf.
    read_rows = tl.minimum(rows, num_tokens - 1).to(tl.int64)
    logits = tl.load(logits_ptr + read_rows[:, None] * stride_logits + experts[None, :],
                     mask=(experts < num_experts)[None, :], other=float("-inf"))
    exps = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = exps / tl.sum(exps, axis=1)[:, None]
    slots = tl.arange(0, BLOCK_K)
    top_weights = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    top_ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.argmax(probs, axis=1, tie_break_left=True)
        best_prob = tl.max(probs, axis=1)
        top_weights = tl.where(slots[None, :] == slot, best_prob[:, None], top_weights)
        top_ids = tl.where(slots[None, :] == slot, best[:, None].to(tl.int32), top_ids)
        probs = tl.where(experts[None, :] == best[:, None], -1.0, probs)
    if RENORMALIZE:
        top_weights = top_weights / tl.sum(top_weights, axis=1)[:, None]
    out = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    out_mask = row_mask[:, None] & (slots < TOP_K)[None, :]
    tl.store(weights_ptr + out, top_weights, mask=out_mask)
    tl.store(ids_ptr + out, top_ids, mask=out_mask)


def moe_topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's softmax top-k in one launch (the torch version is five small kernels per layer)."""
    num_tokens, num_experts = logits.shape
    logits = logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    if num_tokens <= TOPK_ONE_ROW_MAX_TOKENS and block_e <= 512:
        # Decode batches: a program per row, one warp, so that every reduction of the k rounds stays in
        # warp shuffles (16 rows over 4 warps spent ~6 us a layer at batch 1 on an H200).
        block_t, num_warps = 1, 1
    else:
        block_t, num_warps = max(1, min(16, 2048 // block_e)), 4
    _topk_softmax_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits, weights, ids, num_tokens, num_experts, logits.stride(0), TOP_K=top_k, RENORMALIZE=renormalize,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), num_warps=num_warps)
    return weights, ids


TOPK_ONE_ROW_MAX_TOKENS = 64  # up to this many tokens, one row per program (benchmarks' variant sets 0)


# Group-limited routing (DeepSeek-style) is a handful of small torch kernels on a [T, E] tensor, a few
# microseconds beside the experts' GEMMs; a fused kernel for it has not been written yet.
moe_grouped_topk = torch_moe.moe_grouped_topk


# ---- the experts ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeTiles:
    """Tile sizes of the two grouped GEMMs. block_m rows of pairs share one expert; each expert's segment
    of the sorted pairs is padded to a multiple of it."""
    block_m: int
    gate_up_block_n: int  # features of gate and of up per program (two accumulators of this width)
    gate_up_block_k: int
    down_block_n: int
    down_block_k: int
    num_warps: int = 4
    num_stages: int = 3


def default_tiles(num_pairs: int, num_experts: int, element_size: int) -> MoeTiles:
    """By pairs per expert (tokens * top_k / local experts), from `benchmarks/moe_bench.py --sweep` on an H100
    (Qwen3-30B-A3B experts, bf16, 2026-11-24, 86 variants per size): up to 16 pairs (decode and small
    batches, bound by reading the weights), 16-row tiles with 128-wide K tiles, within 1% of the best at
    1 to 256 tokens (40 us at 1 token; 406 us at 64, 97% of the read bandwidth); up to 128, 64-row tiles
    (best at 1024 tokens); beyond, 128-row tiles with 8 warps (best at 4096 tokens: 826 us, against 848
    with 4 warps). fp32 (the accuracy reference, not a speed path) takes shorter K tiles."""
    per_expert = num_pairs / num_experts
    if per_expert <= 16:
        tiles = MoeTiles(block_m=16, gate_up_block_n=32, gate_up_block_k=128, down_block_n=64, down_block_k=128,
                         num_stages=4)
    elif per_expert <= 128:
        tiles = MoeTiles(block_m=64, gate_up_block_n=64, gate_up_block_k=64, down_block_n=64, down_block_k=64)
    else:
        tiles = MoeTiles(block_m=128, gate_up_block_n=64, gate_up_block_k=64, down_block_n=128, down_block_k=64,
                         num_warps=8)
    if element_size > 2:
        tiles = dataclasses.replace(tiles, gate_up_block_k=32, down_block_k=32, num_stages=3)
    return tiles


@triton.jit
def _pair_groups(ids_ptr, pairs, mask, num_experts):
    experts = tl.load(ids_ptr + pairs, mask=mask, other=0)
    return tl.where(experts < 0, num_experts, experts)  # -1 (no local expert) -> E: sorts after the experts


@triton.jit(do_not_specialize=["num_pairs"])
def _count_pairs_kernel(ids_ptr, counts_ptr, num_pairs, num_experts, BLOCK_P: tl.constexpr):
    pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask = pairs < num_pairs
    tl.atomic_add(counts_ptr + _pair_groups(ids_ptr, pairs, mask, num_experts), 1, mask=mask, sem="relaxed")


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _place_pairs_kernel(ids_ptr, counts_ptr, cursors_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs,
                        num_experts, num_blocks, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr):
    """Each program places BLOCK_P pairs in their groups' runs and fills BLOCKS_PER_PROGRAM blocks' expert
    ids and padding; every program derives the runs' padded starts from the counts itself."""
    groups = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + groups, mask=groups <= num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_ends = tl.cumsum(padded, 0)
    padded_starts = padded_ends - padded
    pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask = pairs < num_pairs
    group = _pair_groups(ids_ptr, pairs, mask, num_experts)
    rank = tl.atomic_add(cursors_ptr + group, 1, mask=mask, sem="relaxed")
    tl.store(sorted_pairs_ptr + tl.gather(padded_starts, group, 0) + rank, pairs, mask=mask)
    blocks = tl.program_id(0) * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
    block_mask = blocks < num_blocks
    # A block's group: the first whose padded run ends past the block's start (groups past E are empty,
    # with runs ending at the total, so a block past the used ones gets a group > E).
    block_group = tl.sum((padded_ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
    tl.store(block_expert_ptr + blocks, tl.where(block_group < num_experts, block_group, -1), mask=block_mask)
    block_group = tl.minimum(block_group, BLOCK_E - 1)
    pairs_end = tl.gather(padded_starts, block_group, 0) + tl.gather(counts, block_group, 0)
    rows = blocks[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_pairs_ptr + rows, tl.full(rows.shape, num_pairs, tl.int32),
             mask=block_mask[:, None] & (rows >= pairs_end[:, None]))


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """A bound on the blocks align_pairs uses that depends only on the shapes: the used blocks number
    sum_g ceil(n_g / block_m) over the b <= min(num_pairs, E + 1) non-empty groups (the E experts and the
    id -1 group), so at most (num_pairs + b (block_m - 1)) / block_m, and at most num_pairs (each used
    block holds a pair)."""
    return min(num_pairs, (num_pairs + min(num_pairs, num_experts + 1) * (block_m - 1)) // block_m)


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs (token t, slot j), numbered t * top_k + j, grouped by expert for grouped GEMMs of block_m-row
    tiles: (sorted_pairs [max_blocks * block_m] int32, block_expert [max_blocks] int32). Each expert's pairs
    fill a run of whole blocks, padded with the sentinel num_pairs; block_expert[b] is the expert of block
    b, or -1 for the blocks of pairs with no local expert (id -1) and for unused blocks past the end.

    Two small kernels (count the pairs per expert; place each pair in its expert's run), where the same in
    torch ops (argsort, scatter_add_, cumsum, searchsorted...) took ~25 launches, 49 us of a 96 us batch-1
    layer on an H100. Pairs take their places within a run in the order their atomic increments land; each
    output row depends only on its own pair, so that order changes no result."""
    flat = ids.reshape(-1)
    if flat.dtype != torch.int32 or flat.stride(0) != 1:
        flat = flat.to(torch.int32).contiguous()
    num_pairs = flat.numel()
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=ids.device)
    counters = torch.zeros(2, num_experts + 1, dtype=torch.int32, device=ids.device)  # counts, cursors
    block_p, blocks_per_program = 256, 64
    _count_pairs_kernel[(triton.cdiv(num_pairs, block_p),)](flat, counters[0], num_pairs, num_experts,
                                                            BLOCK_P=block_p)
    grid = max(triton.cdiv(num_pairs, block_p), triton.cdiv(num_blocks, blocks_per_program))
    _place_pairs_kernel[(grid,)](
        flat, counters[0], counters[1], sorted_pairs, block_expert, num_pairs, num_experts, num_blocks,
        BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_E=triton.next_power_of_2(num_experts + 2),
        BLOCKS_PER_PROGRAM=blocks_per_program)
    return sorted_pairs, block_expert


@triton.jit
def block_rows(sorted_pairs_ptr, block, num_pairs, BLOCK_M: tl.constexpr):
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return pairs, pairs < num_pairs


@triton.jit
def clamp_swiglu(gate, up, limit):
    """DeepSeek-V4's clamped SwiGLU inputs: gate <= limit, -limit <= up <= limit."""
    return tl.minimum(gate, limit), tl.minimum(tl.maximum(up, -limit), limit)


@triton.jit
def add_gate_up_bias(gate, up, b13_ptr, expert, stride_be, features, feature_mask, inter, dtype: tl.constexpr):
    """gpt-oss: gate and up as the reference's biased GEMM gives them: rounded to the activations' dtype, plus
    the expert's gate and up biases (b13 [E, 2I]: gate then up), rounded again."""
    base = b13_ptr + expert.to(tl.int64) * stride_be
    gate_bias = tl.load(base + features, mask=feature_mask, other=0.0).to(tl.float32)
    up_bias = tl.load(base + inter + features, mask=feature_mask, other=0.0).to(tl.float32)
    gate = (gate.to(dtype).to(tl.float32) + gate_bias[None, :]).to(dtype).to(tl.float32)
    up = (up.to(dtype).to(tl.float32) + up_bias[None, :]).to(dtype).to(tl.float32)
    return gate, up


@triton.jit
def store_gated(act_ptr, gate, up, pairs, valid, features, feature_mask, inter, alpha, OAI: tl.constexpr,
                GELU: tl.constexpr = False):
    """act = silu(gate) * up, gelu_tanh(gate) * up (GELU, Gemma 4), or (OAI, gpt-oss) (up + 1) * gate *
    sigmoid(alpha * gate), each operation rounded to the activations' dtype as the reference's."""
    if GELU:
        dt = act_ptr.dtype.element_ty
        gelu = gelu_tanh(gate.to(dt).to(tl.float32)).to(dt).to(tl.float32)
        tl.store(act_ptr + pairs.to(tl.int64)[:, None] * inter + features[None, :],
                 (gelu * up.to(dt).to(tl.float32)).to(dt), mask=valid[:, None] & feature_mask[None, :])
    elif OAI:
        dt = act_ptr.dtype.element_ty
        gate = gate.to(dt).to(tl.float32)
        up = up.to(dt).to(tl.float32)
        scaled = (gate * alpha).to(dt).to(tl.float32)
        sig = (1.0 / (1.0 + tl.exp(-scaled))).to(dt).to(tl.float32)
        glu = (gate * sig).to(dt).to(tl.float32)
        up1 = (up + 1.0).to(dt).to(tl.float32)
        tl.store(act_ptr + pairs.to(tl.int64)[:, None] * inter + features[None, :], (up1 * glu).to(dt),
                 mask=valid[:, None] & feature_mask[None, :])
    else:
        store_silu_and_mul(act_ptr, gate, up, pairs, valid, features, feature_mask, inter)


@triton.jit
def add_down_bias(acc, b2_ptr, expert, stride_be, features, feature_mask, dtype: tl.constexpr):
    """gpt-oss: an expert's down output as the reference gives it: the GEMM rounded to the activations'
    dtype, plus the expert's bias in float32 (rounded once more where it is stored)."""
    bias = tl.load(b2_ptr + expert.to(tl.int64) * stride_be + features, mask=feature_mask, other=0.0)
    return acc.to(dtype).to(tl.float32) + bias.to(tl.float32)[None, :]


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(x_ptr, w13_ptr, act_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, hidden, inter,
                    top_k, stride_x, stride_we, stride_wn, num_n_blocks, limit, b13_ptr, stride_be, alpha,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                    USE_PDL: tl.constexpr, CLAMP: tl.constexpr = False, BIAS: tl.constexpr = False,
                    OAI: tl.constexpr = False, GELU: tl.constexpr = False):
    """act[pair, n] = silu(gate) * up for one [BLOCK_M pairs, BLOCK_N features] tile of one expert, where
    gate and up are the rows n and I + n of w13[e] against x[pair // top_k]; CLAMP: gate <= limit and
    -limit <= up <= limit first (equal to clamping after the rounding when limit is a number of the dtype)."""
    if USE_PDL:
        pdl.enter()
    block = tl.program_id(0) // num_n_blocks  # the feature tiles of one block of rows run side by side
    pid_n = tl.program_id(0) % num_n_blocks
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return  # pairs with no local expert, or a block past the used ones
    pairs, valid = block_rows(sorted_pairs_ptr, block, num_pairs, BLOCK_M)
    tokens = tl.where(valid, pairs // top_k, 0).to(tl.int64)
    features = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    feature_mask = features < inter
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tokens[:, None] * stride_x + ks[None, :]
    # [BLOCK_K, BLOCK_N] views of the expert's gate rows and up rows (each row contiguous along K).
    gate_cols = w13_ptr + expert.to(tl.int64) * stride_we + features.to(tl.int64)[None, :] * stride_wn + ks[:, None]
    up_cols = gate_cols + inter.to(tl.int64) * stride_wn
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        k_mask = (k + ks) < hidden
        a = tl.load(x_rows + k, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & feature_mask[None, :]
        gate += dot(a, tl.load(gate_cols + k, mask=w_mask, other=0.0), UPCAST)
        up += dot(a, tl.load(up_cols + k, mask=w_mask, other=0.0), UPCAST)
    if BIAS:
        gate, up = add_gate_up_bias(gate, up, b13_ptr, expert, stride_be, features, feature_mask, inter,
                                    act_ptr.dtype.element_ty)
    if CLAMP:
        gate, up = clamp_swiglu(gate, up, limit)
    store_gated(act_ptr, gate, up, pairs, valid, features, feature_mask, inter, alpha, OAI, GELU)


@triton.jit
def store_silu_and_mul(act_ptr, gate, up, pairs, valid, features, feature_mask, inter):
    """act[pair, feature] = silu(gate) * up, rounded as the reference's separate GEMM, SiLU and product
    round: gate and up, silu, then the product."""
    out_dtype = act_ptr.dtype.element_ty
    gate = gate.to(out_dtype).to(tl.float32)
    up = up.to(out_dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_dtype).to(tl.float32)
    tl.store(act_ptr + pairs.to(tl.int64)[:, None] * inter + features[None, :], (silu * up).to(out_dtype),
             mask=valid[:, None] & feature_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(act_ptr, w2_ptr, expert_out_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, hidden, inter,
                 stride_we, stride_wn, num_n_blocks, b2_ptr, stride_be,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                 USE_PDL: tl.constexpr, BIAS: tl.constexpr = False):
    """expert_out[pair, n] = act[pair] . w2[e, n] for one [BLOCK_M pairs, BLOCK_N features] tile of one
    expert, rounded to the activations' dtype as the reference's per-expert GEMM returns it."""
    if USE_PDL:
        pdl.enter()
    block = tl.program_id(0) // num_n_blocks
    pid_n = tl.program_id(0) % num_n_blocks
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return  # the combine reads nothing of pairs with no local expert
    pairs, valid = block_rows(sorted_pairs_ptr, block, num_pairs, BLOCK_M)
    features = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    feature_mask = features < hidden
    ks = tl.arange(0, BLOCK_K)
    act_rows = act_ptr + tl.where(valid, pairs, 0).to(tl.int64)[:, None] * inter + ks[None, :]
    w_cols = w2_ptr + expert.to(tl.int64) * stride_we + features.to(tl.int64)[None, :] * stride_wn + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, inter, BLOCK_K):
        k_mask = (k + ks) < inter
        a = tl.load(act_rows + k, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + k, mask=k_mask[:, None] & feature_mask[None, :], other=0.0)
        acc += dot(a, w, UPCAST)
    if BIAS:
        acc = add_down_bias(acc, b2_ptr, expert, stride_be, features, feature_mask, expert_out_ptr.dtype.element_ty)
    tl.store(expert_out_ptr + pairs.to(tl.int64)[:, None] * hidden + features[None, :],
             acc.to(expert_out_ptr.dtype.element_ty), mask=valid[:, None] & feature_mask[None, :])


@triton.jit
def _combine_kernel(expert_out_ptr, weights_ptr, ids_ptr, out_ptr, hidden, stride_out,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    """out[t] = sum_j weights[t, j] * expert_out[t * TOP_K + j] over the slots with an expert, in float32,
    rounded once."""
    if USE_PDL:
        pdl.enter()
    token = tl.program_id(0).to(tl.int64)
    features = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        read_to = tl.where(tl.load(ids_ptr + pair) >= 0, hidden, 0)  # nothing of a slot with no expert
        y = tl.load(expert_out_ptr + pair * hidden + features, mask=features < read_to, other=0.0)
        total += tl.load(weights_ptr + pair) * y.to(tl.float32)
    tl.store(out_ptr + token * stride_out + features, total.to(out_ptr.dtype.element_ty), mask=features < hidden)


# The per-pair expert outputs of one launch stay under this size: longer batches run in chunks of tokens.
PAIR_OUTPUT_BUDGET_BYTES = 256 << 20


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, tiles: MoeTiles | None = None, swiglu_limit: float | None = None,
                  w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  oai_alpha: float | None = None, gelu: bool = False) -> torch.Tensor:
    """sum_k weights[t, k] * w2[e] @ (silu(gate) * up)(w13[e] @ x[t]), e = ids[t, k] (-1: nothing), in x's
    dtype: the pairs grouped by expert, one grouped GEMM for gate/up with SiLU-and-mul in its epilogue, one
    for the down projection, then a combine kernel that weights and sums each token's k expert outputs.

    The k pairs of a token land in different blocks, so the combine is its own pass, not atomics into the
    output: float32 atomics would add in whatever order the blocks finish, and the engine keeps its outputs
    the same bits from run to run. The routing weight is applied in the combine rather than in the down
    GEMM's epilogue: each expert's output is rounded to x's dtype as in the reference, and a weighted
    product kept unrounded for the sum would have to be stored in float32, twice the bytes of this round
    trip (at 4096 tokens of Qwen3-30B-A3B, 268 MB more written and read per layer).

    `swiglu_limit` (DeepSeek-V4, gpt-oss): gate clamped to <= limit and up to [-limit, limit] before the
    activation; gpt-oss's `w13_bias` / `w2_bias` (added in the GEMMs' epilogues) and `oai_alpha` (its
    activation, `gated_epilogue`)."""
    num_tokens, hidden = x.shape
    assert w13.shape[1] == 2 * w2.shape[2] and w13.shape[2] == w2.shape[1] == hidden, (w13.shape, w2.shape)
    assert w13.stride(2) == 1 and w2.stride(2) == 1 and w13.dtype == w2.dtype == x.dtype
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    chunk = max(1, PAIR_OUTPUT_BUDGET_BYTES // (ids.shape[1] * hidden * x.element_size()))
    for start in range(0, num_tokens, chunk):
        stop = min(num_tokens, start + chunk)
        _fused_experts_chunk(x[start:stop], w13, w2, weights[start:stop], ids[start:stop], out[start:stop], tiles,
                             gated_epilogue(swiglu_limit, w13_bias, w2_bias, oai_alpha, x, gelu))
    return out


def gated_epilogue(swiglu_limit: float | None, w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None,
                   oai_alpha: float | None, like: torch.Tensor, gelu: bool = False) -> tuple[tuple, dict, tuple, dict]:
    """The gate/up and down kernels' epilogue arguments and constexprs: the clamp, the biases (any tensor
    where there are none) and the activation."""
    assert (w13_bias is None) == (w2_bias is None), "both expert biases or neither"
    b13 = w13_bias if w13_bias is not None else like
    b2 = w2_bias if w2_bias is not None else like
    bias = w13_bias is not None
    return ((float(swiglu_limit or 0.0), b13, b13.stride(0) if bias else 0, float(oai_alpha or 0.0)),
            dict(CLAMP=swiglu_limit is not None, BIAS=bias, OAI=oai_alpha is not None, GELU=gelu),
            (b2, b2.stride(0) if bias else 0), dict(BIAS=bias))


def _fused_experts_chunk(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                         ids: torch.Tensor, out: torch.Tensor, tiles: MoeTiles | None, epilogue: tuple) -> None:
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    top_k = ids.shape[1]
    num_pairs = num_tokens * top_k
    if x.stride(1) != 1:
        x = x.contiguous()
    tiles = tiles or default_tiles(num_pairs, num_experts, x.element_size())
    sorted_pairs, block_expert = align_pairs(ids, num_experts, tiles.block_m)
    num_blocks = block_expert.numel()
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    expert_out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    pdl_options = pdl.launch_options(x)
    launch = dict(UPCAST=x.dtype != torch.float32 and x.device.type == "cpu", num_warps=tiles.num_warps,
                  num_stages=tiles.num_stages, **pdl_options)
    gate_up_args, gate_up_flags, down_args, down_flags = epilogue
    n_blocks = triton.cdiv(inter, tiles.gate_up_block_n)
    _gate_up_kernel[(num_blocks * n_blocks,)](
        x, w13, act, sorted_pairs, block_expert, num_pairs, hidden, inter, top_k, x.stride(0), w13.stride(0),
        w13.stride(1), n_blocks, *gate_up_args, BLOCK_M=tiles.block_m, BLOCK_N=tiles.gate_up_block_n,
        BLOCK_K=tiles.gate_up_block_k, **gate_up_flags, **launch)
    n_blocks = triton.cdiv(hidden, tiles.down_block_n)
    _down_kernel[(num_blocks * n_blocks,)](
        act, w2, expert_out, sorted_pairs, block_expert, num_pairs, hidden, inter, w2.stride(0), w2.stride(1),
        n_blocks, *down_args, BLOCK_M=tiles.block_m, BLOCK_N=tiles.down_block_n, BLOCK_K=tiles.down_block_k,
        **down_flags, **launch)
    combine(expert_out, weights, ids, out)


def combine(expert_out: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
    """out[t] = the weighted sum of token t's expert outputs expert_out[t * top_k + j] (see _combine_kernel)."""
    num_tokens, hidden = out.shape
    block_h = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        expert_out, weights.reshape(-1).float().contiguous(), ids.reshape(-1).contiguous(), out, hidden,
        out.stride(0), TOP_K=ids.shape[1], BLOCK_H=block_h, num_warps=4, **pdl.launch_options(out))

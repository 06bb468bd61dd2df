"""Earlier kernel sequences of the triton backend, re-applied to a running engine for before/after
timings in one run (`benchmarks/gpu_perf.py --variant ...`). Each patch undoes one change; applied in
order they are cumulative, and the engine's CUDA graphs must be captured again afterwards. `snapshot` and
`restore` put the current kernels back (`gpu_perf --alternate`)."""
from __future__ import annotations


def unfused_rope() -> None:
    """The kernel sequence before RoPE was fused into the KV-cache write: a separate rotary kernel, then
    the plain cache write (for before/after comparisons in one run)."""
    from engine.kernels.attention import apply_rope
    from engine.kernels.triton.attention import TritonAttentionBackend
    fused = TritonAttentionBackend.forward

    def forward(query, key, value, kv_cache, metadata, scale, block_size, rope=None):
        query, key = apply_rope(query, key, rope)
        return fused(query, key, value, kv_cache, metadata, scale, block_size)
    TritonAttentionBackend.forward = staticmethod(forward)


def separate_decode_kernels() -> None:
    """Decode-only steps as the three kernels before they were fused into one launch: the rotary KV-cache
    write, the split-K decode and the reduction of its splits."""
    from engine.kernels.triton import decode_attention
    decode_attention.FUSED_DECODE = False


def long_decode_splits() -> None:
    """Decode attention as before splits were allowed down to one 64-token tile: no split shorter than
    256 context tokens (so a batch-1 step walked up to four tiles per program)."""
    import dataclasses

    from engine.kernels.triton.attention import TritonAttentionBackend
    build = TritonAttentionBackend.build_metadata.__func__

    def build_metadata(cls, common, block_size):
        return dataclasses.replace(build(cls, common, block_size), min_split_tokens=256)
    TritonAttentionBackend.build_metadata = classmethod(build_metadata)


def l2_prefetch(bytes_per_row: int):
    def apply() -> None:
        """The skinny GEMM prefetching more of each weight row into L2 (a tuning probe)."""
        from engine.kernels.triton import gemv
        gemv.PREFETCH_BYTES_PER_ROW = bytes_per_row
        gemv.PREFETCH_BYTES_PER_ROW_BY_DEVICE = {}
    return apply


def l2_prefetch_budget(total_bytes: int):
    def apply() -> None:
        """The skinny GEMM prefetching a fixed amount per launch, spread over its weight rows (a probe)."""
        from engine.kernels.triton import gemv
        gemv.PREFETCH_BUDGET_BYTES = total_bytes
    return apply


def _patch_preferred_tiles(rule) -> None:
    """Replace the skinny GEMM's first-choice tiles: rule(n, k, element_size, num_sms, current) -> tiles."""
    from engine.kernels.triton import gemv
    current = gemv.preferred_tiles
    gemv.preferred_tiles = lambda n, k, element_size, num_sms: rule(n, k, element_size, num_sms, current)
    gemv._fitted.clear()


def qkv_split2() -> None:
    """The skinny GEMM splitting K in two (256-wide tiles, 4 stages) for weights of between one and two
    programs per multiprocessor (the Llama-3.1-8B QKV projection: 192 on an H100's 132), the rule that
    won in the layer-chain benchmark but lost in the engine (a probe for other GPUs and shapes)."""
    def rule(n, k, size, sms, current):
        return (256, 4, 2) if size == 2 and sms < -(-n // 32) < 2 * sms and k >= 2048 else current(n, k, size, sms)
    _patch_preferred_tiles(rule)


def prefetch_for_shape(n: int, k: int, bytes_per_row: int):
    def apply() -> None:
        """The skinny GEMM prefetching this much of each row of an [n, k] weight (a tuning probe: the
        Llama-3.1-8B O projection follows the attention kernel, whose time could cover more prefetch)."""
        from engine.kernels.triton import gemv
        gemv.PREFETCH_BYTES_PER_ROW_FOR = {**gemv.PREFETCH_BYTES_PER_ROW_FOR, (n, k): bytes_per_row}
    return apply


def thin_k256_s5() -> None:
    """The skinny GEMM's tile rule before 512-wide K tiles four stages deep became the first choice for
    every shape: 256-wide K tiles five stages deep for the thin projections (K < 8192 and N < 12288), and
    no split-K."""
    _patch_preferred_tiles(lambda n, k, size, sms, current: (256, 5, 1) if size == 2 and k < 8192 and n < 12288
                           else (*current(n, k, size, sms)[:2], 1))


def torch_argmax() -> None:
    """Greedy sampling with torch's argmax (one reduction over the whole vocabulary row), as before the
    chunked Triton argmax."""
    from engine.kernels import ops
    sample = ops.sample

    def greedy_by_torch(logits, t):
        return logits.argmax(dim=-1) if t.all_greedy else sample(logits, t)
    ops.sample = greedy_by_torch


def skinny_warps(num_warps: int):
    def apply() -> None:
        """The skinny GEMM's programs with this many warps (a tuning probe)."""
        from engine.kernels.triton import gemv
        gemv.NUM_WARPS = num_warps
        gemv._fitted.clear()
    return apply


def no_l2_prefetch() -> None:
    """The skinny GEMM without its weight prefetch into L2 ahead of the previous kernel's end."""
    from engine.kernels.triton import gemv
    gemv.PREFETCH_BYTES_PER_ROW = 0
    gemv.PREFETCH_BYTES_PER_ROW_FOR = {}
    gemv.PREFETCH_BYTES_PER_ROW_BY_DEVICE = {}


def pdl_off() -> None:
    """Triton kernels launched without programmatic dependent launch."""
    import os

    from engine.kernels.triton import pdl
    os.environ["ATOM_RAY_TRITON_PDL"] = "0"
    pdl._supported.cache_clear()


def separate_silu_and_mul() -> None:
    """The MLP's SiLU-and-mul as its own kernel after the gate/up GEMM, as before it moved into the
    skinny GEMM's epilogue."""
    from engine.kernels import ops

    def gated_gemm(x, weight, bias=None):
        return ops.silu_and_mul(ops.gemm(x, weight, bias))
    ops.gated_gemm = gated_gemm


def blas_gemm() -> None:
    """Every GEMM on the vendor BLAS (cuBLAS), as before the Triton skinny GEMM took decode-sized batches
    (so the SiLU-and-mul it had fused runs separately again)."""
    from engine.kernels import ops
    from engine.kernels.torch.ops import gemm
    separate_silu_and_mul()
    ops.gemm = gemm


def plan_length_splits() -> None:
    """Decode splits as long as the plan's (made for the longest context a launch may see: for a CUDA graph,
    max_model_len) for every sequence, as before each sequence spread its own context over the splits: a
    short context in a graph replay then walked a few multi-tile splits instead of many one-tile ones."""
    from engine.kernels.triton import decode_attention
    plan = decode_attention.decode_plan

    def decode_plan(metadata, num_kv_heads, block_n, window=None):
        num_splits, _ = plan(metadata, num_kv_heads, block_n, window)
        num_tiles = -(-metadata.max_decode_seq_len // block_n)
        return num_splits, -(-num_tiles // num_splits)  # the plan's split length as every sequence's minimum
    decode_attention.decode_plan = decode_plan


def small_n_split2() -> None:
    """The skinny GEMM splitting K in two for weights with at most one program per two multiprocessors (the
    Qwen3-30B-A3B output projection, 2048 x 4096: 64 programs on 132), a probe that did not pay on an H200."""
    def rule(n, k, size, sms, current):
        return (512, 4, 2) if size == 2 and -(-n // 32) * 2 <= sms and k >= 2048 else current(n, k, size, sms)
    _patch_preferred_tiles(rule)


def router_fp32_weight() -> None:
    """MoE router logits as before the router weight was held in the model's dtype: the activations
    converted to float32, then a float32 GEMM against a float32 copy of the weight (three kernels)."""
    import torch

    from engine.layers import fused_moe

    def route(self, x, config):
        if getattr(self, "_weight32", None) is None:
            self._weight32 = self.weight.float()
        logits = torch.nn.functional.linear(x.float(), self._weight32)
        return fused_moe.ROUTERS[config.kind](logits, config, self.e_score_correction_bias)
    fused_moe.Router.route = route


def topk_softmax_16_rows() -> None:
    """The softmax top-k router kernel as first written: 16 rows per program over 4 warps at every batch size
    (before decode batches got a one-warp program per row)."""
    from engine.kernels.triton import moe
    moe.TOPK_ONE_ROW_MAX_TOKENS = 0


def snapshot() -> dict:
    """Everything a variant patches, to put back with `restore` (`gpu_perf --alternate`)."""
    import inspect
    import os

    from engine.kernels import ops
    from engine.kernels.triton import decode_attention, gemv
    from engine.kernels.triton.attention import TritonAttentionBackend
    return {"ops": dict(ops.__dict__), "pdl": os.environ.get("ATOM_RAY_TRITON_PDL"),
            "attrs": [(obj, name, inspect.getattr_static(obj, name))
                      for obj, name in ((decode_attention, "decode_plan"), (decode_attention, "FUSED_DECODE"),
                                        (gemv, "PREFETCH_BYTES_PER_ROW"), (gemv, "PREFETCH_BUDGET_BYTES"),
                                        (gemv, "PREFETCH_BYTES_PER_ROW_FOR"), (gemv, "PREFETCH_BYTES_PER_ROW_BY_DEVICE"),
                                        (gemv, "preferred_tiles"),
                                        (gemv, "NUM_WARPS"), (_router_class(), "route"),
                                        (_triton_moe(), "TOPK_ONE_ROW_MAX_TOKENS"),
                                        (TritonAttentionBackend, "forward"),
                                        (TritonAttentionBackend, "build_metadata"))]}


def _triton_moe():
    from engine.kernels.triton import moe
    return moe


def _router_class():
    from engine.layers.fused_moe import Router
    return Router


def restore(state: dict) -> None:
    import os

    from engine.kernels import ops
    from engine.kernels.triton import gemv, pdl
    ops.__dict__.clear()
    ops.__dict__.update(state["ops"])
    for obj, name, value in state["attrs"]:
        setattr(obj, name, value)
    gemv._fitted.clear()  # tiles fitted under a variant's rule
    if state["pdl"] is None:
        os.environ.pop("ATOM_RAY_TRITON_PDL", None)
    else:
        os.environ["ATOM_RAY_TRITON_PDL"] = state["pdl"]
    pdl._supported.cache_clear()


# Applied cumulatively in the order given, each re-timed: e.g. `--variant unfused-rope --variant
# long-decode-splits` ends at the kernel sequence before both changes.
KERNEL_VARIANTS = {"plan-length-splits": plan_length_splits,
                   "l2-prefetch-2k": l2_prefetch(2048), "l2-prefetch-4k": l2_prefetch(4096),
                   "l2-prefetch-8k": l2_prefetch(8192), "l2-budget-8m": l2_prefetch_budget(8 << 20),
                   "l2-budget-16m": l2_prefetch_budget(16 << 20), "l2-budget-32m": l2_prefetch_budget(32 << 20),
                   "l2-per-row": l2_prefetch_budget(None), "qkv-split2": qkv_split2,
                   "o-prefetch-4k": prefetch_for_shape(4096, 4096, 4096),
                   "o-prefetch-8k": prefetch_for_shape(4096, 4096, 8192),
                   "thin-k256-s5": thin_k256_s5, "torch-argmax": torch_argmax,
                   "skinny-warps-8": skinny_warps(8),
                   "separate-silu-and-mul": separate_silu_and_mul,
                   "no-l2-prefetch": no_l2_prefetch, "pdl-off": pdl_off, "blas-gemm": blas_gemm,
                   "separate-decode-kernels": separate_decode_kernels, "unfused-rope": unfused_rope,
                   "long-decode-splits": long_decode_splits, "small-n-split2": small_n_split2,
                   "router-fp32-weight": router_fp32_weight, "topk-softmax-16-rows": topk_softmax_16_rows}

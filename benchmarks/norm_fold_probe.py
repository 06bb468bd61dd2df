"""Probe (GPU): could a decoder layer's RMSNorms disappear into its skinny GEMMs without slowing their weight
stream? The layout probed: the norm's gamma folded into the QKV and gate/up weights (W' = W diag(gamma)),
the residual add moved into the epilogue of the O and down projections (they output h = x W^T + residual,
the residual stream itself), and the QKV and gate/up GEMMs multiplying h as loaded while they sum its
squares, scaling their accumulator by 1 / rms(h) at the end. Unlike normalising the input inside the K loop
(tried on 2026-11-23 and 2.8x slower: see docs/BENCHMARKS.md), the matrix product's operands stay plain
loads. Not wired into the engine: this times one layer's kernel chain (Llama-3.1-8B shapes, bf16, batch
rows as given), over several layers' weights as gemm_bench's chains do:

  norm kernels         add+RMSNorm, QKV, O, add+RMSNorm, gate/up (SiLU-and-mul fused), down  (the engine now)
  folded norms         QKV (squares, scale), O (+ residual), gate/up (squares, scale), down (+ residual)
  residual adds only   QKV, O (+ residual), gate/up, down (+ residual): the squares' own cost
  GEMMs only           QKV, O, gate/up, down: the floor

    python -m benchmarks.norm_fold_probe [--rows 1,16] --out probe.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.common import environment_record, print_table
from benchmarks.gemm_bench import projection_shapes, read_bandwidth_gbps, time_calls
from engine.kernels.triton import gemv, ops, pdl, workspace
from engine.kernels.triton.gemv import _epilogue, _prefetch_l2
from engine.kernels.triton.common import dot


@triton.jit
def _probe_kernel(x_ptr, w_ptr, r_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_rm, stride_ym, eps,
                  GATED: tl.constexpr, RMS_SCALE: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  USE_PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr):
    pid = tl.program_id(0)
    j = tl.arange(0, BLOCK_N)
    if GATED:
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
    w_rows = w_ptr + w_index.to(tl.int64)[:, None] * stride_wn
    if USE_PDL:
        if PREFETCH_LINES > 0:
            starts = tl.arange(0, PREFETCH_LINES) * LINE
            ptrs = tl.where(col_mask[:, None] & (starts < K)[None, :], w_rows + starts[None, :], w_ptr)
            _prefetch_l2(ptrs)
        pdl.enter()
    row_mask = (rows < M)[:, None]
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    squares = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = ((k + ks) < K)[None, :]
        x = tl.load(x_rows + k + ks[None, :], mask=row_mask & k_mask, other=0.0)
        w = tl.load(w_rows + k + ks[None, :], mask=col_mask[:, None] & k_mask, other=0.0)
        acc += dot(x, tl.trans(w), False)
        if RMS_SCALE:
            x32 = x.to(tl.float32)
            squares += x32 * x32
    if RMS_SCALE:
        acc *= tl.math.rsqrt(tl.sum(squares, axis=1) / K + eps)[:, None]
    if ADD_RESIDUAL and not GATED:
        acc += tl.load(r_ptr + rows.to(tl.int64)[:, None] * stride_rm + w_index[None, :],
                       mask=row_mask & col_mask[None, :], other=0.0).to(tl.float32)
    # The engine's store (gated: silu(gate) * up); no bias.
    _epilogue(acc, y_ptr, y_ptr, pid, rows, M, n_out, w_index, col_mask, stride_ym,
              False, GATED, BLOCK_M, BLOCK_N)


def probe_gemm(x, weight, *, gated=False, rms_scale=False, residual=None, eps=1e-5):
    m, k = x.shape
    n = weight.shape[0]
    tiles = next(gemv._candidate_tiles(n, k, 2, workspace.num_sms(x.device)))
    out = torch.empty(m, n // 2 if gated else n, dtype=x.dtype, device=x.device)
    res = residual if residual is not None else out
    _probe_kernel[(triton.cdiv(n, tiles["block_n"]),)](
        x, weight, res, out, m, n, k, x.stride(0), weight.stride(0), res.stride(0), out.stride(0), eps,
        GATED=gated, RMS_SCALE=rms_scale, ADD_RESIDUAL=residual is not None, BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=tiles["block_n"], BLOCK_K=tiles["block_k"], num_stages=tiles["num_stages"], num_warps=tiles["num_warps"],
        PREFETCH_LINES=gemv.prefetch_lines(n, k, x.element_size(), bytes_per_row=gemv.device_prefetch_bytes_per_row(x.device)),
        LINE=64, **pdl.launch_options(out))
    return out


def check(shapes) -> float:
    """Largest error of the folded-norm QKV product relative to the output scale, against norm then GEMM."""
    n, k = shapes["qkv"]
    h = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    gamma = (1 + 0.1 * torch.randn(k, device="cuda")).to(torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
    folded = (weight.float() * gamma.float()).to(torch.bfloat16)
    expected = torch.nn.functional.linear(ops.rms_norm(h, gamma, 1e-5).double(), weight.double())
    actual = probe_gemm(h, folded, rms_scale=True).double()
    return float((actual - expected).abs().max() / expected.abs().max())


def chain_rows(config: dict, rows: list[int], layers: int = 4) -> list[dict]:
    shapes = projection_shapes(config, 1)
    names = ("qkv", "o", "gate_up", "down")
    weights = [{name: torch.randn(*shapes[name], device="cuda", dtype=torch.bfloat16) for name in names}
               for _ in range(layers)]
    layer_bytes = sum(w.numel() * 2 for w in weights[0].values())
    hidden, inter = shapes["o"][0], shapes["down"][1]
    gamma = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    out = []
    for m in rows:
        h, residual = (torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        attn, act = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for n in (shapes["o"][1], inter))

        def layer_calls(layer, variant):
            if variant == "norm kernels":
                return [lambda: gemv.skinny_gemm(ops.fused_add_rms_norm(h, residual, gamma, 1e-5)[0], layer["qkv"]),
                        lambda: gemv.skinny_gemm(attn, layer["o"]),
                        lambda: gemv.skinny_gemm(ops.fused_add_rms_norm(h, residual, gamma, 1e-5)[0],
                                                 layer["gate_up"], gated=True),
                        lambda: gemv.skinny_gemm(act, layer["down"])]
            scale = variant == "folded norms"
            res = None if variant == "GEMMs only" else residual
            return [lambda: probe_gemm(h, layer["qkv"], rms_scale=scale),
                    lambda: probe_gemm(attn, layer["o"], residual=res),
                    lambda: probe_gemm(h, layer["gate_up"], gated=True, rms_scale=scale),
                    lambda: probe_gemm(act, layer["down"], residual=res)]
        timings = {}
        for variant in ("norm kernels", "folded norms", "residual adds only", "GEMMs only"):
            calls = [call for layer in weights for call in layer_calls(layer, variant)]
            timings[variant] = time_calls(calls) * len(calls) / layers
        out.append(dict(m=m, layer_bytes=layer_bytes, us_per_layer=timings))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="benchmarks/configs/llama-3.1-8b")
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    config = json.loads((Path(args.model) / "config.json").read_text())
    read_bw = read_bandwidth_gbps()
    error = check(projection_shapes(config, 1))
    chain = chain_rows(config, [int(r) for r in args.rows.split(",")])
    base = "norm kernels"
    print_table(["rows", "variant", "us/layer", "GB/s", "of read bw", f"vs {base}"],
                [(r["m"], label, f"{us:.1f}", f"{r['layer_bytes'] / us / 1e3:.0f}",
                  f"{r['layer_bytes'] / us / 1e3 / read_bw:.3f}", f"{r['us_per_layer'][base] / us:.3f}")
                 for r in chain for label, us in r["us_per_layer"].items()])
    print(f"read bandwidth {read_bw:.0f} GB/s; folded-norm QKV error vs norm then GEMM: {error:.2e} of scale")
    Path(args.out).write_text(json.dumps({"environment": environment_record(), "read_gbps": read_bw,
                                          "folded_norm_error": error, "chain": chain}, indent=2))


if __name__ == "__main__":
    main()

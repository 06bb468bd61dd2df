"""Quantized-weight GEMMs and experts on the GPU (`engine.kernels.triton.quant` / `moe_quant`) against the
bf16 ones the engine runs otherwise (`gemv.gemm`: the Triton skinny GEMM up to 16 rows, cuBLAS beyond;
`moe.fused_experts`), per scheme, over Llama-3.1-8B's projections and Qwen3-30B-A3B's routed experts, after
checking each against the torch reference.

As in gemm_bench, each timed call reads a different copy of the weights (copies totalling > 4x the L2 cache,
the calls captured back to back in a CUDA graph, which also proves the ops capture). GB/s counts the weight
bytes read (scales included; for experts, the distinct experts a batch routes to) over the time.

    python -m benchmarks.quant_gemm_bench --out quant.json [--rows 1,8,64,512,4096]
        [--schemes fp8_tensor,fp8_channel,fp8_block,mxfp4,mxfp4_a4] [--only qkv,o,gate_up,down,experts]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.common import environment_record, print_table
from benchmarks.gemm_bench import projection_shapes, read_bandwidth_gbps, time_calls

SCHEMES = {
    "fp8_tensor": dict(method="fp8_tensor"),
    "fp8_channel": dict(method="fp8_channel"),
    "fp8_block": dict(method="fp8_block"),
    "mxfp4": dict(method="mxfp4", activation="none"),
    "mxfp4_a4": dict(method="mxfp4", activation="mxfp4"),
}
DEVICE = "cuda"
NUM_ROUTINGS = 4  # routing sets the expert calls cycle over (as moe_bench)
ERROR_LIMIT = 8e-2  # against the reference, which also quantizes the activations (weight-only paths do not)


def quantize_experts(master: torch.Tensor, scheme):
    """quantize_weight over [E, N, K] in slices of experts (MXFP4's rounding takes 32 bytes a value at once)."""
    from engine.kernels.quant import QuantizedWeight, quantize_weight
    parts = [quantize_weight(master[e:e + 16], scheme) for e in range(0, master.shape[0], 16)]
    return QuantizedWeight(scheme, torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]))


def qweight_bytes(qw) -> int:
    return qw.weight.numel() * qw.weight.element_size() + qw.scale.numel() * qw.scale.element_size()


def copies_for(nbytes: int, l2_bytes: int) -> int:
    return max(2, -(-4 * l2_bytes // nbytes))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max() / expected.float().abs().max())


def clone(qw):
    from engine.kernels.quant import QuantizedWeight
    return QuantizedWeight(qw.scheme, qw.weight.clone(), qw.scale.clone(), qw.input_scale)


def dense_rows(shapes: dict, schemes: list[str], rows: list[int], l2_bytes: int) -> tuple[list, list]:
    from engine.kernels.quant import QuantScheme, quantize_weight
    from engine.kernels.registry import prepare_quantized
    from engine.kernels.torch import quant as reference
    from engine.kernels.triton import gemv, quant
    out, table = [], []
    for name, (n, k) in shapes.items():
        master = torch.randn(n, k, device=DEVICE) / k ** 0.5
        bf16 = [master.to(torch.bfloat16) for _ in range(copies_for(n * k * 2, l2_bytes))]
        bf16_us = {m: time_calls([lambda w=w, x=x: gemv.gemm(x, w) for w in bf16])
                   for m in rows for x in [torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)]}
        del bf16
        for scheme_name in schemes:
            scheme = QuantScheme(**SCHEMES[scheme_name])
            first = quantize_weight(master, scheme)
            weights = [first] + [clone(first) for _ in range(copies_for(qweight_bytes(first), l2_bytes) - 1)]
            for qw in weights:
                prepare_quantized(quant.gemm_quantized, qw)
            nbytes = qweight_bytes(first)
            for m in rows:
                x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
                try:
                    error = relative_error(quant.gemm_quantized(x, first), reference.gemm_quantized(x, first))
                    us = time_calls([lambda w=w: quant.gemm_quantized(x, w) for w in weights])
                except Exception as exc:  # one failing variant does not end the sweep; it is recorded
                    print(f"  {name} {scheme_name} M={m}: {type(exc).__name__}: {str(exc)[:200]}")
                    out.append(dict(shape=name, n=n, k=k, scheme=scheme_name, m=m, failed=repr(exc)[:500]))
                    continue
                row = dict(shape=name, n=n, k=k, scheme=scheme_name, m=m, us=us, bf16_us=bf16_us[m],
                           weight_bytes=nbytes, gbps=nbytes / (us * 1e-6) / 1e9, max_error=error)
                out.append(row)
                table.append((name, f"{n}x{k}", scheme_name, m, f"{us:.1f}", f"{bf16_us[m]:.1f}",
                              f"{bf16_us[m] / us:.2f}", f"{row['gbps']:.0f}", f"{error:.1e}"
                              + (" !" if error > ERROR_LIMIT else "")))
            del weights, first
            torch.cuda.empty_cache()
    return out, table


def routings(num_tokens: int, num_experts: int, top_k: int, hidden: int):
    from engine.kernels.triton import moe
    inputs = []
    for _ in range(NUM_ROUTINGS):
        x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
        logits = torch.randn(num_tokens, num_experts, device=DEVICE)
        inputs.append((x, *moe.moe_topk_softmax(logits, top_k, True)))
    return inputs


def expert_rows(config: dict, schemes: list[str], rows: list[int]) -> tuple[list, list]:
    from engine.kernels.quant import QuantScheme
    from engine.kernels.registry import prepare_quantized
    from engine.kernels.torch import quant as reference
    from engine.kernels.triton import moe, moe_quant
    num_experts, top_k = config["num_experts"], config["num_experts_per_tok"]
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    w13_master = torch.randn(num_experts, 2 * inter, hidden, device=DEVICE) / hidden ** 0.5
    w2_master = torch.randn(num_experts, hidden, inter, device=DEVICE) / inter ** 0.5
    w13, w2 = w13_master.to(torch.bfloat16), w2_master.to(torch.bfloat16)
    inputs = {m: routings(m, num_experts, top_k, hidden) for m in rows}
    touched = {m: statistics.mean(int(torch.unique(ids).numel()) for _, _, ids in inputs[m]) for m in rows}
    bf16_us = {m: time_calls([lambda i=i: moe.fused_experts(i[0], w13, w2, i[1], i[2]) for i in inputs[m]])
               for m in rows}
    del w13, w2
    label = f"experts E={num_experts} k={top_k}"
    shape = f"{hidden}x{inter}"
    out, table = [], []
    for scheme_name in schemes:
        scheme = QuantScheme(**SCHEMES[scheme_name])
        q13, q2 = quantize_experts(w13_master, scheme), quantize_experts(w2_master, scheme)
        for qw in (q13, q2):
            prepare_quantized(moe_quant.fused_experts_quantized, qw)
        expert_bytes = (qweight_bytes(q13) + qweight_bytes(q2)) / num_experts
        for m in rows:
            x, weights, ids = inputs[m][0]
            calls = [lambda i=i: moe_quant.fused_experts_quantized(i[0], q13, q2, i[1], i[2]) for i in inputs[m]]
            try:
                error = relative_error(moe_quant.fused_experts_quantized(x, q13, q2, weights, ids),
                                       reference.fused_experts_quantized(x, q13, q2, weights, ids))
                us = time_calls(calls)
            except Exception as exc:
                print(f"  {label} {scheme_name} T={m}: {type(exc).__name__}: {str(exc)[:200]}")
                out.append(dict(shape=label, scheme=scheme_name, m=m, failed=repr(exc)[:500]))
                continue
            nbytes = touched[m] * expert_bytes
            row = dict(shape=label, hidden=hidden, inter=inter, scheme=scheme_name, m=m, us=us, bf16_us=bf16_us[m],
                       experts_touched=touched[m], weight_bytes=nbytes, gbps=nbytes / (us * 1e-6) / 1e9,
                       max_error=error)
            out.append(row)
            table.append((label, shape, scheme_name, m, f"{us:.1f}", f"{bf16_us[m]:.1f}", f"{bf16_us[m] / us:.2f}",
                          f"{row['gbps']:.0f}", f"{error:.1e}" + (" !" if error > ERROR_LIMIT else "")))
        del q13, q2
        torch.cuda.empty_cache()
    return out, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="benchmarks/configs/llama-3.1-8b", help="dense projection shapes")
    parser.add_argument("--moe-model", default="benchmarks/configs/qwen3-30b-a3b", help="routed expert shapes")
    parser.add_argument("--rows", default="1,8,64,512,4096", help="rows M (tokens, for the experts)")
    parser.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated, of {', '.join(SCHEMES)}")
    parser.add_argument("--only", default="qkv,o,gate_up,down,experts", help="projections to run, and 'experts'")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    schemes = args.schemes.split(",")
    only = args.only.split(",")
    torch.manual_seed(0)
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    read_bw = read_bandwidth_gbps()
    print(f"read bandwidth {read_bw:.0f} GB/s, L2 {l2_bytes >> 20} MiB")
    config = json.loads((Path(args.model) / "config.json").read_text())
    shapes = {name: shape for name, shape in projection_shapes(config, 1).items() if name in only}
    results, table = dense_rows(shapes, schemes, rows, l2_bytes)
    if "experts" in only:
        moe_config = json.loads((Path(args.moe_model) / "config.json").read_text())
        expert_results, expert_table = expert_rows(moe_config, schemes, rows)
        results += expert_results
        table += expert_table
    print_table(["shape", "N x K", "scheme", "M", "quant us", "bf16 us", "speedup", "weight GB/s", "error"], table)
    Path(args.out).write_text(json.dumps({"environment": environment_record(), "read_gbps": read_bw,
                                          "l2_bytes": l2_bytes, "rows": results}, indent=2))


if __name__ == "__main__":
    main()

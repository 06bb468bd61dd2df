"""The routed experts of one MoE layer on the GPU: the Triton grouped GEMMs (`engine.kernels.triton.moe`)
against the torch reference's loop over experts, at the Qwen3-30B-A3B shape by default (128 experts, top 8,
hidden 2048, expert intermediate 768, bf16), after checking the two agree.

Routing comes from the softmax top-k of random router logits; the timed calls cycle over several routings
so that a decode batch's few experts are not served from L2 by the call before. Times are medians; the
Triton op is timed eagerly (as torch is) and replayed from a CUDA graph (as the engine runs decode); the
bandwidth column counts the distinct experts' weights (3 H I elements each) over the graph time.

    python -m benchmarks.moe_bench --out moe.json [--tokens 1,8,64,256,1024,4096] [--sweep]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import torch

from benchmarks.common import environment_record, print_table
from benchmarks.gemm_bench import read_bandwidth_gbps, time_calls

NUM_ROUTINGS = 4  # routing sets the timed calls cycle over


def eager_us(calls: list, rounds: int = 5) -> float:
    """Median microseconds per call, each round the calls back to back on the stream."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for call in calls:
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(calls))
    return statistics.median(times)


def sweep_tiles(element_size: int) -> list:
    """Tile variants for `--sweep`: row tiles, feature widths, K tiles, warps and pipeline depths."""
    from engine.kernels.triton.moe import MoeTiles
    variants = []
    for block_m in (16, 32, 64, 128):
        for gate_up_n, down_n in ((32, 64), (64, 64), (64, 128), (128, 128)):
            for block_k in (64, 128):
                for warps, stages in ((4, 3), (4, 4), (8, 3)):
                    if block_m * max(gate_up_n * 2, down_n) > 128 * 128 * (warps // 4):
                        continue  # accumulators past ~128 fp32 registers a thread
                    variants.append(MoeTiles(block_m, gate_up_n, block_k, down_n, block_k, warps, stages))
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,8,64,256,1024,4096")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768, help="one expert's intermediate size (per rank)")
    parser.add_argument("--sweep", action="store_true", help="also time every tile variant (sweep_tiles)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from engine.kernels.torch import moe as reference
    from engine.kernels.triton import moe

    torch.manual_seed(0)
    dtype, device = torch.bfloat16, "cuda"
    num_experts, top_k, hidden, inter = args.experts, args.top_k, args.hidden, args.inter
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=device) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device=device) / inter ** 0.5).to(dtype)
    expert_bytes = 3 * hidden * inter * w13.element_size()
    read_bw = read_bandwidth_gbps()
    print(f"E={num_experts} k={top_k} H={hidden} I={inter} {dtype}; expert weights {num_experts * expert_bytes >> 20}"
          f" MiB; read bandwidth {read_bw:.0f} GB/s")
    rows, table = [], []
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        inputs = []
        for _ in range(NUM_ROUTINGS):
            x = torch.randn(num_tokens, hidden, device=device).to(dtype)
            logits = torch.randn(num_tokens, num_experts, device=device)
            inputs.append((x, *moe.moe_topk_softmax(logits, top_k, True)))
        touched = statistics.mean(int(torch.unique(ids).numel()) for _, _, ids in inputs)
        x, weights, ids = inputs[0]
        expected = reference.fused_experts(x, w13, w2, weights, ids)
        error = float((moe.fused_experts(x, w13, w2, weights, ids).float() - expected.float()).abs().max()
                      / expected.float().abs().max())
        if error > 2e-2:
            raise AssertionError(f"T={num_tokens}: Triton fused_experts is off the reference by {error:.3g}")
        torch_us = eager_us([lambda i=i: reference.fused_experts(i[0], w13, w2, i[1], i[2]) for i in inputs])
        triton_calls = [lambda i=i: moe.fused_experts(i[0], w13, w2, i[1], i[2]) for i in inputs]
        eager = eager_us(triton_calls)
        graph = time_calls(triton_calls)
        default = moe.default_tiles(num_tokens * top_k, num_experts, w13.element_size())
        align = time_calls([lambda i=i: moe.align_pairs(i[2], num_experts, default.block_m) for i in inputs])
        gbps = touched * expert_bytes / (graph * 1e-6) / 1e9
        row = dict(tokens=num_tokens, experts_touched=touched, max_error=error, torch_us=torch_us,
                   triton_eager_us=eager, triton_graph_us=graph, align_graph_us=align, speedup=torch_us / eager,
                   weight_gbps=gbps, tiles=dataclasses.asdict(default))
        if args.sweep:
            timings = []
            for tiles in sweep_tiles(w13.element_size()):
                try:
                    got = moe.fused_experts(x, w13, w2, weights, ids, tiles)
                    tile_error = float((got.float() - expected.float()).abs().max() / expected.float().abs().max())
                    if tile_error > 2e-2:
                        raise AssertionError(f"error {tile_error:.3g}")
                    us = time_calls([lambda i=i: moe.fused_experts(i[0], w13, w2, i[1], i[2], tiles)
                                     for i in inputs])
                except Exception as exc:  # a variant that does not fit this GPU: skip it
                    print(f"  T={num_tokens} {tiles}: {type(exc).__name__}: {str(exc)[:100]}")
                    continue
                timings.append((us, tiles))
            timings.sort(key=lambda pair: pair[0])
            row["sweep"] = [dict(us=us, tiles=dataclasses.asdict(tiles)) for us, tiles in timings]
            best_us, best = timings[0]
            print(f"T={num_tokens}: default {graph:.1f} us, best {best_us:.1f} us {best}")
            for us, tiles in timings[1:5]:
                print(f"    {us:.1f} us {tiles}")
        rows.append(row)
        table.append((num_tokens, f"{touched:.1f}", f"{torch_us / 1000:.3f}", f"{eager / 1000:.3f}",
                      f"{graph / 1000:.3f}", f"{align / 1000:.3f}", f"{torch_us / eager:.1f}x", f"{gbps:.0f}",
                      f"{error:.1e}"))
    print_table(["tokens", "experts", "torch ms", "triton ms", "triton graph ms", "align graph ms", "speedup",
                 "GB/s (graph)", "error"], table)
    Path(args.out).write_text(json.dumps({"environment": environment_record(), "read_gbps": read_bw,
                                          "shape": dict(experts=num_experts, top_k=top_k, hidden=hidden,
                                                        inter=inter, dtype=str(dtype)),
                                          "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

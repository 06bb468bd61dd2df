"""Decode-sized GEMMs (a few rows against each projection of a model) on the GPU: the vendor BLAS
(`F.linear`) against the Triton skinny GEMM over a sweep of its tile configurations, as bandwidth
(weight bytes / time) and as a share of the measured copy and read bandwidths.

Each timed call reads a different copy of the weight (copies totalling > 4x the L2 cache, cycled inside a
CUDA graph) so that, as in a real decode step, no weight is served from L2.

    python -m benchmarks.gemm_bench --out gemm.json [--model benchmarks/configs/llama-3.1-8b] [--tp 1]
    python -m benchmarks.gemm_bench --layer-chain --out chain.json   # layers' GEMMs in order, SiLU fused or not
    python -m benchmarks.gemm_bench --split-sweep --rows 1 --out split.json          # split-K per projection
    python -m benchmarks.gemm_bench --layer-chain --tile-rules engine,k512-s4 --out c.json  # tile rules, chained
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import environment_record, print_table

CONFIGS = [dict(block_n=bn, block_k=bk, num_stages=st, num_warps=w)
           for bn, bk, st, w in itertools.product((16, 32, 64), (128, 256, 512), (3, 5), (4, 8))
           if bn * bk <= 16384]
# More rows: wider tiles of outputs, shorter K tiles (the activation tile grows with the rows).
CONFIGS_MANY_ROWS = [dict(block_n=bn, block_k=bk, num_stages=st, num_warps=w)
                     for bn, bk, st, w in itertools.product((32, 64, 128), (64, 128), (3, 4), (4, 8))]


def projection_shapes(config: dict, tp: int) -> dict[str, tuple[int, int]]:
    if config.get("kv_lora_rank"):
        return mla_moe_projection_shapes(config, tp)
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim // tp, hidden),
        "o": (hidden, heads * head_dim // tp),
        "gate_up": (2 * inter // tp, hidden),
        "down": (hidden, inter // tp),
        "lm_head": (config["vocab_size"] // tp, hidden),
    }


def mla_moe_projection_shapes(config: dict, tp: int) -> dict[str, tuple[int, int]]:
    """A DeepSeek (MLA + MoE) model's dense decode GEMMs: the attention projections, the shared experts (one
    MLP of n_shared x the expert width), a dense first layer's MLP and the LM head (the routed experts run
    in the MoE kernels, not here)."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"] // tp
    qk = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    shapes = {}
    if config.get("q_lora_rank"):
        shapes["q_a"] = (config["q_lora_rank"], hidden)
        shapes["q_b"] = (heads * qk, config["q_lora_rank"])
    else:
        shapes["q"] = (heads * qk, hidden)
    shapes["kv_a"] = (config["kv_lora_rank"] + config["qk_rope_head_dim"], hidden)
    shapes["o"] = (hidden, heads * config["v_head_dim"])
    shared = config.get("n_shared_experts") or 0
    if shared:
        shapes["shared_gate_up"] = (2 * shared * config["moe_intermediate_size"] // tp, hidden)
        shapes["shared_down"] = (hidden, shared * config["moe_intermediate_size"] // tp)
    shapes["gate_up"] = (2 * config["intermediate_size"] // tp, hidden)
    shapes["down"] = (hidden, config["intermediate_size"] // tp)
    shapes["lm_head"] = (config["vocab_size"] // tp, hidden)
    return shapes


def time_calls(calls: list, replays: int = 10) -> float:
    """Microseconds per call, the calls captured back to back in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:3]:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * len(calls))


def read_bandwidth_gbps() -> float:
    x = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")  # 1 GiB
    x.fill_(1.0)
    us = time_calls([lambda: torch.sum(x, dtype=torch.float32)] * 4)
    return x.numel() * 2 / (us * 1e-6) / 1e9


def copy_bandwidth_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_calls([lambda: dst.copy_(src)] * 4)
    return 2 * src.numel() / (us * 1e-6) / 1e9


# Split-K sweep (`--split-sweep`): the engine's output-tile width with K tiles, pipeline depths and splits.
CONFIGS_SPLIT = [dict(block_n=32, block_k=bk, num_stages=st, num_warps=4, split=sp)
                 for bk, st, sp in itertools.product((256, 512), (3, 4, 5), (1, 2, 3, 4, 8))]


def _tiles(block_k: int, stages: int, split: int = 1, block_n: int = 32) -> dict:
    return dict(block_n=block_n, block_k=block_k, num_stages=stages, num_warps=4, split=split)


# `--tile-rules`: the layer's four GEMMs with these tiles (name -> projection -> skinny_gemm keywords;
# {} = the engine's own choice, whatever it is at the time).
TILE_RULES = {
    "engine": {},  # thin-k256-s5 is the rule the engine had on 2026-11-23
    "k512-s4": {name: _tiles(512, 4) for name in ("qkv", "o", "gate_up", "down")},
    "k512-s4+qkv-split2": {"qkv": _tiles(256, 4, 2), "o": _tiles(512, 4), "gate_up": _tiles(512, 4),
                             "down": _tiles(512, 4)},
    "k256-s4": {name: _tiles(256, 4) for name in ("qkv", "o", "gate_up", "down")},
    "k512-s3": {name: _tiles(512, 3) for name in ("qkv", "o", "gate_up", "down")},
    "thin-k256-s5": {"qkv": _tiles(256, 5), "o": _tiles(256, 5), "gate_up": _tiles(512, 4),
                                 "down": _tiles(512, 4)},
    # For the half-width shapes of one TP=2 rank (fewer output tiles than multiprocessors for QKV, O, down):
    # more, narrower programs; two programs per multiprocessor (256-wide K tiles take half the shared
    # memory); or the thin projections' K range split over two programs.
    "k512-s4-bn16": {name: _tiles(512, 4, block_n=16) for name in ("qkv", "o", "gate_up", "down")},
    "thin-bn16": {"qkv": _tiles(512, 4, block_n=16), "o": _tiles(512, 4, block_n=16), "gate_up": _tiles(512, 4),
                  "down": _tiles(512, 4, block_n=16)},
    "k256-s3": {name: _tiles(256, 3) for name in ("qkv", "o", "gate_up", "down")},
    "thin-split2": {"qkv": _tiles(256, 4, 2), "o": _tiles(256, 4, 2), "gate_up": _tiles(512, 4),
                    "down": _tiles(512, 4, 2)},
    "thin-k256-s4-bn16": {"qkv": _tiles(256, 4, block_n=16), "o": _tiles(256, 4, block_n=16),
                          "gate_up": _tiles(512, 4), "down": _tiles(256, 4, block_n=16)},
    # More weight bytes in flight per multiprocessor (for GPUs with more bandwidth than the H100, e.g. H200).
    "k512-s6-bn16": {name: _tiles(512, 6, block_n=16) for name in ("qkv", "o", "gate_up", "down")},
    "k256-s7": {name: _tiles(256, 7) for name in ("qkv", "o", "gate_up", "down")},
    "k256-s4-bn64": {name: _tiles(256, 4, block_n=64) for name in ("qkv", "o", "gate_up", "down")},
    "k1024-s2": {name: _tiles(1024, 2) for name in ("qkv", "o", "gate_up", "down")},
}


def layer_chain_rows(config: dict, tp: int, rows: list[int], layers: int = 4,
                     tile_rules: list[str] | None = None) -> list[dict]:
    """A decoder layer's GEMMs in order (QKV, O, gate/up, down, with an RMSNorm kernel before QKV and
    gate/up as the gaps), over several layers' weights: with the SiLU-and-mul as its own kernel or in the
    gate/up GEMM's epilogue; with `tile_rules` (names in TILE_RULES), the fused chain with each rule's tiles
    instead, interleaved twice (the better time of the two)."""
    from engine.kernels.triton import gemv, ops
    shapes = projection_shapes(config, tp)
    names = ("qkv", "o", "gate_up", "down")
    weights = [{name: torch.randn(*shapes[name], device="cuda", dtype=torch.bfloat16) for name in names}
               for _ in range(layers)]
    layer_bytes = sum(w.numel() * 2 for w in weights[0].values())
    hidden, inter = shapes["o"][0], shapes["down"][1]
    norm_weight = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    out = []
    for m in rows:
        x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
        attn, act = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for n in (shapes["o"][1], inter))

        def layer_calls(layer, gated, tiles=TILE_RULES["engine"]):
            def gemm(name, rows, **kw):
                return lambda: gemv.skinny_gemm(rows, layer[name], **tiles.get(name, {}), **kw)
            calls = [lambda: ops.rms_norm(x, norm_weight, 1e-5), gemm("qkv", x), gemm("o", attn),
                     lambda: ops.rms_norm(x, norm_weight, 1e-5)]
            if gated:
                calls.append(gemm("gate_up", x, gated=True))
            else:
                calls.append(lambda: ops.silu_and_mul(gemv.skinny_gemm(x, layer["gate_up"])))
            return calls + [gemm("down", act)]
        timings = {}
        for _ in range(2 if tile_rules else 0):
            for rule in tile_rules:
                calls = [call for layer in weights for call in layer_calls(layer, True, TILE_RULES[rule])]
                us = time_calls(calls) * len(calls) / layers
                timings[rule] = min(us, timings.get(rule, us))
        for gated in (() if tile_rules else (False, True)):
            calls = [call for layer in weights for call in layer_calls(layer, gated)]
            label = "SiLU-and-mul in the GEMM epilogue" if gated else "SiLU-and-mul kernel"
            timings[label] = time_calls(calls) * len(calls) / layers
        out.append(dict(m=m, layer_bytes=layer_bytes, us_per_layer=timings,
                        gbps={label: layer_bytes / (us * 1e-6) / 1e9 for label, us in timings.items()}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="benchmarks/configs/llama-3.1-8b")
    parser.add_argument("--tp", type=int, default=1, help="shapes of one rank at this tensor-parallel size")
    parser.add_argument("--rows", default="1,8,16", help="batch rows (the kernel takes up to 128)")
    parser.add_argument("--only", default=None, help="comma-separated projections to run (qkv,o,gate_up,down,lm_head)")
    parser.add_argument("--layer-chain", action="store_true",
                        help="only time decoder layers' GEMM sequences, with the SiLU-and-mul fused or as its own kernel")
    parser.add_argument("--split-sweep", action="store_true",
                        help="sweep split-K with the engine's tile width (CONFIGS_SPLIT) instead of the tile sweep")
    parser.add_argument("--tile-rules", default=None,
                        help=f"with --layer-chain: comma-separated tile rules to compare ({', '.join(TILE_RULES)})")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from engine.kernels.triton.gemv import skinny_gemm
    config = json.loads((Path(args.model) / "config.json").read_text())
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    copy_bw, read_bw = copy_bandwidth_gbps(), read_bandwidth_gbps()
    print(f"copy {copy_bw:.0f} GB/s, read {read_bw:.0f} GB/s, L2 {l2_bytes >> 20} MiB, TP={args.tp}")
    if args.layer_chain:
        rules = args.tile_rules.split(",") if args.tile_rules else None
        chain = layer_chain_rows(config, args.tp, [int(r) for r in args.rows.split(",")], tile_rules=rules)
        print_table(["rows", "variant", "us/layer", "GB/s", "of read bw", "vs the first variant"],
                    [(r["m"], label, f"{us:.1f}", f"{r['gbps'][label]:.0f}", f"{r['gbps'][label] / read_bw:.3f}",
                      f"{next(iter(r['us_per_layer'].values())) / us:.3f}") for r in chain for label, us in r["us_per_layer"].items()])
        Path(args.out).write_text(json.dumps({"environment": environment_record(), "tp": args.tp, "copy_gbps": copy_bw,
                                              "read_gbps": read_bw, "layer_chain": chain}, indent=2))
        return
    rows_out, table = [], []
    for name, (n, k) in projection_shapes(config, args.tp).items():
        if args.only and name not in args.only.split(","):
            continue
        weight_bytes = n * k * 2
        copies = max(2, -(-4 * l2_bytes // weight_bytes))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            expected = F.linear(x, weights[0])
            blas_us = time_calls([lambda w=w: F.linear(x, w) for w in weights])
            best = None
            for cfg in (CONFIGS_SPLIT if args.split_sweep else CONFIGS if m <= 16 else CONFIGS_MANY_ROWS):
                try:
                    got = skinny_gemm(x, weights[0], None, **cfg)
                    error = float((got.float() - expected.float()).abs().max() / expected.float().abs().max())
                    if error > 2e-2:
                        raise AssertionError(f"error {error:.3g}")
                    us = time_calls([lambda w=w: skinny_gemm(x, w, None, **cfg) for w in weights])
                except Exception as exc:  # a config that does not fit this GPU: skip it
                    print(f"  {name} m={m} {cfg}: {type(exc).__name__}: {str(exc)[:100]}")
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg)
            # The engine's own choice of tiles (fitted to this GPU's shared memory for this many rows).
            rule_us = time_calls([lambda w=w: skinny_gemm(x, w, None) for w in weights])
            row = dict(name=name, n=n, k=k, m=m, weight_mb=weight_bytes / 1e6, blas_us=blas_us, rule_us=rule_us,
                       blas_gbps=weight_bytes / (blas_us * 1e-6) / 1e9,
                       triton_us=best[0] if best else None, triton_config=best[1] if best else None,
                       triton_gbps=weight_bytes / (best[0] * 1e-6) / 1e9 if best else None)
            rows_out.append(row)
            table.append((name, f"{n}x{k}", m, f"{blas_us:.1f}", f"{row['blas_gbps']:.0f}",
                          f"{row['blas_gbps'] / read_bw:.2f}",
                          f"{row['triton_us']:.1f}" if best else "-",
                          f"{row['triton_gbps']:.0f}" if best else "-",
                          f"{blas_us / best[0]:.2f}" if best else "-", f"{blas_us / rule_us:.2f}",
                          json.dumps(best[1]) if best else "-"))
        del weights
        torch.cuda.empty_cache()
    print_table(["proj", "N x K", "rows", "BLAS us", "BLAS GB/s", "of read bw", "triton us", "triton GB/s",
                 "best speedup", "default-tiles speedup", "best config"], table)
    Path(args.out).write_text(json.dumps({"environment": environment_record(), "tp": args.tp,
                                          "copy_gbps": copy_bw, "read_gbps": read_bw, "rows": rows_out}, indent=2))


if __name__ == "__main__":
    main()

"""Decode attention on the GPU: the Triton split-K decode kernel over a sweep of its tile sizes, warps and
pipeline stages, as KV-cache bandwidth (bytes of K and V read / time) and as a share of the measured read
bandwidth, at a few batch sizes and context lengths (Llama-3.1-8B heads: 32 query, 8 KV, head size 128).

Each timed launch reads a different layer's cache (caches totalling > 4x the L2 cache, cycled inside one
CUDA graph), as in a real decode step.

    python -m benchmarks.decode_attention_bench --out decode_attention.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import torch

from benchmarks.common import environment_record, print_table
from benchmarks.gemm_bench import read_bandwidth_gbps, time_calls

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, PAGE = 32, 8, 128, 16
SHAPES = ((128, 1024), (64, 1024), (16, 1024), (1, 384))
CONFIGS = [dict(block_n=bn, num_warps=w, num_stages=st) for bn, w, st in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))]


def decode_inputs(batch: int, context: int, layers: int):
    from engine.kernels.attention import CommonAttentionMetadata
    from engine.kernels.triton.attention import TritonAttentionBackend
    blocks_per_seq = math.ceil(context / PAGE)
    num_blocks = batch * blocks_per_seq
    caches = [torch.randn(TritonAttentionBackend.kv_cache_shape(num_blocks, PAGE, NUM_KV_HEADS, HEAD_SIZE),
                          device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    block_table = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, blocks_per_seq)
    common = CommonAttentionMetadata(
        num_seqs=batch, num_decodes=batch, num_tokens=batch,
        query_start_loc=torch.arange(batch + 1, device="cuda", dtype=torch.int32),
        seq_lens=torch.full((batch,), context, device="cuda", dtype=torch.int32), block_table=block_table,
        slot_mapping=torch.full((batch,), -1, device="cuda"), max_query_len=1, max_seq_len=context,
        query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[context] * batch,
        num_computed_tokens_cpu=[context - 1] * batch)
    return caches, TritonAttentionBackend.build_metadata(common, PAGE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from engine.kernels.triton import attention
    read_bw = read_bandwidth_gbps()
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    results, table = [], []
    for batch, context in SHAPES:
        kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_SIZE * 2
        caches, metadata = decode_inputs(batch, context, max(2, -(-4 * l2_bytes // kv_bytes)))
        query = torch.randn(batch, NUM_HEADS, HEAD_SIZE, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(query)
        expected = None
        timings = {}
        for config in [None] + CONFIGS:
            def call(cache, config=config):
                attention._decode(query, cache[0], cache[1], out, metadata, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS,
                                  HEAD_SIZE, HEAD_SIZE, config["block_n"] if config else 64,
                                  config["num_warps"] if config else 4, HEAD_SIZE ** -0.5 * 1.4426950408889634,
                                  PAGE, False, **({"num_stages": config["num_stages"]} if config else {}))
            label = json.dumps(config) if config else "engine default"
            try:
                call(caches[0])
                if expected is None:
                    expected = out.clone()
                error = float((out.float() - expected.float()).abs().max())
                if error > 2e-2:
                    raise AssertionError(f"error {error:.3g}")
                timings[label] = time_calls([lambda c=c: call(c) for c in caches])
            except Exception as exc:  # a config that does not fit this GPU: skip it
                print(f"  b={batch} ctx={context} {label}: {type(exc).__name__}: {str(exc)[:100]}")
        best = min(timings, key=timings.get)
        for label in ("engine default", best):
            us = timings[label]
            table.append((batch, context, label, f"{us:.1f}", f"{kv_bytes / (us * 1e-6) / 1e9:.0f}",
                          f"{kv_bytes / (us * 1e-6) / 1e9 / read_bw:.2f}", f"{timings['engine default'] / us:.2f}"))
        results.append(dict(batch=batch, context=context, kv_bytes=kv_bytes, us=timings, best=best))
        del caches
        torch.cuda.empty_cache()
    print(f"read bandwidth {read_bw:.0f} GB/s")
    print_table(["batch", "context", "config", "us", "KV GB/s", "of read bw", "vs default"], table)
    Path(args.out).write_text(json.dumps({"environment": environment_record(), "read_gbps": read_bw,
                                          "shapes": results}, indent=2))


if __name__ == "__main__":
    main()

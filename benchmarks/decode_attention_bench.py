"""Decode attention on the GPU (Llama-3.1-8B heads: 32 query, 8 KV, head size 128), as KV-cache bandwidth
(bytes of K and V read / time) and as a share of the measured read bandwidth, at a few batch sizes and
context lengths:
- the Triton split-K decode kernel over a sweep of its tile sizes, warps and pipeline stages;
- a whole decode step of one layer's attention, rotary embedding and KV-cache write included: the fused
  kernel against the three it replaces (rotary cache write, split-K decode, reduction), with the splits
  planned for the step's own contexts and, as a captured CUDA graph plans them, for max_model_len.

Each timed launch reads a different layer's cache (caches totalling > 4x the L2 cache, cycled inside one
CUDA graph), as in a real decode step.

    python -m benchmarks.decode_attention_bench --out decode_attention.json [--fused-only]
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
STEP_SHAPES = ((1, 384), (1, 1024), (4, 1024), (16, 1024), (64, 1024), (128, 1024))
MAX_MODEL_LEN = 4096  # as gpu_perf's latency run captures its graphs


def decode_inputs(batch: int, context: int, layers: int, planned_len: int | None = None):
    """Caches of `layers` layers and the step's metadata; planned_len: the host-side context length that
    plans the splits (a CUDA graph's max_model_len), the step's own by default."""
    from engine.kernels.attention import CommonAttentionMetadata
    from engine.kernels.triton.attention import TritonAttentionBackend
    planned_len = planned_len or context
    blocks_per_seq = math.ceil(context / PAGE)
    num_blocks = batch * blocks_per_seq
    caches = [torch.randn(TritonAttentionBackend.kv_cache_shape(num_blocks, PAGE, NUM_KV_HEADS, HEAD_SIZE),
                          device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    block_table = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, blocks_per_seq)
    last = context - 1  # the new token's slot
    slots = block_table[:, last // PAGE].long() * PAGE + last % PAGE
    common = CommonAttentionMetadata(
        num_seqs=batch, num_decodes=batch, num_tokens=batch,
        query_start_loc=torch.arange(batch + 1, device="cuda", dtype=torch.int32),
        seq_lens=torch.full((batch,), context, device="cuda", dtype=torch.int32), block_table=block_table,
        slot_mapping=slots, max_query_len=1, max_seq_len=planned_len,
        query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[planned_len] * batch,
        num_computed_tokens_cpu=[planned_len - 1] * batch)
    return caches, TritonAttentionBackend.build_metadata(common, PAGE)


def tile_sweep(read_bw: float, l2_bytes: int) -> tuple[list, list]:
    from engine.kernels.triton import decode_attention
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
                decode_attention.decode(query, cache[0], cache[1], out, metadata, NUM_KV_HEADS,
                                        NUM_HEADS // NUM_KV_HEADS, HEAD_SIZE, HEAD_SIZE,
                                        config["block_n"] if config else 64, config["num_warps"] if config else 4,
                                        HEAD_SIZE ** -0.5 * 1.4426950408889634, PAGE, False,
                                        **({"num_stages": config["num_stages"]} if config else {}))
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
    return results, table


def fused_steps(read_bw: float, l2_bytes: int) -> tuple[list, list]:
    """One layer's decode attention through the backend, the fused kernel against the three kernels."""
    from engine.kernels.triton import decode_attention
    from engine.kernels.triton.attention import TritonAttentionBackend
    # A real cos/sin table: the three kernels rotate the query in place on every timed call, and only a
    # rotation keeps its norm through thousands of them.
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD_SIZE, 2, device="cuda") / HEAD_SIZE))
    angles = torch.outer(torch.arange(MAX_MODEL_LEN, device="cuda"), inv_freq)
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    results, table = [], []
    for batch, context in STEP_SHAPES:
        kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_SIZE * 2
        rope = (torch.full((batch,), context - 1, device="cuda"), cos_sin, True)
        for planned_len in (context, MAX_MODEL_LEN):
            qkv = torch.randn(batch, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE, device="cuda", dtype=torch.bfloat16)
            query, key, value = (t.view(batch, -1, HEAD_SIZE) for t in qkv.split(
                [NUM_HEADS * HEAD_SIZE, NUM_KV_HEADS * HEAD_SIZE, NUM_KV_HEADS * HEAD_SIZE], dim=-1))
            caches, metadata = decode_inputs(batch, context, max(2, -(-4 * l2_bytes // kv_bytes)), planned_len)
            timings, outputs = {}, {}
            labels = {False: "three kernels", True: "fused"}
            for fused, label in labels.items():  # the three kernels rotate the query in place: run on copies
                decode_attention.FUSED_DECODE = fused
                outputs[label] = TritonAttentionBackend.forward(query.clone(), key, value, caches[0], metadata,
                                                                HEAD_SIZE ** -0.5, PAGE, rope)
            for fused, label in labels.items():
                decode_attention.FUSED_DECODE = fused

                def call(cache):
                    TritonAttentionBackend.forward(query, key, value, cache, metadata, HEAD_SIZE ** -0.5, PAGE, rope)
                timings[label] = time_calls([lambda c=c: call(c) for c in caches])
            decode_attention.FUSED_DECODE = True
            error = float((outputs["fused"].float() - outputs["three kernels"].float()).abs().max())
            assert error < 2e-2, f"fused decode differs from the three kernels by {error:.3g}"
            num_splits = next(iter(metadata._decode_plans.values()))[0]
            saved = timings["three kernels"] - timings["fused"]
            table.append((batch, context, planned_len, num_splits, f"{timings['three kernels']:.1f}",
                          f"{timings['fused']:.1f}", f"{saved:.1f}",
                          f"{kv_bytes / (timings['fused'] * 1e-6) / 1e9 / read_bw:.2f}"))
            results.append(dict(batch=batch, context=context, planned_len=planned_len, splits=num_splits,
                                kv_bytes=kv_bytes, us=timings, max_abs_difference=error))
            del caches
            torch.cuda.empty_cache()
    return results, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--fused-only", action="store_true", help="skip the tile sweep")
    args = parser.parse_args()
    read_bw = read_bandwidth_gbps()
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    record = {"environment": environment_record(), "read_gbps": read_bw}
    print(f"read bandwidth {read_bw:.0f} GB/s")
    if not args.fused_only:
        record["shapes"], table = tile_sweep(read_bw, l2_bytes)
        print_table(["batch", "context", "config", "us", "KV GB/s", "of read bw", "vs default"], table)
    record["steps"], table = fused_steps(read_bw, l2_bytes)
    print_table(["batch", "context", "planned for", "splits", "three kernels us", "fused us", "saved us",
                 "fused of read bw"], table)
    Path(args.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()

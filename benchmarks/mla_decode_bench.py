"""The Triton absorbed MLA decode (engine/kernels/triton/mla.py) against the torch reference decode
(engine/kernels/torch/mla.py) at DeepSeek-V2-Lite's attention shape: 16 heads, kv_lora_rank 512, rope 64,
qk_nope 128, v_head_dim 128, bf16, block size 16; batch 1/8/32/64 x context 1024/4096/8192.

Per shape: microseconds per call (q_nope @ W_UK, attention over the paged latent cache, @ W_UV; the cache
write is not timed), the speedup over the reference, and the bytes that must move (every sequence's latent
cache, W_UK and W_UV, q and the output) per second, also as a fraction of the device-copy bandwidth measured
in the same run. Each timed call reads a different layer's cache and weights (together > 4x the L2 cache),
as a real decode step does. Timed with CUDA events: the Triton decode captured back to back in a CUDA graph
(as the engine runs it; also with its splits planned for a graph captured at MAX_MODEL_LEN) and eagerly;
the reference eagerly (it loops on host lengths, the engine never captures it). Then a sweep of the
decode's split rule and a few tile shapes at some shapes. Also whole prefill steps, Triton against the
reference. First, the largest absolute differences from the
reference on the GPU for decode, prefill (with and without a cached prefix), a mixed batch and sparse
attention.

    PYTHONPATH=. python -m benchmarks.mla_decode_bench --out mla_decode.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import torch

from benchmarks.common import environment_record, print_table
from benchmarks.gemm_bench import copy_bandwidth_gbps, time_calls

HEADS, RANK, ROPE, NOPE, V = 16, 512, 64, 128, 128
PAGE = 16
SCALE = (NOPE + ROPE) ** -0.5
BATCHES = (1, 8, 32, 64)
CONTEXTS = (1024, 4096, 8192)
MAX_MODEL_LEN = 16384  # a CUDA graph plans the splits for the longest context
SWEEP_SHAPES = ((1, 1024), (1, 8192), (8, 4096), (64, 1024), (64, 8192))
# (MIN_SPLIT_TOKENS, MAX_SPLITS, tiles or None for the default)
SWEEP = ([(m, s, None) for m, s in itertools.product((32, 64, 128, 256), (64, 128))]
         + [(128, 64, (16, 64, 8, 2)), (128, 64, (16, 32, 4, 3)), (128, 64, (16, 32, 8, 2))])


def make_weights(layers: int):
    from engine.kernels.mla import MLAWeights
    weights = []
    for _ in range(layers):
        kv_b = torch.randn(HEADS * (NOPE + V), RANK, device="cuda", dtype=torch.bfloat16) * RANK ** -0.5
        per_head = kv_b.view(HEADS, NOPE + V, RANK)
        weights.append(MLAWeights(lambda x, w=kv_b: x @ w.T, per_head[:, :NOPE], per_head[:, NOPE:]))
    return weights


def decode_inputs(batch: int, context: int, layers: int):
    from engine.kernels.attention import CommonAttentionMetadata
    blocks_per_seq = math.ceil(context / PAGE)
    num_blocks = batch * blocks_per_seq
    caches = [torch.randn(num_blocks, PAGE, RANK + ROPE, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    block_table = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, blocks_per_seq)
    last = context - 1
    metadata = CommonAttentionMetadata(
        num_seqs=batch, num_decodes=batch, num_tokens=batch,
        query_start_loc=torch.arange(batch + 1, device="cuda", dtype=torch.int32),
        seq_lens=torch.full((batch,), context, device="cuda", dtype=torch.int32), block_table=block_table,
        slot_mapping=block_table[:, last // PAGE].long() * PAGE + last % PAGE, max_query_len=1,
        max_seq_len=context, query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[context] * batch,
        num_computed_tokens_cpu=[context - 1] * batch)
    q_nope = torch.randn(batch, HEADS, NOPE, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(batch, HEADS, ROPE, device="cuda", dtype=torch.bfloat16)
    return caches, metadata, q_nope, q_pe


def must_move(batch: int, context: int) -> int:
    """Bytes one decode call must move at least: the latent cache, W_UK and W_UV, q in, out back."""
    cache = batch * context * (RANK + ROPE) * 2
    weights = HEADS * (NOPE + V) * RANK * 2
    return cache + weights + batch * HEADS * (NOPE + ROPE) * 2 + batch * HEADS * V * 2


def eager_us(calls: list, rounds: int = 3) -> float:
    for call in calls[:3]:
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        for call in calls:
            call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (rounds * len(calls))


def decode_table(bandwidth: float, l2_bytes: int) -> tuple[list, list]:
    from engine.kernels.torch import mla as reference
    from engine.kernels.triton import mla
    results, table = [], []
    for batch, context in itertools.product(BATCHES, CONTEXTS):
        moved = must_move(batch, context)
        layers = max(2, min(256, -(-4 * l2_bytes // moved)))
        caches, metadata, q_nope, q_pe = decode_inputs(batch, context, layers)
        weights = make_weights(layers)
        seq_lens, block_table = metadata.seq_lens, metadata.block_table

        def triton_call(i, planned=context):
            return mla.decode_absorbed(q_nope, q_pe, caches[i], seq_lens, block_table, planned, weights[i], SCALE)

        def reference_call(i):
            return reference.decode_absorbed(q_nope, q_pe, caches[i], metadata, weights[i], SCALE, PAGE)
        out, expected = triton_call(0), reference_call(0)
        error = float((out.float() - expected.float()).abs().max())
        triton_us = time_calls([lambda i=i: triton_call(i) for i in range(layers)])
        planned_us = time_calls([lambda i=i: triton_call(i, MAX_MODEL_LEN) for i in range(layers)])
        triton_eager_us = eager_us([lambda i=i: triton_call(i) for i in range(layers)])
        reference_us = eager_us([lambda i=i: reference_call(i) for i in range(min(layers, 16))])
        gbps = moved / (triton_us * 1e-6) / 1e9
        splits = mla.decode_splits(batch, 1, context, 32, torch.device("cuda"))[0]
        table.append((batch, context, splits, f"{triton_us:.1f}", f"{planned_us:.1f}", f"{triton_eager_us:.1f}",
                      f"{reference_us:.1f}",
                      f"{reference_us / triton_us:.1f}x", f"{reference_us / triton_eager_us:.1f}x", f"{gbps:.0f}",
                      f"{gbps / bandwidth:.2f}", f"{error:.2e}"))
        results.append(dict(batch=batch, context=context, splits=splits, bytes=moved, layers=layers,
                            triton_us=triton_us, triton_planned_max_len_us=planned_us,
                            triton_eager_us=triton_eager_us, reference_eager_us=reference_us,
                            gbps=gbps,
                            roofline_fraction=gbps / bandwidth, max_abs_error=error))
        del caches, weights
        torch.cuda.empty_cache()
    return results, table


def split_sweep(bandwidth: float, l2_bytes: int) -> tuple[list, list]:
    """The decode's split rule (shortest split, most splits) and a few tile shapes."""
    from engine.kernels.triton import mla
    defaults = (mla.MIN_SPLIT_TOKENS, mla.MAX_SPLITS)
    results, table = [], []
    for batch, context in SWEEP_SHAPES:
        moved = must_move(batch, context)
        layers = max(2, min(256, -(-4 * l2_bytes // moved)))
        caches, metadata, q_nope, q_pe = decode_inputs(batch, context, layers)
        weights = make_weights(layers)
        expected = mla.decode_absorbed(q_nope, q_pe, caches[0], metadata.seq_lens, metadata.block_table, context,
                                       weights[0], SCALE)
        timings = {}
        for min_tokens, max_splits, tiles in [(*defaults, None)] + SWEEP:
            mla.MIN_SPLIT_TOKENS, mla.MAX_SPLITS = min_tokens, max_splits

            def call(i, tiles=tiles):
                return mla.decode_absorbed(q_nope, q_pe, caches[i], metadata.seq_lens, metadata.block_table,
                                           context, weights[i], SCALE, tiles)
            label = f"min{min_tokens}-max{max_splits}" + ("" if tiles is None else "-h{}-n{}-w{}-s{}".format(*tiles))
            try:
                error = float((call(0).float() - expected.float()).abs().max())
                if error > 2e-2:
                    raise AssertionError(f"error {error:.3g}")
                timings[label] = time_calls([lambda i=i: call(i) for i in range(layers)])
            except Exception as exc:  # noqa: BLE001  (a config that does not fit: skip it)
                print(f"  b={batch} ctx={context} {label}: {type(exc).__name__}: {str(exc)[:100]}")
        mla.MIN_SPLIT_TOKENS, mla.MAX_SPLITS = defaults
        default = "min{}-max{}".format(*defaults)
        for label, us in sorted(timings.items(), key=lambda item: item[1]):
            table.append((batch, context, label + (" (default)" if label == default else ""), f"{us:.1f}",
                          f"{moved / (us * 1e-6) / 1e9 / bandwidth:.2f}"))
        results.append(dict(batch=batch, context=context, us=timings, best=min(timings, key=timings.get)))
        del caches, weights
        torch.cuda.empty_cache()
    return results, table


def breakdown(l2_bytes: int) -> tuple[list, list]:
    """Microseconds of the decode's three parts at a few shapes (graph-timed each alone): q_nope @ W_UK,
    the attention over the cache (split kernel and reduction), @ W_UV."""
    from engine.kernels.triton import mla
    results, table = [], []
    for batch, context in ((1, 1024), (1, 8192), (64, 1024), (64, 8192)):
        moved = must_move(batch, context)
        layers = max(2, min(256, -(-4 * l2_bytes // moved)))
        caches, metadata, q_nope, q_pe = decode_inputs(batch, context, layers)
        weights = make_weights(layers)
        q_latent = torch.bmm(q_nope.transpose(0, 1), weights[0].w_uk)
        out_latent = torch.empty_like(q_latent)
        parts = {
            "q_nope @ W_UK": [lambda i=i: torch.bmm(q_nope.transpose(0, 1), weights[i].w_uk) for i in range(layers)],
            "attention": [lambda i=i: mla.decode_latent(q_latent.transpose(0, 1), q_pe, caches[i], metadata.seq_lens,
                                                        metadata.block_table, context, SCALE,
                                                        out_latent.transpose(0, 1)) for i in range(layers)],
            "@ W_UV": [lambda i=i: torch.bmm(out_latent, weights[i].w_uv.transpose(1, 2)) for i in range(layers)],
        }
        us = {name: time_calls(calls) for name, calls in parts.items()}
        table.append((batch, context, *(f"{us[name]:.1f}" for name in parts)))
        results.append(dict(batch=batch, context=context, us=us))
        del caches, weights
        torch.cuda.empty_cache()
    return results, table


def step_inputs(num_decodes: int, query_lens: list[int], seq_lens: list[int]):
    """A step's inputs, metadata and a noise-filled cache: each sequence's blocks shuffled over the cache,
    slots for its last query_len positions."""
    from engine.kernels.attention import CommonAttentionMetadata
    blocks = [math.ceil(n / PAGE) for n in seq_lens]
    num_blocks = sum(blocks) + 8
    order = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device="cuda")
    used = 0
    for i, count in enumerate(blocks):
        table[i, :count] = order[used:used + count]
        used += count
    slots = torch.cat([table[i, torch.arange(s - q, s, device="cuda") // PAGE].long() * PAGE
                       + torch.arange(s - q, s, device="cuda") % PAGE
                       for i, (q, s) in enumerate(zip(query_lens, seq_lens))])
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    metadata = CommonAttentionMetadata(
        num_seqs=len(seq_lens), num_decodes=num_decodes, num_tokens=starts[-1],
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), block_table=table, slot_mapping=slots,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens, num_computed_tokens_cpu=[s - q for q, s in zip(query_lens, seq_lens)])
    tokens = starts[-1]
    cache = torch.randn(num_blocks, PAGE, RANK + ROPE, device="cuda", dtype=torch.bfloat16)
    inputs = (torch.randn(tokens, HEADS, NOPE, device="cuda", dtype=torch.bfloat16),
              torch.randn(tokens, HEADS, ROPE, device="cuda", dtype=torch.bfloat16),
              torch.randn(tokens, RANK, device="cuda", dtype=torch.bfloat16),
              torch.randn(tokens, ROPE, device="cuda", dtype=torch.bfloat16))
    return inputs, cache, metadata


def accuracy() -> dict:
    """Largest absolute differences from the torch reference: decode inside mla_attention, prefill with and
    without a cached prefix, a mixed batch, and sparse attention (-1 padding, an empty row)."""
    from engine.kernels.torch import mla as reference
    from engine.kernels.triton import mla
    torch.manual_seed(0)
    weights = make_weights(1)[0]
    record = {}
    for name, num_decodes, query_lens, seq_lens in (
            ("decode", 4, [1, 1, 1, 1], [37, 1000, 4096, 9]),
            ("prefill_fresh", 0, [300, 1024], [300, 1024]),
            ("prefill_cached_prefix", 0, [256, 100], [956, 100]),
            ("mixed", 2, [1, 1, 200, 64], [500, 33, 200, 777])):
        inputs, cache, metadata = step_inputs(num_decodes, query_lens, seq_lens)
        expected_cache = cache.clone()
        out = mla.mla_attention(*inputs, cache, metadata, weights, SCALE, PAGE)
        expected = reference.mla_attention(*inputs, expected_cache, metadata, weights, SCALE, PAGE)
        record[name] = dict(max_abs_error=float((out.float() - expected.float()).abs().max()),
                            output_max=float(expected.float().abs().max()),
                            cache_equal=bool(torch.equal(cache, expected_cache)))
    cache = torch.randn(4096, PAGE, RANK + ROPE, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(64, HEADS, RANK + ROPE, device="cuda", dtype=torch.bfloat16)
    slots = torch.stack([torch.randperm(4096 * PAGE, device="cuda")[:2048] for _ in range(64)])
    slots[1::3, 1500:] = -1
    slots[5] = -1
    out, lse = mla.mla_sparse_attention(q, cache, slots, SCALE, RANK)
    expected, expected_lse = reference.mla_sparse_attention(q, cache, slots, SCALE, RANK)
    finite = expected_lse.isfinite()
    record["sparse"] = dict(max_abs_error=float((out.float() - expected.float()).abs().max()),
                            output_max=float(expected.float().abs().max()),
                            lse_max_abs_error=float((lse[finite] - expected_lse[finite]).abs().max()),
                            empty_row_ok=bool((out[5] == 0).all() and (lse[5] == float("-inf")).all()))
    return record


def prefill_table() -> tuple[list, list]:
    """Whole mla_attention calls on prefill steps (cache write, expansion through kv_b_proj, attention), the
    Triton op against the reference, both eager (prefill steps run eagerly)."""
    from engine.kernels.torch import mla as reference
    from engine.kernels.triton import mla
    weights = make_weights(1)[0]
    results, table = [], []
    for label, query_lens, seq_lens in (("4 x 1024 fresh", [1024] * 4, [1024] * 4),
                                         ("1 x 8192 fresh", [8192], [8192]),
                                         ("512 after 3584 cached", [512], [4096]),
                                         ("4 x 256 after 1792 cached", [256] * 4, [2048] * 4)):
        inputs, cache, metadata = step_inputs(0, query_lens, seq_lens)
        us = {name: eager_us([lambda op=op: op.mla_attention(*inputs, cache, metadata, weights, SCALE, PAGE)] * 4)
              for name, op in (("triton", mla), ("torch", reference))}
        table.append((label, f"{us['triton']:.1f}", f"{us['torch']:.1f}", f"{us['torch'] / us['triton']:.2f}x"))
        results.append(dict(label=label, query_lens=query_lens, seq_lens=seq_lens, us=us))
        del cache
        torch.cuda.empty_cache()
    return results, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--no-sweep", action="store_true", help="skip the sweep of split rules and tiles")
    args = parser.parse_args()
    bandwidth = copy_bandwidth_gbps()
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    record = {"environment": environment_record(), "device": torch.cuda.get_device_name(),
              "copy_gbps": bandwidth, "shape": dict(heads=HEADS, kv_lora_rank=RANK, rope=ROPE, qk_nope=NOPE,
                                                    v_head_dim=V, dtype="bfloat16", block_size=PAGE)}
    print(f"{record['device']}: device copy bandwidth {bandwidth:.0f} GB/s")
    record["accuracy"] = accuracy()
    print(json.dumps(record["accuracy"], indent=1))
    record["decode"], table = decode_table(bandwidth, l2_bytes)
    print_table(["batch", "context", "splits", "triton us (graph)", f"planned at {MAX_MODEL_LEN}",
                 "triton us (eager)", "torch us (eager)",
                 "speedup graph", "speedup eager", "GB/s (graph)", "of copy bw", "max abs err"], table)
    record["prefill"], table = prefill_table()
    print_table(["prefill step", "triton us (eager)", "torch us (eager)", "speedup"], table)
    record["breakdown"], table = breakdown(l2_bytes)
    print_table(["batch", "context", "q_nope @ W_UK us", "attention us", "@ W_UV us"], table)
    if not args.no_sweep:
        record["sweep"], table = split_sweep(bandwidth, l2_bytes)
        print_table(["batch", "context", "min split tokens, max splits, tiles", "us", "of copy bw"], table)
    Path(args.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()

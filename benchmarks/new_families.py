"""Issue 27's measurements for the families with sliding windows, sinks and recurrent state (gpt-oss, Gemma 4,
Qwen3-Next / Qwen3.5), dummy weights at the real shapes of benchmarks/configs:

- `capacity` (any machine, the model built on the meta device): KV tokens the cache holds at a fixed memory
  budget with the model's window groups, against the same layers each keeping a full-context cache. This is
  the allocator's arithmetic (engine/runner/kv_cache.py), exactly what a GPU start-up computes.
- `roofline`: the bytes one decode step must move at batch 1 (weights without the embedding gather, the
  routed experts' top-k share, each paged cache's entries inside its window, each state read and written)
  and, with the measured bandwidth, the decode roofline.
- `latency` (GPU): batch-1 decode tokens/s against that roofline and against transformers' `generate`.
- `throughput` (GPU): offline output tokens/s on the first N requests of gpu_perf's workload, against
  transformers' `generate` over static batches on the same requests (its continuous batching does not run
  every family), in the same call.
- `window` (GPU): a windowed layer's decode attention (Triton, window 128) at 32k context against 1k: a
  window reads the same bytes at any context (target: within 10 %), beside a full-context layer's.

    python -m benchmarks.new_families capacity --out capacity.json
    python -m benchmarks.new_families latency --models gpt-oss-20b --out latency.json
"""
from __future__ import annotations

import argparse
from functools import partial
import dataclasses
import json
import time
from pathlib import Path

import torch

from benchmarks.common import environment_record, print_table

FAMILIES = ("gpt-oss-20b", "gpt-oss-120b", "gemma-4-31b", "gemma-4-26b-a4b", "qwen3-next-80b-a3b",
            "qwen3.5-35b-a3b")
WINDOWED = ("gpt-oss-20b", "gpt-oss-120b", "gemma-4-31b", "gemma-4-26b-a4b")
BLOCK = 16


def meta_model(name: str, quantized: bool = True):
    """Our model of benchmarks/configs/<name> on the meta device (no memory), with the checkpoint's own
    quantization applied (gpt-oss's MXFP4 experts) unless `quantized` is off."""
    from engine.layers.quantization import quantized_build
    from engine.loader import default_dtype, resolve_model
    from engine.loader.quant_plan import apply_plan, resolve_quant_plan
    from engine.models import model_class_for
    source = resolve_model(f"benchmarks/configs/{name}", "dummy", None)
    plan = resolve_quant_plan(source.hf_config, None, source.format) if quantized else None
    with default_dtype(torch.bfloat16), torch.device("meta"), quantized_build(plan):
        model = model_class_for(source.hf_config)(source.hf_config, residual_dtype=torch.bfloat16)
        if plan is not None:
            apply_plan(model, plan)
    return model


class FullContext:
    """A cache layer whose paged specs keep every token (the window removed): the baseline of `capacity`."""

    def __init__(self, layer) -> None:
        self.layer = layer

    def cache_specs(self):
        from engine.kv_cache_spec import PagedSpec
        return {name: dataclasses.replace(spec, window=None) if isinstance(spec, PagedSpec) else spec
                for name, spec in self.layer.cache_specs().items()}

    def kv_scale_shape(self, *args):
        return self.layer.kv_scale_shape(*args)


def cache_layers(model):
    from engine.layers.attention import KVCacheLayer
    return [m for m in model.modules() if isinstance(m, KVCacheLayer)]


def capacity(args) -> dict:
    """A window group needs at most `max_num_seqs` windows' blocks; the rest of the budget goes to the full
    group. So windows pay off where sequences are longer than the window and few enough: both are shown."""
    from engine.runner.kv_cache import CachePools
    budget = int(args.budget_gib * 2**30)
    results, rows = {}, []
    for name in args.models.split(","):
        layers = cache_layers(meta_model(name, quantized=False))
        results[name] = {}
        for seqs in (int(n) for n in args.max_num_seqs.split(",")):
            counts = {}
            for label, pool_layers in (("windows", layers), ("full context", [FullContext(m) for m in layers])):
                pools = CachePools(pool_layers, BLOCK, lambda _, spec: spec.dtype or torch.bfloat16, False, seqs, 8192)
                blocks = pools.most_blocks_within(budget, 1 << 30)
                layout = pools.layout(blocks)
                counts[label] = {"tokens": blocks * BLOCK, "groups": [
                    {"window": g.window, "blocks": g.num_blocks, "bytes_per_block": g.bytes_per_block}
                    for g in layout.groups]}
            ratio = counts["windows"]["tokens"] / counts["full context"]["tokens"]
            results[name][seqs] = {**counts, "ratio": ratio}
            rows.append((name, str(seqs), f"{counts['windows']['tokens']:,}", f"{counts['full context']['tokens']:,}",
                         f"{ratio:.2f}x"))
    print_table([f"KV tokens at {args.budget_gib:g} GiB", "max_num_seqs", "with windows", "full context", "ratio"],
                rows)
    return {"budget_bytes": budget, "models": results}


def step_bytes(name: str, context: int, batch: int = 1) -> dict:
    """Bytes a decode step of `batch` sequences at `context` tokens must move (see the module docstring)."""
    from engine.kv_cache_spec import PagedSpec, StateSpec
    from engine.layers.embed_head import VocabParallelEmbedding
    from engine.layers.fused_moe import FusedMoE
    model = meta_model(name)
    size = {id(p): p.numel() * p.element_size() for p in model.parameters()}
    experts = {id(p) for m in model.modules() if isinstance(m, FusedMoE) for p in m.parameters(recurse=False)}
    embedding = {id(m.weight) for m in model.modules() if type(m) is VocabParallelEmbedding}
    tied = bool(getattr(model, "tie_word_embeddings", False))
    moe = next((m for m in model.modules() if isinstance(m, FusedMoE)), None)
    fraction = moe.router.top_k / moe.num_experts if moe is not None else 1.0
    touched = 1 - (1 - fraction) ** batch
    dense = sum(v for k, v in size.items() if k not in experts and (tied or k not in embedding))
    expert = sum(size[k] for k in experts)
    cache = state = 0
    for layer in cache_layers(model):
        for spec in layer.cache_specs().values():
            dtype = spec.dtype or torch.bfloat16
            if isinstance(spec, PagedSpec):
                entries = -(-min(context, spec.window or context) // spec.ratio)
                cache += entries * spec.bytes_per_block(1, dtype)
            elif isinstance(spec, StateSpec):
                state += 2 * spec.bytes_per_slot(dtype)  # read and written back
    return {"weights": dense + touched * expert, "dense": dense, "experts": expert, "expert_fraction": touched,
            "cache": batch * cache, "state": batch * state,
            "total": dense + touched * expert + batch * (cache + state)}


def roofline(args) -> dict:
    from benchmarks.device_limits import measure_bandwidth
    bandwidth = measure_bandwidth() if torch.cuda.is_available() else args.bandwidth_gbps * 1e9
    results, rows = {}, []
    for name in args.models.split(","):
        moved = step_bytes(name, args.context)
        results[name] = {**moved, "roofline_tok_s": bandwidth / moved["total"]}
        rows.append((name, f"{moved['weights'] / 1e9:.2f}", f"{moved['cache'] / 1e6:.1f}", f"{moved['state'] / 1e6:.1f}",
                     f"{bandwidth / moved['total']:.1f}"))
    print_table([f"batch 1 at {args.context} tokens", "weights GB", "KV MB", "state MB", "roofline tok/s"], rows)
    return {"bandwidth_Bps": bandwidth, "context": args.context, "models": results}


def engine(name: str, **overrides):
    from engine import LLM
    return LLM(f"benchmarks/configs/{name}", load_format="dummy", dtype="bfloat16", show_progress=False,
               **{"max_model_len": 4096, "max_num_seqs": 256, **overrides})


def hf_model(name: str):
    """transformers' model of the config in bf16 (its quantization config dropped: the MXFP4 kernels it would
    need come from the hub)."""
    from transformers import AutoConfig

    from benchmarks import gpu_perf
    config = AutoConfig.from_pretrained(f"benchmarks/configs/{name}")
    config.quantization_config = None
    if getattr(config, "text_config", None) is not None:
        config.text_config.quantization_config = None
    return gpu_perf.hf_model(f"benchmarks/configs/{name}", config)


def latency(args) -> dict:
    from benchmarks.device_limits import measure_bandwidth
    from benchmarks.gpu_perf import decode_rate, free_gpu, hf_decode_rate, random_prompts
    bandwidth = measure_bandwidth()
    results = {}
    for name in args.models.split(","):
        llm = engine(name, max_num_seqs=8)
        vocab = llm.engine.source.hf_config.get_text_config().vocab_size
        prompt = random_prompts(vocab, [128], 0)[0]
        ours = decode_rate(llm, prompt, 256)
        graphs = llm.engine.executor.runner.graphs is not None
        del llm
        free_gpu()
        moved = step_bytes(name, 128 + 128)
        results[name] = {"tok_s": ours, "cuda_graphs": graphs, "roofline_tok_s": bandwidth / moved["total"],
                         "of_roofline": ours * moved["total"] / bandwidth, "bytes_per_step": moved}
        if not args.skip_hf:
            results[name]["hf_tok_s"] = hf_decode_rate(name, prompt, 256, hf=hf_model(name))
        print(name, {k: v for k, v in results[name].items() if k != "bytes_per_step"}, flush=True)
    print_table(["decode b=1", "tok/s", "of roofline", "vs transformers", "graphs"], [
        (n, f"{r['tok_s']:.1f}", f"{r['of_roofline']:.3f}",
         f"{r['tok_s'] / r['hf_tok_s']:.1f}x" if r.get("hf_tok_s") else "-", str(r["cuda_graphs"]))
        for n, r in results.items()])
    return {"bandwidth_Bps": bandwidth, "models": results}


def throughput(args) -> dict:
    from benchmarks.gpu_perf import free_gpu, hf_static_batches, throughput_workload
    from engine import SamplingParams
    results = {}
    for name in args.models.split(","):
        llm = engine(name)
        vocab = llm.engine.source.hf_config.get_text_config().vocab_size
        prompts, lens = throughput_workload(vocab)
        prompts, lens = prompts[:args.num_requests], lens[:args.num_requests]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
        llm.generate(prompts[:16], [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 16)
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        ours = sum(lens) / (time.perf_counter() - start)
        del llm
        free_gpu()
        results[name] = {"tok_s": ours, "num_requests": len(prompts)}
        if not args.skip_hf:
            hf = hf_model(name)
            results[name]["hf"] = hf_static_batches(hf, prompts, lens, args.hf_batch)
            del hf
            free_gpu()
        print(name, results[name], flush=True)
    print_table(["offline", "requests", "tok/s", "transformers tok/s", "ratio"], [
        (n, str(r["num_requests"]), f"{r['tok_s']:.0f}", f"{r['hf']['hf_static_tok_s']:.0f}" if "hf" in r else "-",
         f"{r['tok_s'] / r['hf']['hf_static_tok_s']:.1f}x" if "hf" in r else "-") for n, r in results.items()])
    return {"models": results}


def window(args) -> dict:
    """Decode attention of one layer per call, cycled over enough layers' caches to leave the L2."""
    from benchmarks.gemm_bench import time_calls
    from engine.kernels.attention import AttentionOptions, CommonAttentionMetadata
    from engine.kernels.triton.attention import TritonAttentionBackend
    shapes = {"gpt-oss (64 q / 8 kv heads, 64 dim, sinks)": (64, 8, 64, True),
              "Gemma 4 sliding (32 q / 16 kv heads, 256 dim)": (32, 16, 256, False)}
    rows, results = [], {}
    for label, (heads, kv_heads, dim, sinks) in shapes.items():
        for batch in (1, 64):
            times = {}
            for context in (1024, 32768):
                for win in (128, None):
                    blocks_per_seq = -(-context // BLOCK)
                    num_blocks = batch * blocks_per_seq
                    shape = TritonAttentionBackend.kv_cache_shape(num_blocks, BLOCK, kv_heads, dim)
                    cache_bytes = 2 * torch.Size(shape).numel()
                    budget = 0.35 * torch.cuda.get_device_properties(0).total_memory
                    if cache_bytes > budget:  # one layer's cache alone: Gemma 4 at batch 64 x 32k is 32 GiB
                        times[(context, win)] = None
                        continue
                    # Enough layers' caches to leave the L2 between calls, within the budget.
                    layers = max(1, min(2 if win is None else 8, int(budget // cache_bytes)))
                    caches = [torch.randn(TritonAttentionBackend.kv_cache_shape(num_blocks, BLOCK, kv_heads, dim),
                                          device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
                    table = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, blocks_per_seq)
                    common = CommonAttentionMetadata(
                        num_seqs=batch, num_decodes=batch, num_tokens=batch,
                        query_start_loc=torch.arange(batch + 1, device="cuda", dtype=torch.int32),
                        seq_lens=torch.full((batch,), context, device="cuda", dtype=torch.int32), block_table=table,
                        slot_mapping=table[:, -1].long() * BLOCK, max_query_len=1, max_seq_len=context,
                        query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[context] * batch,
                        num_computed_tokens_cpu=[context - 1] * batch)
                    metadata = TritonAttentionBackend.build_metadata(common, BLOCK)
                    options = AttentionOptions(window=win, sinks=torch.zeros(heads, device="cuda") if sinks else None)
                    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
                    k = torch.randn(batch, kv_heads, dim, device="cuda", dtype=torch.bfloat16)

                    def call(cache, q=q, k=k, metadata=metadata, options=options, dim=dim):
                        TritonAttentionBackend.forward(q, k, k, cache, metadata, dim ** -0.5, BLOCK, options=options)
                    times[(context, win)] = time_calls([partial(call, cache) for cache in caches])
                    del caches
                    torch.cuda.empty_cache()
            key = f"{label}, batch {batch}"
            results[key] = {f"{c} tokens, window {w}": t for (c, w), t in times.items()}
            us = {k: "-" if t is None else f"{t * 1e6:.1f}" for k, t in times.items()}
            grows = times[(32768, 128)] and times[(1024, 128)] and times[(32768, 128)] / times[(1024, 128)]
            rows.append((key, us[(1024, 128)], us[(32768, 128)], f"{grows:.2f}" if grows else "-",
                         us[(1024, None)], us[(32768, None)]))
    print_table(["decode attention (us)", "window 128 @1k", "window 128 @32k", "32k / 1k", "full @1k", "full @32k"],
                rows)
    return {"times_s": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["capacity", "roofline", "latency", "throughput", "window"])
    parser.add_argument("--models", default=None, help=f"comma-separated configs (default: {', '.join(FAMILIES)}; "
                        "capacity: the windowed ones)")
    parser.add_argument("--budget-gib", type=float, default=40.0, help="capacity: the cache's memory budget")
    parser.add_argument("--max-num-seqs", default="8,256", help="capacity: the sequence counts to size for")
    parser.add_argument("--context", type=int, default=256, help="roofline: the context of the step")
    parser.add_argument("--bandwidth-gbps", type=float, default=4800.0, help="roofline without a GPU: an assumed "
                        "bandwidth (H200's 4.8 TB/s nominal)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    args.models = args.models or ",".join(WINDOWED if args.mode == "capacity" else FAMILIES)
    result = globals()[args.mode](args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"environment": environment_record(), "mode": args.mode, **result},
                                         indent=2, default=str))


if __name__ == "__main__":
    main()

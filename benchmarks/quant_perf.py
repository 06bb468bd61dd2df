"""Quantized weights and the FP8 KV cache on a GPU, at real shapes with random weights (dummy load, quantized
online as it loads), each against bf16 in the same run:

    python -m benchmarks.quant_perf decode     [--model benchmarks/configs/llama-3.1-8b] --out decode.json
    python -m benchmarks.quant_perf kv-cache   [--model ...] --out kv.json
    python -m benchmarks.quant_perf throughput [--model benchmarks/configs/qwen3-30b-a3b] --out moe.json

decode: batch 1, 128-token prompt, 256 new tokens (CUDA graphs, run-ahead), for bf16 and each FP8 scheme:
tokens/s, the ratio to bf16, and the ratio to the scheme's own roofline (measured bandwidth / bytes a step
reads: quantized weights at 1 byte per parameter plus their scales, the bf16 LM head, the KV at the mean
context). kv-cache: KV blocks the same memory holds in bf16 and FP8, and output tokens/s with 256 requests in
flight (prompts 128..1024, outputs 64..512, seed 0). throughput: gpu_perf's 512-request offline workload,
bf16 against FP8 128x128 block-scaled weights (experts included).
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from benchmarks.common import environment_record, print_table
from benchmarks.device_limits import device_limits
from benchmarks.gpu_perf import (MAX_NUM_SEQS, decode_rate, free_gpu, model_facts, random_prompts,
                                 throughput_workload, timed_generate)

SCHEMES = ("fp8_block", "fp8_channel", "fp8_tensor")


def quantized_weight_bytes(facts: dict, config, scheme: str | None) -> float:
    """Bytes of weights a batch-1 decode step reads under `scheme`: linear layers (and experts) at one byte
    per parameter plus their scales; the LM head stays bf16."""
    if scheme is None:
        return facts["weight_bytes_per_step"]
    head = config.vocab_size * config.hidden_size
    quantized = facts["weight_bytes_per_step"] / 2 - head
    scale_bytes = {"fp8_block": quantized / (128 * 128) * 4, "fp8_channel": 0.0, "fp8_tensor": 0.0}[scheme]
    return quantized + scale_bytes + head * 2


def decode(args) -> dict:
    from engine import LLM
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(args.model)
    limits = device_limits()
    facts = model_facts(config)
    prompt = random_prompts(config.vocab_size, [128], 0)[0]
    new_tokens, mean_context = 256, 128 + 128
    kv_bytes = facts["kv_bytes_per_token"] * mean_context
    results, rows = {}, []
    for scheme in (None, *args.schemes):
        llm = LLM(args.model, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=8,
                  show_progress=False, quantization=scheme)
        rate = decode_rate(llm, prompt, new_tokens)
        step_bytes = quantized_weight_bytes(facts, config, scheme) + kv_bytes
        roofline = limits["bandwidth_GBps"] * 1e9 / step_bytes
        table = dict(llm.engine.executor.runner.kernel_backend.table())
        name = scheme or "bf16"
        results[name] = {"tok_s": rate, "roofline_tok_s": roofline, "bytes_per_step": step_bytes,
                         "gemm_kernel": table.get(f"gemm_{scheme}", table["gemm"])}
        print(f"decode b=1 {name}: {rate:.1f} tok/s, {rate / roofline:.2f} of its roofline", flush=True)
        del llm
        free_gpu()
    base = results["bf16"]["tok_s"]
    for name, r in results.items():
        rows.append((name, f"{r['tok_s']:.1f}", f"{r['tok_s'] / base:.2f}x", f"{r['tok_s'] / r['roofline_tok_s']:.3f}",
                     f"{r['bytes_per_step'] / 1e9:.2f}"))
    print_table(["decode b=1", "tok/s", "vs bf16", "of own roofline", "GB per step"], rows)
    return {"limits": limits, "model_facts": facts, "schemes": results, "prompt_tokens": 128,
            "new_tokens": new_tokens}


def kv_cache(args) -> dict:
    from engine import LLM, SamplingParams
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(args.model)
    rng = random.Random(0)
    lens = [rng.randint(128, 1024) for _ in range(256)]
    outs = [rng.randint(64, 512) for _ in range(256)]
    prompts = random_prompts(config.vocab_size, lens, 1)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outs]
    results, rows = {}, []
    for kv in args.kv_cache_dtypes:  # one per process: a freed engine's memory is not all back at once
        llm = LLM(args.model, load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=256,
                  max_num_batched_tokens=8192, show_progress=False, kv_cache_dtype=kv,
                  gpu_memory_utilization=args.gpu_memory_utilization)
        timed_generate(llm, prompts[:32], params[:32])
        llm.engine.scheduler.block_manager.reset_prefix_cache()
        seconds = timed_generate(llm, prompts, params)
        stats = llm.engine.stats()
        name = "bf16" if kv == "auto" else "fp8 (per-token scales)"
        blocks = stats["num_kv_blocks"]
        results[name] = {"num_kv_blocks": blocks, "kv_tokens": blocks * 16, "tok_s": sum(outs) / seconds,
                         "seconds": seconds, "num_preemptions": stats["num_preemptions"]}
        rows.append((name, blocks, blocks * 16, f"{sum(outs) / seconds:.0f}", stats["num_preemptions"]))
        del llm
        free_gpu()
    print_table(["KV cache", "blocks", "tokens", "output tok/s (256 in flight)", "preemptions"], rows)
    return {"gpu_memory_utilization": args.gpu_memory_utilization, "results": results,
            "output_tokens": sum(outs), "prompt_tokens": sum(lens)}


def throughput(args) -> dict:
    from engine import LLM, SamplingParams
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(args.model)
    prompts, output_lens = throughput_workload(config.vocab_size)
    if args.num_requests:
        prompts, output_lens = prompts[:args.num_requests], output_lens[:args.num_requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    results, rows = {}, []
    for scheme in [None if name == "bf16" else name for name in args.moe_schemes]:  # one per process, ideally
        llm = LLM(args.model, load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=MAX_NUM_SEQS,
                  max_num_batched_tokens=8192, show_progress=False, quantization=scheme)
        timed_generate(llm, prompts[:64], params[:64])
        llm.engine.scheduler.block_manager.reset_prefix_cache()
        seconds = timed_generate(llm, prompts, params)
        name = scheme or "bf16"
        table = dict(llm.engine.executor.runner.kernel_backend.table())
        results[name] = {"tok_s": sum(output_lens) / seconds, "seconds": seconds,
                         "num_kv_blocks": llm.engine.stats()["num_kv_blocks"],
                         "experts_kernel": table["fused_experts_fp8" if scheme else "fused_experts"]}
        del llm
        free_gpu()
    base = results["bf16"]["tok_s"] if "bf16" in results else None
    for name, r in results.items():
        rows.append((name, f"{r['tok_s']:.0f}", f"{r['tok_s'] / base:.2f}x" if base else "-", f"{r['seconds']:.1f}",
                     r["num_kv_blocks"]))
    print_table(["offline throughput", "output tok/s", "vs bf16", "seconds", "KV blocks"], rows)
    return {"results": results, "num_requests": len(prompts), "output_tokens": sum(output_lens)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["decode", "kv-cache", "throughput"])
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--schemes", nargs="*", default=list(SCHEMES), choices=SCHEMES)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-dtypes", nargs="*", default=["auto", "fp8"], choices=["auto", "fp8"],
                        help="kv-cache: which caches to run (one per process gives each the same free memory)")
    parser.add_argument("--num-requests", type=int, default=None, help="throughput: only the first N requests")
    parser.add_argument("--moe-schemes", nargs="*", default=["bf16", "fp8_block"], choices=["bf16", *SCHEMES],
                        help="throughput: weights to run (one per process gives each the same free memory)")
    args = parser.parse_args()
    args.model = args.model or ("benchmarks/configs/qwen3-30b-a3b" if args.mode == "throughput"
                                else "benchmarks/configs/llama-3.1-8b")
    result = {"decode": decode, "kv-cache": kv_cache, "throughput": throughput}[args.mode](args)
    result.update(mode=args.mode, model=args.model, environment=environment_record())
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = True
    main()

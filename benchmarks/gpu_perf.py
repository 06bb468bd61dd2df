"""GPU benchmarks at real model shapes with random weights (benchmarks/configs/*, load_format="dummy").

    python -m benchmarks.gpu_perf latency    [--model benchmarks/configs/llama-3.1-8b] --out latency.json
    python -m benchmarks.gpu_perf throughput [--model ...] --out throughput.json
    python -m benchmarks.gpu_perf hf-throughput --out hf_throughput.json   (the baseline; minutes)

latency: batch 1, 128-token prompt, 256 new tokens: decode tokens/s of the engine (CUDA graphs with the
next step launched ahead; graphs alone; eager) and of transformers, and the ratio to the roofline
(measured bandwidth / bytes read per step: weights + KV at the mean context).
throughput: 512 requests, prompts uniform in 128..1024, outputs uniform in 64..512 (seed 0, ignore_eos):
output tokens/s, and the workload's roofline (prefill FLOPs at the measured matmul rate, then decode at
the larger of its FLOPs and its bytes at the measured bandwidth, with max_num_seqs sequences at a time).
Every run records device, versions, commit and the two measured ceilings.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import environment_record, print_table
from benchmarks.device_limits import device_limits
from benchmarks.kernel_variants import KERNEL_VARIANTS, restore, snapshot

DEFAULT_MODEL = "benchmarks/configs/llama-3.1-8b"
NUM_REQUESTS, PROMPT_RANGE, OUTPUT_RANGE = 512, (128, 1024), (64, 512)
MAX_NUM_SEQS = 256


def model_facts(hf_config, dtype_bytes: int = 2) -> dict:
    """Parameter counts and the bytes a decode step must read (the embedding table is only gathered), from
    our own model built on the meta device (no memory). For a mixture of experts, a step reads the dense
    weights and the experts its tokens chose: `weight_bytes_per_step` is batch 1's (top_k of E experts per
    layer), `weight_bytes_at_batch(b)` the expectation under uniform routing, all experts as b grows."""
    from engine.layers.fused_moe import FusedMoE
    from engine.models import model_class_for
    with torch.device("meta"):
        model = model_class_for(hf_config)(hf_config)
    params = sum(p.numel() for p in model.parameters())
    moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
    expert_params = sum(m.w13.numel() + m.w2.numel() for m in moe)
    active_fraction = moe[0].router.top_k / moe[0].num_experts if moe else 1.0
    embedding = 0 if getattr(model, "tie_word_embeddings", False) else hf_config.vocab_size * hf_config.hidden_size
    dense_read = params - embedding - expert_params
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_per_token = 2 * hf_config.num_hidden_layers * kv_heads * head_dim * dtype_bytes
    if getattr(hf_config, "kv_lora_rank", None):  # multi-head latent attention: one latent entry per token
        kv_per_token = hf_config.num_hidden_layers * (hf_config.kv_lora_rank + hf_config.qk_rope_head_dim) * dtype_bytes
    return {"params": params, "active_params": params - expert_params * (1 - active_fraction),
            "expert_params": expert_params, "active_expert_fraction": active_fraction,
            "dense_weight_bytes": dense_read * dtype_bytes, "expert_weight_bytes": expert_params * dtype_bytes,
            "weight_bytes_per_step": (dense_read + expert_params * active_fraction) * dtype_bytes,
            "kv_bytes_per_token": kv_per_token}


def weight_bytes_at_batch(facts: dict, batch: int) -> float:
    """Weight bytes a decode step of `batch` tokens reads: the dense weights, and each expert that at least
    one token chose (expected fraction 1 - (1 - k/E)^batch under uniform routing)."""
    touched = 1 - (1 - facts["active_expert_fraction"]) ** batch
    return facts["dense_weight_bytes"] + touched * facts["expert_weight_bytes"]


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab - 1000) for _ in range(n)] for n in lengths]


def throughput_workload(vocab: int):
    rng = random.Random(0)
    prompt_lens = [rng.randint(*PROMPT_RANGE) for _ in range(NUM_REQUESTS)]
    output_lens = [rng.randint(*OUTPUT_RANGE) for _ in range(NUM_REQUESTS)]
    return random_prompts(vocab, prompt_lens, 1), output_lens


def free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def timed_generate(llm, prompts, params) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def decode_rate(llm, prompt: list[int], new_tokens: int) -> float:
    """Decode tokens/s of one sequence: the best of three full generations less the best of three prefills
    (after a warm-up)."""
    from engine import SamplingParams
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0, max_tokens=new_tokens + 1, ignore_eos=True)
    timed_generate(llm, [prompt], many)  # warm-up
    prefill = min(timed_generate(llm, [prompt], one) for _ in range(3))
    total = min(timed_generate(llm, [prompt], many) for _ in range(3))
    return new_tokens / (total - prefill)


# ---- latency ----------------------------------------------------------------------------------------------
def engine_decode_rates(model: str, prompt: list[int], new_tokens: int, variants: tuple[str, ...] = (),
                        alternate: int = 0, residual_dtype: str = "auto") -> dict:
    from engine import LLM, SamplingParams
    llm = LLM(model, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=8, show_progress=False,
              residual_dtype=residual_dtype)
    engine = llm.engine
    runner = engine.executor.runner

    def rate():
        return decode_rate(llm, prompt, new_tokens)

    results = {"backend": runner.kernel_backend.name, "graphs_and_run_ahead": rate()}
    engine._run_ahead = False
    results["graphs_only"] = rate()
    graphs, runner.graphs = runner.graphs, None
    results["eager"] = rate()
    runner.graphs, engine._run_ahead = graphs, True

    def greedy_tokens():
        return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0].token_ids

    tokens = greedy_tokens()
    runner.graphs = None
    results["graph_tokens_equal_eager"] = tokens == greedy_tokens()
    runner.graphs = graphs
    if alternate:
        # The current kernels and each variant alone, in turn, graphs re-captured each time (every patch point
        # is restored in between): the same engine and GPU state, alternating, so drift shows as spread
        # rather than as a difference.
        current = snapshot()
        turns = ("current",) + variants
        for name in turns:
            results[f"alternating {name}"] = []
        for _ in range(alternate):
            for name in turns:
                restore(current)
                if name != "current":
                    KERNEL_VARIANTS[name]()
                graphs.capture()
                results[f"alternating {name}"].append(rate())
                if name != "current":
                    results[f"variant {name} tokens equal default"] = greedy_tokens() == tokens
        restore(current)
        graphs.capture()
        variants = ()
    for variant in variants:  # earlier kernel sequences, re-captured into fresh graphs of the same engine
        KERNEL_VARIANTS[variant]()
        graphs.capture()
        results[f"variant {variant}"] = rate()
        results[f"variant {variant} tokens equal default"] = greedy_tokens() == tokens
    del llm, engine, runner, graphs
    free_gpu()
    return results


def hf_model(model: str, config=None):
    """transformers' model of `model`'s config (or the given `config`) on the GPU in bf16, random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = config if config is not None else AutoConfig.from_pretrained(model)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    hf.eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def hf_decode_rate(model: str, prompt: list[int], new_tokens: int, hf=None) -> float:
    """transformers' batch-1 decode tokens/s: `model`'s (or the given `hf` model's), which is freed after."""
    hf = hf if hf is not None else hf_model(model)
    ids = torch.tensor([prompt], device="cuda")

    def run(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run(8)
    prefill = min(run(1) for _ in range(2))
    total = min(run(new_tokens + 1) for _ in range(2))
    del hf
    free_gpu()
    return new_tokens / (total - prefill)


def latency(args) -> dict:
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(args.model)
    limits = device_limits()
    facts = model_facts(config)
    prompt = random_prompts(config.vocab_size, [128], 0)[0]
    new_tokens = 256
    mean_context = 128 + new_tokens / 2
    step_bytes = facts["weight_bytes_per_step"] + facts["kv_bytes_per_token"] * mean_context
    roofline = limits["bandwidth_GBps"] * 1e9 / step_bytes
    ours = engine_decode_rates(args.model, prompt, new_tokens, tuple(args.variant), args.alternate, args.residual_dtype)
    hf = hf_decode_rate(args.model, prompt, new_tokens) if not args.skip_hf else None
    rows = []
    cumulative = () if args.alternate else tuple(f"variant {v}" for v in args.variant)
    for variant in ("graphs_and_run_ahead", "graphs_only", "eager") + cumulative:
        rate = ours[variant]
        rows.append((f"atom-ray {variant}", f"{rate:.1f}", f"{rate / roofline:.3f}", f"{rate / hf:.2f}x" if hf else "-"))
    if hf:
        rows.append(("transformers generate", f"{hf:.1f}", f"{hf / roofline:.3f}", "1.00x"))
    print_table(["decode b=1", "tok/s", "of roofline", "vs transformers"], rows)
    if args.alternate:
        print_table(["alternating runs", "tok/s each", "median", "of roofline"],
                    [(name, " / ".join(f"{r:.1f}" for r in ours[f"alternating {name}"]),
                      f"{statistics.median(ours[f'alternating {name}']):.1f}",
                      f"{statistics.median(ours[f'alternating {name}']) / roofline:.3f}")
                     for name in ("current", *args.variant)])
    print(f"roofline {roofline:.1f} tok/s = {limits['bandwidth_GBps']:.0f} GB/s / {step_bytes / 1e9:.2f} GB per step")
    return {"limits": limits, "model_facts": facts, "roofline_tok_s": roofline, "bytes_per_step": step_bytes,
            "engine": ours, "hf_tok_s": hf, "prompt_tokens": 128, "new_tokens": new_tokens}


# ---- throughput -------------------------------------------------------------------------------------------
def workload_roofline(config, prompts, output_lens, limits) -> float:
    facts = model_facts(config)
    rate, bandwidth = limits["bf16_matmul_TFLOPs"] * 1e12, limits["bandwidth_GBps"] * 1e9
    layers, hidden = config.num_hidden_layers, config.hidden_size
    matmul_flops_per_token = 2 * facts["active_params"]
    attention_flops = sum(2 * 2 * layers * hidden * len(p) * len(p) / 2 for p in prompts)  # causal QK^T and PV
    prefill_s = (matmul_flops_per_token * sum(map(len, prompts)) + attention_flops) / rate
    decode_tokens = sum(output_lens)
    waves = -(-len(prompts) // MAX_NUM_SEQS)
    steps = waves * max(output_lens)
    kv_read = sum(facts["kv_bytes_per_token"] * (len(p) * n + n * n / 2) for p, n in zip(prompts, output_lens))
    decode_bytes = steps * weight_bytes_at_batch(facts, MAX_NUM_SEQS) + kv_read
    decode_s = max(matmul_flops_per_token * decode_tokens / rate, decode_bytes / bandwidth)
    return decode_tokens / (prefill_s + decode_s)


class StepTrace:
    """Where an offline run's time goes, by kind of step: the time from one step's scheduling to the next
    (with run-ahead, the device time of a step once the pipeline is full), grouped into steps that carry
    prompt tokens and decode-only steps by batch size."""

    def __init__(self, engine) -> None:
        self.engine, self.records = engine, []

    def __enter__(self):
        original = self.engine.schedule_step

        def traced():
            scheduled = original()
            if scheduled is not None:
                decodes = sum(1 for n in scheduled.num_scheduled_tokens.values() if n == 1)
                self.records.append((time.perf_counter(), decodes, scheduled.total_num_scheduled_tokens - decodes))
            return scheduled
        self.engine.schedule_step = traced
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.schedule_step  # back to the class's method

    def summary(self) -> list[dict]:
        groups: dict[str, list[float]] = {}
        for (t0, decodes, prompt_tokens), (t1, _, _) in zip(self.records, self.records[1:]):
            if prompt_tokens:
                key = "with prompt tokens"
            elif not decodes:
                key = "empty"
            else:
                low = 1 << (decodes.bit_length() - 1)
                key = f"decode-only, batch {low}..{2 * low - 1}" if decodes > 1 else "decode-only, batch 1"
            groups.setdefault(key, []).append(t1 - t0)
        rows = [{"kind": k, "steps": len(v), "seconds": sum(v), "ms_per_step": 1000 * sum(v) / len(v)}
                for k, v in groups.items()]
        print_table(["step kind", "steps", "seconds", "ms/step"],
                    [(r["kind"], r["steps"], f"{r['seconds']:.2f}", f"{r['ms_per_step']:.2f}") for r in rows])
        return rows


def expert_load(llm, prompts, params, ep_sizes=(2, 8)) -> dict | None:
    """Tokens routed to each expert over a run (the layers' device counters, engine/runner/expert_load.py,
    reset first): per layer the busiest expert against the mean, and for EP layouts the busiest rank against
    the mean (what an EP step waits for). None for a model without experts or with counting off."""
    from engine.layers.fused_moe import experts_per_rank
    tracker = llm.engine.executor.runner.expert_load
    if tracker is None:
        return None
    tracker.reset()
    llm.engine.scheduler.block_manager.reset_prefix_cache()
    llm.generate(prompts, params)
    rows, result = [], {"layers": []}
    for index, layer in enumerate(tracker.layers):
        counts = layer.load_counts[:layer.num_experts].double().cpu()
        mean = counts.mean().item()
        entry = {"layer": index, "tokens": int(counts.sum()), "expert_max_over_mean": counts.max().item() / mean,
                 "expert_min_over_mean": counts.min().item() / mean}
        for ep in ep_sizes:
            sizes = experts_per_rank(layer.num_experts, ep)
            per_rank = torch.stack([part.sum() for part in counts.split([sizes[r] for r in range(ep)])])
            entry[f"ep{ep}_rank_max_over_mean"] = (per_rank.max() / per_rank.mean()).item()
        result["layers"].append(entry)
        if index in (0, len(tracker.layers) // 2, len(tracker.layers) - 1):
            rows.append((str(index), str(entry["tokens"]), f"{entry['expert_max_over_mean']:.2f}",
                         f"{entry['expert_min_over_mean']:.2f}",
                         *(f"{entry[f'ep{ep}_rank_max_over_mean']:.2f}" for ep in ep_sizes)))
    print_table(["MoE layer", "routed tokens", "busiest expert / mean", "idlest / mean",
                 *(f"EP={ep}: busiest rank / mean" for ep in ep_sizes)], rows)
    return result


def throughput(args) -> dict:
    from engine import LLM, SamplingParams
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(args.model)
    limits = device_limits()
    prompts, output_lens = throughput_workload(config.vocab_size)
    roofline = workload_roofline(config, prompts, output_lens, limits)
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=8192, show_progress=False, residual_dtype=args.residual_dtype)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    timed_generate(llm, prompts[:64], params[:64])  # warm-up: every kind of step compiled before timing
    rows = []

    def measure(label: str) -> dict:
        """The whole workload, then (for a like-for-like ratio with a time-limited baseline run) its first
        --num-requests requests with a per-step trace; the prefix cache emptied before each."""
        llm.engine.scheduler.block_manager.reset_prefix_cache()
        seconds = timed_generate(llm, prompts, params)
        result = {"tok_s": sum(output_lens) / seconds, "seconds": seconds}
        rows.append((label, f"{result['tok_s']:.0f}", f"{result['tok_s'] / roofline:.3f}", f"{seconds:.1f}"))
        if args.num_requests:
            n = args.num_requests
            llm.engine.scheduler.block_manager.reset_prefix_cache()
            with StepTrace(llm.engine) as trace:
                sub_seconds = timed_generate(llm, prompts[:n], params[:n])
            result.update(subset_requests=n, subset_tok_s=sum(output_lens[:n]) / sub_seconds,
                          subset_seconds=sub_seconds, subset_steps=trace.summary())
            rows.append((f"{label}, first {n} requests", f"{result['subset_tok_s']:.0f}", "-", f"{sub_seconds:.1f}"))
        return result

    ours = measure("atom-ray")
    stats = llm.engine.stats()
    load = expert_load(llm, prompts[:64], params[:64])
    variants = {}
    for variant in args.variant:  # earlier kernel sequences on the same engine, graphs re-captured
        KERNEL_VARIANTS[variant]()
        llm.engine.executor.runner.graphs.capture()
        variants[variant] = measure(f"+ variant {variant}")
    rows.append(("roofline", f"{roofline:.0f}", "1.000", "-"))
    print_table(["offline throughput", "output tok/s", "of roofline", "seconds"], rows)
    subset = {k: v for k, v in ours.items() if k.startswith("subset_")}
    return {"limits": limits, "engine_tok_s": ours["tok_s"], "variants": variants, "seconds": ours["seconds"],
            "roofline_tok_s": roofline, "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(output_lens),
            "num_preemptions": stats["num_preemptions"], "num_kv_blocks": stats["num_kv_blocks"],
            "expert_load": load, **subset}


def hf_throughput(args) -> dict:
    """transformers' continuous-batching manager on the same 512 requests (per-request output lengths)."""
    from transformers import AutoConfig, GenerationConfig
    config = AutoConfig.from_pretrained(args.model)
    prompts, output_lens = throughput_workload(config.vocab_size)
    if args.num_requests:
        prompts, output_lens = prompts[:args.num_requests], output_lens[:args.num_requests]
    hf = hf_model(args.model)
    if args.hf_static_batch:
        return hf_static_batches(hf, prompts, output_lens, args.hf_static_batch)
    generation = GenerationConfig(max_new_tokens=max(output_lens), do_sample=False, eos_token_id=None, pad_token_id=0)
    manager = hf.init_continuous_batching(generation_config=generation)
    manager.start()
    try:
        def run(batch_prompts, batch_lens):
            pending = {manager.add_request(p, max_new_tokens=n) for p, n in zip(batch_prompts, batch_lens)}
            produced = 0
            while pending:
                result = manager.get_result(timeout=900)
                if result is None:
                    raise RuntimeError("continuous batching returned no result")
                if result.request_id in pending and result.is_finished():
                    pending.discard(result.request_id)
                    produced += len(result.generated_tokens)
            return produced
        run(prompts[:4], [8] * 4)
        torch.cuda.synchronize()
        start = time.perf_counter()
        produced = run(prompts, output_lens)
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    tok_s = produced / seconds
    print_table(["transformers continuous batching", "output tok/s", "seconds", "requests"],
                [("manager", f"{tok_s:.0f}", f"{seconds:.1f}", str(len(prompts)))])
    return {"hf_cb_tok_s": tok_s, "seconds": seconds, "num_requests": len(prompts), "output_tokens": produced}


def hf_static_batches(hf, prompts, output_lens, batch_size: int) -> dict:
    """transformers `generate` over static batches (for models its continuous batching cannot run): requests
    sorted by prompt length, `batch_size` at a time, left-padded; each batch runs to its longest output and
    only each request's own output length counts as produced."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]

    def run(batch):
        width = max(len(prompts[i]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.int64, device="cuda")
        mask = torch.zeros_like(ids)
        for row, i in enumerate(batch):
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        n = max(output_lens[i] for i in batch)
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return sum(output_lens[i] for i in batch)

    run(batches[0][:2])
    torch.cuda.synchronize()
    start = time.perf_counter()
    produced = sum(run(batch) for batch in batches)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tok_s = produced / seconds
    print_table(["transformers static batches", "output tok/s", "seconds", "requests"],
                [(f"generate, batches of {batch_size}", f"{tok_s:.0f}", f"{seconds:.1f}", str(len(prompts)))])
    return {"hf_static_tok_s": tok_s, "seconds": seconds, "num_requests": len(prompts), "output_tokens": produced,
            "batch_size": batch_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["latency", "throughput", "hf-throughput"])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--hf-static-batch", type=int, default=0, metavar="N",
                        help="hf-throughput: transformers generate over static batches of N instead of its "
                             "continuous batching (for models that cannot run there)")
    parser.add_argument("--variant", action="append", default=[], choices=sorted(KERNEL_VARIANTS),
                        help="latency, throughput: also time this earlier kernel sequence in the same run (repeatable, "
                             "cumulative)")
    parser.add_argument("--alternate", type=int, default=0, metavar="ROUNDS",
                        help="latency: time the current kernels and each variant alone in turn, ROUNDS each (instead "
                             "of the cumulative variant runs)")
    parser.add_argument("--residual-dtype", default="auto", help="latency, throughput: the engine's residual_dtype")
    parser.add_argument("--num-requests", type=int, default=None, help="hf-throughput: only the first N requests; throughput: also time the engine on them")
    args = parser.parse_args()
    try:
        result = {"latency": latency, "throughput": throughput, "hf-throughput": hf_throughput}[args.mode](args)
    except Exception as exc:  # keep what the run tells, also when a baseline's API moved between releases
        import traceback
        traceback.print_exc()
        result = {"error": repr(exc)}
    result = {"environment": environment_record(), "model": args.model, "mode": args.mode,
              "residual_dtype": args.residual_dtype, **result}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Tensor parallelism on GPUs through Ray rank actors (NCCL), against the bare engine, in one run.

Batch-1 decode (128-token prompt, 256 new tokens) of the bare engine, of atom_ray.start with TP=1 and
with TP=2; and the teacher-forced
agreement of TP=2 with TP=1: the top-1 token at every position of fixed 1024-token sequences (prompt
logprobs; one, or `--sequences N`), in bf16 and fp32. Dummy weights are a seeded random checkpoint, so both layouts shard the same
model. Random weights give nearly flat logits, so bf16 rounding alone flips many top-1 choices; the script
measures that noise floor too (TP=1 against TP=1 with the prompt prefilled in 256-token chunks, which only
changes the order of the sums) and the top-1/top-2 logprob margin where the choices differ. With real
weights (`--load-format auto` and a model folder or .gguf file) `--teacher natural` makes the sequence
the model's own text (sampled from the bf16 TP=1 engine at temperature 0.8 with a fixed seed) instead of
random token ids; `--agreement-only` skips the speed stages. `--gpus-per-rank 0.5 --agreement-only` runs
the TP=2 engine's two ranks on one GPU (their all-reduces through gloo in host memory: a two-rank sum
rounds once whichever library adds it, so the tokens are those of two GPUs; the speed is not).

    python -m benchmarks.tp_scaling [--model benchmarks/configs/llama-3.1-8b] --out tp.json
    python -m benchmarks.tp_scaling --model SmolLM2.gguf --load-format auto --teacher natural --agreement-only --out a.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
from pathlib import Path

from benchmarks.common import environment_record, print_table

PROMPT_LEN, NEW_TOKENS, TEACHER_LEN = 128, 256, 1024
ENGINE_ARGS = dict(load_format="dummy", max_model_len=4096, max_num_seqs=8, device="cuda")
# Openings of the natural teacher sequences (`--sequences N` takes the first N; the first alone is the
# sequence of the runs before 2026-11-23 21:00).
TEACHER_PROMPTS = ["Once upon a time, in a small town by the sea, there lived",
                   "The main causes of the French Revolution were",
                   "To bake a loaf of bread at home, you will need",
                   "Photosynthesis is the process by which plants",
                   "Here is a short Python function that sorts a list:",
                   "The history of the Roman Empire",
                   "Dear Sir or Madam, I am writing to",
                   "The three laws of motion described by Isaac Newton"]


def decode_rate(generate) -> float:
    from engine import SamplingParams
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 100000) for _ in range(PROMPT_LEN)]

    def run(n):
        start = time.perf_counter()
        generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start

    run(8)
    prefill = min(run(1) for _ in range(3))
    total = min(run(NEW_TOKENS + 1) for _ in range(3))
    return NEW_TOKENS / (total - prefill)


def teacher_sequences(llm, natural: bool, count: int = 1) -> list[list[int]]:
    """`count` fixed sequences of TEACHER_LEN token ids: random ids from the vocabulary, or the model's own
    text after each of the first `count` TEACHER_PROMPTS (sampled at temperature 0.8, seed = its index)."""
    from engine import SamplingParams
    if not natural:
        vocab = llm.engine.source.hf_config.vocab_size
        return [[rng.randrange(1000, min(100000, vocab)) for _ in range(TEACHER_LEN)]
                for rng in (random.Random(1 + i) for i in range(count))]
    sequences = []
    for seed, text in enumerate(TEACHER_PROMPTS[:count]):
        prompt = llm.get_tokenizer().encode(text)
        params = SamplingParams(temperature=0.8, seed=seed, max_tokens=TEACHER_LEN - len(prompt), ignore_eos=True)
        sequences.append(prompt + list(llm.generate([prompt], params)[0].token_ids))
    return sequences


def prefill_rate(generate, length: int = 2048) -> float:
    """Prompt tokens/s of one long prompt (best of three, one output token)."""
    from engine import SamplingParams
    rng = random.Random(3)
    prompt = [rng.randrange(1000, 30000) for _ in range(length)]

    def run():
        start = time.perf_counter()
        generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        return time.perf_counter() - start
    run()
    return length / min(run() for _ in range(3))


def top1_tokens(generate, sequences: list[list[int]]) -> tuple[list[int], list[float]]:
    """The top-1 token at every position of the sequences (one after the other), and its logprob margin
    over the top-2."""
    from engine import SamplingParams
    tops, margins = [], []
    for output in generate(sequences, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)):
        for entry in output.prompt_logprobs[1:]:
            ranked = sorted(entry.items(), key=lambda item: item[1].rank)
            tops.append(ranked[0][0])
            margins.append(ranked[0][1].logprob - ranked[1][1].logprob)
    return tops, margins


def agreement(reference, other) -> dict:
    """Share of positions where the top-1 tokens agree; median reference margin where they differ."""
    (ref_tops, ref_margins), (other_tops, _) = reference, other
    differ = [m for a, b, m in zip(ref_tops, other_tops, ref_margins) if a != b]
    ordered = sorted(ref_margins)
    return {"agreement": 1 - len(differ) / len(ref_tops), "positions": len(ref_tops), "different": len(differ),
            "median_margin_all": ordered[len(ordered) // 2],
            "median_margin_where_different": sorted(differ)[len(differ) // 2] if differ else None}


def step_timing(args) -> None:
    """Batch-1 decode through Ray at TP=1 and TP=2 with engine.runner.step_timer.StepTimer on every rank."""
    import ray

    import atom_ray
    results = {}
    for tp in (1, 2):
        folder = Path(args.step_timing_dir).resolve() / f"tp{tp}"
        ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR",
                 runtime_env={"env_vars": {"ATOM_RAY_STEP_TIMING_DIR": str(folder)}})
        handle = atom_ray.start(args.model, dtype="bfloat16", tensor_parallel_size=tp, **ENGINE_ARGS)
        try:
            rate = decode_rate(handle.generate)
            tokens = greedy_tokens(handle.generate)
        finally:
            handle.shutdown()
            ray.shutdown()
        ranks = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*rank*.json"))}
        results[f"tp{tp}"] = {"tok_s": rate, "ranks": ranks, "greedy_tokens": tokens}
        print(f"TP={tp} decode {rate:.1f} tok/s")
        for name, timing in ranks.items():
            print(" ", name, {k: round(v, 3) for k, v in timing.items()})
    from engine import LLM
    bare = greedy_tokens(LLM(args.model, dtype="bfloat16", show_progress=False, **ENGINE_ARGS).generate)
    for tp in (1, 2):
        same = sum(a == b for a, b in zip(bare, results[f"tp{tp}"]["greedy_tokens"]))
        results[f"tp{tp}"]["greedy_same_as_bare"] = same / len(bare)
        print(f"TP={tp} through Ray: {same}/{len(bare)} greedy tokens as the bare engine's")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


def greedy_tokens(generate) -> list[int]:
    from engine import SamplingParams
    rng = random.Random(2)
    prompt = [rng.randrange(1000, 100000) for _ in range(PROMPT_LEN)]
    return generate([prompt], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))[0].token_ids


def print_agreement(results: dict) -> None:
    print(f"teacher-forced top-1 agreement TP=2 vs TP=1 over {results['sequences']} x {TEACHER_LEN - 1} positions "
          f"({results['teacher']} sequences): bf16 {results['teacher_forced_bfloat16']}, fp32 {results['teacher_forced_float32']}")
    for reduce in results["tp_reduce_dtypes"][1:]:
        print(f"  bf16 with tp_reduce_dtype={reduce}: {results[f'teacher_forced_bfloat16_{reduce}']}")
    print(f"bf16 noise floor (TP=1 vs TP=1 prefilled in 256-token chunks): {results['noise_floor_bfloat16']}")
    print(f"TP=1 bf16 against TP=1 fp32: {results['tp1_bfloat16_vs_float32']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="benchmarks/configs/llama-3.1-8b")
    parser.add_argument("--out", required=True)
    parser.add_argument("--load-format", default="dummy", help="dummy (seeded random weights) or auto (the model's own)")
    parser.add_argument("--teacher", choices=("random", "natural"), default="random",
                        help="teacher-forced sequence: random token ids, or text the model itself wrote")
    parser.add_argument("--sequences", type=int, default=1,
                        help=f"teacher-forced sequences of {TEACHER_LEN} tokens (at most {len(TEACHER_PROMPTS)})")
    parser.add_argument("--agreement-only", action="store_true", help="only the teacher-forced agreement stages")
    parser.add_argument("--device", default="cuda", help="cuda; cpu runs the agreement stages with gloo")
    parser.add_argument("--tp-reduce-dtypes", default="float32",
                        help="comma-separated tp_reduce_dtype values to run TP=2 with (the first is the headline)")
    parser.add_argument("--residual-dtype", default="auto", help="the engines' residual_dtype (auto, float32, model)")
    parser.add_argument("--gpus-per-rank", type=float, default=1.0,
                        help="0.5 runs TP=2 on one GPU (ranks reduce through host memory): agreement only")
    parser.add_argument("--ray-tp1-only", action="store_true",
                        help="one GPU: only the bare engine against atom_ray.start with TP=1")
    parser.add_argument("--step-timing-dir", default=None,
                        help="only TP=2 decode, with each rank's step timing (device time, idle gaps) written here")
    args = parser.parse_args()
    if not 1 <= args.sequences <= len(TEACHER_PROMPTS):
        parser.error(f"--sequences must be in 1..{len(TEACHER_PROMPTS)}")
    if args.gpus_per_rank != 1 and not args.agreement_only:
        parser.error("--gpus-per-rank below 1 measures numerics only: add --agreement-only")
    ENGINE_ARGS.update(load_format=args.load_format, device=args.device, residual_dtype=args.residual_dtype)
    if args.step_timing_dir:
        step_timing(args)
        return
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    import torch

    import atom_ray
    from engine import LLM

    results = {"environment": environment_record(), "model": args.model, "engine_args": ENGINE_ARGS,
               "teacher": args.teacher, "sequences": args.sequences, "gpus_per_rank": args.gpus_per_rank}

    def save() -> None:  # after every stage, so a run cut short still leaves what it measured
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
    # With --agreement-only the bare engine only writes the teacher text: always with a bf16 residual stream
    # (as before residual_dtype existed), so that every run scores the same sequences.
    bare_args = {**ENGINE_ARGS, "residual_dtype": "model"} if args.agreement_only else ENGINE_ARGS
    bare = LLM(args.model, dtype="bfloat16", show_progress=False, **bare_args)
    sequences = teacher_sequences(bare, args.teacher == "natural", args.sequences)
    if not args.agreement_only:
        results["bare_tok_s"] = decode_rate(bare.generate)
        results["bare_prefill_tok_s"] = prefill_rate(bare.generate)
        save()
    del bare
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if args.ray_tp1_only:
        ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR")
        handle = atom_ray.start(args.model, dtype="bfloat16", **ENGINE_ARGS)
        try:
            results["ray_tp1_tok_s"] = decode_rate(handle.generate)
        finally:
            handle.shutdown()
            ray.shutdown()
        results["ray_tp1_vs_bare"] = results["ray_tp1_tok_s"] / results["bare_tok_s"]
        print_table(["batch-1 decode", "tok/s", "ratio"], [
            ("bare engine", f"{results['bare_tok_s']:.1f}", "1.00"),
            ("Ray TP=1", f"{results['ray_tp1_tok_s']:.1f}", f"{results['ray_tp1_vs_bare']:.3f} of bare")])
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
        return
    chunked = LLM(args.model, dtype="bfloat16", show_progress=False, max_num_batched_tokens=256, **ENGINE_ARGS)
    chunked_tops = top1_tokens(chunked.generate, sequences)
    del chunked
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR")
    tops = {}
    reduce_dtypes = args.tp_reduce_dtypes.split(",")
    results["tp_reduce_dtypes"] = reduce_dtypes
    for dtype in ("bfloat16", "float32"):
        # (TP, tp_reduce_dtype): in float32 the reduce dtype is float32 either way.
        runs = [(1, None)] + [(2, r) for r in (reduce_dtypes if dtype == "bfloat16" else reduce_dtypes[:1])]
        for tp, reduce in runs:
            extra = {"tp_reduce_dtype": reduce, "gpus_per_rank": args.gpus_per_rank} if reduce else {}
            suffix = f"_{reduce}" if reduce and reduce != reduce_dtypes[0] else ""
            handle = atom_ray.start(args.model, dtype=dtype, tensor_parallel_size=tp, **extra, **ENGINE_ARGS)
            try:
                if dtype == "bfloat16" and not args.agreement_only:
                    results[f"ray_tp{tp}{suffix}_tok_s"] = decode_rate(handle.generate)
                    results[f"ray_tp{tp}{suffix}_prefill_tok_s"] = prefill_rate(handle.generate)
                    save()
                tops[(dtype, tp, suffix)] = top1_tokens(handle.generate, sequences)
            finally:
                handle.shutdown()
            if tp == 2:
                results[f"teacher_forced_{dtype}{suffix}"] = agreement(tops[(dtype, 1, "")], tops[(dtype, 2, suffix)])
                results[f"teacher_forced_agreement_{dtype}{suffix}"] = results[f"teacher_forced_{dtype}{suffix}"]["agreement"]
                save()
    results["noise_floor_bfloat16"] = agreement(tops[("bfloat16", 1, "")], chunked_tops)
    results["tp1_bfloat16_vs_float32"] = agreement(tops[("float32", 1, "")], tops[("bfloat16", 1, "")])
    save()
    ray.shutdown()
    if args.agreement_only:
        print_agreement(results)
        return
    # The same TP=2 engine with every all-reduce on NCCL (no symmetric-memory one-shot kernel): before/after.
    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR",
             runtime_env={"env_vars": {"ATOM_RAY_SYMMETRIC_ALL_REDUCE": "0"}})
    handle = atom_ray.start(args.model, dtype="bfloat16", tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        results["ray_tp2_nccl_only_tok_s"] = decode_rate(handle.generate)
        save()
    finally:
        handle.shutdown()
        ray.shutdown()

    results["tp2_speedup"] = results["ray_tp2_tok_s"] / results["ray_tp1_tok_s"]
    results["ray_tp1_vs_bare"] = results["ray_tp1_tok_s"] / results["bare_tok_s"]
    print_table(["batch-1 decode", "tok/s", "ratio"], [
        ("bare engine (TP=1)", f"{results['bare_tok_s']:.1f}", "1.00"),
        ("Ray TP=1", f"{results['ray_tp1_tok_s']:.1f}", f"{results['ray_tp1_vs_bare']:.3f} of bare"),
        ("Ray TP=2", f"{results['ray_tp2_tok_s']:.1f}", f"{results['tp2_speedup']:.2f}x TP=1"),
        ("Ray TP=2, every all-reduce on NCCL", f"{results['ray_tp2_nccl_only_tok_s']:.1f}",
         f"{results['ray_tp2_nccl_only_tok_s'] / results['ray_tp1_tok_s']:.2f}x TP=1"),
    ] + [(f"Ray TP=2, tp_reduce_dtype={r}", f"{results[f'ray_tp2_{r}_tok_s']:.1f}",
          f"{results[f'ray_tp2_{r}_tok_s'] / results['ray_tp1_tok_s']:.2f}x TP=1") for r in reduce_dtypes[1:]])
    print("prefill (2048-token prompt) tok/s: " + ", ".join(
        f"{key[:-len('_prefill_tok_s')]} {value:.0f}" for key, value in results.items() if key.endswith("_prefill_tok_s")))
    print_agreement(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

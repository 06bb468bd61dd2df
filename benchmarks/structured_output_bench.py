"""Structured output (issue 28): the cost of constraining a batch, with the packaged SmolLM2 through engine.LLM.

- throughput of 64 concurrent JSON-schema requests against the same 64 prompts unconstrained, each of those
  generating exactly as many tokens as its constrained twin did (ignore_eos), rounds alternating (target >= 0.9x);
- grammar compile time of the 50 test schemas/regexes/choices (median, worst), with a fresh cache, beside the
  one-off build of the library's tokenizer;
- time to first token of a constrained request while a batch of 32 runs, against an unconstrained one (target:
  within 10 %), with its grammar cached and cold;
- with --libraries: the library choice (benchmarks/structured_output_libraries.py: xgrammar against llguidance,
  compile, mask fill for a batch of 64, install weight, JSON-schema keyword coverage).

    python -m benchmarks.structured_output_bench [--out so.json] [--libraries --path /tmp/so_xg --path /tmp/so_llg]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the 50 test cases

from benchmarks.common import environment_record, print_table, run_requests  # noqa: E402
from structured_output_cases import CASE_MAX_TOKENS, CASES  # noqa: E402

BATCH = 64
ROUNDS = 5


def json_workload() -> tuple[list[str], list]:
    """BATCH prompts of the JSON-schema test cases (in turn) and their constrained sampling parameters."""
    from engine import SamplingParams
    json_cases = [c for c in CASES if c.kind == "json"]
    cases = [json_cases[i % len(json_cases)] for i in range(BATCH)]
    return [c.prompt for c in cases], [SamplingParams(temperature=0, max_tokens=CASE_MAX_TOKENS,
                                                      structured_outputs=c.structured_outputs) for c in cases]


def throughput(llm) -> dict:
    from engine import SamplingParams
    prompts, constrained = json_workload()
    run_requests(llm.engine, prompts, constrained)  # warm-up: grammars cached, kernels warm
    rates = {"constrained": [], "unconstrained": []}
    lengths = None
    for _ in range(ROUNDS):
        outputs, seconds = run_requests(llm.engine, prompts, constrained)
        lengths = [len(o.token_ids) for o in outputs]
        rates["constrained"].append(sum(lengths) / seconds)
        free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        outputs, seconds = run_requests(llm.engine, prompts, free)
        rates["unconstrained"].append(sum(len(o.token_ids) for o in outputs) / seconds)
    constrained_rate, free_rate = (statistics.median(rates[k]) for k in ("constrained", "unconstrained"))
    return {"requests": BATCH, "output_tokens": sum(lengths), "constrained_tok_s": round(constrained_rate, 1),
            "unconstrained_tok_s": round(free_rate, 1), "ratio": round(constrained_rate / free_rate, 3),
            "rounds": {k: [round(v, 1) for v in vs] for k, vs in rates.items()}}


def host_profile(llm, top: int = 25) -> dict:
    """The step thread's functions (cProfile, by own time) over one constrained round and one unconstrained
    round of the throughput workload: where a constrained step's extra host time goes."""
    import cProfile
    import io
    import pstats
    from engine import SamplingParams
    prompts, constrained = json_workload()
    outputs, _ = run_requests(llm.engine, prompts, constrained)  # warm-up
    free = [SamplingParams(temperature=0, max_tokens=len(o.token_ids), ignore_eos=True) for o in outputs]
    report = {}
    for label, params in (("constrained", constrained), ("unconstrained", free)):
        profile = cProfile.Profile()
        profile.enable()
        _, seconds = run_requests(llm.engine, prompts, params)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
        report[label] = {"seconds": seconds, "functions": text.getvalue()}
        print(f"== {label}: {seconds:.2f} s under cProfile\n{text.getvalue()[:5000]}")
    return report


def compile_times(llm) -> dict:
    from engine.sampling_params import StructuredOutputsParams
    from engine.structured_output.manager import StructuredOutputManager
    engine = llm.engine
    manager = StructuredOutputManager(engine.tokenizer, engine.source.hf_config.vocab_size, engine.eos_token_ids)
    try:
        start = time.perf_counter()
        manager._tokenizer()
        tokenizer_s = time.perf_counter() - start
        times = []
        for case in CASES:
            params = StructuredOutputsParams(**case.structured_outputs)
            start = time.perf_counter()
            manager._new_matcher(params)
            times.append(time.perf_counter() - start)
    finally:
        manager.shutdown()
    return {"cases": len(times), "median_ms": round(statistics.median(times) * 1e3, 3),
            "worst_ms": round(max(times) * 1e3, 3), "tokenizer_build_ms": round(tokenizer_s * 1e3, 1)}


def ttft_under_load(llm, probes: int = 6) -> dict:
    """A batch of 32 long unconstrained requests runs; probes arrive one at a time, alternating constrained
    (cached grammar, then a cold one) and unconstrained, and each one's time from add to first token is taken."""
    from engine import SamplingParams
    engine = llm.engine
    background = SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True)
    for i in range(32):
        engine.add_request(f"load-{i}", f"Story number {i}:", background)
    for _ in range(3):
        engine.step()
    case = next(c for c in CASES if c.name == "person")
    kinds = {"unconstrained": lambda i: SamplingParams(temperature=0, max_tokens=2),
             "constrained_cached": lambda i: SamplingParams(temperature=0, max_tokens=2,
                                                            structured_outputs=case.structured_outputs),
             "constrained_cold": lambda i: SamplingParams(temperature=0, max_tokens=2, structured_outputs={
                 "json": {**case.spec, "title": f"cold-{i}"}})}
    times = {kind: [] for kind in kinds}
    for i in range(probes):
        for kind, make in kinds.items():
            request_id = f"probe-{kind}-{i}"
            start = time.perf_counter()
            engine.add_request(request_id, case.prompt, make(i))
            while not any(o.request_id == request_id and o.outputs[0].token_ids for o in engine.step()):
                pass
            times[kind].append(time.perf_counter() - start)
            engine.abort_request(request_id)
    for i in range(32):
        engine.abort_request(f"load-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    medians = {kind: statistics.median(values) for kind, values in times.items()}
    return {"batch": 32, "probes": probes, **{f"{k}_ms": round(v * 1e3, 1) for k, v in medians.items()},
            "cached_ratio": round(medians["constrained_cached"] / medians["unconstrained"], 3),
            "cold_ratio": round(medians["constrained_cold"] / medians["unconstrained"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--libraries", action="store_true", help="also compare xgrammar and llguidance")
    parser.add_argument("--path", action="append", default=[], help="extra import path (the other library)")
    parser.add_argument("--skip-engine", action="store_true", help="only the library comparison")
    parser.add_argument("--model", default="smollm2-135m",
                        help="the packaged SmolLM2 (default), or a folder such as benchmarks/configs/smollm2-135m: "
                             "its config and real tokenizer, for a GPU host the 94 MiB GGUF cannot travel to")
    parser.add_argument("--load-format", default="auto", help="'dummy' with a config-only folder")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--profile", action="store_true", help="only the step thread's host profile")
    args = parser.parse_args()
    sys.path[:0] = args.path
    from engine import LLM
    results = {"environment": environment_record()}
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, show_progress=False)
    results["model"] = {"model": args.model, "load_format": args.load_format, "dtype": args.dtype}
    if args.profile:
        results["host_profile"] = host_profile(llm)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))
        return
    if args.libraries:
        from benchmarks.structured_output_libraries import compare
        engine = llm.engine
        specs = [(c.name, c.kind, c.spec) for c in CASES if c.kind == "json"]
        results["libraries"] = compare(engine.tokenizer.hf, engine.source.hf_config.vocab_size,
                                       sorted(engine.eos_token_ids), specs)
        rows = []
        for name, r in results["libraries"].items():
            if "skipped" in r:
                rows.append((name, r["skipped"], "", "", "", ""))
                continue
            ignored = [k for k, v in r["keywords"].items() if v == "IGNORED"]
            refused = [k for k, v in r["keywords"].items() if v.startswith("refused")]
            rows.append((name, f"{r['json_schema_compile']['median_ms']} / {r['json_schema_compile']['worst_ms']}",
                         f"{r['mask_fill_batch64']['median_ms']} ({r['mask_fill_per_row_us']} us/row)",
                         f"{sum(r['install_mb'].values()):.1f}", ", ".join(ignored) or "-", ", ".join(refused) or "-"))
        print_table(["library", "JSON compile ms median / worst", "mask fill b=64 ms", "install MB",
                     "keywords ignored", "keywords refused"], rows)
    if not args.skip_engine:
        results["compile"] = compile_times(llm)
        results["throughput"] = throughput(llm)
        results["ttft_under_load"] = ttft_under_load(llm)
        t, c, f = results["throughput"], results["compile"], results["ttft_under_load"]
        print_table(["measure", "value"], [
            ("64 JSON-schema requests, tok/s", f"{t['constrained_tok_s']} vs {t['unconstrained_tok_s']} "
                                               f"unconstrained = {t['ratio']}x"),
            ("compile, 50 test cases", f"median {c['median_ms']} ms, worst {c['worst_ms']} ms "
                                       f"(tokenizer once: {c['tokenizer_build_ms']} ms)"),
            ("TTFT beside a batch of 32", f"unconstrained {f['unconstrained_ms']} ms; constrained "
                                          f"{f['constrained_cached_ms']} ms ({f['cached_ratio']}x), cold grammar "
                                          f"{f['constrained_cold_ms']} ms ({f['cold_ratio']}x)"),
        ])
    llm.shutdown()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""Multi-GPU layouts against one GPU, all through Ray (`atom_ray.start`), in one run on a two-GPU host.

For each model shape (benchmarks/configs, dummy bf16 weights) and layout: offline output tokens/s on the
512-request workload of gpu_perf (prompts 128..1024, outputs 64..512; `--num-requests` takes the first N),
batch-1 decode tokens/s (128-token prompt, 256 new tokens: the best of three generations less the best of
three prefills), the time to start and to shut down, what each DP rank's lockstep agreement cost, the expert
load per EP rank over the run, and each rank's device time per decode step against its idle gaps
(engine.runner.step_timer.StepTimer: over the batch-1 run, and by step kind over the whole layout's run).
Every ratio is against the one-GPU engine of the same model in the same run, which runs after the model's
other layouts: on a fresh machine the first layout compiles the Triton variants the others then load from the
disk cache, so a baseline run first is slowed and every ratio against it flatters the layout (the table of
variants compiled in timed steps shows what a layout paid; docs/BENCHMARKS.md, issue 26).

    python -m benchmarks.multi_gpu --out multi.json [--models qwen3-30b-a3b,deepseek-v2-lite,llama-3.1-8b]
    python -m benchmarks.multi_gpu --check --out check.json     # tiny float32 MoE: every layout's greedy tokens
                                                                  # against one GPU's, with CUDA graphs
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import environment_record, print_table

# Prompt-step graphs ("auto": on for MoE models, off for dense ones) against the other choice.
EAGER_PROMPTS, PROMPT_GRAPHS = {"cuda_graph_prompt_steps": "off"}, {"cuda_graph_prompt_steps": "on"}
LAYOUTS = {
    "qwen3-30b-a3b": {"1 GPU": {}, "DP=2 + EP=2": {"data_parallel_size": 2, "enable_expert_parallel": True},
                      "TP=2 + EP": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
                      "TP=2": {"tensor_parallel_size": 2},
                      "1 GPU (eager prompt steps)": EAGER_PROMPTS,
                      "TP=2 (eager prompt steps)": {"tensor_parallel_size": 2, **EAGER_PROMPTS}},
    "deepseek-v2-lite": {"1 GPU": {}, "DP=2 + EP=2": {"data_parallel_size": 2, "enable_expert_parallel": True}},
    "llama-3.1-8b": {"1 GPU": {}, "TP=2": {"tensor_parallel_size": 2},
                     "1 GPU (prompt-step graphs)": PROMPT_GRAPHS,
                     "TP=2 (prompt-step graphs)": {"tensor_parallel_size": 2, **PROMPT_GRAPHS}},
}
ENGINE_ARGS = dict(load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=256,
                   max_num_batched_tokens=8192, device="cuda")
PROMPT_LEN, NEW_TOKENS = 128, 256


def decode_rate(generate) -> float:
    from engine import SamplingParams
    prompt = [random.Random(0).randrange(1000, 30000) for _ in range(PROMPT_LEN)]

    def run(n: int) -> float:
        start = time.perf_counter()
        generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start

    run(8)
    prefill = min(run(1) for _ in range(3))
    return NEW_TOKENS / (min(run(NEW_TOKENS + 1) for _ in range(3)) - prefill)


def rank_timings(folder: Path, keep: Path) -> dict:
    """The ranks' StepTimer files of the layout just run, moved out of the shared folder into `keep`."""
    keep.mkdir(parents=True, exist_ok=True)
    timings = {}
    for path in sorted(folder.glob("*.json")):
        timings[path.stem] = json.loads(path.read_text())
        path.rename(keep / path.name)
    return timings


def measure_layout(model: str, layout: dict, prompts, params, timing_dir: Path, label: str, probe=None) -> dict:
    """One layout's figures (the module's docstring). `probe(engine, outputs) -> dict`, if given, runs on the
    live engine after the offline run (its outputs in hand) and adds its entries to the result."""
    import atom_ray
    started = time.perf_counter()
    engine = atom_ray.start(model, **ENGINE_ARGS, **layout)
    result = {"start_s": time.perf_counter() - started}
    try:
        from engine import SamplingParams
        # Warm-up: prefill chunks and decode batches of many sizes, so that kernel compilation stays out.
        engine.generate(prompts[:32], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        result["decode_tok_s"] = decode_rate(engine.generate)  # StepTimer records these steps
        started = time.perf_counter()
        outputs = engine.generate(prompts, params)
        seconds = time.perf_counter() - started
        produced = sum(len(o.token_ids) for o in outputs)
        assert produced == sum(p.max_tokens for p in params), "fewer tokens than asked"
        result.update(offline_tok_s=produced / seconds, offline_s=seconds)
        stats = engine.stats()
        ranks = stats.get("dp_ranks") or [stats]
        result["lockstep"] = [{k: r[k] for k in ("lockstep_votes", "lockstep_vote_us_mean", "lockstep_vote_us_max")
                               if k in r} for r in ranks]
        result["expert_load"] = ranks[0].get("expert_load")
        result["num_preemptions"] = sum(r.get("num_preemptions", 0) for r in ranks)
        if probe is not None:
            result.update(probe(engine, outputs))
    finally:
        started = time.perf_counter()
        engine.shutdown()
        result["shutdown_s"] = time.perf_counter() - started
    result["ranks"] = rank_timings(timing_dir, timing_dir / label.replace(" ", "").replace("=", "").replace("+", "_"))
    return result


def benchmark(args) -> dict:
    import ray
    from transformers import AutoConfig

    from benchmarks.gpu_perf import throughput_workload
    from engine import SamplingParams
    results = {}
    # One Ray cluster for every layout; each rank's StepTimer writes into this folder (Ray starts the actors
    # with the driver's environment variables).
    timing_dir = Path(tempfile.mkdtemp(prefix="step-timing-"))
    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR",
             runtime_env={"env_vars": {"ATOM_RAY_STEP_TIMING_DIR": str(timing_dir),
                                       "ATOM_RAY_KERNEL_PROFILE_STEPS": str(args.kernel_profile_steps),
                                       "ATOM_RAY_HOST_SAMPLE_HZ": str(args.host_sample_hz)}})
    for name in args.models.split(","):
        model = f"benchmarks/configs/{name}"
        prompts, output_lens = throughput_workload(AutoConfig.from_pretrained(model).vocab_size)
        prompts, output_lens = prompts[:args.num_requests], output_lens[:args.num_requests]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
        results[name] = {}
        # The baseline last: it must not be the one that pays for a cold compile cache.
        for label, layout in sorted(LAYOUTS[name].items(), key=lambda item: item[0] == "1 GPU"):
            if args.layouts and label not in args.layouts.split(","):
                continue
            try:
                results[name][label] = measure_layout(model, layout, prompts, params, timing_dir, f"{name}-{label}")
            except Exception as exc:  # one layout's failure leaves the others' numbers
                results[name][label] = {"error": repr(exc)}
                print(f"{name} {label}: {exc!r}")
            print(name, label, {k: v for k, v in results[name][label].items() if k != "expert_load"}, flush=True)
            Path(args.out).write_text(json.dumps({"environment": environment_record(), "results": results}, indent=2))
    ray.shutdown()
    return results


def table(results: dict) -> None:
    rows = []
    for name, layouts in results.items():
        base = layouts.get("1 GPU", {})
        for label, r in sorted(layouts.items(), key=lambda item: item[0] != "1 GPU"):  # the baseline's row first
            if "error" in r:
                rows.append((name, label, "error", "", "", "", "", "", r["error"][:60]))
                continue
            load = r.get("expert_load") or {}
            votes = [v.get("lockstep_vote_us_mean") for v in r.get("lockstep", []) if v.get("lockstep_votes")]
            steps = [t.get("device_ms_median") for t in r.get("ranks", {}).values()]
            gaps = [t.get("gap_ms_median") for t in r.get("ranks", {}).values()]
            rows.append((name, label, f"{r['offline_tok_s']:.0f}",
                         f"{r['offline_tok_s'] / base['offline_tok_s']:.2f}x" if base.get("offline_tok_s") else "-",
                         f"{r['decode_tok_s']:.1f}",
                         f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base.get("decode_tok_s") else "-",
                         "/".join(f"{s:.2f}" for s in steps if s is not None) + " ; " +
                         "/".join(f"{g:.2f}" for g in gaps if g is not None),
                         f"{statistics.mean(votes):.0f}" if votes else "-",
                         f"{load.get('ep_rank_imbalance', 0):.2f} ({'/'.join(str(t) for t in load.get('tokens_per_ep_rank', []))})"
                         if load else "-"))
    print_table(["model", "layout", "offline tok/s", "vs 1 GPU", "b=1 tok/s", "vs 1 GPU",
                 "b=1 device ms per step ; idle gap ms (per rank)", "agree us", "EP rank imbalance (tokens)"], rows)
    profile_table(results)


def profile_table(results: dict) -> None:
    """Where each rank's whole run went, by step kind (StepTimer at shutdown): device seconds against the
    idle gaps before the steps; gaps that rival the device time mean the host bounds the steps."""
    rows = []
    for name, layouts in results.items():
        for label, r in layouts.items():
            for rank, timing in sorted(r.get("ranks", {}).items()):
                if "kernels" in timing:
                    continue
                for kind, k in timing.get("by_kind", {}).items():
                    rows.append((name, label, rank, kind, k["steps"], k["tokens"], f"{k['device_ms_median']:.2f}",
                                 f"{k['device_s_total']:.2f}", f"{k['gap_ms_mean']:.2f}", f"{k['gap_s_total']:.2f}",
                                 f"{k['host_launch_ms_median']:.2f}"))
    if rows:
        print_table(["model", "layout", "rank", "step kind", "steps", "tokens", "device ms median",
                     "device s", "gap ms mean", "gap s", "host launch ms"], rows)
    compiles = [(name, label, rank, t["triton"]["compiled"], f"{t['triton']['compile_s']:.1f}",
                 ", ".join(f"{k['name']} x{k['compiled']}" for k in t["triton"]["kernels"][:4]))
                for name, layouts in results.items() for label, r in layouts.items()
                for rank, t in sorted(r.get("ranks", {}).items()) if "triton" in t]
    if compiles:  # a layout that compiled inside its timed steps ran slower than a warm one would
        print_table(["model", "layout", "rank", "Triton variants compiled in timed steps", "seconds",
                     "kernels"], compiles)
    kernel_table(results)


def kernel_table(results: dict, top: int = 12) -> None:
    """The kernels that took the most device time over each rank's traced window of full-batch steps
    (`--kernel-profile-steps`), per step, beside the window's wall time per step."""
    rows = []
    for name, layouts in results.items():
        for label, r in layouts.items():
            for rank, trace in sorted(r.get("ranks", {}).items()):
                if "kernels" not in trace:
                    continue
                steps = trace["steps"]
                rows.append((name, label, rank, "(window: wall / kernels per step)",
                             f"{trace['wall_ms'] / steps:.2f} / {trace['kernel_ms'] / steps:.2f}", "", ""))
                for k in trace["kernels"][:top]:
                    rows.append((name, label, rank, k["name"][:70], f"{k['ms_per_step']:.3f}",
                                 f"{k['calls_per_step']:.0f}", f"{k['share']:.2f}"))
    if rows:
        print_table(["model", "layout", "rank", "kernel", "ms per step", "calls per step", "share"], rows)
    host_table(results)


def host_table(results: dict, top: int = 8) -> None:
    """Where each rank process's busy threads spent their wall time (`--host-sample-hz`): the functions most
    often on their stacks. Threads parked in one frame for 90 % of the samples or more are left out."""
    rows = []
    for name, layouts in results.items():
        for label, r in layouts.items():
            for rank, report in sorted(r.get("ranks", {}).items()):
                for thread, t in report.get("threads", {}).items():
                    if not t["self"] or t["self"][0][1] >= 0.9:
                        continue
                    for key, share in t["inclusive"][:top]:
                        rows.append((name, label, rank, thread[:28], key[:80], f"{share:.2f}"))
    if rows:
        print_table(["model", "layout", "rank", "thread", "function (inclusive)", "share of samples"], rows)


def check(args) -> dict:
    """Greedy tokens of a tiny float32 Qwen3-MoE in every layout against one GPU's, with CUDA graphs and
    requests that leave one DP rank idle or give the ranks very different batches."""
    import sys

    import ray

    import atom_ray
    from engine import SamplingParams
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_models import make_tiny_model
    folder = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-moe-")), "qwen3_moe"))
    prompts = [[5, 6, 7], list(range(10, 40)), list(range(50, 67)), [100] * 9 + [200]] + \
              [list(range(300, 348)) + [i] for i in range(6)]  # a shared prefix: most go to one DP rank
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    layouts = {"1 GPU": {}, "TP=2": {"tensor_parallel_size": 2},
               "TP=2 + EP": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
               "DP=2 + EP=2": {"data_parallel_size": 2, "enable_expert_parallel": True},
               "DP=2 + EP=2 (all-to-all)": {"data_parallel_size": 2, "enable_expert_parallel": True,
                                            "expert_exchange": "all_to_all"}}
    if args.layouts:
        layouts = {label: layouts[label] for label in args.layouts.split(",")}
    tokens, results = {}, {}
    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR")
    try:
        for label, layout in layouts.items():
            engine = atom_ray.start(folder, dtype="float32", device=args.device, max_model_len=512, **layout)
            try:
                alone = engine.generate([prompts[1]], greedy)[0].token_ids  # one DP rank idle
                tokens[label] = [o.token_ids for o in engine.generate(prompts, greedy)] + [alone]
            finally:
                engine.shutdown()
            same = sum(a == b for a, b in zip(tokens[label], tokens[next(iter(layouts))]))
            results[label] = {"same_sequences": same, "sequences": len(tokens[label])}
            print(f"check {label}: {same}/{len(tokens[label])} sequences as one GPU's", flush=True)
    finally:
        ray.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(LAYOUTS))
    parser.add_argument("--layouts", default=None, help="comma-separated layout labels to run (default: all)")
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--kernel-profile-steps", type=int, default=0,
                        help="trace each rank's kernels over this many full-batch steps of the offline run")
    parser.add_argument("--host-sample-hz", type=float, default=0,
                        help="sample every rank process's Python stacks at this rate (engine/runner/host_sampler.py); "
                             "50 or less: each sample holds the GIL (at 200, TP=2 ran at 1.07x of one GPU "
                             "against 1.30x unsampled)")
    parser.add_argument("--check", action="store_true", help="only the tiny-model token check")
    parser.add_argument("--device", default="cuda", help="the check's device (cpu runs it through gloo)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.check:
        results = check(args)
        Path(args.out).write_text(json.dumps({"environment": environment_record(), "check": results}, indent=2))
        return
    results = benchmark(args)
    Path(args.out).write_text(json.dumps({"environment": environment_record(), "results": results}, indent=2))
    table(results)


if __name__ == "__main__":
    main()

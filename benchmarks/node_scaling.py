"""Issue 30: whole-node runs on the GPUs this host has (n = the largest of 8, 4, 2), every layout through Ray
(benchmarks/multi_gpu.py's `measure_layout`: offline output tokens/s, batch-1 decode tokens/s, start and
shutdown times, lockstep, expert load), dummy weights at real shapes (benchmarks/configs), the plan of
benchmarks/node_plan.py (which layers fit: the same on every layout of a model, stated in every row).

    python -m benchmarks.node_scaling --part moe --out moe.json [--models deepseek-v3] [--num-requests 256]
    python -m benchmarks.node_scaling --part dense --out dense.json [--models llama-3.1-70b]
    python -m benchmarks.node_scaling --part serving --out serving.json
    python -m benchmarks.node_scaling --part moe --dry-run --gpus 8 [--gpu-mem-gib 80]   # the plan; no GPU, no Ray

- moe: Qwen3-235B-A22B, DeepSeek-V3 (MLA) in bf16 and DeepSeek-V3 with FP8 128x128 block weights as published,
  each at DP=n + EP=n against TP=n (the ratio's baseline; target >= 1.3x offline) on the first --num-requests
  (256) of gpu_perf's 512-request workload; per layout also TTFT, TPOT and inter-token latency percentiles of
  --latency-requests (64) fresh requests of the same lengths streamed at once through the engine handle, the
  engine's own TTFT/TPOT over the offline run (request metrics), requests and tokens per DP rank (counted over
  the layout's run: 32 warm-up, 7 batch-1 and the offline requests) and tokens per EP rank of the expert load
  (under TP: per n contiguous expert ranges, the split EP=n would give).
- dense: Llama-3.1-70B at TP=n (and TP=4 against it on eight GPUs; the baseline is the fewest GPUs) and
  Llama-3.1-8B at TP=1, 2, 4, 8 (against TP=1), the 512 requests; batch-1 decode also against its roofline:
  each GPU reads 1/TP of the step's weights and its KV heads' cache at the mean context (256), at the
  bandwidth measured on one GPU in the same run (benchmarks/device_limits.py). Target: 70B at TP=8 >= 0.6.
- serving: benchmarks/node_serving.py (the whole-node TP config under `serve run` against the same engine
  offline, concurrency 64 and 256, --num-requests (256) per level; target: HTTP >= 0.9x offline at 256).

Time, estimated from issue 26's two-GPU runs (engine start 25-45 s, shutdown 10-20 s, the first layout also
compiling Triton kernels) and not yet measured at these sizes: a MoE model's two layouts 5-7 minutes with
256 requests (start ~60-90 s each at 235B/671B shapes, batch-1 decode ~10-15 s, offline 10-40 s, the
streamed 64 ~15 s), so one model per device call; dense: the 70B's two layouts ~5 minutes, the 8B's four
~5.5 minutes with 512 requests; serving ~7 minutes (offline start and both levels ~2.5, `serve run` ready in
~3, both levels ~1.5). benchmarks/node_scaling_run.sh runs each as its own step.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import environment_record, print_table
from benchmarks.node_plan import (PLAN_HEADERS, WEIGHT_FRACTION, GiB, decode_roofline, dense_plans, gpus_to_use,
                                  layout_sizes, moe_plans, plan_rows, serving_plan, workload)

DEFAULT_REQUESTS = {"moe": 256, "dense": 512, "serving": 256}
MOE_TARGET, DENSE_ROOFLINE_TARGET, SERVING_TARGET = 1.3, 0.6, 0.9
STATS_POLL_S = 1.5  # the Ray client's stats arrive with its next poll (one a second)


def host_gpus(args) -> tuple[int, int, float]:
    """(GPUs the host has, how many the part uses, GiB of memory of one): --gpus / --gpu-mem-gib, else asked of
    torch (no context is made on the GPUs: the ranks get all of their memory); a dry run assumes 80 GiB."""
    import torch
    count = args.gpus if args.gpus is not None else torch.cuda.device_count()
    n = gpus_to_use(count)
    memory = args.gpu_mem_gib or (80.0 if args.dry_run else torch.cuda.get_device_properties(0).total_memory / GiB)
    return count, n, memory


def part_plans(args, n: int, memory_gib: float) -> list:
    names = args.models.split(",") if args.models else None
    if args.part == "moe":
        return moe_plans(n, memory_gib, names)
    if args.part == "dense":
        return dense_plans(n, memory_gib, names)
    return [serving_plan(n, memory_gib)]


def measure_bandwidth_in_child() -> float:
    """One GPU's memory bandwidth (bytes/s) measured in a child process, so that this driver holds no GPU
    memory while the ranks size their KV caches."""
    code = "from benchmarks.device_limits import measure_bandwidth; print(measure_bandwidth())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parent.parent)
    return float(done.stdout.strip().splitlines()[-1])


def request_metrics(outputs) -> dict | None:
    """The engine's own TTFT (arrival to first token, queueing included) and TPOT percentiles over a run."""
    from benchmarks.serving import percentiles
    ttfts, tpots = [], []
    for output in outputs:
        m = output.metrics
        if m is None or m.first_token_time is None:
            continue
        ttfts.append(m.first_token_time - m.arrival_time)
        tpots.append((m.last_token_time - m.first_token_time) / max(len(output.token_ids) - 1, 1))
    return {"ttft_s": percentiles(ttfts), "tpot_s": percentiles(tpots)} if ttfts else None


def moe_probe(requests: list):
    """What measure_layout adds to a MoE layout after its offline run: the request metrics of that run, the
    per-DP-rank counters, then a streamed pass of `requests` all at once (a failure of which is recorded, not
    raised, so that the layout keeps its other figures)."""
    from benchmarks.node_serving import stream_requests

    def probe(engine, outputs) -> dict:
        result = {"offline_request_metrics": request_metrics(outputs)}
        time.sleep(STATS_POLL_S)
        stats = engine.stats()
        result["per_dp_rank"] = [{k: r.get(k) for k in ("routed_requests", "prompt_tokens", "generation_tokens",
                                                        "num_preemptions", "num_kv_blocks")}
                                 for r in stats.get("dp_ranks") or [stats]]
        try:
            result["streamed"] = asyncio.run(stream_requests(engine, requests, len(requests)))
        except Exception as exc:  # the layout's offline figures stay
            result["streamed_error"] = repr(exc)
        return result
    return probe


def expert_load_per_rank(load: dict | None, n: int) -> dict | None:
    """Tokens per EP rank of an expert-load report; for a layout without EP (one range over all experts), per
    n contiguous expert ranges, the split EP=n gives."""
    if not load:
        return None
    from engine.layers.linear import shard_range
    per_expert, per_rank = load["tokens_per_expert"], load["tokens_per_ep_rank"]
    if len(per_rank) != n:
        per_rank = [sum(per_expert[start:start + count])
                    for start, count in (shard_range(len(per_expert), n, rank) for rank in range(n))]
    total = sum(per_rank)
    return {"tokens_per_rank": per_rank, "rank_imbalance": max(per_rank) * n / total if total else 1.0,
            "expert_imbalance": load["expert_imbalance"], "window_steps": load["window_steps"]}


def run_layouts(args, plans: list, n: int, record: dict, save) -> None:
    """Every layout of every plan through measure_layout, in one Ray cluster; one layout's failure leaves
    the others' figures."""
    import ray

    from benchmarks.gpu_perf import random_prompts
    from benchmarks.multi_gpu import NEW_TOKENS, PROMPT_LEN, measure_layout
    from engine import SamplingParams
    timing_dir = Path(tempfile.mkdtemp(prefix="step-timing-"))
    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR",
             runtime_env={"env_vars": {"ATOM_RAY_STEP_TIMING_DIR": str(timing_dir)}})
    try:
        for plan in plans:
            config = plan.hf_config()
            prompts, output_lens = workload(config.vocab_size, args.num_requests, args.max_tokens)
            params = [SamplingParams(temperature=0, max_tokens=t, ignore_eos=True) for t in output_lens]
            count = min(args.latency_requests, len(prompts))
            fresh = random_prompts(config.vocab_size, [len(p) for p in prompts[:count]], seed=2)  # no cache hits
            probe = moe_probe(list(zip(fresh, output_lens[:count]))) if args.part == "moe" else None
            results = record["results"].setdefault(plan.name, {})
            for label, layout in plan.layouts.items():
                try:
                    results[label] = measure_layout(plan.model, layout, prompts, params, timing_dir,
                                                    f"{plan.name}-{label}", probe=probe)
                except Exception as exc:
                    results[label] = {"error": repr(exc)}
                if args.part == "moe" and "error" not in results[label]:
                    results[label]["expert_load_per_rank"] = expert_load_per_rank(results[label]["expert_load"], n)
                if args.part == "dense":
                    tp = layout_sizes(layout)[0]
                    results[label]["roofline"] = decode_roofline(config, tp, record["bandwidth_Bps"],
                                                                 PROMPT_LEN + NEW_TOKENS / 2)
                print(plan.name, label, {k: v for k, v in results[label].items()
                                         if k in ("error", "start_s", "offline_tok_s", "decode_tok_s")}, flush=True)
                save()
    finally:
        ray.shutdown()


def ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value and base else None


def fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def layout_rows(record: dict, plans: list) -> tuple[list, list]:
    """(rows of the table, ratio records): each layout's figures and its ratios against its model's baseline."""
    rows, ratios = [], []
    for plan in plans:
        results = record["results"].get(plan.name, {})
        base = results.get(plan.baseline, {})
        for label, r in results.items():
            if "error" in r:
                rows.append((plan.shape, label, "error: " + r["error"][:80]))
                continue
            offline = ratio(r.get("offline_tok_s"), base.get("offline_tok_s"))
            decode = ratio(r.get("decode_tok_s"), base.get("decode_tok_s"))
            row = [plan.shape, label, fmt(r.get("offline_tok_s"), ".0f"), fmt(offline, ".2f", f"x {plan.baseline}"),
                   fmt(r.get("decode_tok_s"), ".1f"), fmt(decode, ".2f", f"x {plan.baseline}")]
            if label != plan.baseline:
                ratios.append({"shape": plan.shape, "layout": label, "against": plan.baseline,
                               "offline_ratio": offline, "decode_b1_ratio": decode})
            if "roofline" in r:
                of_roofline = r["decode_tok_s"] / r["roofline"]["roofline_tok_s"]
                row.append(f"{of_roofline:.3f} of {r['roofline']['roofline_tok_s']:.0f}")
                ratios.append({"shape": plan.shape, "layout": label, "against": "batch-1 bandwidth roofline",
                               "decode_b1_ratio": of_roofline})
            if "per_dp_rank" in r:  # a MoE layout's latencies and per-rank loads
                s = r.get("streamed")
                row += [f"{s['ttft_s']['p50'] * 1e3:.0f} / {s['ttft_s']['p99'] * 1e3:.0f}" if s else "-",
                        f"{s['itl_s']['p50'] * 1e3:.1f} / {s['itl_s']['p99'] * 1e3:.1f}" if s else "-",
                        "/".join(str(d.get("routed_requests") or "-") for d in r["per_dp_rank"]),
                        fmt_load(r.get("expert_load_per_rank"))]
            rows.append(tuple(row))
    return rows, ratios


def fmt_load(load: dict | None) -> str:
    if not load:
        return "-"
    return f"{load['rank_imbalance']:.2f} ({'/'.join(str(t) for t in load['tokens_per_rank'])})"


def target_rows(record: dict, plans: list, n: int) -> list:
    """The issue's targets this run speaks to: figure, baseline, met or not."""
    def row(target: str, shape: str, value: float | None, minimum: float, against: str) -> tuple:
        return target, shape, fmt(value, ".3f", against), "-" if value is None else "yes" if value >= minimum else "no"

    rows = []
    for plan in plans:
        results = record["results"].get(plan.name, {})
        if record["part"] == "moe":
            dp = results.get(f"DP={n} + EP={n}", {}).get("offline_tok_s")
            value = ratio(dp, results.get(plan.baseline, {}).get("offline_tok_s"))
            rows.append(row(f"DP={n} + EP={n} offline >= {MOE_TARGET}x TP={n}", plan.shape, value, MOE_TARGET,
                            f"x TP={n}"))
        elif record["part"] == "dense" and plan.name == "llama-3.1-70b":
            r = results.get(f"TP={n}", {})
            value = r["decode_tok_s"] / r["roofline"]["roofline_tok_s"] if "decode_tok_s" in r else None
            rows.append(row(f"TP={n} batch-1 decode >= {DENSE_ROOFLINE_TARGET} of the roofline", plan.shape, value,
                            DENSE_ROOFLINE_TARGET, " of roofline"))
    if record["part"] == "serving":
        value = record["results"].get("serving", {}).get("http_over_offline", {}).get(256)
        rows.append(row(f"serving c=256 >= {SERVING_TARGET}x offline", plans[0].shape, value, SERVING_TARGET,
                        "x offline"))
    return rows


def report(record: dict, plans: list, n: int) -> None:
    env = record["environment"]
    print(f"{env['date']}, commit {env['commit']}, {n}x {env.get('device')}, part {record['part']}, "
          f"{record['num_requests']} requests" + (f", {record['bandwidth_Bps'] / 1e9:.0f} GB/s one GPU"
                                                 if record.get("bandwidth_Bps") else ""))
    if record["part"] == "serving":
        from benchmarks.node_serving import SERVING_HEADERS, serving_rows
        serving = record["results"].get("serving", {})
        print_table(SERVING_HEADERS, serving_rows(plans[0], serving))
        record["ratios"] = [{"shape": plans[0].shape, "layout": plans[0].baseline, "concurrency": c,
                             "against": "the same engine offline, same requests and concurrency", "http_ratio": value}
                            for c, value in serving.get("http_over_offline", {}).items()]
    else:
        rows, record["ratios"] = layout_rows(record, plans)
        headers = ["shape", "layout", "offline tok/s", "vs", "b=1 tok/s", "vs"]
        headers += ["b=1 of roofline (tok/s)"] if record["part"] == "dense" else \
            ["TTFT p50/p99 ms", "ITL p50/p99 ms", "requests per DP rank", "EP rank imbalance (tokens)"]
        print_table(headers, [tuple(row) + ("-",) * (len(headers) - len(row)) for row in rows])
    print_table(["target", "shape", "figure", "met?"], target_rows(record, plans, n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", required=True, choices=sorted(DEFAULT_REQUESTS))
    parser.add_argument("--out", default=None, help="the JSON (required unless --dry-run)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs of the host (default: torch's count)")
    parser.add_argument("--gpu-mem-gib", type=float, default=None, help="one GPU's memory (default: queried)")
    parser.add_argument("--models", default=None, help="comma-separated shapes of the part (default: all)")
    parser.add_argument("--num-requests", type=int, default=None,
                        help=f"requests per offline run, or per serving level (default {DEFAULT_REQUESTS})")
    parser.add_argument("--max-tokens", type=int, default=None, help="cap the workload's output lengths")
    parser.add_argument("--latency-requests", type=int, default=64, help="moe: requests of the streamed pass")
    parser.add_argument("--dry-run", action="store_true", help="print the plan only (no GPU, no Ray)")
    args = parser.parse_args()
    if not args.dry_run and not args.out:
        parser.error("--out is required unless --dry-run")
    args.num_requests = args.num_requests or DEFAULT_REQUESTS[args.part]
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    count, n, memory_gib = host_gpus(args)
    plans = part_plans(args, n, memory_gib)
    print(f"{count} GPU(s) of {memory_gib:.0f} GiB: the part runs on {n}; dummy weights take at most "
          f"{WEIGHT_FRACTION * memory_gib:.0f} GiB of each")
    print_table(PLAN_HEADERS, plan_rows(plans, args.num_requests, args.max_tokens if args.part != "serving" else None))
    if args.dry_run:
        if args.part == "serving":
            import yaml

            from benchmarks.node_serving import engine_args_for, serve_config
            print(yaml.safe_dump(serve_config("<the shape with a synthetic tokenizer>",
                                              engine_args_for(plans[0].layouts[plans[0].baseline]), 8766),
                                 sort_keys=False))
        return
    record = {"environment": environment_record(), "part": args.part, "gpus": n, "gpus_on_host": count,
              "gpu_mem_gib": memory_gib, "num_requests": args.num_requests, "max_tokens": args.max_tokens,
              "plans": [{"model": p.name, "shape": p.shape, "layers": p.layers, "full_layers": p.full_layers,
                         "hf_overrides": p.overrides, "layouts": p.layouts, "weight_gib_per_rank": p.gib_per_rank,
                         "baseline": p.baseline} for p in plans], "results": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(*_):
        out.write_text(json.dumps(record, indent=2, default=str))

    if args.part == "dense":
        record["bandwidth_Bps"] = measure_bandwidth_in_child()
    if args.part == "serving":
        from benchmarks.node_serving import serving_part
        record["results"]["serving"] = serving_part(
            plans[0], args.num_requests, save=lambda r: (record["results"].update(serving=r), save()))
    else:
        run_layouts(args, plans, n, record, save)
    report(record, plans, n)
    save()


if __name__ == "__main__":
    main()

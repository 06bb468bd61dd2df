"""Failover soak (issue 31): a data-parallel engine through Ray (`atom_ray.start`, DP=2 by default, on the CPU or
GPUs) serves N concurrent greedy streams without pause for a while, and one DP rank's process is killed
(SIGKILL) every `--kill-every` seconds, the ranks taken in turn. Every stream's tokens are checked against an
undisturbed run of the same prompt (greedy: any repeated, dropped or different token shows), and reported:
streams completed and lost, streams whose tokens differ, the longest pause a live stream saw (between two of
its tokens), the rank restarts and resumed requests the engine counted, the survivors' output rate while a
rank was down against the rate with both up, the memory (resident set) of the driver and the DP ranks at the
start and at the end, and whether every KV block is free at the end.

    python -m benchmarks.failover_soak [--model smollm2-135m] [--minutes 10] [--streams 32] [--kill-every 60] \
        [--engine-args '{"enable_expert_parallel": true}'] --out failover_soak.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import time
from pathlib import Path

from benchmarks.common import environment_record, print_table

PROMPT_POOL = 64


def prompts_for(seed: int = 0) -> list[list[int]]:
    """Token-id prompts of 8..48 tokens, ids 100..29999 (inside every served family's vocabulary)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 30000) for _ in range(rng.randint(8, 48))] for _ in range(PROMPT_POOL)]


def resident_mb(pid: int) -> float | None:
    try:
        import psutil
        return psutil.Process(pid).memory_info().rss / 2**20
    except Exception:  # a rank being restarted
        return None


async def one_stream(engine, prompt, params, record: dict) -> None:
    """One stream; `record` gets its tokens, the longest gap between two of them and whether it failed."""
    tokens, last, longest = [], time.monotonic(), 0.0
    record.update(start=last, tokens=tokens)  # filled as the tokens come: the run's output rate reads them
    try:
        async for output in engine.stream(prompt, params):
            now = time.monotonic()
            if output.outputs[0].new_token_ids:
                longest, last = max(longest, now - last), now
            tokens += output.outputs[0].new_token_ids
    except Exception as exc:  # a lost stream
        record["error"] = repr(exc)[:200]
    record.update(tokens=tokens, longest_gap_s=longest, end=time.monotonic())


async def soak(engine, prompts, expected, params, args) -> dict:
    end = time.monotonic() + args.minutes * 60
    records, outstanding = [], set()
    kills, next_kill, victim = [], time.monotonic() + args.kill_every, 0
    produced = []  # (time, tokens so far) samples for the rate while a rank is down
    rng = random.Random(1)

    async def client(slot: int) -> None:
        while time.monotonic() < end:
            index = rng.randrange(len(prompts))
            record = {"prompt": index}
            records.append(record)
            await one_stream(engine, prompts[index], params, record)

    tasks = [asyncio.ensure_future(client(i)) for i in range(args.streams)]
    while time.monotonic() < end:
        await asyncio.sleep(0.5)
        produced.append((time.monotonic(), sum(len(r.get("tokens", ())) for r in records)))
        if time.monotonic() >= next_kill:
            ranks = engine.rank_process_ids()
            _, pid = ranks[victim % len(ranks)]
            os.kill(pid, signal.SIGKILL)
            kills.append({"at": time.monotonic(), "dp_rank": victim % len(ranks), "pid": pid})
            victim += 1
            next_kill = time.monotonic() + args.kill_every
    await asyncio.gather(*tasks, return_exceptions=True)
    for record in records:
        record["same"] = record.get("tokens") == expected[record["prompt"]]
    return {"records": records, "kills": kills, "produced": produced}


def rate_around(produced: list[tuple[float, int]], at: float, window_s: float = 5.0) -> tuple[float, float]:
    """Output tokens/s over `window_s` before `at` and over `window_s` after it, from the run's samples."""
    def tokens_at(t: float) -> int:
        earlier = [n for when, n in produced if when <= t]
        return earlier[-1] if earlier else 0
    before = (tokens_at(at) - tokens_at(at - window_s)) / window_s
    after = (tokens_at(at + window_s) - tokens_at(at)) / window_s
    return before, after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", help="float32: greedy tokens that do not depend on the batch")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--kill-every", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--data-parallel-size", type=int, default=2)
    parser.add_argument("--engine-args", type=json.loads, default={})
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    import atom_ray
    from engine import SamplingParams
    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR")
    engine = atom_ray.start(args.model, data_parallel_size=args.data_parallel_size, dtype=args.dtype,
                            **args.engine_args)
    try:
        prompts = prompts_for()
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        expected = [o.token_ids for o in engine.generate(prompts, params)]  # the undisturbed run
        driver = os.getpid()
        memory_start = {"driver": resident_mb(driver),
                        **{f"dp{i}": resident_mb(pid) for i, (_, pid) in enumerate(engine.rank_process_ids())}}
        result = asyncio.run(soak(engine, prompts, expected, params, args))
        deadline = time.monotonic() + 300
        while not all(r.get("serving", True) for r in engine.stats().get("dp_ranks", [])):
            if time.monotonic() > deadline:
                break
            time.sleep(1)
        stats = engine.stats()
        memory_end = {"driver": resident_mb(driver),
                      **{f"dp{i}": resident_mb(pid) for i, (_, pid) in enumerate(engine.rank_process_ids())}}
    finally:
        engine.shutdown()
        ray.shutdown()
    records = result["records"]
    done = [r for r in records if "error" not in r and len(r.get("tokens", ())) == args.max_tokens]
    lost = [r for r in records if "error" in r]
    unfinished = [r for r in records if "error" not in r and len(r.get("tokens", ())) != args.max_tokens]
    differ = [r for r in done if not r["same"]]
    kill_times = [kill["at"] for kill in result["kills"]]
    spanned = [r for r in done if any(r["start"] <= t <= r["end"] for t in kill_times)]
    gaps = [r["longest_gap_s"] for r in done]
    rates = [rate_around(result["produced"], kill["at"]) for kill in result["kills"]]
    survivors = [after / before for before, after in rates if before > 0]
    summary = {
        "minutes": args.minutes, "streams": args.streams, "kills": len(result["kills"]),
        "requests": len(records), "completed": len(done), "lost": len(lost), "unfinished": len(unfinished),
        "streams_across_a_kill": len(spanned),
        "tokens_differ": len(differ),
        "tokens_differ_across_a_kill": sum(1 for r in spanned if not r["same"]),
        "longest_pause_s": max(gaps, default=0.0),
        "median_longest_pause_s": statistics.median(gaps) if gaps else 0.0,
        "output_rate_5s_after_a_kill_vs_before": statistics.median(survivors) if survivors else None,
        "resumed_requests": stats.get("resumed_requests"), "failed_resumes": stats.get("failed_resumes"),
        "dp_rank_restarts": stats.get("dp_rank_restarts"),
        "kv_blocks_free_at_end": stats.get("num_free_kv_blocks") == stats.get("num_kv_blocks"),
        "memory_mb_start": memory_start, "memory_mb_end": memory_end,
        "errors": sorted({r["error"] for r in lost})[:5],
    }
    Path(args.out).write_text(json.dumps({"environment": environment_record(), "args": vars(args),
                                          "summary": summary, "kills": result["kills"],
                                          "produced": result["produced"]}, indent=2))
    print_table(["measure", "value"], [(k, v) for k, v in summary.items() if k not in ("errors",)])
    if summary["errors"]:
        print("errors:", summary["errors"])


if __name__ == "__main__":
    main()

"""CPU time of every process of the served stack (Ray, Serve, Coordinator, rank worker, this load generator):
idle, and per output token under the 16-stream HTTP workload of `ray_overhead`. CPU seconds are steadier
than throughput on a noisy machine, so A/B comparisons of serving-stack settings use this.

The cluster is started the way `atom-ray serve` starts one (atom_ray.cluster.ensure_ray), or, with
--stock, by a plain `ray.init` without atom-ray's local-cluster settings. --env KEY=VALUE sets an
environment variable before the cluster starts (its processes inherit it).

    python -m benchmarks.stack_cpu [--stock] [--env RAY_X=1] [--idle-s 20] [--load-runs 1] [--out f.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.common import environment_record, print_table


def process_name(process) -> str | None:
    """A short stable name for a process of the stack, None for unrelated ones."""
    try:
        cmdline = process.cmdline()
    except Exception:
        return None
    if not cmdline:
        return None
    head = cmdline[0]
    if head.startswith("ray::"):
        name = head.split()[0][len("ray::"):].split(".")[0]  # "ray::Coordinator.poll": actor, then its task
        return "ServeReplica" if name.startswith("ServeReplica") else name
    joined = " ".join(cmdline)
    for key, name in (("gcs_server", "gcs_server"), ("raylet/raylet", "raylet"), ("dashboard/agent.py", "dashboard_agent"),
                      ("runtime_env/agent/main.py", "runtime_env_agent"), ("log_monitor.py", "log_monitor"),
                      ("dashboard/dashboard.py", "dashboard"), ("autoscaler/_private/monitor.py", "monitor"),
                      ("bin/haproxy", "haproxy")):
        if key in joined:
            return name
    return None


def snapshot(own_pid: int) -> dict[int, tuple[str, float]]:
    """pid -> (name, user+system CPU seconds, children included) of the stack's processes and this one."""
    import psutil
    result = {}
    for process in psutil.process_iter():
        name = "load_generator" if process.pid == own_pid else process_name(process)
        if name is None:
            continue
        try:
            times = process.cpu_times()
        except Exception:
            continue
        result[process.pid] = (name, times.user + times.system)
    return result


def cpu_between(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds per process name between two snapshots (processes present in both)."""
    used: dict[str, float] = defaultdict(float)
    for pid, (name, seconds) in after.items():
        if pid in before:
            used[name] += seconds - before[pid][1]
    return dict(used)


async def http_workload(base: str, model: str, prompts, output_lens) -> int:
    import httpx

    from benchmarks.ray_overhead import http_stream, run_streams
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        await run_streams(http_stream(client, model), prompts, output_lens)
    return sum(output_lens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--stock", action="store_true", help="plain ray.init instead of atom-ray's ensure_ray")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE set before the cluster starts")
    parser.add_argument("--settle-s", type=float, default=15.0, help="wait after the app is up before measuring")
    parser.add_argument("--idle-s", type=float, default=20.0)
    parser.add_argument("--load-runs", type=int, default=1, help="timed HTTP workload runs (0: idle only)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    for item in args.env:
        key, _, value = item.partition("=")
        os.environ[key] = value
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from atom_ray.cluster import ensure_ray
    from atom_ray.serving import wait_until_healthy
    from benchmarks.ray_overhead import workload
    from deployments.serve_app import build_app

    if args.stock:
        ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR")
    else:
        ensure_ray(join_running=False)
    deploy_start = time.perf_counter()
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    engine_args = {"max_model_len": 2048}
    serve.run(build_app({"model": args.model, "engine_args": engine_args}), name="bench", route_prefix="/",
              blocking=False)
    base = f"http://127.0.0.1:{args.port}"
    wait_until_healthy(f"{base}/health", 600)
    deploy_s = time.perf_counter() - deploy_start
    prompts, output_lens = workload(tokenizer=None)  # the prompts are words; the tokenizer is not used
    asyncio.run(http_workload(base, args.model, prompts, output_lens))  # warm-up: every batch shape once
    time.sleep(args.settle_s)

    own = os.getpid()
    results = {"environment": environment_record(), "stock": args.stock, "env": args.env, "deploy_s": deploy_s}
    before = snapshot(own)
    time.sleep(args.idle_s)
    idle = cpu_between(before, snapshot(own))
    results["idle_cpu_percent"] = {name: 100 * s / args.idle_s for name, s in idle.items()}

    load_runs = []
    for _ in range(args.load_runs):
        before, start = snapshot(own), time.perf_counter()
        tokens = asyncio.run(http_workload(base, args.model, prompts, output_lens))
        seconds = time.perf_counter() - start
        used = cpu_between(before, snapshot(own))
        load_runs.append({"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens,
                          "cpu_ms_per_token": {name: 1000 * s / tokens for name, s in used.items()}})
    results["load_runs"] = load_runs
    serve.shutdown()
    ray.shutdown()

    names = sorted(results["idle_cpu_percent"], key=lambda n: -results["idle_cpu_percent"][n])
    rows = []
    for name in names:
        per_token = [f"{run['cpu_ms_per_token'].get(name, 0):.2f}" for run in load_runs]
        rows.append((name, f"{results['idle_cpu_percent'][name]:.2f}", " / ".join(per_token) or "-"))
    stack_idle = sum(v for n, v in results["idle_cpu_percent"].items() if n not in ("load_generator",))
    # The process that runs the model: the Coordinator (rank 0) now, a RankWorker in the earlier design.
    for run in load_runs:
        run["engine_process"] = max(run["cpu_ms_per_token"], key=run["cpu_ms_per_token"].get)
        run["stack_ms_per_token"] = sum(v for n, v in run["cpu_ms_per_token"].items()
                                        if n not in ("load_generator", run["engine_process"]))
    rows.append(("stack total (w/o load gen.)", f"{stack_idle:.2f}",
                 " / ".join(f"{r['stack_ms_per_token']:.2f}" for r in load_runs) + " (w/o the engine process)"))
    print_table(["process", "idle % of a core", "ms CPU per token under load"], rows)
    print(f"serve.start + serve.run until /health answers: {deploy_s:.1f} s")
    for run in load_runs:
        print(f"load run: {run['tok_s']:.1f} tok/s over {run['seconds']:.1f} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

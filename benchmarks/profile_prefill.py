"""Where a step with prompt tokens spends its time on one GPU: the host's launch of the step against the
device's work, the host functions that take the launch time (cProfile), and from a CPU + CUDA trace the
kernel launches per step, the host time spent in launch and synchronising calls, and the device's busy time.
Issue 26's offline runs showed such steps taking ~100 ms of device time per step with the host's launch as
long as the step, which TP=2 did not shorten: this says whether the host (Python, launch calls) or the GPU
(kernels) bounds them. Such steps replay piecewise graphs now (engine/runner/prompt_graphs.py);
`--prompt-graphs off` measures them as they were.

    python -m benchmarks.profile_prefill [--model benchmarks/configs/qwen3-30b-a3b] [--tokens 8192] [--out p.json]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.common import environment_record, print_table

LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync", "cudaHostAlloc", "cudaMalloc", "cudaFree")


def fill(engine, count: int, prompt_len: int, offset: int) -> None:
    from engine import SamplingParams
    for i in range(count):
        engine.add_request(f"p{offset + i}", [(1000 + offset + i * 7 + j) % 30000 + 10 for j in range(prompt_len)],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))


def timed_steps(engine, steps: int) -> dict:
    """Each step run alone (no run-ahead): the host's time in execute_async against the device's time."""
    runner = engine.executor.runner
    launch, device = [], []
    original = runner.execute_async

    def wrapped(scheduled):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        host = time.perf_counter()
        start.record()
        pending = original(scheduled)
        end.record()
        launch.append((time.perf_counter() - host) * 1e3)
        end.synchronize()
        device.append(start.elapsed_time(end))
        return pending
    runner.execute_async = wrapped
    try:
        for _ in range(steps):
            engine.step()
    finally:
        runner.execute_async = original
    return {"host_launch_ms": launch, "device_ms": device}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="benchmarks/configs/qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=8192, help="max_num_batched_tokens: prompt tokens per step")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompt-graphs", choices=("auto", "on", "off"), default="on",
                        help="cuda_graph_prompt_steps: 'off' runs the steps eagerly, as before prompt-step graphs")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from engine import LLM
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=256,
              max_num_batched_tokens=args.tokens, enable_prefix_caching=False, show_progress=False,
              cuda_graph_prompt_steps=args.prompt_graphs)
    engine = llm.engine
    engine._run_ahead = False  # one step at a time: the launch and the device time of each step apart
    per_step = args.tokens // args.prompt_len
    fill(engine, per_step * 3, args.prompt_len, 0)  # warm-up: kernels compiled for these shapes
    while engine.has_unfinished_requests():
        engine.step()

    fill(engine, per_step * args.steps, args.prompt_len, 1000)
    timing = timed_steps(engine, args.steps)
    while engine.has_unfinished_requests():
        engine.step()

    fill(engine, per_step * args.steps, args.prompt_len, 2000)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    profile.disable()
    while engine.has_unfinished_requests():
        engine.step()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
    host_functions = text.getvalue()

    fill(engine, per_step * args.steps, args.prompt_len, 3000)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as trace:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    calls = defaultdict(lambda: [0, 0.0])
    kernels = defaultdict(lambda: [0, 0.0])
    for event in trace.events():
        duration = (event.time_range.end - event.time_range.start) / 1e3  # ms
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name[:80]][0] += 1
            kernels[event.name[:80]][1] += duration
        elif event.name in LAUNCH_CALLS or event.name in SYNC_CALLS:
            calls[event.name][0] += 1
            calls[event.name][1] += duration
    steps = args.steps
    launches = sum(calls[name][0] for name in LAUNCH_CALLS) / steps
    result = {
        "environment": environment_record(), "model": args.model, "tokens_per_step": args.tokens,
        "prompt_step_graphs": llm.engine.executor.runner.prompt_graphs is not None,
        "timed": timing,
        "launches_per_step": launches,
        "runtime_calls_per_step": {name: {"count": c / steps, "ms": ms / steps} for name, (c, ms) in calls.items()},
        "kernel_ms_per_step": sum(ms for _, ms in kernels.values()) / steps,
        "kernels": sorted(({"name": n, "count": c / steps, "ms": ms / steps} for n, (c, ms) in kernels.items()),
                          key=lambda k: -k["ms"])[:30],
        "host_functions": host_functions,
    }
    median = sorted(timing["host_launch_ms"])[len(timing["host_launch_ms"]) // 2]
    mode = "prompt-step graphs" if result["prompt_step_graphs"] else "eager"
    print(f"{args.model}: {args.tokens} prompt tokens a step, {mode}: host launch {median:.1f} ms (median), device "
          f"{sorted(timing['device_ms'])[steps // 2]:.1f} ms; kernels {result['kernel_ms_per_step']:.1f} ms a step "
          f"in {sum(k[0] for k in kernels.values()) / steps:.0f} kernels, {launches:.0f} launch calls")
    print_table(["runtime call", "per step", "ms per step"],
                [(n, f"{v['count']:.0f}", f"{v['ms']:.2f}") for n, v in sorted(
                    result["runtime_calls_per_step"].items(), key=lambda item: -item[1]["ms"])])
    print_table(["kernel", "per step", "ms per step"],
                [(k["name"], f"{k['count']:.0f}", f"{k['ms']:.2f}") for k in result["kernels"][:15]])
    print(host_functions[:6000])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

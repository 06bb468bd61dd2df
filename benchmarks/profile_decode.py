"""Where a batch-1 decode step's time goes on the GPU: graph replay time against the bytes it must read,
and the per-kernel device time of the same step run eagerly (kernel names aggregated).

    python -m benchmarks.profile_decode [--model benchmarks/configs/llama-3.1-8b] [--out profile.json]
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.common import environment_record, print_table
from benchmarks.gpu_perf import DEFAULT_MODEL, model_facts


# The kernels of the decoder layers (and the LM head's skinny GEMM); everything else a step runs on the GPU
# (input copies, embedding, sampling, output copy) is listed by `steady_state`.
LAYER_KERNELS = ("_skinny_gemm_kernel", "_rms_norm_kernel", "_fused_decode_kernel")


def steady_state(engine, steps: int = 8) -> dict:
    """Decode steps as served (CUDA graphs, run-ahead): the time per step, and from a device trace the GPU's
    idle time between operations and the operations outside the layers' kernels."""
    import time
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        engine.step()
    torch.cuda.synchronize()
    step_us = (time.perf_counter() - start) / 50 * 1e6
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    ops = sorted(((e.time_range.start, e.time_range.end, e.name) for e in profiler.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda op: op[0])
    # Steps are told apart by the first RMSNorm after a non-layer operation (the first layer's input norm).
    idle, other, one_step, busy_until, step_index, previous_layer = 0.0, [], [], None, 0, True
    gaps_after: dict[str, float] = defaultdict(float)  # idle time by the operation it follows
    last_name = None
    for begin, end, name in ops:
        gap = max(0.0, begin - busy_until) if busy_until is not None else 0.0
        idle += gap
        if last_name is not None and gap > 0:
            gaps_after[f"{last_name[:40]} -> {name[:40]}"] += gap / steps
        last_name = name
        busy_until = end if busy_until is None else max(busy_until, end)
        is_layer = any(kernel in name for kernel in LAYER_KERNELS)
        if not is_layer:
            other.append(end - begin)
            if step_index == 2:
                one_step.append({"name": name[:80], "us": end - begin, "gap_before_us": gap})
        elif not previous_layer and "_rms_norm_kernel" in name:
            step_index += 1
        previous_layer = is_layer
    return {"step_us": step_us, "steps_traced": steps, "idle_us_per_step": idle / steps,
            "other_busy_us_per_step": sum(other) / steps, "other_ops_per_step": len(other) / steps,
            "one_step": one_step,
            "idle_us_per_step_by_boundary": dict(sorted(gaps_after.items(), key=lambda item: -item[1]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=256, help="prompt tokens of each sequence")
    parser.add_argument("--residual-dtype", default="auto", help="the engine's residual_dtype")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from engine import LLM, SamplingParams
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", max_model_len=4096,
              max_num_seqs=max(8, args.batch), residual_dtype=args.residual_dtype, show_progress=False)
    engine, runner = llm.engine, llm.engine.executor.runner
    facts = model_facts(engine.source.hf_config)
    for i in range(args.batch):
        engine.add_request(f"r{i}", list(range(1000 + i, 1000 + i + args.context)), SamplingParams(max_tokens=1000, ignore_eos=True))
    for _ in range(10 + args.batch * args.context // 2048):  # past every prefill chunk
        engine.step()

    graphs, size = runner.graphs, runner.graphs.padded_size(args.batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(50):
        graphs.graphs[size].replay()
    end.record()
    end.synchronize()
    replay_ms = start.elapsed_time(end) / 50
    body_bytes = facts["weight_bytes_per_step"] - engine.source.hf_config.vocab_size * engine.source.hf_config.hidden_size * 2
    body_bytes += args.batch * (args.context + 20) * facts["kv_bytes_per_token"]  # the KV cache read at this context

    steady = steady_state(engine)

    runner.graphs = None
    engine._run_ahead = False
    for _ in range(3):
        engine.step()
    kernels = defaultdict(lambda: [0, 0.0])
    steps = 10
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels[event.name[:90]]
            entry[0] += 1
            entry[1] += getattr(event, "device_time", None) or getattr(event, "cuda_time", 0.0)
    rows = sorted(((name, count / steps, total / steps) for name, (count, total) in kernels.items()),
                  key=lambda row: -row[2])
    busy_us = sum(row[2] for row in rows)
    print_table(["kernel", "launches/step", "us/step"], [(n, f"{c:.0f}", f"{t:.1f}") for n, c, t in rows[:25]])
    print(f"eager: {busy_us:.0f} us of kernels per step, {sum(r[1] for r in rows):.0f} launches")
    print(f"graph replay (layers only, weights + KV): {replay_ms * 1000:.0f} us for {body_bytes / 1e9:.2f} GB "
          f"= {body_bytes / replay_ms / 1e6:.0f} GB/s")
    print(f"steady state (graphs + run-ahead): {steady['step_us']:.0f} us per step, of which the GPU idles "
          f"{steady['idle_us_per_step']:.1f} us; outside the layers' kernels: "
          f"{steady['other_busy_us_per_step']:.1f} us busy in {steady['other_ops_per_step']:.0f} operations")
    print_table(["one step's other operations, in order", "us", "idle before, us"],
                [(op["name"], f"{op['us']:.1f}", f"{op['gap_before_us']:.1f}") for op in steady["one_step"]])
    print_table(["GPU idle per step after -> before", "us"],
                [(pair, f"{us:.1f}") for pair, us in list(steady["idle_us_per_step_by_boundary"].items())[:12]])
    if args.out:
        Path(args.out).write_text(json.dumps({
            "environment": environment_record(), "batch": args.batch, "replay_us": replay_ms * 1000,
            "steady_state": steady,
            "layer_bytes": body_bytes, "eager_kernel_us_per_step": busy_us,
            "kernels": [{"name": n, "launches_per_step": c, "us_per_step": t} for n, c, t in rows]}, indent=2))


if __name__ == "__main__":
    main()

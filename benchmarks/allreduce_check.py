"""What a tensor-parallel all-reduce costs a decode step: NCCL all-reduce latency on two GPUs.

Two processes, each seeing only its own GPU (as Ray rank actors do), join a group through
engine.parallel.init_parallel and time decode-sized all-reduces (batch x hidden, bf16) the way a decode
step issues them: 64 back-to-back all-reduces captured in one CUDA graph, microseconds per all-reduce.
The sums are checked against the exact result.

    python -m benchmarks.allreduce_check --out allreduce.json
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

HIDDEN = 4096
BATCHES = (1, 8, 64, 256)
GRAPH_CALLS = 64
REPLAYS = 20


def _rank(rank: int, world: int, port: int, queue) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    import torch
    import torch.distributed as dist

    from engine.parallel import state
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    group = state.init_parallel(rank, world, f"tcp://127.0.0.1:{port}", device).device_group
    report = {"rank": rank, "sizes": []}
    try:
        for batch in BATCHES:
            x = torch.full((batch, HIDDEN), float(rank + 1), device=device, dtype=torch.bfloat16)
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                dist.all_reduce(x.clone(), group=group)  # warm NCCL up outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(graph):
                for _ in range(GRAPH_CALLS):
                    dist.all_reduce(x, group=group)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            x.fill_(float(rank + 1))
            graph.replay()  # one replay: 1+2 summed 64 times is 3 * 2**63, exact in bf16
            torch.cuda.synchronize()
            exact = bool((x == 3.0 * 2.0 ** (GRAPH_CALLS - 1)).all())
            start.record()
            for _ in range(REPLAYS):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            report["sizes"].append({"batch": batch, "bytes": x.numel() * x.element_size(), "exact": exact,
                                    "us_per_all_reduce": start.elapsed_time(end) * 1000 / (REPLAYS * GRAPH_CALLS)})
    except Exception as exc:  # reported, not raised: the parent prints it
        report["error"] = repr(exc)
    queue.put(report)
    state.destroy_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--port", type=int, default=29561)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    from benchmarks.common import environment_record, print_table
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, args.port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    reports = sorted((queue.get(timeout=300) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join(timeout=60)
    print_table(["batch", "bytes", "us per all-reduce (in a graph)", "exact"],
                [(e["batch"], e["bytes"], f"{e['us_per_all_reduce']:.1f}", e["exact"]) for e in reports[0]["sizes"]])
    for report in reports:
        if "error" in report:
            print(f"rank {report['rank']} error: {report['error']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"environment": environment_record(), "hidden": HIDDEN,
                                          "graph_calls": GRAPH_CALLS, "ranks": reports}, indent=2))


if __name__ == "__main__":
    main()

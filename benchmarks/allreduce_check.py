"""What a tensor-parallel all-reduce costs a decode step, on two GPUs: NCCL against the engine's own path
(`tensor_parallel_all_reduce`: the one-shot symmetric-memory kernel for small tensors where it could be
set up, NCCL otherwise).

Two processes that see both GPUs (as Ray rank actors do at TP > 1) join a group through
engine.parallel.init_parallel and time decode-sized all-reduces (batch x hidden, bf16) the way a decode
step issues them: 64 back-to-back all-reduces captured in one CUDA graph, microseconds per all-reduce.
The sums are checked against the exact result.

Then the fused all-reduce + residual add + RMSNorm (engine/parallel/fused_all_reduce_norm.py) against
today's pair (the engine's all-reduce, then the Triton fused_add_rms_norm) at hidden 4096, float32
partial sums, a bf16 weight and a float32 or bf16 residual: each checked on fresh random inputs against
the torch reference, and timed as 64 chained ops (the residual passed on, as between layers) in one graph.

    python -m benchmarks.allreduce_check --out allreduce.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

HIDDEN = 4096
BATCHES = (1, 8, 64, 256)
GRAPH_CALLS = 64
REPLAYS = 20
FUSED_ROWS = (1, 8, 64)
EPS = 1e-6


def _time_in_graph(reduce, x, rank: int) -> tuple[float, bool]:
    """Microseconds per all-reduce of GRAPH_CALLS chained reduces in one CUDA graph, and whether one
    replay gave the exact sum."""
    import torch
    initial = float(rank + 1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        reduce(x.clone())  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(GRAPH_CALLS):
            y = reduce(y)
    x.fill_(initial)
    graph.replay()  # 1+2 summed 64 times is 3 * 2**63, exact in bf16
    torch.cuda.synchronize()
    exact = bool((y == 3.0 * 2.0 ** (GRAPH_CALLS - 1)).all())
    return _us_per_op(graph), exact


def _us_per_op(graph) -> float:
    """Microseconds per op of a graph of GRAPH_CALLS ops, over REPLAYS replays."""
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (REPLAYS * GRAPH_CALLS)


def _time_chain(step, partial, residual) -> float:
    """Microseconds per op of GRAPH_CALLS chained (all-reduce, residual add, RMSNorm) ops in one CUDA graph,
    each taking the residual the one before it returned."""
    import torch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(partial.clone(), residual)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chained = residual
        for _ in range(GRAPH_CALLS):
            _, chained = step(partial, chained)
    graph.replay()
    torch.cuda.synchronize()
    return _us_per_op(graph)


def _fused_entries(rank: int, world: int, parallel, device) -> list[dict]:
    """The fused op against the pair at each row count and residual dtype: numerics and time."""
    import torch
    import torch.distributed as dist

    from engine.kernels.torch import ops as reference
    from engine.kernels.triton import ops as triton_ops
    from engine.parallel import state
    from engine.parallel.fused_all_reduce_norm import AllReduceAddNorm
    fused = AllReduceAddNorm.create(parallel.device_group, device, HIDDEN, max_rows=max(FUSED_ROWS))
    if fused is None:
        return []

    def pair(partial, residual, weight):
        return triton_ops.fused_add_rms_norm(state.tensor_parallel_all_reduce(partial), residual, weight, EPS)
    entries = []
    for rows in FUSED_ROWS:
        for residual_dtype in (torch.float32, torch.bfloat16):
            shared = torch.Generator(device).manual_seed(rows)  # the same residual and weight on every rank
            residual = torch.randn(rows, HIDDEN, device=device, generator=shared).to(residual_dtype)
            weight = (1 + 0.1 * torch.randn(HIDDEN, device=device, generator=shared)).to(torch.bfloat16)
            own = torch.Generator(device).manual_seed(1000 * rows + rank)
            partial = torch.randn(rows, HIDDEN, device=device, generator=own)
            partials = [torch.empty_like(partial) for _ in range(world)]
            dist.all_gather(partials, partial, group=parallel.device_group)
            total = partials[0]
            for p in partials[1:]:
                total = total + p
            expected_normed, expected_residual = reference.fused_add_rms_norm(total, residual, weight, EPS)
            normed, new_residual = fused(partial, residual, weight, EPS)
            pair_normed, pair_residual = pair(partial.clone(), residual, weight)
            gathered = [torch.empty_like(normed) for _ in range(world)]
            dist.all_gather(gathered, normed, group=parallel.device_group)
            entry = {
                "rows": rows, "residual_dtype": str(residual_dtype).removeprefix("torch."),
                "residual_exact": bool(torch.equal(new_residual, expected_residual)),
                "normed_max_abs_error": float((normed.float() - expected_normed.float()).abs().max()),
                "pair_normed_max_abs_error": float((pair_normed.float() - expected_normed.float()).abs().max()),
                "same_bits_as_pair": torch.equal(normed, pair_normed) and torch.equal(new_residual, pair_residual),
                "ranks_agree": all(torch.equal(g, gathered[0]) for g in gathered),
            }
            entry["pair_us"] = _time_chain(lambda p, r: pair(p, r, weight), partial, residual)
            entry["fused_us"] = _time_chain(lambda p, r: fused(p, r, weight, EPS), partial, residual)
            entry["timed_out"] = bool(fused.error_flag.item())
            entries.append(entry)
    return entries


def _rank(rank: int, world: int, port: int, queue) -> None:
    report = {"rank": rank, "sizes": []}
    try:
        import torch
        import torch.distributed as dist

        from engine.parallel import state
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        parallel = state.init_parallel(rank, world, f"tcp://127.0.0.1:{port}", device)
        report["symmetric_memory"] = parallel.small_all_reduce is not None

        def nccl(x):
            dist.all_reduce(x, group=parallel.device_group)
            return x
        for batch in BATCHES:
            x = torch.full((batch, HIDDEN), float(rank + 1), device=device, dtype=torch.bfloat16)
            entry = {"batch": batch, "bytes": x.numel() * x.element_size()}
            entry["nccl_us"], entry["nccl_exact"] = _time_in_graph(nccl, x, rank)
            entry["engine_us"], entry["engine_exact"] = _time_in_graph(state.tensor_parallel_all_reduce, x, rank)
            report["sizes"].append(entry)
        report["fused"] = _fused_entries(rank, world, parallel, device)
        state.destroy_parallel()
    except Exception as exc:  # reported, not raised: the parent prints it
        report["error"] = repr(exc)
    queue.put(report)


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
        if p.is_alive():
            p.kill()
    print(f"engine path uses symmetric memory: {reports[0].get('symmetric_memory')}")
    print_table(["batch", "bytes", "NCCL us per all-reduce (in a graph)", "engine path us", "exact (NCCL / engine)"],
                [(e["batch"], e["bytes"], f"{e['nccl_us']:.1f}", f"{e['engine_us']:.1f}",
                  f"{e['nccl_exact']} / {e['engine_exact']}") for e in reports[0]["sizes"]])
    if reports[0].get("fused"):
        print_table(["rows", "residual", "pair us (all-reduce + norm)", "fused us", "residual exact",
                     "normed max err (fused / pair)", "same bits as pair", "ranks agree", "timed out"],
                    [(e["rows"], e["residual_dtype"], f"{e['pair_us']:.1f}", f"{e['fused_us']:.1f}",
                      e["residual_exact"], f"{e['normed_max_abs_error']:.2e} / {e['pair_normed_max_abs_error']:.2e}",
                      e["same_bits_as_pair"], e["ranks_agree"], e["timed_out"]) for e in reports[0]["fused"]])
    else:
        print("fused all-reduce + RMSNorm unavailable (see the ranks' log)")
    for report in reports:
        if "error" in report:
            print(f"rank {report['rank']} error: {report['error']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"environment": environment_record(), "hidden": HIDDEN,
                                          "graph_calls": GRAPH_CALLS, "ranks": reports}, indent=2))


if __name__ == "__main__":
    main()

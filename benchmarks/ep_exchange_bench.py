"""The expert-parallel exchange's forms on the GPUs of one host (one process per GPU, NCCL): dispatch +
combine of one MoE layer's tokens, without the experts, at decode and prefill sizes, after checking that
every form returns the same sums.

Forms: the all-gather form over one-shot symmetric-memory all-reduces (where the step fits), the same form
over NCCL's all-gather / reduce-scatter, and the padded all-to-all. Routing is a random top-k over E experts;
the timed calls are replayed from a CUDA graph (as decode runs) or eagerly (as prefill runs), median of 20.
This decides engine.parallel.all_to_all's PREFILL_FORM and DECODE_ROWS.

    python -m benchmarks.ep_exchange_bench --out exchange.json [--tokens 1,8,64,256,1024,4096,8192]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path


def _worker(rank: int, world: int, init_file: str, args, out: str) -> None:
    import torch
    import torch.distributed as dist

    from engine.parallel.all_to_all import ExpertPlacement, GatherScatterExchange, PaddedAllToAll
    from engine.parallel.symmetric_all_reduce import SymmetricAllReduce
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    small = SymmetricAllReduce.create(dist.group.WORLD, device)
    base, extra = divmod(args.experts, world)
    placement = ExpertPlacement(tuple((r * base + min(r, extra), base + (r < extra)) for r in range(world)), rank)
    forms = {"allgather-nccl": GatherScatterExchange(dist.group.WORLD, placement, False),
             "padded-all-to-all": PaddedAllToAll(dist.group.WORLD, placement, False, device)}
    if small is not None:
        forms["allgather-one-shot"] = GatherScatterExchange(dist.group.WORLD, placement, False, small)
    results = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        generator = torch.Generator(device=device).manual_seed(rank * 1000 + tokens)
        hidden = torch.randn(tokens, args.hidden, device=device, generator=generator).to(torch.bfloat16)
        ids = torch.rand(tokens, args.experts, device=device, generator=generator).topk(args.top_k)[1].int()
        weights = torch.rand(tokens, args.top_k, device=device, generator=generator)
        row = {"tokens_per_rank": tokens}
        sums = {}
        for name, form in forms.items():
            if name == "allgather-one-shot" and not form._one_shot(tokens, hidden, args.top_k):
                continue

            def layer():
                sent = form.dispatch(hidden, weights, ids)
                # stand-in for the experts: each received row times its local weights' sum
                return form.combine((sent.hidden.float() * sent.weights.sum(1, keepdim=True)).to(hidden.dtype),
                                    sent.handle)
            sums[name] = layer().float()
            graphed = tokens <= 512
            if graphed:
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(8):
                        layer()
                run, per_run = graph.replay, 8
            else:
                run, per_run = layer, 1
            times = []
            for _ in range(20):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                dist.barrier()
                start.record()
                run()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1000 / per_run)
            row[name + "_us"] = statistics.median(times)
            row[name + "_graphed"] = graphed
        reference = sums["allgather-nccl"]
        row["forms_agree"] = all(float((s - reference).abs().max()) <= 2e-2 * float(reference.abs().max())
                                 for s in sums.values())
        results.append(row)
    if rank == 0:
        Path(out).write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,8,64,256,1024,4096,8192")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    from benchmarks.common import environment_record, print_table
    scratch = tempfile.mkdtemp(prefix="ep-exchange-")
    partial = os.path.join(scratch, "rank0.json")
    mp.spawn(_worker, args=(args.gpus, os.path.join(scratch, "rendezvous"), args, partial), nprocs=args.gpus)
    rows = json.loads(Path(partial).read_text())
    forms = ("allgather-one-shot", "allgather-nccl", "padded-all-to-all")
    print_table(["tokens / rank", *[f"{f} us" for f in forms], "forms agree"],
                [(r["tokens_per_rank"], *[f"{r[f + '_us']:.1f}" if f + "_us" in r else "-" for f in forms],
                  r["forms_agree"]) for r in rows])
    Path(args.out).write_text(json.dumps({"environment": environment_record(), "args": vars(args),
                                          "results": rows}, indent=2))


if __name__ == "__main__":
    main()

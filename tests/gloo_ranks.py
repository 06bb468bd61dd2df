"""Run a worker in two processes joined by a gloo group, and read back what each saved."""
from __future__ import annotations

import torch
import torch.multiprocessing as mp


def run_two_ranks(worker, root) -> list[dict]:
    """`worker(rank, init_method, out_dir)` in two processes; each saves its results to out_dir/rank<r>.pt."""
    mp.spawn(worker, args=(f"file://{root}/rendezvous", str(root)), nprocs=2, join=True)
    return [torch.load(root / f"rank{rank}.pt", weights_only=False) for rank in range(2)]

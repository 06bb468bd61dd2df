"""The host work of one decode step's inputs, without a model: `prepare_host_inputs` (ids, positions, slot
mappings, block tables) and `sampling_batch` (the sampler's per-row parameters) for a batch of decoding
requests, median of repeated calls. Every GPU step of a large batch pays this on the host before its launch
(and a TP peer again), so it is part of what leaves the device idle between steps (docs/BENCHMARKS.md).

    python -m benchmarks.host_inputs_bench [--batch 256] [--context 900] [--out host_inputs.json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from benchmarks.common import environment_record, print_table


def decoding_requests(batch: int, context: int, block_size: int = 16) -> dict:
    from engine.runner.input_batch import RunnerRequest
    from engine.sampling_params import SamplingParams
    rng = random.Random(0)
    requests = {}
    for i in range(batch):
        tokens = [rng.randrange(1000, 30000) for _ in range(context)]
        blocks = rng.sample(range(50_000), -(-(context + 64) // block_size))
        requests[f"r{i}"] = RunnerRequest(f"r{i}", tokens, context // 2,
                                          SamplingParams(temperature=0.7, top_p=0.9, max_tokens=512), blocks,
                                          context - 1)
    return requests


def measure(batch: int, context: int, repeats: int = 50) -> dict:
    from engine.runner.input_batch import prepare_host_inputs, sampling_batch
    requests = decoding_requests(batch, context)
    counts = dict.fromkeys(requests, 1)
    prepare, sampling = [], []
    for _ in range(repeats):
        for request in requests.values():
            request.num_computed_tokens = len(request.token_ids) - 1
        started = time.perf_counter()
        host = prepare_host_inputs(requests, counts, 16)
        prepare.append(time.perf_counter() - started)
        started = time.perf_counter()
        sampling_batch(host.sampling_requests, host.sampling_rows, frozenset([2]))
        sampling.append(time.perf_counter() - started)
    return {"batch": batch, "context": context, "prepare_host_inputs_ms": 1e3 * statistics.median(prepare),
            "sampling_batch_ms": 1e3 * statistics.median(sampling)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=900)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = measure(args.batch, args.context)
    print_table(["decoding requests", "context", "prepare_host_inputs ms", "sampling_batch ms"],
                [(result["batch"], result["context"], f"{result['prepare_host_inputs_ms']:.2f}",
                  f"{result['sampling_batch_ms']:.2f}")])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": environment_record(), "result": result}, f, indent=2)


if __name__ == "__main__":
    main()

"""Serving benchmark: the OpenAI HTTP server (Ray Serve) under a concurrency sweep, against the offline
engine at the same concurrency, in one run.

Each level c sends requests (prompts uniform in 128..1024 token ids, outputs uniform in 64..512,
ignore_eos, streaming) with c in flight at a time, and reports TTFT / TPOT / end-to-end percentiles and
output tokens/s; the offline engine with max_num_seqs=64 runs the c=64 requests as the baseline. The
model gets a synthetic word-level tokenizer (one word per id), so streaming carries real text.

    python -m benchmarks.serving [--model benchmarks/configs/llama-3.1-8b] --out serving.json [--plot serving.png]
    python -m benchmarks.serving --model benchmarks/configs/qwen3-30b-a3b --levels 64 \
        --engine-args '{"data_parallel_size": 2, "enable_expert_parallel": true}' --out serving_dp2.json

A layout of several GPUs (`--engine-args` with tensor_parallel_size or data_parallel_size) takes its offline
baseline from the same layout through `atom_ray.start`, the serving path's engine without HTTP.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import environment_record, print_table

LEVELS = {1: 8, 16: 64, 64: 256, 256: 512}  # concurrency -> number of requests
ENGINE_ARGS = {"load_format": "dummy", "dtype": "bfloat16", "max_model_len": 2048, "max_num_seqs": 256,
               "max_num_batched_tokens": 8192}


def with_synthetic_tokenizer(config_folder: str) -> str:
    """A copy of the config folder with a word-level tokenizer covering the whole vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, PreTrainedTokenizerFast
    vocab_size = AutoConfig.from_pretrained(config_folder).vocab_size
    folder = Path(tempfile.mkdtemp(prefix="bench-model-"))
    shutil.copy(Path(config_folder) / "config.json", folder / "config.json")
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0").save_pretrained(str(folder))
    return str(folder)


def requests_for(count: int, seed: int, vocab_size: int):
    rng = random.Random(seed)
    return [([rng.randrange(1000, vocab_size - 1000) for _ in range(rng.randint(128, 1024))], rng.randint(64, 512))
            for _ in range(count)]


def percentiles(values: list[float]) -> dict:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"mean": statistics.mean(ordered), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


async def sweep_level(base_url: str, model: str, requests, concurrency: int, api_key: str | None = None) -> dict:
    """`requests` with `concurrency` in flight at a time, streamed (`api_key`: sent as the Bearer token)."""
    import httpx
    limit = asyncio.Semaphore(concurrency)
    ttfts, tpots, e2es, produced = [], [], [], []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with httpx.AsyncClient(base_url=base_url, timeout=1800, headers=headers,
                                 limits=httpx.Limits(max_connections=concurrency + 8)) as client:
        async def one(prompt, max_tokens):
            async with limit:
                body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                start = time.perf_counter()
                first, tokens = None, 0
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("choices") and first is None:
                            first = time.perf_counter() - start
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                end = time.perf_counter() - start
                ttfts.append(first)
                e2es.append(end)
                tpots.append((end - first) / max(tokens - 1, 1))
                produced.append(tokens)

        start = time.perf_counter()
        await asyncio.gather(*(one(p, n) for p, n in requests))
        seconds = time.perf_counter() - start
    assert sum(produced) == sum(n for _, n in requests), "the server returned fewer tokens than asked"
    return {"concurrency": concurrency, "num_requests": len(requests), "output_tokens": sum(produced),
            "seconds": seconds, "tok_s": sum(produced) / seconds, "ttft_s": percentiles(ttfts),
            "tpot_s": percentiles(tpots), "e2e_s": percentiles(e2es)}


def offline_throughput(model: str, requests, concurrency: int) -> float:
    import torch
    from engine import LLM, SamplingParams
    args = {**ENGINE_ARGS, "max_num_seqs": concurrency}
    several = args.get("tensor_parallel_size", 1) * args.get("data_parallel_size", 1) > 1
    if several:
        import ray

        import atom_ray
        ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR")
        llm = atom_ray.start(model, **args)
    else:
        llm = LLM(model, show_progress=False, **args)
    prompts = [p for p, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    try:
        llm.generate(prompts[:4], params[:4])
        if not several:
            llm.engine.scheduler.block_manager.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(prompts, params)  # returns once every token is on the host
        tok_s = sum(n for _, n in requests) / (time.perf_counter() - start)
    finally:
        llm.shutdown()
        if several:
            ray.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return tok_s


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    levels = results["levels"]
    xs = [level["concurrency"] for level in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(xs, [level["tok_s"] for level in levels], marker="o", label="HTTP (Serve)")
    if results.get("offline_c64_tok_s"):
        left.scatter([64], [results["offline_c64_tok_s"]], color="red", zorder=3, label="offline engine, c=64")
    left.set(xscale="log", xlabel="concurrent requests", ylabel="output tokens/s", title="Throughput")
    left.legend()
    for key, label in (("ttft_s", "TTFT p50"), ("tpot_s", "TPOT p50"), ("e2e_s", "end-to-end p50")):
        right.plot(xs, [level[key]["p50"] * 1000 for level in levels], marker="o", label=label)
    right.set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="ms", title="Latency")
    right.legend()
    fig.suptitle(f"{results['model']} on {results['environment'].get('device')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="benchmarks/configs/llama-3.1-8b")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--levels", type=int, nargs="*", default=list(LEVELS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--plot", default=None, help="draw throughput and latency against concurrency (PNG)")
    parser.add_argument("--from-json", default=None, help="only draw the plot of an earlier run's JSON")
    parser.add_argument("--engine-args", default="{}", help="JSON of engine arguments over the defaults "
                        "(e.g. '{\"data_parallel_size\": 2, \"enable_expert_parallel\": true}')")
    args = parser.parse_args()
    ENGINE_ARGS.update(json.loads(args.engine_args))
    if args.from_json:
        plot(json.loads(Path(args.from_json).read_text()), args.plot or "serving.png")
        return
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from transformers import AutoConfig
    model = with_synthetic_tokenizer(args.model)
    vocab_size = AutoConfig.from_pretrained(model).vocab_size
    workloads = {c: requests_for(LEVELS[c], seed=c, vocab_size=vocab_size) for c in args.levels}
    results = {"environment": environment_record(), "model": args.model, "engine_args": ENGINE_ARGS, "levels": []}
    if 64 in workloads:
        results["offline_c64_tok_s"] = offline_throughput(model, workloads[64], 64)

    import ray
    from ray import serve

    from atom_ray.cluster import ensure_ray
    from atom_ray.serving import wait_until_healthy
    from deployments.serve_app import build_app
    ensure_ray(join_running=False)  # the cluster `atom-ray serve` starts (HAProxy ingress where available)
    results["haproxy_ingress"] = os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1"
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(build_app({"model": model, "served_model_name": "bench", "engine_args": ENGINE_ARGS,
                         "max_pending_sequences": 4096}), name="bench", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{args.port}"
    wait_until_healthy(f"{base}/health", 900)
    asyncio.run(sweep_level(base, "bench", requests_for(4, 99, vocab_size), 4))  # warm-up
    for concurrency, requests in workloads.items():
        results["levels"].append(asyncio.run(sweep_level(base, "bench", requests, concurrency)))
    serve.shutdown()
    ray.shutdown()

    rows = []
    for level in results["levels"]:
        rows.append((level["concurrency"], f"{level['tok_s']:.0f}", f"{level['ttft_s']['p50'] * 1000:.0f}",
                     f"{level['ttft_s']['p99'] * 1000:.0f}", f"{level['tpot_s']['p50'] * 1000:.1f}",
                     f"{level['e2e_s']['p50']:.1f}"))
        if level["concurrency"] == 64 and results.get("offline_c64_tok_s"):
            results["c64_http_vs_offline"] = level["tok_s"] / results["offline_c64_tok_s"]
    print_table(["concurrency", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "E2E p50 s"], rows)
    if "c64_http_vs_offline" in results:
        print(f"c=64: HTTP {results['c64_http_vs_offline']:.3f}x the offline engine "
              f"({results['offline_c64_tok_s']:.0f} tok/s)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    if args.plot:
        try:
            plot(results, args.plot)
        except ImportError:
            print("matplotlib is not installed here: draw it elsewhere with --from-json OUT.json --plot OUT.png")


if __name__ == "__main__":
    main()

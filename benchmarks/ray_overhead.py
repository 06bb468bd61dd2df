"""What Ray and Serve cost over the bare engine, measured in one run on the same machine.

Three paths serve the same 16 concurrent requests (fixed prompts, fixed output lengths, `ignore_eos`):
the bare `engine.LLM.generate` in this process, `atom_ray.start(...).generate` (Coordinator + one
RankWorker actor, TP=1, the same contract), and HTTP streaming through the Serve deployment with the
OpenAI API. Reported: output tokens/s and each path's ratio to the bare engine, mean time to first token
at that load, and the time to first token of a single request on an idle engine (bare and Ray:
`generate` of one token; HTTP: the first streamed chunk), whose difference is what Ray and Serve add.

    python -m benchmarks.ray_overhead [--model smollm2-135m] [--out bench_out/ray_overhead.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from benchmarks.common import environment_record, print_table

NUM_REQUESTS = 16


def workload(tokenizer, seed: int = 0):
    rng = random.Random(seed)
    words = "the of and a to in is you that it he was for on are as with his they at be this".split()
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(40, 160))) for _ in range(NUM_REQUESTS)]
    output_lens = [rng.randint(48, 128) for _ in range(NUM_REQUESTS)]
    return prompts, output_lens


def params_for(n: int):
    from engine import SamplingParams
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


async def run_streams(stream_fn, prompts, output_lens) -> dict:
    """stream_fn(prompt, max_tokens) is an async iterator of token counts received so far."""
    start = time.perf_counter()
    ttfts, produced = [], []

    async def one(prompt, n):
        first = None
        count = 0
        async for count in stream_fn(prompt, n):
            if first is None and count > 0:
                first = time.perf_counter() - start
        ttfts.append(first)
        produced.append(count)

    await asyncio.gather(*(one(p, n) for p, n in zip(prompts, output_lens)))
    seconds = time.perf_counter() - start
    assert sum(produced) == sum(output_lens), (sum(produced), sum(output_lens))
    return {"tok_s": sum(produced) / seconds, "seconds": seconds, "mean_ttft_s": statistics.mean(ttfts)}


def offline_path(generate, prompts, output_lens) -> dict:
    """engine.LLM / EngineHandle: generate(prompts, params) -> outputs, with request metrics where given."""
    params = [params_for(n) for n in output_lens]
    generate(prompts[:2], params[:2])  # warm-up
    start = time.perf_counter()
    outputs = generate(prompts, params)
    seconds = time.perf_counter() - start
    assert sum(len(o.token_ids) for o in outputs) == sum(output_lens)
    result = {"tok_s": sum(output_lens) / seconds, "seconds": seconds}
    if outputs[0].metrics is not None and outputs[0].metrics.first_token_time is not None:
        result["mean_ttft_s"] = statistics.mean(o.metrics.first_token_time - o.metrics.arrival_time for o in outputs)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        generate([prompts[0]], [params_for(1)])
        times.append(time.perf_counter() - start)
    result["idle_ttft_s"] = statistics.median(times[1:])
    return result


def ray_stream(handle):
    async def stream(prompt, n):
        async for output in handle.stream(prompt, params_for(n)):
            yield len(output.token_ids)
    return stream


def http_stream(client, model: str):
    async def stream(prompt, n):
        body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        count = 0
        async with client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():  # a light client: it shares the CPU with the server
                if not line.startswith("data: {"):
                    continue
                if '"completion_tokens"' in line:  # the usage chunk, last
                    count = json.loads(line[6:])["usage"]["completion_tokens"]
                else:
                    count += 1  # one chunk per engine step and request carries one token here
                yield count
    return stream


async def measure_streams(stream_fn, prompts, output_lens) -> dict:
    """Warm-up, the concurrent workload, then the idle single-request TTFT, all in one event loop."""
    await run_streams(stream_fn, prompts[:2], [4, 4])
    result = await run_streams(stream_fn, prompts, output_lens)
    result["idle_ttft_s"] = await single_request_ttft(stream_fn, prompts[0])
    return result


async def measure_http(base_url: str, model: str, prompts, output_lens) -> dict:
    import httpx
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        return await measure_streams(http_stream(client, model), prompts, output_lens)


async def single_request_ttft(stream_fn, prompt: str, repeats: int = 7) -> float:
    """Median time to the first token of a one-token request on an idle engine (each stream is read to
    its end, so no step of an earlier request is still running when the next one arrives)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        first = None
        async for count in stream_fn(prompt, 1):
            if first is None and count > 0:
                first = time.perf_counter() - start
        times.append(first)
        await asyncio.sleep(0.2)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--out", default="bench_out/ray_overhead.json")
    args = parser.parse_args()

    import os
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    import atom_ray
    from atom_ray.serving import wait_until_healthy
    from deployments.serve_app import build_app
    from engine import LLM

    engine_args = {"max_model_len": 2048}
    results = {"environment": environment_record(), "model": args.model, "num_requests": NUM_REQUESTS}

    bare = LLM(args.model, show_progress=False, **engine_args)
    prompts, output_lens = workload(bare.get_tokenizer())
    results["bare"] = offline_path(bare.generate, prompts, output_lens)
    del bare

    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR")
    handle = atom_ray.start(args.model, **engine_args)
    results["ray"] = offline_path(handle.generate, prompts, output_lens)
    results["ray"]["mean_ttft_s"] = asyncio.run(measure_streams(ray_stream(handle), prompts, output_lens))["mean_ttft_s"]
    handle.shutdown()

    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(build_app({"model": args.model, "engine_args": engine_args}), name="bench", route_prefix="/",
              blocking=False)
    base = f"http://127.0.0.1:{args.port}"
    wait_until_healthy(f"{base}/health", 600)
    results["http"] = asyncio.run(measure_http(base, args.model, prompts, output_lens))
    serve.shutdown()
    ray.shutdown()

    bare_tput = results["bare"]["tok_s"]
    rows = []
    for path in ("bare", "ray", "http"):
        r = results[path]
        r["ratio_vs_bare"] = r["tok_s"] / bare_tput
        r["added_idle_ttft_ms"] = (r["idle_ttft_s"] - results["bare"]["idle_ttft_s"]) * 1000
        rows.append((path, f"{r['tok_s']:.1f}", f"{r['ratio_vs_bare']:.2f}x", f"{r.get('mean_ttft_s', 0) * 1000:.0f}",
                     f"{r['idle_ttft_s'] * 1000:.1f}", f"{r['added_idle_ttft_ms']:+.1f}"))
    print_table(["path", "output tok/s", "vs bare", "mean TTFT ms (16 conc.)", "idle TTFT ms", "added TTFT ms"],
                rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

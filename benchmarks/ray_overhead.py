"""What Ray and Serve cost over the bare engine, measured in one run on the same machine.

Three paths serve the same 16 concurrent requests (fixed prompts, fixed output lengths, `ignore_eos`):
the bare `engine.LLM.generate` in this process, `atom_ray.start(...).generate` (Coordinator + one
RankWorker actor, TP=1, the same contract), and HTTP streaming through the Serve deployment with the
OpenAI API, both on the local Ray cluster that atom-ray starts (`atom_ray.cluster.ensure_ray`). Every path
runs the workload once untimed first (on this CPU a first pass is ~15 % slower: new batch shapes), then
timed. Reported: output tokens/s and each path's ratio to the bare engine
(measured right before and after that path, to follow a drifting machine), the mean time to first token of the streamed paths at
that load, and the time to first token of a one-token request on an idle engine, alternating requests to
the bare engine and to the path so that both see the same machine; the difference of the medians is what
Ray and Serve add.

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
    """engine.LLM / EngineHandle: generate(prompts, params) -> outputs; output tokens/s."""
    params = [params_for(n) for n in output_lens]
    generate(prompts, params)  # warm-up: the workload once, so every batch shape has run before timing
    start = time.perf_counter()
    outputs = generate(prompts, params)
    seconds = time.perf_counter() - start
    assert sum(len(o.token_ids) for o in outputs) == sum(output_lens)
    return {"tok_s": sum(output_lens) / seconds, "seconds": seconds}


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


async def measure_streams(stream_fn, prompts, output_lens, bare_generate) -> dict:
    """Warm-up (the workload once, as for the bare engine), the concurrent workload, then idle TTFT
    alternating with the bare engine."""
    await run_streams(stream_fn, prompts, output_lens)
    result = await run_streams(stream_fn, prompts, output_lens)
    result.update(await interleaved_idle_ttft(stream_fn, bare_generate, prompts[0]))
    return result


async def measure_http(base_url: str, model: str, prompts, output_lens, bare_generate) -> dict:
    import httpx
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        return await measure_streams(http_stream(client, model), prompts, output_lens, bare_generate)


async def interleaved_idle_ttft(stream_fn, bare_generate, prompt: str, rounds: int = 9) -> dict:
    """Median time to the first token of a one-token request on an idle engine, through the path and
    through the bare engine in turn (each stream read to its end, so no step of an earlier request is
    still running when the next one arrives); the first round is a warm-up."""
    bare, path = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        bare_generate([prompt], [params_for(1)])
        bare.append(time.perf_counter() - start)
        await asyncio.sleep(0.1)
        start, first = time.perf_counter(), None
        async for count in stream_fn(prompt, 1):
            if first is None and count > 0:
                first = time.perf_counter() - start
        path.append(first)
        await asyncio.sleep(0.1)
    bare_s, path_s = statistics.median(bare[1:]), statistics.median(path[1:])
    return {"idle_ttft_s": path_s, "bare_idle_ttft_s": bare_s, "added_idle_ttft_ms": (path_s - bare_s) * 1000}


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
    from atom_ray.cluster import ensure_ray
    from atom_ray.serving import wait_until_healthy
    from deployments.serve_app import build_app
    from engine import LLM

    engine_args = {"max_model_len": 2048}
    results = {"environment": environment_record(), "model": args.model, "num_requests": NUM_REQUESTS}

    bare = LLM(args.model, show_progress=False, **engine_args)
    prompts, output_lens = workload(bare.get_tokenizer())
    bare_runs = [offline_path(bare.generate, prompts, output_lens)["tok_s"]]

    ensure_ray(join_running=False)  # the local cluster atom_ray.start and `atom-ray serve` would start
    handle = atom_ray.start(args.model, **engine_args)
    results["ray"] = offline_path(handle.generate, prompts, output_lens)
    results["ray"].update({k: v for k, v in asyncio.run(measure_streams(
        ray_stream(handle), prompts, output_lens, bare.generate)).items() if k not in ("tok_s", "seconds")})
    handle.shutdown()
    bare_runs.append(offline_path(bare.generate, prompts, output_lens)["tok_s"])

    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(build_app({"model": args.model, "engine_args": engine_args}), name="bench", route_prefix="/",
              blocking=False)
    base = f"http://127.0.0.1:{args.port}"
    wait_until_healthy(f"{base}/health", 600)
    results["http"] = asyncio.run(measure_http(base, args.model, prompts, output_lens, bare.generate))
    serve.shutdown()
    ray.shutdown()
    bare_runs.append(offline_path(bare.generate, prompts, output_lens)["tok_s"])

    results["bare"] = {"tok_s_runs": bare_runs}
    results["ray"]["bare_tok_s"] = statistics.mean(bare_runs[:2])
    results["http"]["bare_tok_s"] = statistics.mean(bare_runs[1:])
    rows = [("bare", " / ".join(f"{r:.1f}" for r in bare_runs), "1.00x", "-", "-", "-")]
    for path in ("ray", "http"):
        r = results[path]
        r["ratio_vs_bare"] = r["tok_s"] / r["bare_tok_s"]
        rows.append((path, f"{r['tok_s']:.1f}", f"{r['ratio_vs_bare']:.2f}x", f"{r['mean_ttft_s'] * 1000:.0f}",
                     f"{r['idle_ttft_s'] * 1000:.1f} (bare {r['bare_idle_ttft_s'] * 1000:.1f})",
                     f"{r['added_idle_ttft_ms']:+.1f}"))
    print_table(["path", "output tok/s", "vs bare (before/after)", "mean TTFT ms (16 conc.)", "idle TTFT ms",
                 "added TTFT ms"], rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

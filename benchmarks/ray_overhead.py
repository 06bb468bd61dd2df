"""What Ray and Serve cost over the bare engine, measured in one run on the same machine.

Three paths serve the same 16 concurrent requests (fixed prompts, fixed output lengths, `ignore_eos`):
the bare `engine.LLM.generate` in this process, `atom_ray.start(...).generate` (the Coordinator actor
running TP rank 0, the same contract), and HTTP streaming through the Serve deployment with the OpenAI API,
both on the local Ray cluster that atom-ray starts (`atom_ray.cluster.ensure_ray`, with Serve's HAProxy
ingress where available). Every engine runs the workload once untimed first (on this CPU a first pass is
~15 % slower: new batch shapes). A shared 2-core VM drifts by 20 % and more within minutes, so each path's
timed runs alternate with bare runs (bare, path, bare, path, ..., bare) and each path run is compared with
the mean of the bare runs on either side; the median of those ratios is reported. Also reported: the mean
time to first token of the streamed paths at that load, and the time to first token of a one-token request
on an idle engine, alternating requests to the bare engine and to the path so that both see the same
machine; the median of each path request's difference to the bare requests on either side is what Ray and
Serve add.

    python -m benchmarks.ray_overhead [--model smollm2-135m] [--rounds 3] [--ttft-rounds 15]
                                      [--out bench_out/ray_overhead.json]
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


def timed_generate(generate, prompts, params) -> float:
    """engine.LLM / EngineHandle: output tokens/s of generate(prompts, params) -> outputs."""
    start = time.perf_counter()
    outputs = generate(prompts, params)
    seconds = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outputs)
    assert produced == sum(p.max_tokens for p in params)
    return produced / seconds


def interleaved(bare_run, path_run, rounds: int) -> dict:
    """bare, path, bare, ..., path, bare (after one untimed run of the path): each path run against the mean of
    the bare runs on either side, and the median of those ratios."""
    path_run()
    bare_runs, path_runs = [bare_run()], []
    for _ in range(rounds):
        path_runs.append(path_run())
        bare_runs.append(bare_run())
    ratios = [path / ((before + after) / 2) for path, before, after in zip(path_runs, bare_runs, bare_runs[1:])]
    return {"tok_s": statistics.median(path_runs), "tok_s_runs": path_runs, "bare_tok_s_runs": bare_runs,
            "ratios": ratios, "ratio_vs_bare": statistics.median(ratios)}


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


def http_path(base_url: str, model: str):
    """Runs of HTTP streaming workloads, each with a fresh light client."""
    import httpx

    def with_client(work):
        async def run():
            async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
                return await work(http_stream(client, model))
        return asyncio.run(run())
    return with_client


async def interleaved_idle_ttft(stream_fn, bare_generate, prompt: str, rounds: int) -> dict:
    """Time to the first token of a one-token request on an idle engine, through the path and through the
    bare engine in turn (bare, path, bare, ..., path, bare; each stream read to its end, so no step of an
    earlier request is still running when the next one arrives), after one warm-up request each. Each path
    request is compared with the mean of the bare requests on either side; the median of those differences
    is what Ray and Serve add (the medians of the two series are reported too)."""
    def bare_once() -> float:
        start = time.perf_counter()
        bare_generate([prompt], [params_for(1)])
        return time.perf_counter() - start

    async def path_once() -> float:
        start, first = time.perf_counter(), None
        async for count in stream_fn(prompt, 1):
            if first is None and count > 0:
                first = time.perf_counter() - start
        return first

    bare_once()
    await path_once()
    bare, path = [bare_once()], []
    for _ in range(rounds):
        await asyncio.sleep(0.1)
        path.append(await path_once())
        await asyncio.sleep(0.1)
        bare.append(bare_once())
    added = [p - (before + after) / 2 for p, before, after in zip(path, bare, bare[1:])]
    return {"idle_ttft_s": statistics.median(path), "bare_idle_ttft_s": statistics.median(bare),
            "idle_ttft_s_runs": path, "bare_idle_ttft_s_runs": bare,
            "added_idle_ttft_ms": statistics.median(added) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of each path, each between two bare runs")
    parser.add_argument("--ttft-rounds", type=int, default=15, help="one-token requests through each path for idle TTFT")
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
    results = {"environment": environment_record(), "model": args.model, "num_requests": NUM_REQUESTS,
               "rounds": args.rounds}

    bare = LLM(args.model, show_progress=False, **engine_args)
    prompts, output_lens = workload(bare.get_tokenizer())
    params = [params_for(n) for n in output_lens]
    bare.generate(prompts, params)  # warm-up: every batch shape has run before timing

    def bare_run():
        return timed_generate(bare.generate, prompts, params)

    ensure_ray(join_running=False)  # the local cluster atom_ray.start and `atom-ray serve` would start
    results["haproxy_ingress"] = os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1"
    handle = atom_ray.start(args.model, **engine_args)
    results["ray"] = interleaved(bare_run, lambda: timed_generate(handle.generate, prompts, params), args.rounds)
    results["ray"].update(asyncio.run(run_streams(ray_stream(handle), prompts, output_lens)))
    results["ray"].update(asyncio.run(interleaved_idle_ttft(ray_stream(handle), bare.generate, prompts[0], args.ttft_rounds)))
    handle.shutdown()

    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(build_app({"model": args.model, "engine_args": engine_args}), name="bench", route_prefix="/",
              blocking=False)
    base = f"http://127.0.0.1:{args.port}"
    wait_until_healthy(f"{base}/health", 600)
    http = http_path(base, args.model)
    streamed = {}

    def http_run():
        streamed.update(http(lambda stream: run_streams(stream, prompts, output_lens)))
        return streamed["tok_s"]
    results["http"] = interleaved(bare_run, http_run, args.rounds)
    results["http"]["mean_ttft_s"] = streamed["mean_ttft_s"]
    results["http"].update(http(lambda stream: interleaved_idle_ttft(stream, bare.generate, prompts[0], args.ttft_rounds)))
    serve.shutdown()
    ray.shutdown()

    rows = []
    for path in ("ray", "http"):
        r = results[path]
        rows.append((path, " / ".join(f"{t:.1f}" for t in r["tok_s_runs"]),
                     " / ".join(f"{t:.1f}" for t in r["bare_tok_s_runs"]),
                     " / ".join(f"{x:.2f}" for x in r["ratios"]), f"{r['ratio_vs_bare']:.2f}x",
                     f"{r['mean_ttft_s'] * 1000:.0f}",
                     f"{r['idle_ttft_s'] * 1000:.1f} (bare {r['bare_idle_ttft_s'] * 1000:.1f})",
                     f"{r['added_idle_ttft_ms']:+.1f}"))
    print_table(["path", "output tok/s", "bare tok/s (around them)", "ratios", "median ratio",
                 "mean TTFT ms (16 conc.)", "idle TTFT ms (medians)", "added TTFT ms (paired)"], rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

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
Serve add. That difference is also reported less each request's own prefill time as the engine measured it
(first scheduling to first token; through HTTP read from the server's /metrics around the request): the
prefill compute is the same work on every path and, on a busy CPU, varies by more than the path costs.

    python -m benchmarks.ray_overhead [--model smollm2-135m] [--rounds 3] [--ttft-rounds 15] [--ttft-only]
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


def with_http_client(base_url: str, work):
    """asyncio.run of work(client) with a fresh light HTTP client."""
    import httpx

    async def run():
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
            return await work(client)
    return asyncio.run(run())


def http_idle_ttft(base_url: str, model: str, prompt: str, bare_once, rounds: int) -> dict:
    return with_http_client(base_url, lambda client: interleaved_idle_ttft(http_one_token(client, model, prompt),
                                                                           bare_once, rounds))


def http_path(base_url: str, model: str):
    """Runs of HTTP streaming workloads, each with a fresh light client."""
    return lambda work: with_http_client(base_url, lambda client: work(http_stream(client, model)))


def prefill_seconds(metrics) -> float:
    """The engine's own part of a time to first token that the path cannot change: first scheduling to first
    token (a prefill step's compute, the noisiest term on a shared CPU)."""
    return metrics.first_token_time - metrics.first_scheduled_time


def bare_one_token(bare_generate, prompt: str):
    def once() -> tuple[float, float]:
        start = time.perf_counter()
        output, = bare_generate([prompt], [params_for(1)])
        return time.perf_counter() - start, prefill_seconds(output.metrics)
    return once


def ray_one_token(handle, prompt: str):
    async def once() -> tuple[float, float]:
        start, first, metrics = time.perf_counter(), None, None
        async for output in handle.stream(prompt, params_for(1)):
            if first is None and output.token_ids:
                first = time.perf_counter() - start
            metrics = output.metrics or metrics
        return first, prefill_seconds(metrics)
    return once


PREFILL_SUM = "atom_ray:request_prefill_time_seconds_sum"


async def scrape_sum(client, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    text = (await client.get("/metrics")).text
    return next(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                if sample.name == name)


def http_one_token(client, model: str, prompt: str):
    """The server's prefill time of the request is the change of its histogram's sum around it (requests
    here run one at a time)."""
    stream_fn = http_stream(client, model)

    async def once() -> tuple[float, float]:
        before = await scrape_sum(client, PREFILL_SUM)
        start, first = time.perf_counter(), None
        async for count in stream_fn(prompt, 1):
            if first is None and count > 0:
                first = time.perf_counter() - start
        return first, await scrape_sum(client, PREFILL_SUM) - before
    return once


async def interleaved_idle_ttft(path_once, bare_once, rounds: int) -> dict:
    """Time to the first token of a one-token request on an idle engine, through the path and through the
    bare engine in turn (bare, path, bare, ..., path, bare; each stream read to its end, so no step of an
    earlier request is still running when the next one arrives), after one warm-up request each. Each path
    request is compared with the mean of the bare requests on either side; the median of those differences
    is what Ray and Serve add (the medians of the two series are reported too). Each request also reports
    the engine's prefill time (first scheduling to first token, from the engine's own metrics): the same
    work on both paths, and the term that varies most on a busy machine. The second figure, paired the same
    way, compares TTFT minus that prefill time: the time spent outside the engine's prefill (HTTP, Ray,
    queueing, scheduling, output delivery)."""
    bare_once()
    await path_once()
    bare, path = [bare_once()], []
    for _ in range(rounds):
        await asyncio.sleep(0.1)
        path.append(await path_once())
        await asyncio.sleep(0.1)
        bare.append(bare_once())

    def paired(value) -> list[float]:
        return [value(p) - (value(before) + value(after)) / 2 for p, before, after in zip(path, bare, bare[1:])]
    added = paired(lambda run: run[0])
    added_outside = paired(lambda run: run[0] - run[1])
    return {"idle_ttft_s": statistics.median(p[0] for p in path),
            "bare_idle_ttft_s": statistics.median(b[0] for b in bare),
            "idle_prefill_s": statistics.median(p[1] for p in path),
            "bare_idle_prefill_s": statistics.median(b[1] for b in bare),
            "idle_ttft_s_runs": path, "bare_idle_ttft_s_runs": bare,
            "added_idle_ttft_ms": statistics.median(added) * 1000,
            "added_idle_ttft_outside_prefill_ms": statistics.median(added_outside) * 1000,
            "added_idle_ttft_outside_prefill_ms_quartiles": [x * 1000 for x in statistics.quantiles(added_outside, n=4)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of each path, each between two bare runs")
    parser.add_argument("--ttft-rounds", type=int, default=15, help="one-token requests through each path for idle TTFT")
    parser.add_argument("--ttft-only", action="store_true", help="only the idle time-to-first-token pairs")
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
    results["ray"] = {}
    if not args.ttft_only:
        results["ray"] = interleaved(bare_run, lambda: timed_generate(handle.generate, prompts, params), args.rounds)
        results["ray"].update(asyncio.run(run_streams(ray_stream(handle), prompts, output_lens)))
    bare_once = bare_one_token(bare.generate, prompts[0])
    results["ray"].update(asyncio.run(interleaved_idle_ttft(ray_one_token(handle, prompts[0]), bare_once, args.ttft_rounds)))
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
    results["http"] = {}
    if not args.ttft_only:
        results["http"] = interleaved(bare_run, http_run, args.rounds)
        results["http"]["mean_ttft_s"] = streamed["mean_ttft_s"]
    results["http"].update(http_idle_ttft(base, args.model, prompts[0], bare_once, args.ttft_rounds))
    serve.shutdown()
    ray.shutdown()

    rows = []
    for path in ("ray", "http"):
        r = results[path]
        throughput = ("-",) * 5 if args.ttft_only else (
            " / ".join(f"{t:.1f}" for t in r["tok_s_runs"]), " / ".join(f"{t:.1f}" for t in r["bare_tok_s_runs"]),
            " / ".join(f"{x:.2f}" for x in r["ratios"]), f"{r['ratio_vs_bare']:.2f}x", f"{r['mean_ttft_s'] * 1000:.0f}")
        rows.append((path, *throughput,
                     f"{r['idle_ttft_s'] * 1000:.1f} (bare {r['bare_idle_ttft_s'] * 1000:.1f})",
                     f"{r['added_idle_ttft_ms']:+.1f}",
                     f"{r['idle_prefill_s'] * 1000:.1f} (bare {r['bare_idle_prefill_s'] * 1000:.1f})",
                     f"{r['added_idle_ttft_outside_prefill_ms']:+.1f} "
                     f"[{', '.join(f'{q:+.1f}' for q in r['added_idle_ttft_outside_prefill_ms_quartiles'][::2])}]"))
    print_table(["path", "output tok/s", "bare tok/s (around them)", "ratios", "median ratio",
                 "mean TTFT ms (16 conc.)", "idle TTFT ms (medians)", "added TTFT ms (paired)",
                 "engine prefill ms (medians)", "added TTFT outside prefill ms (paired) [quartiles]"], rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""The serving part of benchmarks/node_scaling.py: the whole-node tensor-parallel serve config
(deployments/configs/mi355x_tp8.yaml: Llama-3.1-70B, here at TP=n with dummy weights) written for this host
(loopback, one replica, the OpenAI API key on through ATOM_RAY_API_KEY) and deployed with `serve run`, under
benchmarks/serving.py's streaming load at concurrency 64 and 256, against the same engine offline: the same
engine arguments through `atom_ray.start`, the same requests with the same number in flight, streamed through
the engine handle. Also `stream_requests`, the closed-loop streaming driver the other parts time TTFT and
inter-token latency with.
"""
from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEPLOYMENT = ROOT / "deployments" / "configs" / "mi355x_tp8.yaml"
LEVELS = (64, 256)
PORT = 8766
# Over the deployment's engine arguments: the benchmark's sizes (benchmarks/serving.py's ENGINE_ARGS).
BENCHMARK_ENGINE_ARGS = {"load_format": "dummy", "max_model_len": 2048, "max_num_seqs": 256,
                         "max_num_batched_tokens": 8192}


async def stream_requests(engine, requests: list[tuple[list[int], int]], concurrency: int) -> dict:
    """Stream `requests` ((prompt token ids, output tokens), greedy, ignore_eos) through an engine handle with
    `concurrency` in flight: output tokens/s, and per request the time to its first token (TTFT) and to its
    last over its tokens after the first (TPOT); the inter-token latency (ITL) is each gap between two
    outputs of a request as the Ray client hands them over (one sample per output, as vLLM's benchmark
    counts a streamed chunk)."""
    from benchmarks.serving import percentiles
    from engine import SamplingParams
    limit = asyncio.Semaphore(concurrency)
    ttfts, tpots, itls, produced = [], [], [], []

    async def one(prompt: list[int], max_tokens: int) -> None:
        async with limit:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            start = time.perf_counter()
            first = last = None
            output = None
            async for output in engine.stream(prompt, params):
                if not output.outputs[0].new_token_ids:
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    itls.append(now - last)
                last = now
            tokens = len(output.token_ids)
            ttfts.append(first - start)
            tpots.append((last - first) / max(tokens - 1, 1))
            produced.append(tokens)

    start = time.perf_counter()
    await asyncio.gather(*(one(prompt, n) for prompt, n in requests))
    seconds = time.perf_counter() - start
    assert sum(produced) == sum(n for _, n in requests), "the engine returned fewer tokens than asked"
    return {"concurrency": concurrency, "num_requests": len(requests), "output_tokens": sum(produced),
            "seconds": seconds, "tok_s": sum(produced) / seconds, "ttft_s": percentiles(ttfts),
            "tpot_s": percentiles(tpots), "itl_s": percentiles(itls)}


def serve_config(model_folder: str, engine_args: dict, port: int) -> dict:
    """The deployment's config for this host: its app with the benchmark's model folder and engine arguments
    over its own, one replica (no autoscaling: the node has no GPUs for a second), the HTTP port on
    loopback, no accelerator type (the deployment names MI355X), and `require_api_key` as it ships."""
    import yaml
    config = yaml.safe_load(DEPLOYMENT.read_text())
    app = config["applications"][0]
    args = app["args"]
    args.pop("accelerator_type", None)
    args.update(model=model_folder, served_model_name="bench",
                engine_args={**args["engine_args"], **engine_args})
    deployment = {k: v for k, v in args.get("deployment_config", {}).items() if k != "autoscaling_config"}
    args["deployment_config"] = {**deployment, "num_replicas": 1}
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    config["proxy_location"] = "HeadOnly"
    assert args.get("require_api_key"), "the deployment config no longer requires an API key"
    return config


def engine_args_for(layout: dict) -> dict:
    """The serve config's engine arguments (the deployment's, the benchmark's sizes, the plan's layout)."""
    import yaml
    deployed = yaml.safe_load(DEPLOYMENT.read_text())["applications"][0]["args"]["engine_args"]
    return {**deployed, **BENCHMARK_ENGINE_ARGS, **layout}


def offline_levels(model_folder: str, engine_args: dict, workloads: dict[int, list], warm_up: list) -> dict:
    """The same engine without HTTP: one start, a warm-up, then each level's requests streamed through the
    handle with that many in flight."""
    import ray

    import atom_ray
    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR")
    result = {}
    try:
        started = time.perf_counter()
        engine = atom_ray.start(model_folder, **engine_args)
        result["start_s"] = time.perf_counter() - started
        try:
            asyncio.run(stream_requests(engine, warm_up, len(warm_up)))
            for concurrency, requests in workloads.items():
                result[concurrency] = asyncio.run(stream_requests(engine, requests, concurrency))
                print(f"offline c={concurrency}: {result[concurrency]['tok_s']:.0f} tok/s", flush=True)
        finally:
            engine.shutdown()
    finally:
        ray.shutdown()
    return result


class ServeRun:
    """`serve run CONFIG` in a child process (its own local Ray cluster), with the API key in its
    environment and Serve's HAProxy ingress as `atom-ray serve` starts it; stopped with Ctrl-C's signal."""

    def __init__(self, config: dict, api_key: str) -> None:
        import yaml

        from atom_ray.cluster import LOCAL_ENV, haproxy_ingress_settings
        from atom_ray.serving import API_KEY_ENV
        folder = Path(tempfile.mkdtemp(prefix="node-serve-"))
        self.config_path, self.log_path = folder / "serve.yaml", folder / "serve_run.log"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.ingress = {} if "RAY_SERVE_ENABLE_HA_PROXY" in os.environ else haproxy_ingress_settings()
        env = {**LOCAL_ENV, **self.ingress, **os.environ, API_KEY_ENV: api_key}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        self.base = f"http://127.0.0.1:{config['http_options']['port']}"
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen([sys.executable, "-m", "ray.serve.scripts", "run", str(self.config_path)],
                                        env=env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until /health answers; raises if `serve run` exits or the time runs out."""
        from atom_ray.serving import wait_until_healthy
        started = time.perf_counter()
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"serve run exited with {self.process.returncode}; see {self.log_path}")
            try:
                wait_until_healthy(f"{self.base}/health", 5)
                return time.perf_counter() - started
            except TimeoutError:
                if time.perf_counter() - started > timeout_s:
                    raise TimeoutError(f"the app was not healthy within {timeout_s:.0f} s; see {self.log_path}")

    def status_without_key(self) -> int:
        """The HTTP status of a /v1/models request without the key (401 while auth is on)."""
        import httpx
        return httpx.get(f"{self.base}/v1/models", timeout=30).status_code

    def stop(self) -> None:
        """Ctrl-C's signal (Serve and the cluster shut down), then harder ones if it lingers."""
        for send, wait_s in ((lambda: self.process.send_signal(signal.SIGINT), 90), (self.process.terminate, 30),
                             (self.process.kill, 30)):
            if self.process.poll() is not None:
                break
            send()
            try:
                self.process.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
        self.log.close()


def serving_part(plan, num_requests: int, save=lambda result: None, ready_timeout_s: float = 420.0,
                 port: int = PORT) -> dict:
    """Offline at each level, then `serve run` and the HTTP sweep at each level: throughput, TTFT, TPOT, and
    HTTP over offline per level (the issue's target: >= 0.9 at concurrency 256). `save(result)` after each
    phase, so that a step cut short keeps what it measured."""
    from transformers import AutoConfig

    from benchmarks.serving import requests_for, sweep_level, with_synthetic_tokenizer
    model_folder = with_synthetic_tokenizer(plan.model)
    vocab_size = AutoConfig.from_pretrained(model_folder).vocab_size
    workloads = {c: requests_for(num_requests, seed=c, vocab_size=vocab_size) for c in LEVELS}
    warm_up = requests_for(4, 99, vocab_size)
    engine_args = engine_args_for(plan.layouts[plan.baseline])
    result = {"engine_args": engine_args, "num_requests_per_level": num_requests}
    result["offline"] = offline_levels(model_folder, engine_args, workloads, warm_up)
    save(result)
    api_key = secrets.token_urlsafe(24)
    config = serve_config(model_folder, engine_args, port)
    result["serve_config"] = config  # the key is not in it: serve run's environment carries it
    server = ServeRun(config, api_key)
    result["haproxy_ingress"], result["http"] = bool(server.ingress), {}
    try:
        result["serve_ready_s"] = server.wait_ready(ready_timeout_s)
        result["status_without_api_key"] = server.status_without_key()
        asyncio.run(sweep_level(server.base, "bench", warm_up, len(warm_up), api_key))
        for concurrency, requests in workloads.items():
            result["http"][concurrency] = asyncio.run(sweep_level(server.base, "bench", requests, concurrency, api_key))
            print(f"HTTP c={concurrency}: {result['http'][concurrency]['tok_s']:.0f} tok/s", flush=True)
            save(result)
    except Exception as exc:  # the offline figures stay
        result["error"] = repr(exc)
        print(f"serving: {exc!r} (serve run's log: {server.log_path})", flush=True)
    finally:
        server.stop()
    result["http_over_offline"] = {c: result["http"][c]["tok_s"] / result["offline"][c]["tok_s"]
                                   for c in LEVELS if c in result["http"]}
    return result


def serving_rows(plan, result: dict) -> list[tuple]:
    """Table rows: per level, offline and HTTP throughput, their ratio (baseline: offline), TTFT and TPOT."""
    rows = []
    for c in LEVELS:
        offline, http = result.get("offline", {}).get(c), result.get("http", {}).get(c)
        if not offline or not http:
            continue
        rows.append((plan.shape, plan.baseline, c, f"{offline['tok_s']:.0f}", f"{http['tok_s']:.0f}",
                     f"{http['tok_s'] / offline['tok_s']:.3f}x offline",
                     f"{offline['ttft_s']['p50'] * 1e3:.0f} / {http['ttft_s']['p50'] * 1e3:.0f}",
                     f"{offline['tpot_s']['p50'] * 1e3:.1f} / {http['tpot_s']['p50'] * 1e3:.1f}"))
    return rows


SERVING_HEADERS = ["shape", "layout", "concurrency", "offline tok/s", "HTTP tok/s", "HTTP vs offline",
                   "TTFT p50 ms offline / HTTP", "TPOT p50 ms offline / HTTP"]

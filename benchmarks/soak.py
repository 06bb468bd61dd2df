"""Soak: `atom-ray serve` (its own local Ray, Serve's HAProxy ingress, the packaged SmolLM2 on the CPU) under
N concurrent clients for a while, with random lengths, clients that give up mid-request and hostile
requests mixed in. Reports requests served, errors by kind, the engine's and the replica's memory over the
run (resident set, sampled every few seconds), the longest gap between two tokens of a stream, and whether
every KV block and admission slot came back at the end.

    python -m benchmarks.soak [--clients 64] [--minutes 10] --out soak.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.common import environment_record, print_table

MODEL = "smollm2-135m"
WORDS = "the of and to in is was for on that with as by at from his her an are which this be".split()
# Requests a hostile or careless client sends (all must get a 4xx and hurt nobody else).
BAD_REQUESTS = [
    {"prompt": "hi", "top_k": 2**70},
    {"prompt": "hi", "min_tokens": 1, "stop_token_ids": [49152]},
    {"prompt": "hi", "temperature": -1},
    {"prompt": "hi \ud800"},
    {"prompt": "hi", "n": 10**6},
    {"prompt": "hi", "guided_json": {"type": "object"}},
    {"prompt": [1, 10**9]},
    {"prompt": "word " * 9000},  # longer than the context
    {"model": "gpt-9", "prompt": "hi"},
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int, max_model_len: int) -> tuple[subprocess.Popen, dict]:
    env = {key: value for key, value in os.environ.items() if key != "RAY_AUTH_MODE"}
    env.update(RAY_ADDRESS="local", RAY_TMPDIR=tempfile.mkdtemp(prefix="soak-", dir="/tmp"))
    process = subprocess.Popen([sys.executable, "-m", "atom_ray.cli", "serve", "--port", str(port), "--max-model-len",
                                str(max_model_len)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    return process, env


def wait_healthy(base: str, timeout_s: float = 600) -> None:
    import httpx
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("the server did not become healthy")


def engine_processes(root_pid: int) -> dict[str, int]:
    """pid of the Serve replica and of the Coordinator (TP rank 0: the engine itself)."""
    import psutil
    found = {}
    for process in psutil.Process(root_pid).children(recursive=True):
        name = " ".join(process.cmdline()[:1])
        if "ServeReplica" in name:
            found["replica"] = process.pid
        elif "Coordinator" in name:
            found["engine"] = process.pid
    return found


def resident_mb(pid: int) -> float:
    import psutil
    return psutil.Process(pid).memory_info().rss / 2**20


def trimmed_mb(pid: int) -> float | None:
    """Resident memory after the process's C heap gave its free pages back (glibc malloc_trim, called
    through gdb): what it holds, as opposed to what its allocator keeps around. None without gdb."""
    if not shutil.which("gdb"):
        return None
    subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "call (int)malloc_trim(0)"], capture_output=True,
                   timeout=60)
    return resident_mb(pid)


def metrics(base: str) -> dict[str, float]:
    import httpx
    values = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith("atom_ray:") and not line.startswith("atom_ray:request_success") and "{" not in line:
            name, value = line.split()[:2]
            values[name.removeprefix("atom_ray:")] = float(value)
    return values


class Tally:
    def __init__(self) -> None:
        self.outcomes: Counter = Counter()
        self.longest_gap_s = 0.0
        self.gaps: list[float] = []
        self.tokens = 0


def random_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 400)))


async def one_request(client, base: str, rng: random.Random, tally: Tally) -> None:
    import httpx
    roll = rng.random()
    if roll < 0.08:  # a hostile or careless request
        body = {"model": MODEL, "max_tokens": 8, **rng.choice(BAD_REQUESTS)}
        # Encoded here: escaped as a hostile client sends it (httpx's own encoder refuses a lone surrogate).
        response = await client.post(f"{base}/v1/completions", content=json.dumps(body),
                                     headers={"Content-Type": "application/json"})
        tally.outcomes[f"refused {response.status_code}"] += 1
        return
    chat = rng.random() < 0.4
    body = {"model": MODEL, "max_tokens": rng.randint(1, 256), "stream": True, "temperature": rng.choice([0, 0.8]),
            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": random_prompt(rng)}]
    else:
        body["prompt"] = random_prompt(rng)
    give_up_after = rng.randint(0, 30) if roll < 0.23 else None  # events before the client leaves
    path = "/v1/chat/completions" if chat else "/v1/completions"
    last, events = None, 0
    try:
        async with client.stream("POST", f"{base}{path}", json=body) as response:
            if response.status_code != 200:
                tally.outcomes[f"status {response.status_code}"] += 1
                await response.aread()
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.monotonic()
                if line == "data: [DONE]":
                    tally.outcomes["completed"] += 1
                    return
                if '"error"' in line[:20]:
                    tally.outcomes["error event"] += 1
                    continue
                events += 1
                if last is not None:
                    tally.gaps.append(now - last)
                    tally.longest_gap_s = max(tally.longest_gap_s, now - last)
                last = now
                tally.tokens += 1
                if give_up_after is not None and events >= give_up_after:
                    tally.outcomes["client left"] += 1
                    return
            tally.outcomes["stream ended without [DONE]"] += 1
    except httpx.HTTPError as exc:
        tally.outcomes[f"client error {type(exc).__name__}"] += 1
    except Exception as exc:  # a bug of this script: counted, and the soak goes on
        tally.outcomes[f"load generator error {type(exc).__name__}"] += 1


async def client_loop(base: str, seed: int, until: float, tally: Tally) -> None:
    import httpx
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30)) as client:
        while time.monotonic() < until:
            await one_request(client, base, rng, tally)


async def run_load(base: str, clients: int, seconds: float, tally: Tally) -> None:
    until = time.monotonic() + seconds
    await asyncio.gather(*(client_loop(base, seed, until, tally) for seed in range(clients)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--warmup-minutes", type=float, default=3.0,
                        help="load before the memory baseline: the allocator's and oneDNN's per-shape caches fill "
                             "over the first minutes of a random workload, then stay")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process, env = start_server(port, args.max_model_len)
    try:
        wait_healthy(base)
        pids = engine_processes(process.pid)
        tally = Tally()
        asyncio.run(run_load(base, args.clients, args.warmup_minutes * 60, Tally()))
        memory = {role: [resident_mb(pid)] for role, pid in pids.items()}
        started = time.monotonic()

        async def sample_memory():
            while True:
                await asyncio.sleep(10)
                for role, pid in pids.items():
                    memory[role].append(resident_mb(pid))

        async def soak():
            sampler = asyncio.ensure_future(sample_memory())
            await run_load(base, args.clients, args.minutes * 60, tally)
            sampler.cancel()

        asyncio.run(soak())
        elapsed = time.monotonic() - started
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the last aborts reach the engine
            end = metrics(base)
            if not any(end.get(k) for k in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                                             "num_pending_sequences")):
                break
            time.sleep(1)
        for role, pid in pids.items():
            memory[role].append(resident_mb(pid))
        trimmed = {role: trimmed_mb(pid) for role, pid in pids.items()}
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)

    gaps = sorted(tally.gaps)
    result = {
        "environment": environment_record(),
        "workload": {"clients": args.clients, "minutes": args.minutes, "warmup_minutes": args.warmup_minutes,
                     "model": MODEL, "max_model_len": args.max_model_len,
                     "mix": "92 % streaming completions/chats (5-400 words, 1-256 tokens; 15 % of them leave after "
                            "0-30 events), 8 % hostile requests"},
        "seconds": elapsed,
        "outcomes": dict(tally.outcomes),
        "stream_events": tally.tokens,
        "inter_event_gap_s": {"max": tally.longest_gap_s, "p99": gaps[int(0.99 * len(gaps))] if gaps else None,
                              "p50": gaps[len(gaps) // 2] if gaps else None},
        "memory_mb": {role: {"start": values[0], "end": values[-1], "max": max(values),
                             "end_after_malloc_trim": trimmed[role], "every_10_s": [round(v, 1) for v in values]}
                      for role, values in memory.items()},
        "at_end": {k: end.get(k) for k in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                                           "num_pending_sequences", "engine_restarts_total")},
    }
    print_table(["outcome", "count"], sorted(tally.outcomes.items(), key=lambda kv: -kv[1]))
    print()
    print_table(["process", "RSS start MB", "RSS end MB", "max MB", "end/start", "end after malloc_trim MB"],
                [(role, f"{m['start']:.0f}", f"{m['end']:.0f}", f"{m['max']:.0f}", f"{m['end'] / m['start']:.3f}",
                  "-" if m["end_after_malloc_trim"] is None else f"{m['end_after_malloc_trim']:.0f}")
                 for role, m in result["memory_mb"].items()])
    print()
    print(f"{elapsed / 60:.1f} min, {tally.tokens} stream events; gap between events: longest "
          f"{tally.longest_gap_s:.2f} s, p99 {result['inter_event_gap_s']['p99']:.3f} s; at the end: {result['at_end']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

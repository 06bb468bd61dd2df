"""Failover across Serve replicas on a real local Ray cluster (the tiny Llama in float32, TP=1, one core per
engine): streams over HTTP, greedy, seeded and n=2, with logprobs (the tokens) and usage. The engine of the
replica whose streams are live is killed (SIGKILL of its process) mid-stream: every stream completes with
exactly the text and tokens of an undisturbed run, usage counted once. With two replicas the other one
continues them; with one, they wait for the restarted engine, or, with a tiny resume_timeout_s, end with a
clean error event."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import requests

import tiny_models
from http_testing import free_port, wait_healthy

MAX_TOKENS = 400  # the tiny model allows 512 positions; about 2 s of streaming here
KILL_AFTER_TOKENS = 8
PROMPTS = [[5, 17, 33, 60], [9, 8, 7, 6, 5], [100, 2, 300], [42, 43, 44, 45, 46, 47], [250, 7, 7], [3, 1, 4, 1, 5]]
SAMPLING = [{"temperature": 0}, {"temperature": 1.0, "seed": 7}, {"temperature": 0.9, "seed": 11, "n": 2},
            {"temperature": 1.0, "seed": 3}, {"temperature": 0}, {"temperature": 0.8, "top_k": 40, "seed": 5}]


def body(index: int) -> dict:
    return {"model": "tiny", "prompt": PROMPTS[index], "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 0,
            "stream": True, "stream_options": {"include_usage": True}, **SAMPLING[index]}


class Stream(threading.Thread):
    """One streaming completion read in the background: per choice its text, tokens (from the logprobs) and
    finish reason; the usage; an error event if one came."""

    def __init__(self, base: str, request: dict) -> None:
        super().__init__(daemon=True)
        self.base, self.request = base, request
        self.choices: dict[int, dict] = {}
        self.usage, self.error, self.done = None, None, False

    def run(self) -> None:
        with requests.post(f"{self.base}/v1/completions", json=self.request, stream=True, timeout=300) as response:
            assert response.status_code == 200, response.text
            for line in response.iter_lines():
                if not line:
                    continue
                data = line.removeprefix(b"data: ")
                if data == b"[DONE]":
                    self.done = True
                    return
                event = json.loads(data)
                if "error" in event:
                    self.error = event["error"]
                    continue
                self.usage = event.get("usage") or self.usage
                for choice in event["choices"]:
                    seen = self.choices.setdefault(choice["index"], {"text": "", "tokens": [], "finish_reason": None})
                    seen["text"] += choice["text"]
                    seen["tokens"] += (choice.get("logprobs") or {}).get("tokens", [])
                    seen["finish_reason"] = choice["finish_reason"] or seen["finish_reason"]

    @property
    def tokens_so_far(self) -> int:
        n = self.request.get("n", 1)
        return min((len(c["tokens"]) for c in self.choices.values()), default=0) if len(self.choices) == n else 0

    def result(self) -> dict:
        return {index: (c["text"], c["tokens"], c["finish_reason"]) for index, c in sorted(self.choices.items())}


def run_streams(base: str, indices, fault=None, prepare=None) -> list[Stream]:
    """The requests at once; `prepare()` once each has its first token (where the streams are can be looked up
    then, while all of them have hundreds of tokens to go: under a loaded machine the lookup takes seconds),
    `fault()` once each has KILL_AFTER_TOKENS tokens (all still streaming)."""
    streams = [Stream(base, body(index)) for index in indices]
    for stream in streams:
        stream.start()
    if prepare is not None:
        deadline = time.monotonic() + 120
        while any(stream.tokens_so_far < 1 for stream in streams):
            assert time.monotonic() < deadline, [stream.tokens_so_far for stream in streams]
            time.sleep(0.01)
        prepare()
    if fault is not None:
        deadline = time.monotonic() + 120
        while any(stream.tokens_so_far < KILL_AFTER_TOKENS for stream in streams):
            assert time.monotonic() < deadline, [stream.tokens_so_far for stream in streams]
            assert not any(stream.done for stream in streams), "a stream ended before the fault"
            time.sleep(0.01)
        fault()
    for stream in streams:
        stream.join(timeout=300)
        assert not stream.is_alive()
    return streams


def deploy(name: str, port: int, model: str, **args) -> str:
    from ray import serve

    from deployments.serve_app import build_app
    serve.run(build_app({"model": model, "served_model_name": "tiny", "cpus_per_rank": 1,
                         "engine_args": {"dtype": "float32", "max_num_seqs": 16}, **args}),
              name=name, route_prefix=f"/{name}", blocking=False)
    base = f"http://127.0.0.1:{port}/{name}"
    wait_healthy(f"{base}/health", timeout=180)
    return base


def engine_states(app: str, replicas: int) -> dict[str, dict]:
    """Each replica's engine_state, by replica tag: asked many times at once, so that every replica answers."""
    from ray import serve
    handle = serve.get_app_handle(app)
    deadline = time.monotonic() + 60
    while True:
        states = {state["replica"]: state for state in
                  [response.result() for response in [handle.engine_state.remote() for _ in range(4 * replicas)]]}
        if len(states) == replicas or time.monotonic() > deadline:
            assert len(states) == replicas, states
            return states
        time.sleep(0.2)


def wait_all_serving(app: str, replicas: int, timeout: float = 120) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        states = engine_states(app, replicas)
        if all(state["serving"] for state in states.values()):
            return states
        assert time.monotonic() < deadline, states
        time.sleep(0.5)


def kill_engine(state: dict):
    def fault():
        (_, pid), = state["rank_process_ids"]
        os.kill(pid, signal.SIGKILL)
    return fault


@pytest.fixture(scope="module")
def cluster(ray_cluster, tmp_path_factory):
    from ray import serve
    folder = tiny_models.make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port, str(folder)
    serve.shutdown()  # Serve keeps the first start's port: the next module's serve.start must start it afresh


@pytest.fixture(scope="module")
def two_replicas(cluster):
    from ray import serve
    port, model = cluster
    base = deploy("two", port, model, deployment_config={"num_replicas": 2})
    reference = [stream.result() for stream in run_streams(base, range(len(PROMPTS)))]
    yield base, reference
    serve.delete("two")


def assert_undisturbed(streams: list[Stream], reference: list[dict], indices) -> None:
    for stream, index in zip(streams, indices):
        assert stream.done and stream.error is None, (index, stream.error)
        assert stream.result() == reference[index], index  # text, tokens and finish reason of every choice
        assert all(finish == "length" for _, _, finish in reference[index].values())
        n = SAMPLING[index].get("n", 1)
        assert stream.usage == {"prompt_tokens": len(PROMPTS[index]), "completion_tokens": n * MAX_TOKENS,
                                "total_tokens": len(PROMPTS[index]) + n * MAX_TOKENS}, index


def test_streams_of_a_killed_engine_continue_on_the_other_replica(two_replicas):
    base, reference = two_replicas
    indices = range(len(PROMPTS))
    victim: dict = {}

    def find_victim():
        # The replicas' stats refresh with their engines' polls: right after the first tokens they may still
        # say nothing runs, so they are asked again (the streams have hundreds of tokens to go).
        deadline = time.monotonic() + 30
        while True:
            states = engine_states("two", 2)
            running = {tag: state for tag, state in states.items() if state["num_running"]}
            if running or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert running, states
        victim.update(max(running.values(), key=lambda state: state["num_running"]))

    streams = run_streams(base, indices, lambda: kill_engine(victim)(), prepare=find_victim)
    assert_undisturbed(streams, reference, indices)
    states = wait_all_serving("two", 2)
    killed, other = states[victim["replica"]], next(s for tag, s in states.items() if tag != victim["replica"])
    assert killed["rank_process_ids"] != victim["rank_process_ids"] and killed["engine_restarts"] == 1
    # Each of its live sequences' requests was continued, by the other replica (its own engine restarts in
    # seconds; the other took them at once).
    assert killed["replica_resumed_requests"] >= 1 and killed["replica_failed_resumes"] == 0
    assert other["peer_continuations"] == killed["replica_resumed_requests"]
    again = run_streams(base, [0, 1])  # both replicas serve
    assert [stream.result() for stream in again] == reference[:2]


def test_with_one_replica_streams_wait_for_the_restarted_engine(cluster, two_replicas):
    from ray import serve
    port, model = cluster
    _, reference = two_replicas
    base = deploy("one", port, model)
    try:
        state, = engine_states("one", 1).values()
        indices = [0, 1, 2]
        streams = run_streams(base, indices, kill_engine(state))
        assert_undisturbed(streams, reference, indices)
        state, = wait_all_serving("one", 1).values()
        assert state["engine_restarts"] == 1 and state["replica_resumed_requests"] == len(indices)
        assert state["peer_continuations"] == 0
    finally:
        serve.delete("one")


def test_with_one_replica_and_a_tiny_timeout_streams_end_with_a_clean_error(cluster):
    from ray import serve
    port, model = cluster
    base = deploy("no-wait", port, model, resume_timeout_s=0.5)
    try:
        state, = engine_states("no-wait", 1).values()
        killed = time.monotonic()
        streams = run_streams(base, [0, 3], kill_engine(state))
        for stream in streams:
            assert stream.done and stream.error is not None
            assert stream.error["code"] == "engine_unavailable" and "within 0.5 s" in stream.error["message"]
        assert time.monotonic() - killed < 30
        state, = wait_all_serving("no-wait", 1).values()
        assert state["replica_failed_resumes"] == 2 and state["replica_resumed_requests"] == 0
    finally:
        serve.delete("no-wait")

"""The door of the OpenAI app: the API key, the request body cap, admission by sequences, and request
preparation (tokenization, chat templates) off the event loop."""
from __future__ import annotations

import json
import threading

import openai
import pytest
import requests

from deployments.openai import build_openai_app

SERVED_MODEL = "smollm2"  # as the conftest serves it
KEY = "sk-test-0123456789"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def keyed(engine, serve_app):
    with serve_app(build_openai_app(engine, SERVED_MODEL, api_key=KEY)) as served:
        yield served


def test_without_the_key_every_v1_route_is_401_with_openais_error_body(keyed):
    for method, path in (("get", "/v1/models"), ("post", "/v1/completions"), ("post", "/v1/chat/completions")):
        response = requests.request(method, f"{keyed.base_url}{path}", json={"model": SERVED_MODEL, "prompt": "x"},
                                    timeout=30)
        assert response.status_code == 401, path
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert set(error) == {"message", "type", "param", "code"}


def test_a_wrong_key_is_401_and_the_right_one_serves(keyed):
    wrong = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    right = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key=KEY, max_retries=0)
    reply = right.completions.create(model=SERVED_MODEL, prompt="The capital of France is", max_tokens=3,
                                     temperature=0)
    assert reply.choices[0].text


def test_health_and_metrics_stay_open_with_a_key(keyed):
    assert requests.get(f"{keyed.base_url}/health", timeout=30).status_code == 200
    assert requests.get(f"{keyed.base_url}/metrics", timeout=30).status_code == 200


@pytest.fixture(scope="module")
def capped(engine, serve_app):
    with serve_app(build_openai_app(engine, SERVED_MODEL, max_request_body_bytes=4096)) as served:
        yield served


def test_a_body_over_the_cap_is_413_before_it_is_parsed(capped, idle_engine):
    before = idle_engine.stats()["prompt_tokens"]
    body = json.dumps({"model": SERVED_MODEL, "prompt": "x" * 5000})
    response = requests.post(f"{capped.base_url}/v1/completions", data=body, timeout=30,
                             headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    # Without a Content-Length (chunked), the cap holds while the body is read.
    chunks = (body[i:i + 1000].encode() for i in range(0, len(body), 1000))
    response = requests.post(f"{capped.base_url}/v1/completions", data=chunks, timeout=30,
                             headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert idle_engine.stats()["prompt_tokens"] == before
    ok = requests.post(f"{capped.base_url}/v1/completions", timeout=30,
                       json={"model": SERVED_MODEL, "prompt": "hi", "max_tokens": 1})
    assert ok.status_code == 200


@pytest.fixture
def four_sequences(engine, serve_app):
    with serve_app(build_openai_app(engine, SERVED_MODEL, max_pending_sequences=4)) as served:
        yield served


def test_admission_counts_sequences_not_requests(four_sequences, idle_engine, wait_idle):
    base = four_sequences.base_url
    never = requests.post(f"{base}/v1/completions", timeout=30,
                          json={"model": SERVED_MODEL, "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1})
    assert never.status_code == 400 and never.json()["error"]["param"] == "n"  # 6 sequences can never fit in 4
    # Three running sequences leave room for one more, not two.
    with requests.post(f"{base}/v1/completions", stream=True, timeout=60,
                       json={"model": SERVED_MODEL, "prompt": "Tell me a story", "n": 3, "max_tokens": 400,
                             "ignore_eos": True, "stream": True}) as running:
        lines = running.iter_lines()  # kept: a closed line iterator closes the connection
        next(line for line in lines if line)
        busy = requests.post(f"{base}/v1/chat/completions", timeout=30,
                             json={"model": SERVED_MODEL, "messages": USER, "n": 2, "max_tokens": 1})
        assert busy.status_code == 429 and busy.headers["Retry-After"]
        fits = requests.post(f"{base}/v1/chat/completions", timeout=30,
                             json={"model": SERVED_MODEL, "messages": USER, "max_tokens": 1})
        assert fits.status_code == 200
    wait_idle(idle_engine)
    assert four_sequences.app.state.serving.admission.in_flight == 0


def test_tokenizing_a_prompt_does_not_hold_the_event_loop(server, engine, monkeypatch):
    """While one request's prompt is being tokenized (here: held inside the tokenizer), the app still
    answers other requests: preparation runs in a worker thread, not on the event loop."""
    tokenizer = engine.tokenizer
    entered, release = threading.Event(), threading.Event()
    original = tokenizer.encode

    def slow_encode(text, *args, **kwargs):
        if text.startswith("SLOW"):
            entered.set()
            release.wait(30)
        return original(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    result = {}
    worker = threading.Thread(target=lambda: result.update(response=requests.post(
        f"{server.base_url}/v1/completions", timeout=60,
        json={"model": SERVED_MODEL, "prompt": "SLOW prompt", "max_tokens": 1})))
    worker.start()
    try:
        assert entered.wait(30)
        assert requests.get(f"{server.base_url}/health", timeout=5).status_code == 200
        other = requests.post(f"{server.base_url}/v1/completions", timeout=30,
                              json={"model": SERVED_MODEL, "prompt": "quick", "max_tokens": 1})
        assert other.status_code == 200
    finally:
        release.set()
        worker.join(60)
    assert result["response"].status_code == 200


def test_a_client_that_leaves_is_counted_as_aborted(server, idle_engine, wait_idle):
    def aborted() -> float:
        text = requests.get(f"{server.base_url}/metrics", timeout=30).text
        lines = [l for l in text.splitlines() if l.startswith("atom_ray:request_success_total") and 'abort' in l]
        return float(lines[0].split()[-1]) if lines else 0.0

    before = aborted()
    with requests.post(f"{server.base_url}/v1/completions", stream=True, timeout=60,
                       json={"model": SERVED_MODEL, "prompt": "Tell me a story", "n": 2, "max_tokens": 500,
                             "ignore_eos": True, "stream": True}) as response:
        next(line for line in response.iter_lines() if line)
    wait_idle(idle_engine)
    assert aborted() == before + 2

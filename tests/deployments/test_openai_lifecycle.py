"""What surrounds a generation: a client that leaves frees its KV blocks, the in-flight limit answers 429,
and /health, /v1/models and /metrics report the server's state."""
from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlparse

from prometheus_client.parser import text_string_to_metric_families

LONG_GENERATION = {"prompt": "Tell me a long story.", "max_tokens": 200, "ignore_eos": True, "temperature": 0.7}


def open_request(served, path: str, body: dict) -> http.client.HTTPConnection:
    """Send a request on a raw connection that the test can drop at any moment."""
    url = urlparse(served.base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    connection.request("POST", path, json.dumps({"model": served.model, **body}),
                       {"Content-Type": "application/json"})
    return connection


def read_events(response: http.client.HTTPResponse, count: int) -> list[str]:
    events = []
    while len(events) < count:
        line = response.readline().decode().strip()
        if line.startswith("data: "):
            events.append(line)
    return events


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_client_leaving_mid_stream_aborts_the_request_and_frees_its_blocks(controllable, idle_engine, wait_idle):
    client, served = controllable
    before = idle_engine.stats()
    connection = open_request(served, "/v1/completions", {**LONG_GENERATION, "stream": True})
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
    read_events(response, 3)
    left_at = time.monotonic()
    connection.close()
    wait_for(lambda: client.abort_times, timeout=5)
    (request_id, aborted_at), = client.abort_times.items()
    assert request_id.startswith("cmpl-") and aborted_at - left_at < 2
    after = wait_idle(idle_engine, timeout=5)
    assert after["num_running"] == 0 and after["num_free_kv_blocks"] == before["num_free_kv_blocks"]
    assert after["generation_tokens"] - before["generation_tokens"] < LONG_GENERATION["max_tokens"]


def test_client_leaving_a_non_streaming_request_aborts_it(controllable, idle_engine, wait_idle):
    client, served = controllable
    before = idle_engine.stats()
    connection = open_request(served, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": LONG_GENERATION["prompt"]}],
        **{key: LONG_GENERATION[key] for key in ("max_tokens", "ignore_eos", "temperature")}})
    time.sleep(0.5)  # long enough for the request to reach the engine
    left_at = time.monotonic()
    connection.close()
    wait_for(lambda: client.abort_times, timeout=5)
    (request_id, aborted_at), = client.abort_times.items()
    assert request_id.startswith("chatcmpl-") and aborted_at - left_at < 2
    after = wait_idle(idle_engine, timeout=5)
    assert after["num_running"] == 0 and after["num_free_kv_blocks"] == before["num_free_kv_blocks"]
    assert after["generation_tokens"] - before["generation_tokens"] < LONG_GENERATION["max_tokens"]


def test_requests_past_the_pending_limit_get_429_with_retry_after(limited_server, idle_engine, wait_idle):
    holder = open_request(limited_server, "/v1/completions", {**LONG_GENERATION, "stream": True})
    read_events(holder.getresponse(), 1)
    refused = limited_server.post("/v1/chat/completions", json={
        "model": limited_server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert refused.status_code == 429
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["message"]
    holder.close()
    wait_idle(idle_engine)
    wait_for(lambda: limited_server.post("/v1/completions", json={
        "model": limited_server.model, "prompt": "hi", "max_tokens": 1}).status_code == 200, timeout=10)


def test_health_is_ok_while_the_engine_runs(server):
    response = server.get("/health")
    assert response.status_code == 200


def test_models_lists_the_served_model_with_its_context_length(server, engine):
    models = server.openai.models.list().data
    assert [model.id for model in models] == [server.model]
    assert server.get("/v1/models").json()["data"][0]["max_model_len"] == engine.max_model_len


def scrape(served) -> dict[str, float]:
    response = served.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            if "le" not in sample.labels:
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def test_metrics_expose_the_names_and_move_after_requests(server, idle_engine):
    before = scrape(server)
    for name in ("atom_ray:num_requests_running", "atom_ray:num_requests_waiting", "atom_ray:kv_cache_usage_perc",
                 "atom_ray:prefix_cache_queries_total", "atom_ray:prefix_cache_hits_total",
                 "atom_ray:prompt_tokens_total", "atom_ray:generation_tokens_total",
                 "atom_ray:num_preemptions_total"):
        assert name in before, name
    prompt = "Metrics count what happens. " * 8  # several full KV blocks, so the second request hits the cache
    server.openai.completions.create(model=server.model, prompt=prompt, max_tokens=4,
                                     extra_body={"ignore_eos": True})
    list(server.openai.completions.create(model=server.model, prompt=prompt, max_tokens=4, stream=True,
                                          extra_body={"ignore_eos": True}))
    after = scrape(server)
    assert after["atom_ray:generation_tokens_total"] >= before["atom_ray:generation_tokens_total"] + 8
    assert after["atom_ray:prompt_tokens_total"] > before["atom_ray:prompt_tokens_total"]
    assert after["atom_ray:prefix_cache_hits_total"] > before["atom_ray:prefix_cache_hits_total"]
    success = "atom_ray:request_success_total{finished_reason=length}"
    assert after[success] == before.get(success, 0) + 2
    for histogram in ("atom_ray:time_to_first_token_seconds", "atom_ray:e2e_request_latency_seconds",
                      "atom_ray:request_queue_time_seconds", "atom_ray:request_prefill_time_seconds",
                      "atom_ray:request_decode_time_seconds"):
        assert after[f"{histogram}_count"] == before[f"{histogram}_count"] + 2
    # The engine's share of the time to first token lies inside it.
    added = {name: after[f"atom_ray:{name}_seconds_sum"] - before[f"atom_ray:{name}_seconds_sum"]
             for name in ("time_to_first_token", "request_queue_time", "request_prefill_time")}
    assert 0 < added["request_queue_time"] + added["request_prefill_time"] <= added["time_to_first_token"]
    gaps = "atom_ray:inter_token_latency_seconds_count"
    assert after[gaps] >= before[gaps] + 6


def test_each_app_counts_only_its_own_requests(server, limited_server):
    server.post("/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 1})
    assert scrape(limited_server)["atom_ray:e2e_request_latency_seconds_count"] == 0
    limited_server.post("/v1/completions", json={"model": limited_server.model, "prompt": "hi", "max_tokens": 1})
    assert scrape(limited_server)["atom_ray:e2e_request_latency_seconds_count"] == 1

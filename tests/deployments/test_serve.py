"""The Serve deployment on a real local Ray cluster: HTTP with the openai client, Python handles from another
Ray driver, `serve run` of the shipped local config, and the `atom-ray serve` command."""
from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import requests

from http_testing import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
APP_NAME = "atom-ray-test"


def metric(base: str, name: str) -> float:
    text = requests.get(f"{base}/metrics", timeout=10).text
    return float(next(l for l in text.splitlines() if l.startswith(f"atom_ray:{name}")).split()[-1])


def kv_cache_usage(base: str) -> float:
    return metric(base, "kv_cache_usage_perc")


def wait_until_nothing_runs(base: str, timeout: float = 30) -> None:
    """No request running or waiting, every KV block free, no admission slot held."""
    names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_pending_sequences")
    deadline = time.monotonic() + timeout
    while any(metric(base, name) for name in names):
        assert time.monotonic() < deadline, {name: metric(base, name) for name in names}
        time.sleep(0.2)


def start_stream(base: str, model: str, **fields):
    """A streaming completion that has sent its first event; returns (response, its line iterator)."""
    response = requests.post(f"{base}/v1/completions", stream=True, timeout=60,
                             json={"model": model, "prompt": "Tell me a long story.", "max_tokens": 1500,
                                   "ignore_eos": True, "stream": True, **fields})
    lines = response.iter_lines()  # kept: a dropped line iterator closes the connection
    assert response.status_code == 200 and next(line for line in lines if line).startswith(b"data: {")
    return response, lines


def assert_cancellations_leave_nothing_behind(base: str, model: str) -> None:
    """Clients that give up at every stage of a request, on an engine that runs two sequences at a time in
    64-token steps: while queued, while their prompt is prefilled (streaming or not), while decoding, between
    two stream events. The engine serves on, and no KV block or admission slot stays taken."""
    long_prompt = "The history of the world, told slowly. " * 150  # about 1200 tokens: about 19 steps
    holders = [start_stream(base, model) for _ in range(2)]  # both sequence slots taken
    with pytest.raises(requests.ReadTimeout):  # queued behind them; the client gives up after 1 s
        requests.post(f"{base}/v1/completions", stream=True, timeout=(5, 1),
                      json={"model": model, "prompt": "Queued", "max_tokens": 5, "stream": True})
    for response, _ in holders:  # decoding
        response.close()
    for stream in (False, True):  # prefilling
        with pytest.raises(requests.ReadTimeout):  # a prompt of its own each time: no prefix-cache hit
            requests.post(f"{base}/v1/completions", stream=stream, timeout=(5, 1.5),
                          json={"model": model, "prompt": f"{stream} {long_prompt}", "max_tokens": 5, "stream": stream})
        time.sleep(0.5)
    response, lines = start_stream(base, model)  # between two events
    time.sleep(0.3)
    response.close()
    with pytest.raises(requests.ReadTimeout):  # a whole completion, given up while it decodes
        requests.post(f"{base}/v1/completions", timeout=(5, 2),
                      json={"model": model, "prompt": "Count to a thousand.", "max_tokens": 1000, "ignore_eos": True})
    wait_until_nothing_runs(base)
    assert requests.get(f"{base}/health", timeout=10).status_code == 200
    reply = requests.post(f"{base}/v1/completions", timeout=60, json={"model": model, "prompt": "The capital of France is",
                                                                       "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200 and "Paris" in reply.json()["choices"][0]["text"]
    wait_until_nothing_runs(base)


@pytest.fixture(scope="module")
def served(ray_cluster):
    from ray import serve

    from deployments.serve_app import build_app
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # Two sequences at a time and 64-token steps: a third request waits, and a long prompt prefills over many
    # steps, so that clients can give up at every stage. Failover off: a killed engine fails its streams
    # (test_replica_failover.py has them continue).
    serve.run(build_app({"model": "smollm2-135m", "served_model_name": "smol", "resume_timeout_s": 0,
                         "engine_args": {"max_model_len": 2048, "max_num_seqs": 2, "max_num_batched_tokens": 64}}),
              name=APP_NAME, route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(f"{base}/health")
    yield base
    serve.delete(APP_NAME)
    serve.shutdown()  # Serve keeps the first start's port: the next module's serve.start must start it afresh


@pytest.fixture(scope="module")
def openai_client(served):
    from openai import OpenAI
    return OpenAI(base_url=f"{served}/v1", api_key="unused")


def test_chat_through_serve(openai_client):
    reply = openai_client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=30, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 10


def test_streaming_completion_through_serve_with_usage(openai_client):
    stream = openai_client.completions.create(model="smol", prompt="The capital of France is", max_tokens=12,
                                              temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_n2_stop_and_logprobs_through_serve(openai_client):
    reply = openai_client.completions.create(model="smol", prompt="Count: 1, 2, 3,", max_tokens=20, n=2,
                                             temperature=0.9, seed=5, stop=["7"], logprobs=2)
    assert sorted(c.index for c in reply.choices) == [0, 1]
    for choice in reply.choices:
        assert "7" not in choice.text
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) > 0


def test_bad_request_through_serve_is_an_openai_error(served):
    response = requests.post(f"{served}/v1/completions", json={"model": "smol", "prompt": "x", "max_tokens": -1})
    assert response.status_code == 400 and response.json()["error"]["message"]
    unknown = requests.post(f"{served}/v1/completions", json={"model": "nope", "prompt": "x"})
    assert unknown.status_code == 404


def assert_leaving_mid_stream_frees_kv_blocks(base: str, model: str, max_tokens: int) -> None:
    """The blocks come back, and because the request was cut short, not because it ran to its end: the engine
    generated far fewer than max_tokens (a deadline generous enough for a loaded 2-core machine would
    otherwise also pass a stream that was never aborted)."""
    baseline, generated = kv_cache_usage(base), metric(base, "generation_tokens")
    with requests.post(f"{base}/v1/completions", stream=True, timeout=60,
                       json={"model": model, "prompt": "Tell me a long story.", "max_tokens": max_tokens,
                             "ignore_eos": True, "stream": True}) as response:
        for index, _ in enumerate(response.iter_lines()):
            if index > 10:
                break
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and kv_cache_usage(base) > baseline:
        time.sleep(0.2)
    assert kv_cache_usage(base) <= baseline
    assert metric(base, "generation_tokens") - generated < max_tokens // 2, "the stream ran on after its client left"


def test_disconnect_mid_stream_returns_kv_blocks(served):
    assert_leaving_mid_stream_frees_kv_blocks(served, "smol", max_tokens=1500)


def test_clients_giving_up_at_any_stage_leave_nothing_behind_through_serves_proxy(served):
    assert_cancellations_leave_nothing_behind(served, "smol")


def test_a_killed_engine_fails_its_streams_and_the_deployment_serves_again(served):
    """The coordinator (rank 0, which runs the scheduler) is killed with two streams in flight: without
    failover they end with an error event; while the replica restarts its engine, new requests get a fast 503; then the
    deployment serves again, with no person involved."""
    from ray import serve
    (_, coordinator_pid), = serve.get_app_handle(APP_NAME).rank_process_ids.remote().result()
    streams = [start_stream(served, "smol") for _ in range(2)]
    os.kill(coordinator_pid, signal.SIGKILL)
    killed = time.monotonic()
    for _, lines in streams:
        events = [line for line in lines if line]
        assert events[-1] == b"data: [DONE]" and b'"error"' in events[-2], events[-2:]
    assert time.monotonic() - killed < 10
    began = time.monotonic()
    refused = requests.post(f"{served}/v1/completions", timeout=30, json={"model": "smol", "prompt": "hi"})
    assert refused.status_code == 503 and refused.headers["Retry-After"]
    assert time.monotonic() - began < 2
    wait_healthy(f"{served}/health", timeout=120)
    assert metric(served, "engine_restarts") == 1
    reply = requests.post(f"{served}/v1/completions", timeout=60, json={"model": "smol", "prompt": "The capital of France is",
                                                                        "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200 and "Paris" in reply.json()["choices"][0]["text"]
    wait_until_nothing_runs(served)


@pytest.mark.parametrize("request_body, message", [
    ({"prompt": "hi", "top_k": 2**70}, r"SamplingParams\.top_k"),
    ({"prompt": "hi", "min_tokens": 1, "stop_token_ids": [49152]}, "outside the vocabulary"),
    ({"prompt": "hi", "top_q": 0.5}, "unknown sampling parameter.*top_q"),
    ({"prompt": "hi \ud800"}, "lone surrogate"),
    ({"text": "hi"}, "needs 'prompt' or 'messages'"),
])
def test_handle_calls_get_the_engines_bounds_and_the_replica_serves_on(served, request_body, message):
    from ray import serve
    handle = serve.get_app_handle(APP_NAME)
    with pytest.raises(Exception, match=message):
        handle.generate.remote(request_body).result()
    assert handle.generate.remote({"prompt": "Hi", "max_tokens": 2}).result()["finish_reason"] == "length"


def test_another_ray_driver_streams_through_a_handle(served, ray_cluster):
    script = textwrap.dedent(f"""
        import ray
        from ray import serve
        ray.init(address="{ray_cluster}", logging_level="ERROR")
        handle = serve.get_app_handle("{APP_NAME}")
        pieces = []
        for chunk in handle.options(stream=True).generate_stream.remote(
                {{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}}):
            pieces.append(chunk["text"])
        print("PIECES", len(pieces), "TEXT", repr("".join(pieces)))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Paris" in result.stdout and "PIECES" in result.stdout
    assert int(result.stdout.split("PIECES")[1].split()[0]) > 1  # streamed, not one reply


@pytest.fixture
def isolated_ray_env():
    """A Ray of its own, as a user starts it: RAY_ADDRESS=local keeps `serve run` from joining the test
    session's cluster; token authentication as Ray and atom-ray default it (RAY_AUTH_MODE unset), with a home
    of its own for the token file; a temp dir of its own (short, for Ray's socket paths). Removed afterwards."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_AUTH_MODE"}
    env["RAY_ADDRESS"] = "local"
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ar-", dir="/tmp")
    env["HOME"] = os.path.join(env["RAY_TMPDIR"], "home")
    os.makedirs(env["HOME"])
    yield env
    shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)


def stop(process: subprocess.Popen) -> str:
    os.killpg(process.pid, signal.SIGINT)
    try:
        return process.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.communicate()[0]


def test_serve_run_of_the_local_config_answers(tmp_path, isolated_ray_env):
    """`serve run deployments/configs/local.yaml`, as a user types it (on a Ray it starts itself)."""
    config = (ROOT / "deployments" / "configs" / "local.yaml").read_text()
    port = free_port()
    path = tmp_path / "local.yaml"
    path.write_text(config.replace("port: 8000", f"port: {port}"))
    process = subprocess.Popen(["serve", "run", str(path)], cwd=ROOT, env=isolated_ray_env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", timeout=400)
        reply = requests.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                              json={"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 6,
                                    "temperature": 0}).json()
        assert "Paris" in reply["choices"][0]["text"]
    finally:
        stop(process)


def assert_no_open_control_endpoint(root_pid: int) -> None:
    from socket_audit import audit
    findings = audit(root_pid)
    report = "\n".join(f"{f.socket.process} {f.socket.address}:{f.socket.port} {f.kind}: {f.verdict}" for f in findings)
    assert sum(f.kind == "grpc" for f in findings) >= 3, report  # GCS, raylet, workers at least were probed
    assert not [f for f in findings if f.problem], report


def assert_ray_tools_work_with_the_token_and_not_without(env: dict) -> None:
    # As the README says: Ray's command-line tools find the token in ~/.ray/auth_token, and (Ray 2.60) send it
    # when RAY_AUTH_MODE=token says they should.
    tools = {**env, "RAY_AUTH_MODE": "token"}
    status = subprocess.run(["serve", "status"], env=tools, capture_output=True, text=True, timeout=120)
    assert status.returncode == 0 and "atom-ray" in status.stdout, status.stderr[-2000:]
    ray_status = subprocess.run(["ray", "status"], env={**tools, "RAY_ADDRESS": "auto"}, capture_output=True, text=True,
                                timeout=120)
    assert ray_status.returncode == 0 and "Resources" in ray_status.stdout, ray_status.stderr[-2000:]
    # Another Ray job, as the README shows it, with nothing set: Ray finds the token file by itself.
    driver = textwrap.dedent("""
        import ray
        from ray import serve
        ray.init(address="auto", logging_level="ERROR")
        reply = serve.get_app_handle("atom-ray").generate.remote({"prompt": "The capital of France is",
                                                                 "max_tokens": 4, "temperature": 0}).result()
        print("REPLY", reply["text"])
    """)
    joined = subprocess.run([sys.executable, "-c", driver], env={**env, "RAY_ADDRESS": "auto"}, capture_output=True,
                            text=True, timeout=180)
    assert joined.returncode == 0 and "Paris" in joined.stdout, joined.stderr[-2000:]
    stranger = {**env, "RAY_ADDRESS": "auto", "HOME": tempfile.mkdtemp(prefix="ar-stranger-"), "RAY_AUTH_MODE": "token"}
    refused = subprocess.run([sys.executable, "-c", "import ray; ray.init(address='auto')"], env=stranger,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "token" in refused.stderr.lower(), refused.stderr[-2000:]
    shutil.rmtree(stranger["HOME"], ignore_errors=True)


def test_atom_ray_serve_command_starts_its_own_local_ray(isolated_ray_env):
    """With no cluster to join it starts one on 127.0.0.1 with token authentication and Serve's HAProxy
    ingress in front of the replica, prints the URL, streams completions (a client that leaves mid-stream
    gets its KV blocks freed), opens no control endpoint to callers without the token while `serve status`
    with the token works, and cleans up on Ctrl-C within 10 s, without warnings."""
    from openai import OpenAI

    from atom_ray.cluster import haproxy_available
    port = free_port()
    haproxy_folders = set(glob.glob("/tmp/arh-*"))
    process = subprocess.Popen([sys.executable, "-m", "atom_ray.cli", "serve", "--port", str(port),
                                "--max-model-len", "2048", "--max-num-seqs", "2", "--max-num-batched-tokens", "64",
                                "--dashboard"], cwd=ROOT, env=isolated_ray_env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    healthy = False
    try:
        wait_healthy(f"{base}/health", timeout=400)
        healthy = True
        if haproxy_available() and shutil.which("ss"):
            listening = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True).stdout
            assert "haproxy" in listening, listening  # the port is HAProxy's, not Serve's Python proxy
        models = requests.get(f"{base}/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == "smollm2-135m"
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=8,
                                           temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "Paris" in "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens == 8
        assert_leaving_mid_stream_frees_kv_blocks(base, "smollm2-135m", max_tokens=900)
        assert_cancellations_leave_nothing_behind(base, "smollm2-135m")
        assert_no_open_control_endpoint(process.pid)
        assert_ray_tools_work_with_the_token_and_not_without(isolated_ray_env)
    finally:
        stopping = time.monotonic()
        output = stop(process)
        stop_seconds = time.monotonic() - stopping
        if not healthy:
            print(output[-6000:])
    assert f"{base}/v1" in output
    assert process.returncode == 0, output[-3000:]
    assert stop_seconds < 10, output[-3000:]
    tail = output[output.index("shutting down"):]
    assert "WARNING" not in tail and "Traceback" not in tail, tail[-3000:]
    assert set(glob.glob("/tmp/arh-*")) <= haproxy_folders  # its HAProxy folder went with it


@pytest.mark.parametrize("args, field", [({"gpus_per_rank": 2}, "gpus_per_rank"), ({"gpus_per_rank": 0}, "gpus_per_rank"),
                                         ({"cpus_per_rank": 0}, "cpus_per_rank"), ({"tensor_parallel": 2}, "tensor_parallel")])
def test_bad_app_args_fail_at_build_naming_the_field(args, field):
    from deployments.serve_app import build_app
    with pytest.raises(ValueError, match=f"(?s)invalid atom-ray app args.*{field}"):
        build_app(args)


@pytest.mark.parametrize("path", sorted((ROOT / "deployments" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_serve_config_builds(path, monkeypatch):
    from atom_ray.serving import build_application, load_serve_config
    monkeypatch.setenv("ATOM_RAY_API_KEY", "sk-test")
    for app in load_serve_config(str(path))["applications"]:
        build_application(app["import_path"], app["args"])


def test_a_config_reachable_from_other_machines_refuses_to_start_without_an_api_key(monkeypatch):
    from atom_ray.serving import build_application, load_serve_config
    config = load_serve_config(str(ROOT / "deployments" / "configs" / "mi355x_tp8.yaml"))
    assert config["http_options"]["host"] == "0.0.0.0"
    monkeypatch.delenv("ATOM_RAY_API_KEY", raising=False)
    app = config["applications"][0]
    with pytest.raises(ValueError, match="requires an API key.*ATOM_RAY_API_KEY"):
        build_application(app["import_path"], app["args"])

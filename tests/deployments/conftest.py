"""The OpenAI app served over real HTTP (uvicorn on 127.0.0.1 in a background thread) in front of an
in-process AsyncLLM running the packaged SmolLM2 model, plus wrappers that make the engine fail on demand."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass

import openai
import pytest
import requests
import uvicorn

from deployments.openai import build_openai_app
from engine.async_llm import AsyncLLM
from engine.config import EngineConfig

SERVED_MODEL = "smollm2"


@dataclass
class Served:
    base_url: str
    app: object
    model: str = SERVED_MODEL

    @property
    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="x", max_retries=0, timeout=60)

    def post(self, path: str, json=None, data=None, **kwargs) -> requests.Response:
        headers = {"Content-Type": "application/json"} if data is not None else None
        return requests.post(f"{self.base_url}{path}", json=json, data=data, headers=headers, timeout=60, **kwargs)

    def get(self, path: str) -> requests.Response:
        return requests.get(f"{self.base_url}{path}", timeout=30)


@contextlib.contextmanager
def serve(app):
    """Serve `app` on a free loopback port until the block ends."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield Served(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture(scope="session")
def engine():
    llm = AsyncLLM.from_config(EngineConfig("smollm2-135m"))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def server(engine):
    with serve(build_openai_app(engine, SERVED_MODEL)) as served:
        yield served


@pytest.fixture
def limited_server(engine):
    """A second app on the same engine that lets one generation request in at a time."""
    with serve(build_openai_app(engine, SERVED_MODEL, max_pending_sequences=1)) as served:
        yield served


class ControllableClient:
    """The engine client interface over the real AsyncLLM, which tests can make unhealthy or failing."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.healthy = True
        self.failure: BaseException | None = None  # raised by generate() for every request while set
        self.failure_after_first_output: BaseException | None = None
        self.abort_times: dict[str, float] = {}  # request id -> when the app asked to abort it

    @property
    def is_healthy(self) -> bool:
        return self.healthy

    async def generate(self, prompt, params, request_id=None):
        if self.failure is not None:
            raise self.failure
        async for output in self.engine.generate(prompt, params, request_id):
            yield output
            if self.failure_after_first_output is not None:
                raise self.failure_after_first_output

    def abort(self, request_id: str) -> None:
        self.abort_times.setdefault(request_id, time.monotonic())
        self.engine.abort(request_id)

    def stats(self) -> dict:
        return self.engine.stats()


@pytest.fixture
def controllable(engine):
    client = ControllableClient(engine)
    with serve(build_openai_app(client, SERVED_MODEL)) as served:
        yield client, served


def wait_until_engine_idle(engine: AsyncLLM, timeout: float = 30.0) -> dict:
    """Poll until no request runs or waits and every KV block is free; returns the last stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        idle = (stats["num_running"] == 0 and stats["num_waiting"] == 0
                and stats["num_free_kv_blocks"] == stats["num_kv_blocks"])
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


@pytest.fixture
def idle_engine(engine):
    """The engine, checked idle before the test (so a test sees only its own requests)."""
    stats = wait_until_engine_idle(engine)
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    return engine


@pytest.fixture
def wait_idle():
    return wait_until_engine_idle


@pytest.fixture(scope="session")
def serve_app():
    """serve(app) as a fixture: a context manager serving an app of the test's own on a free loopback port."""
    return serve

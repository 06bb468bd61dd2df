"""`atom-ray serve`: deploy the OpenAI app (or the applications of a serve config) on Ray Serve, wait
until it answers, print the URL, and clean up on Ctrl-C."""
from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

DEFAULT_APP_NAME = "atom-ray"


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    address: str | None = None
    config_path: str | None = None
    dashboard: bool = False
    ready_timeout_s: float = 900.0


def load_serve_config(path: str) -> dict:
    import yaml
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"serve config {path} does not exist")
    try:
        config = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"serve config {path} is not valid YAML: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("applications"), list) or not config["applications"]:
        raise ValueError(f"serve config {path} needs a non-empty 'applications' list")
    for app in config["applications"]:
        if not isinstance(app, dict) or ":" not in str(app.get("import_path", "")):
            raise ValueError(f"serve config {path}: every application needs import_path 'module:builder'")
    return config


def build_application(import_path: str, args: dict):
    module_name, _, attribute = import_path.partition(":")
    builder = getattr(importlib.import_module(module_name), attribute)
    return builder(args or {})


def wait_until_healthy(url: str, timeout_s: float, stop: threading.Event | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            raise KeyboardInterrupt
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not become healthy within {timeout_s:.0f}s")


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
API_KEY_ENV = "ATOM_RAY_API_KEY"


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """What to tell the operator when the OpenAI API listens beyond loopback without a key (None: nothing)."""
    if host in LOOPBACK_HOSTS or api_key or os.environ.get(API_KEY_ENV):
        return None
    return (f"the OpenAI API listens on {host} without an API key: anyone who can reach it can use the model. "
            f"Pass --api-key, or set {API_KEY_ENV} (or api_key in the app args).")


def deploy(options: ServeOptions, app_args: dict, stop: threading.Event | None = None) -> list[tuple[str, str]]:
    """Deploy and wait until every app answers /health. Returns (name, url prefix) per application."""
    from ray import serve
    if options.config_path:
        config = load_serve_config(options.config_path)
        http = config.get("http_options") or {}
        host, port = http.get("host", options.host), http.get("port", options.port)
        apps = [(a.get("name", DEFAULT_APP_NAME), a.get("route_prefix", "/"), a["import_path"], a.get("args") or {})
                for a in config["applications"]]
    else:
        host, port = options.host, options.port
        apps = [(DEFAULT_APP_NAME, "/", "deployments.serve_app:build_app", app_args)]
    built = [(name, prefix, build_application(path, args)) for name, prefix, path, args in apps]
    for name, _, _, args in apps:
        warning = exposure_warning(host, args.get("api_key"))
        if warning:
            print(f"atom-ray: WARNING: {name}: {warning}", file=sys.stderr, flush=True)
    serve.start(http_options={"host": host, "port": port})
    served = []
    for name, prefix, application in built:
        serve.run(application, name=name, route_prefix=prefix, blocking=False)
        base = f"http://{host}:{port}{prefix.rstrip('/')}"
        wait_until_healthy(f"{base}/health", options.ready_timeout_s, stop)
        served.append((name, base))
    return served


def serve_until_interrupted(options: ServeOptions, app_args: dict) -> int:
    """On a cluster this command started, Ctrl-C stops everything; on a cluster it joined, it deletes
    only its own applications."""
    import ray
    from ray import serve
    from atom_ray.cluster import ensure_ray
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    started_ray = ensure_ray(options.address, join_running=False, dashboard=options.dashboard)
    served = []
    try:
        served = deploy(options, app_args, stop)
        for name, base in served:
            print(f"atom-ray: {name} is serving at {base}/v1 (OpenAI-compatible). Ctrl-C to stop.", flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        print("atom-ray: shutting down", flush=True)
        if started_ray:
            serve.shutdown()
        else:
            for name, _ in served:
                serve.delete(name)
        ray.shutdown()
    return 0

"""Shared fixtures: tiny random checkpoints of every architecture and the packaged SmolLM2 model."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# Keep the tokenizer cache and Ray inside the test run, bound to loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: tiny_models.make_tiny_model(root / arch, arch) for arch in tiny_models.ARCHITECTURES}


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dirs) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def smollm2():
    from engine import LLM
    return LLM("smollm2-135m", show_progress=False)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster on 127.0.0.1 for the whole run; yields its GCS address."""
    import ray
    ray.init(num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING")
    yield ray.get_runtime_context().gcs_address
    from ray import serve
    serve.shutdown()
    ray.shutdown()

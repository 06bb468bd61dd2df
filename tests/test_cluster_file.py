"""cluster.yaml is a valid `ray up` file for on-premise MI355X nodes."""
from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def load_cluster_file() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def test_cluster_file_passes_rays_own_schema():
    import json

    import jsonschema
    import ray
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(load_cluster_file(), schema)


def test_cluster_file_passes_ray_up_validation_after_defaults():
    from ray.autoscaler._private.util import prepare_config, validate_config
    validate_config(prepare_config(load_cluster_file()))


def test_cluster_file_is_accepted_by_rays_on_premise_provider():
    from ray.autoscaler._private.local.config import prepare_local
    prepared, _ = prepare_local(load_cluster_file())
    assert prepared["max_workers"] == len(prepared["provider"]["worker_ips"])


def test_containers_get_the_rocm_devices_and_the_project_is_installed():
    config = load_cluster_file()
    options = " ".join(config["docker"]["run_options"])
    for flag in ("--device=/dev/kfd", "--device=/dev/dri", "--group-add=video", "--ipc=host", "--shm-size"):
        assert flag in options
    assert any("atom-ray" in command and "pip install" in command for command in config["setup_commands"])
    assert any("--head" in command and "6379" in command for command in config["head_start_ray_commands"])
    assert any("$RAY_HEAD_IP:6379" in command for command in config["worker_start_ray_commands"])

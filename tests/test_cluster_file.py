"""cluster.yaml is a valid `ray up` file for on-premise MI355X nodes, with token auth and least-privilege containers."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_FILE = ROOT / "cluster.yaml"
HEAD_IP = "10.0.0.10"


def load_cluster_file() -> dict:
    return yaml.safe_load(CLUSTER_FILE.read_text())


def ray_start_command(commands: list[str]) -> str:
    (command,) = [command for command in commands if "ray start" in command]
    return command


def all_run_options(config: dict) -> list[str]:
    docker = config["docker"]
    return docker.get("run_options", []) + docker.get("head_run_options", []) + docker.get("worker_run_options", [])


def container_env(config: dict) -> dict[str, str]:
    """The variables `docker run` gives the container, hence every `docker exec` that `ray up`/`ray exec` runs in it."""
    env = {}
    for option in all_run_options(config):
        match = re.fullmatch(r"(?:--env[= ]|-e )(\w+)=(.*)", option)
        if match:
            env[match[1]] = match[2]
    return env


def secrets_dir(config: dict) -> str:
    return os.path.dirname(container_env(config)["RAY_AUTH_TOKEN_PATH"])


def commented_list_items(key: str) -> list[tuple[str, bool]]:
    """Each item of the YAML list under `key:`, and whether a comment explains it (on its line or just above).

    yaml.safe_load drops comments, so this reads the raw text.
    """
    lines = CLUSTER_FILE.read_text().splitlines()
    (start,) = [i for i, line in enumerate(lines) if line.strip() == f"{key}:"]
    indent = len(lines[start]) - len(lines[start].lstrip())
    items, comment_above = [], False
    for line in lines[start + 1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            comment_above = True
            continue
        if not stripped or len(line) - len(line.lstrip()) <= indent:
            break
        items.append((stripped, comment_above or re.search(r"\s#\s*\S", stripped) is not None))
        comment_above = False
    return items


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
    for flag in ("--device=/dev/kfd", "--device=/dev/dri", "--group-add=video", "--shm-size"):
        assert flag in options
    assert any("atom-ray" in command and "pip install" in command for command in config["setup_commands"])
    assert any("--head" in command and "6379" in command for command in config["head_start_ray_commands"])
    assert any("$RAY_HEAD_IP:6379" in command for command in config["worker_start_ray_commands"])


def test_dashboard_listens_on_the_heads_loopback_only():
    config = load_cluster_file()
    head = ray_start_command(config["head_start_ray_commands"])
    assert re.findall(r"--dashboard-host[= ](\S+)", head) == ["127.0.0.1"]
    assert "--dashboard-host" not in ray_start_command(config["worker_start_ray_commands"])


def test_no_ray_client_server_port_is_opened():
    config = load_cluster_file()
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert not any("--ray-client-server-port" in command for command in config[key])


def test_token_auth_is_on_for_both_ray_starts_and_in_the_containers():
    config = load_cluster_file()
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert "RAY_AUTH_MODE=token" in ray_start_command(config[key]).split()
    assert container_env(config)["RAY_AUTH_MODE"] == "token"


def test_the_token_is_a_file_shipped_to_every_node_from_outside_the_checkout():
    config = load_cluster_file()
    token_path = container_env(config)["RAY_AUTH_TOKEN_PATH"]
    assert os.path.isabs(token_path)
    local_folder = config["file_mounts"][secrets_dir(config)]
    assert not Path(os.path.expanduser(local_folder)).resolve().is_relative_to(ROOT)
    assert "RAY_AUTH_TOKEN=" not in CLUSTER_FILE.read_text()


def test_image_is_pinned_to_a_tag():
    docker = load_cluster_file()["docker"]
    for image in {docker["image"], docker.get("head_image", docker["image"]), docker.get("worker_image", docker["image"])}:
        name, _, _digest = image.partition("@")
        _repository, colon, tag = name.rpartition(":")
        assert colon and "/" not in tag and tag != "latest", image


def test_ray_and_aiter_are_pinned():
    requirements = []
    for command in load_cluster_file()["setup_commands"]:
        words = shlex.split(command)
        if words[:2] == ["pip", "install"]:
            requirements += [word for previous, word in zip(words, words[1:]) if not word.startswith("-") and previous != "-e"]
    pinned = {re.split(r"[\[=<>!~]", requirement)[0]: requirement for requirement in requirements}
    assert re.fullmatch(r"ray\[serve\]==2\.60\.0", pinned["ray"])
    assert re.fullmatch(r"amd-aiter==[\w.]+", pinned["amd-aiter"])
    assert not any("aiter" in command and "git clone" in command for command in load_cluster_file()["setup_commands"])


def test_containers_get_no_blanket_privileges():
    options = all_run_options(load_cluster_file())
    joined = " ".join(options)
    assert "--privileged" not in joined
    assert "unconfined" not in joined  # seccomp and AppArmor profiles stay on
    capabilities = {cap.upper().removeprefix("CAP_") for cap in re.findall(r"--cap-add[= ](\S+)", joined)}
    assert not capabilities & {"SYS_PTRACE", "SYS_ADMIN", "ALL"}


def test_every_run_option_says_why_in_a_comment():
    for key in ("run_options", "head_run_options", "worker_run_options"):
        if key not in load_cluster_file()["docker"]:
            continue
        items = commented_list_items(key)
        assert len(items) == len(load_cluster_file()["docker"][key])
        for item, explained in items:
            assert explained, f"run option without a comment: {item}"


def test_run_options_leave_host_networking_to_ray():
    # Ray's `docker run` adds --net=host itself; a second network flag makes docker refuse to start the container.
    from ray.autoscaler._private.docker import docker_start_cmds
    config = load_cluster_file()
    docker_run = docker_start_cmds("amd", config["docker"]["image"], config["file_mounts"], "atom_ray",
                                   all_run_options(config), config["cluster_name"], "/root", "docker")
    assert len(re.findall(r"--net(?:work)?[= ]", docker_run)) == 1
    assert f"-v /tmp/ray_tmp_mount/{config['cluster_name']}/{secrets_dir(config)}:{secrets_dir(config)}" in docker_run


def test_haproxy_runs_through_the_wrapper_wherever_it_is_enabled():
    config = load_cluster_file()
    commands = config["setup_commands"] + config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    enabled = [command for command in commands if "RAY_SERVE_ENABLE_HA_PROXY=1" in command]
    assert ray_start_command(config["head_start_ray_commands"]) in enabled
    assert ray_start_command(config["worker_start_ray_commands"]) in enabled
    for command in enabled:
        assert 'RAY_SERVE_HAPROXY_BINARY_PATH="$(command -v atom-ray-haproxy)"' in command


# What `ray up` really runs: each start command goes through Ray's own wrapping (exports, login shell, docker exec)
# and then, with a stand-in `docker` that runs it here with the container's environment, to a stand-in `ray`.

def run_start_command(tmp_path: Path, key: str, *, api_key: bool = True, wrapper: bool = True):
    from ray.autoscaler._private.command_runner import DockerCommandRunner
    from ray.autoscaler._private.util import with_head_node_ip

    config = load_cluster_file()
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "ray_auth_token").write_text("0123456789abcdef\n")
    if api_key:
        (secrets / "api_key").write_text("test-api-key\n")

    sent = []

    class RecordingSSH:
        def run(self, cmd, **kwargs):
            sent.append(cmd)

    runner = DockerCommandRunner(config["docker"], log_prefix="", node_id="head", provider=None,
                                 auth_config=config["auth"], cluster_name=config["cluster_name"],
                                 process_runner=subprocess, use_internal_ip=False)
    runner.ssh_command_runner, runner.home_dir = RecordingSSH(), "/root"
    runner.run(ray_start_command(with_head_node_ip(config[key], HEAD_IP)), environment_variables={}, run_env="auto")
    (docker_exec,) = sent

    bin_dir, home = tmp_path / "bin", tmp_path / "home"
    bin_dir.mkdir()
    home.mkdir()
    (home / ".bashrc").write_text(f'export PATH="{bin_dir}:$PATH"\n')  # a login shell may reset PATH
    env_flags = " ".join(f"{name}={value.replace(secrets_dir(config), str(secrets))}"
                         for name, value in container_env(config).items())
    stubs = {
        "docker": f'#!/bin/bash\nshift; [ "$1" = -it ] && shift; shift\nexec env {env_flags} "$@"\n',
        "ray": f'#!/bin/bash\nenv > "{tmp_path}/ray.env"\necho "$@" > "{tmp_path}/ray.args"\n',
    }
    if wrapper:
        stubs["atom-ray-haproxy"] = "#!/bin/sh\n"
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)

    command = docker_exec.replace(secrets_dir(config), str(secrets))
    result = subprocess.run(["bash", "-c", command], env={"HOME": str(home), "PATH": f"{bin_dir}:/usr/bin:/bin"},
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    ray_env = None
    if (tmp_path / "ray.env").exists():
        ray_env = dict(line.split("=", 1) for line in (tmp_path / "ray.env").read_text().splitlines() if "=" in line)
        ray_env["argv"] = (tmp_path / "ray.args").read_text().split()
    return result, ray_env, secrets


@pytest.mark.parametrize("key", ["head_start_ray_commands", "worker_start_ray_commands"])
def test_ray_start_gets_the_token_file_the_api_key_and_the_haproxy_wrapper(tmp_path, key):
    result, ray_env, secrets = run_start_command(tmp_path, key)
    assert result.returncode == 0, result.stderr
    assert ray_env["RAY_AUTH_MODE"] == "token"
    assert ray_env["RAY_AUTH_TOKEN_PATH"] == str(secrets / "ray_auth_token")
    assert ray_env["ATOM_RAY_API_KEY"] == "test-api-key"
    assert ray_env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert ray_env["RAY_SERVE_HAPROXY_BINARY_PATH"] == str(tmp_path / "bin" / "atom-ray-haproxy")
    assert ray_env["argv"][0] == "start"
    if key == "worker_start_ray_commands":
        assert f"--address={HEAD_IP}:6379" in ray_env["argv"]


@pytest.mark.parametrize("missing", ["api_key", "wrapper"])
def test_ray_does_not_start_without_the_api_key_or_the_haproxy_wrapper(tmp_path, missing):
    result, ray_env, _ = run_start_command(tmp_path, "head_start_ray_commands",
                                           api_key=missing != "api_key", wrapper=missing != "wrapper")
    assert result.returncode != 0
    assert ray_env is None
    assert ("API key" if missing == "api_key" else "atom-ray-haproxy") in result.stderr

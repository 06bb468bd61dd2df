"""`atom-ray bundle`: a compact archive of Ray, Ray Serve's HTTP stack and atom-ray itself, for GPU hosts
without network access that already have torch, transformers and the common scientific stack.

Built on a connected machine with `pip download` for the host's Python and platform; unpacked there
onto PYTHONPATH:

    atom-ray bundle --python-version 3.12 --grpcio-version 1.84.0 --out atom-ray-bundle.tar.xz
    mkdir -p /opt/atom-ray && tar -xJf atom-ray-bundle.tar.xz -C /opt/atom-ray
    export PYTHONPATH=/opt/atom-ray:$PYTHONPATH
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

# What a host with torch/transformers/aiohttp/grpcio/protobuf/pyyaml/requests lacks for Ray, Serve and
# the OpenAI app (checked by starting Ray and Serve in an environment holding only those packages).
PACKAGES = [
    "fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
    "annotated-doc", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py", "opentelemetry-api",
    "llguidance",  # structured output (a main dependency the engine imports only when a request asks for it)
]
# Parts of the Ray wheel that serving never imports (Java, the dashboard's web build, the ML libraries).
PRUNED = ["ray/jars", "ray/dashboard/client/build", "ray/rllib", "ray/tune", "ray/train", "ray/data", "ray/air",
          "ray/llm", "ray/serve/llm", "ray/util/dask", "ray/util/spark", "ray/workflow"]
PROJECT_PACKAGES = ["engine", "atom_ray", "deployments", "benchmarks"]
# llguidance's wheels are manylinux_2_31 (glibc 2.31 and later, as the GPU hosts' images are).
PLATFORMS = ["manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]


def download_wheels(target: Path, python_version: str, ray_version: str, grpcio_version: str,
                    extra: list[str]) -> None:
    requirements = [f"ray=={ray_version}", f"grpcio-reflection=={grpcio_version}", *PACKAGES, *extra]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", python_version, "--implementation", "cp", "-d", str(target)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run(command + requirements, check=True)


def unpack(wheels: Path, site: Path) -> None:
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            for entry in archive.infolist():
                path = archive.extract(entry, site)
                mode = entry.external_attr >> 16  # zipfile drops Unix modes: Ray's binaries need +x
                if mode & 0o111:
                    os.chmod(path, mode & 0o777)
    for relative in PRUNED:
        shutil.rmtree(site / relative, ignore_errors=True)
    for cache in site.rglob("__pycache__"):
        shutil.rmtree(cache, ignore_errors=True)


def build_bundle(out: Path, python_version: str, grpcio_version: str, extra: list[str] | None = None,
                 with_project: bool = True) -> Path:
    import ray
    with tempfile.TemporaryDirectory() as tmp:
        wheels, site = Path(tmp) / "wheels", Path(tmp) / "site"
        download_wheels(wheels, python_version, ray.__version__, grpcio_version, extra or [])
        unpack(wheels, site)
        if with_project:
            root = Path(__file__).resolve().parent.parent
            for package in PROJECT_PACKAGES:
                shutil.copytree(root / package, site / package, ignore=shutil.ignore_patterns("__pycache__"))
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w:xz", preset=9) as archive:
            for entry in sorted(site.iterdir()):
                archive.add(entry, arcname=entry.name)
    return out

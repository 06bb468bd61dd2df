"""The `atom-ray generate` command."""
from __future__ import annotations

import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "atom_ray.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_streams_the_completion_to_stdout():
    result = run_cli("generate", "--prompt", "The capital of France is", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_invalid_engine_flag_is_a_clear_error():
    result = run_cli("generate", "--prompt", "hi", "--block-size", "24")
    assert result.returncode == 2
    assert "EngineConfig.block_size must be a power of two" in result.stderr

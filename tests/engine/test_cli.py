"""The `atom-ray generate` and `atom-ray kernels` commands."""
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


def test_kernels_lists_the_mla_ops_and_refuses_a_backend_this_machine_cannot_run(capsys):
    """`atom-ray kernels` for DeepSeek-V3's real shape (dummy weights: nothing is loaded); asking for the
    Triton backend on a CPU is a clear error, not a traceback."""
    from atom_ray.cli import main
    from pathlib import Path
    model = str(Path(__file__).parents[2] / "benchmarks" / "configs" / "deepseek-v3")
    assert main(["kernels", "--model", model, "--load-format", "dummy"]) == 0
    table = capsys.readouterr().out
    assert "mla_attention" in table and "mla_sparse_attention" in table
    assert main(["kernels", "--model", model, "--load-format", "dummy", "--kernel-backend", "triton"]) == 2
    assert "kernel_backend='triton' cannot run on cpu" in capsys.readouterr().err


def test_speculative_config_flag_takes_a_json_object_and_names_what_is_wrong():
    import argparse
    from atom_ray.engine_args import add_engine_arguments, engine_kwargs_from_args
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_arguments(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert engine_kwargs_from_args(args) == {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    result = run_cli("generate", "--prompt", "hi", "--speculative-config", '{"method": "ngram"}')
    assert result.returncode == 2 and "speculative_config.num_speculative_tokens is required" in result.stderr
    result = run_cli("generate", "--prompt", "hi", "--speculative-config", "ngram")
    assert result.returncode == 2 and "not valid JSON" in result.stderr

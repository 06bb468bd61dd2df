"""benchmarks/validate_rocm.py, the command that certifies a ROCm host, run on the CPU against the AITER double
for both emulated GPUs: every check passes there (the double computes what AITER documents), the table names
every op, and a kernel that computes something else fails the run."""
from __future__ import annotations

import json

import pytest

from benchmarks import validate_rocm
from engine.kernels.registry import OPS


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("validate-rocm-models")  # trained once for both arches


@pytest.mark.parametrize("arch", ["gfx950", "gfx942"])
def test_the_validation_passes_on_the_double_and_prints_its_table(arch, models_dir, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert validate_rocm.main(["--double", arch, "--quick", "--out", str(out), "--models-dir", str(models_dir)]) == 0
    printed = capsys.readouterr().out
    assert f"aiter on {arch}" in printed and "FAIL" not in printed
    report = json.loads(out.read_text())
    assert report["passed"] and report["arch"] == arch
    checked = {row["op"].split(" ")[0] for row in report["checks"] if row["section"] == "op"}
    assert checked == set(OPS)
    for op in (*OPS, "attention", "attention fp8 KV (token)"):
        assert f"\n{op} " in printed, op
    models = {(row["op"], row["shape"].split(",")[0]) for row in report["checks"] if row["section"] == "model"}
    assert models == {(model, mode) for model in ("llama", "qwen3_moe", "llama fp8-block", "llama fp8 KV cache",
                                                  "deepseek_v3") for mode in ("teacher-forced", "greedy")}
    mla = [row["implementation"] for row in report["checks"] if row["op"].startswith("mla_")]
    assert mla and all(impl.startswith("aiter.") for impl in mla)
    mxfp4 = [row["implementation"] for row in report["checks"] if row["op"] == "gemm_mxfp4 w4a4"]
    if arch == "gfx942":  # no MXFP4 kernels: the fallback runs, and the table says why
        assert all("fallback: AITER's MXFP4 kernels need gfx950" in impl for impl in mxfp4)
    else:
        assert all(impl.startswith("aiter.") for impl in mxfp4)


def test_a_kernel_that_computes_something_else_fails_the_run(monkeypatch, capsys):
    from engine.kernels import aiter as aiter_backend
    rms_norm = aiter_backend.BACKEND.ops["rms_norm"]
    monkeypatch.setitem(aiter_backend.BACKEND.ops, "rms_norm", lambda x, weight, eps: rms_norm(x, weight, eps) * 1.05)
    assert validate_rocm.main(["--double", "gfx950", "--quick", "--no-models"]) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rms_norm ")]
    assert lines and all(line.split()[-1] == "FAIL" for line in lines)

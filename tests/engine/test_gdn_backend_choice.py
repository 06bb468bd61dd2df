"""Which Gated DeltaNet ops the Triton backend's table holds: flash-linear-attention's kernels only where `fla`
imports and a GPU is visible, else the torch references, with one log line saying which and why."""
from __future__ import annotations

import importlib
import logging
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels.torch import gdn as torch_gdn  # noqa: E402
from engine.kernels.triton import gdn  # noqa: E402

REFERENCES = {"causal_conv1d": torch_gdn.causal_conv1d, "gated_delta_rule": torch_gdn.gated_delta_rule}


def gdn_log(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == gdn.__name__]


def test_the_triton_table_holds_the_torch_references_when_fla_is_not_importable(caplog):
    """The table as the backend builds it at import, on a machine with a GPU but without fla."""
    import engine.kernels.triton as triton_backend
    try:
        with pytest.MonkeyPatch.context() as patch, caplog.at_level(logging.INFO, logger=gdn.__name__):
            patch.setattr(torch.cuda, "is_available", lambda: True)
            patch.setitem(sys.modules, "fla", None)
            gdn._fla.cache_clear()
            ops = importlib.reload(triton_backend).BACKEND.ops
    finally:
        gdn._fla.cache_clear()
        importlib.reload(triton_backend)  # this machine's own table again
    assert {name: ops[name] for name in REFERENCES} == REFERENCES
    [line] = gdn_log(caplog)
    assert "torch references" in line and "flash-linear-attention is not importable" in line
    assert "atom-ray[gdn]" in line  # says what to install


def test_the_torch_references_without_a_gpu(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.INFO, logger=gdn.__name__):
        assert gdn.select_ops() == REFERENCES
    [line] = gdn_log(caplog)
    assert "torch references" in line and "no CUDA or ROCm GPU" in line


def test_the_fla_adapters_where_fla_imports_on_a_gpu(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gdn, "_fla", lambda: SimpleNamespace(version="0.6.0"))
    with caplog.at_level(logging.INFO, logger=gdn.__name__):
        assert gdn.select_ops() == {"causal_conv1d": gdn.causal_conv1d, "gated_delta_rule": gdn.gated_delta_rule}
    [line] = gdn_log(caplog)
    assert "flash-linear-attention 0.6.0" in line

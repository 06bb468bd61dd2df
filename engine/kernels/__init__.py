"""One dispatch point per operation. Layers call `ops.<name>(...)`; `activate` fills `ops` from the
chosen backend once, at start-up."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.kernels.registry import OPS, BackendUnavailable, KernelBackend, ModelFacts, resolve

ops = SimpleNamespace()
_active: KernelBackend | None = None


def activate(requested: str, device: torch.device, facts: ModelFacts | None = None) -> KernelBackend:
    global _active
    backend = resolve(requested, device, facts)
    ops.__dict__.clear()
    ops.__dict__.update(backend.ops)
    _active = backend
    return backend


def active_backend() -> KernelBackend:
    assert _active is not None
    return _active


activate("torch", torch.device("cpu"))  # a usable default until an engine chooses


__all__ = ["OPS", "BackendUnavailable", "KernelBackend", "ModelFacts", "activate", "active_backend", "ops"]

"""A test double of AMD's AITER kernel library (amd-aiter 0.1.7.post2.dev18) for CPU-only CI.

`with activate("gfx942") as aiter:` makes `import aiter` return the double (tests/aiter_double/fake)
emulating that GPU; CALLS counts the public aiter functions called meanwhile, by name ("fused_moe",
"pa_fwd_asm", "tgemm.mm", ...); `with serving("gfx950"):` also lets kernel_backend="aiter" run on this
machine. tests/engine/test_aiter_api_drift.py keeps its signatures equal to the real package's;
tests/engine/test_aiter_double.py checks its layouts.
"""
from __future__ import annotations

import collections
import contextlib
import importlib
import os
import sys
from pathlib import Path

FAKE_ROOT = Path(__file__).parent / "fake"
ARCHES = ("gfx942", "gfx950")  # MI300X (fp8 = float8_e4m3fnuz), MI355X (fp8 = float8_e4m3fn)
CALLS: collections.Counter = collections.Counter()


def _aiter_modules() -> dict:
    return {name: module for name, module in sys.modules.items() if name == "aiter" or name.startswith("aiter.")}


@contextlib.contextmanager
def activate(arch: str = "gfx950"):
    """Import the double as `aiter` for the emulated GPU `arch`; restore sys.path, sys.modules and
    GPU_ARCHS (which the real and the double's get_gfx read) on exit. Resets CALLS."""
    if arch not in ARCHES:
        raise ValueError(f"the aiter double emulates {ARCHES}, not {arch!r}")
    saved_path, saved_modules = list(sys.path), _aiter_modules()
    saved_arch = os.environ.get("GPU_ARCHS")
    for name in saved_modules:
        del sys.modules[name]
    sys.path.insert(0, str(FAKE_ROOT))
    os.environ["GPU_ARCHS"] = arch
    importlib.invalidate_caches()
    CALLS.clear()
    try:
        aiter = importlib.import_module("aiter")
        if not getattr(aiter, "__atom_ray_double__", False):
            raise ImportError(f"`import aiter` found {aiter.__file__}, not the double")
        importlib.import_module("aiter._double.recording").CALLS = CALLS
        yield aiter
    finally:
        for name in _aiter_modules():
            del sys.modules[name]
        sys.modules.update(saved_modules)
        sys.path[:] = saved_path
        if saved_arch is None:
            os.environ.pop("GPU_ARCHS", None)
        else:
            os.environ["GPU_ARCHS"] = saved_arch
        _leave_no_aiter_backend_active()


def _leave_no_aiter_backend_active() -> None:
    """An engine built meanwhile left the aiter backend active (global state): later layers would call the
    real `aiter`. Back to the torch reference."""
    import torch
    from engine import kernels
    backend = kernels.active_backend()
    if backend.name == "aiter":
        kernels.activate("torch", torch.device("cpu"))


@contextlib.contextmanager
def serving(arch: str = "gfx950"):
    """`activate(arch)`, with the engine's aiter backend allowed on this machine (its `available` check
    passes): kernel_backend="aiter" then runs on the double as on a ROCm host with AITER installed."""
    import engine.kernels.aiter as backend
    from engine.kernels.aiter import ops
    available = backend.available
    backend.available = lambda device: None
    ops.gfx.cache_clear()  # the arch is read once per process
    try:
        with activate(arch) as aiter:
            yield aiter
    finally:
        backend.available = available
        ops.gfx.cache_clear()

"""A test double of AMD's MORI (amd-mori 1.2.4) expert-parallel dispatch/combine, for CPU-only CI.

`with activate() as mori:` makes `import mori` return the double (tests/mori_double/fake): the names and
parameters of the real `mori.shmem` and `mori.ops` that engine/parallel/mori_all_to_all.py uses, their
semantics emulated with torch.distributed collectives over the process group registered for shmem (gloo
on CPU), so that a few CPU processes exchange tokens as MORI's IntraNode kernels would.
tests/engine/test_mori_all_to_all.py keeps its signatures equal to the real package's.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path

FAKE_ROOT = Path(__file__).parent / "fake"


def _mori_modules() -> dict:
    return {name: module for name, module in sys.modules.items() if name == "mori" or name.startswith("mori.")}


@contextlib.contextmanager
def activate():
    """Import the double as `mori`; restore sys.path and sys.modules on exit."""
    saved_path, saved_modules = list(sys.path), _mori_modules()
    for name in saved_modules:
        del sys.modules[name]
    sys.path.insert(0, str(FAKE_ROOT))
    importlib.invalidate_caches()
    try:
        mori = importlib.import_module("mori")
        if not getattr(mori, "__atom_ray_double__", False):
            raise ImportError(f"`import mori` found {mori.__file__}, not the double")
        yield mori
    finally:
        for name in _mori_modules():
            del sys.modules[name]
        sys.modules.update(saved_modules)
        sys.path[:] = saved_path

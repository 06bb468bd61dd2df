"""Where the Triton kernel tests run: compiled on a CUDA GPU, else under TRITON_INTERPRET=1 on CPU
(tests/engine/kernels/conftest.py sets it before any kernel module is imported); a test module that imports
this is skipped without Triton, or with neither a GPU nor the interpreter."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if INTERPRETED:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("no GPU and TRITON_INTERPRET is off", allow_module_level=True)
ON_GPU = DEVICE == "cuda"

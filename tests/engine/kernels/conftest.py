"""Kernel tests run the Triton kernels on a GPU when there is one, else under Triton's interpreter on CPU;
the switch has to be set before any kernel module is imported. Every test draws its random inputs from a seed
of its own name: fresh inputs per test, reproducible."""
from __future__ import annotations

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def fresh_seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))

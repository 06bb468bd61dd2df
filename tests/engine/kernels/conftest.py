"""Kernel tests run the Triton kernels on a GPU when there is one, else under Triton's interpreter on CPU;
the switch has to be set before any kernel module is imported."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

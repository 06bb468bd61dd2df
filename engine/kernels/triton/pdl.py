"""Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the kernel
before it in the stream is still finishing, so consecutive small kernels (a batch-1 decode step is ~300 of
them) stop paying a full launch gap each.

Every kernel of this backend that is launched this way calls `enter` first: it waits until the previous
kernel has finished and its writes are visible (so no read or write can race it), then lets the next
kernel start launching. Kernels that are not ours (cuBLAS, NCCL, torch) are launched normally; a kernel
after one of them finds it complete. Off on ROCm, before sm_90, under the interpreter, and with
ATOM_RAY_TRITON_PDL=0.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def enter():
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    if torch.version.hip or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    if os.environ.get("ATOM_RAY_TRITON_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_options(tensor: torch.Tensor) -> dict:
    """Keyword arguments for a launch on `tensor`'s device: the kernel's USE_PDL flag, and the launch
    attribute where it is on."""
    if tensor.device.type == "cuda" and _supported(tensor.device.index if tensor.device.index is not None
                                                   else torch.cuda.current_device()):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}

"""Device-wide state that several Triton kernels share: the arrival counters of kernels whose last program
combines the others' partial results, and the multiprocessor count that split rules aim to fill."""
from __future__ import annotations

import functools

import torch
import triton


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (compute units) of the device."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a small number keeps the split paths exercised at test sizes


_counters: dict[torch.device, torch.Tensor] = {}
_retired_counters: list[torch.Tensor] = []


def arrival_counters(device: torch.device, needed: int) -> torch.Tensor:
    """Arrival counters (int32, zero between launches: the program that arrives last resets its own), shared
    by every kernel and call on the device, which is safe while the kernels run one after another on one
    stream (under programmatic dependent launch each kernel waits for the one before it before it touches
    them). CUDA graphs bake in the address, so a buffer is never freed, and it is allocated outside capture:
    the eager warm-up step before each capture sizes it."""
    counters = _counters.get(device)
    if counters is None or counters.numel() < needed:
        assert device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), \
            "arrival counters must be allocated by an eager step before CUDA-graph capture"
        if counters is not None:
            _retired_counters.append(counters)  # graphs captured earlier still use it
        counters = _counters[device] = torch.zeros(max(1 << 16, triton.next_power_of_2(needed)), dtype=torch.int32,
                                                   device=device)
    return counters

"""The two ceilings every GPU figure is compared with, measured on the device in the same run:
memory bandwidth (a large device-to-device copy, bytes read plus written) and the bf16 matmul rate."""
from __future__ import annotations

import statistics

import torch


def _median_ms(fn, repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_bandwidth(num_bytes: int = 4 << 30, repeats: int = 10) -> float:
    """Device memory bandwidth in bytes/s."""
    src = torch.randn(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = _median_ms(lambda: dst.copy_(src), repeats) / 1000
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes / seconds


def measure_matmul_rate(size: int = 8192, repeats: int = 10) -> float:
    """bf16 matmul FLOP/s on random data."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    seconds = _median_ms(lambda: a @ b, repeats) / 1000
    del a, b
    torch.cuda.empty_cache()
    return 2 * size ** 3 / seconds


def device_limits() -> dict:
    return {"bandwidth_GBps": measure_bandwidth() / 1e9, "bf16_matmul_TFLOPs": measure_matmul_rate() / 1e12}

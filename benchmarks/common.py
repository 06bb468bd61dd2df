"""Helpers shared by the benchmark scripts: timing, the run's environment record, table printing."""
from __future__ import annotations

import platform
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path


def timed(fn) -> float:
    """Wall-clock seconds of one call (callers synchronize devices themselves)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def git_commit() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=root, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=root).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment_record() -> dict:
    import torch
    record = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
    }
    try:
        import transformers
        record["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        import triton
        record["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        record["device"] = torch.cuda.get_device_name()
    else:
        try:
            model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
            record["device"] = f"CPU: {model}"
        except (OSError, StopIteration):
            record["device"] = "CPU"
    return record


def print_table(headers: list[str], rows: list[tuple]) -> None:
    cells = [list(map(str, headers))] + [list(map(str, row)) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    line = "+".join("-" * (w + 2) for w in widths)
    for index, row in enumerate(cells):
        print(" | ".join(cell.ljust(width) for cell, width in zip(row, widths)))
        if index == 0:
            print(line)


def run_requests(engine, prompts: list, params: list) -> tuple[list, float]:
    """Generate through an LLMEngine's step loop: (final RequestOutputs in the prompts' order, seconds)."""
    ids = [engine.new_request_id() for _ in prompts]
    start = time.perf_counter()
    for request_id, prompt, p in zip(ids, prompts, params):
        engine.add_request(request_id, prompt, p)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return [finals[i] for i in ids], time.perf_counter() - start

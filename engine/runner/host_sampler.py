"""Diagnostics: where a rank process's threads spend their wall time, by sampling every thread's Python stack
at a fixed rate (a small in-process py-spy). Off unless ATOM_RAY_HOST_SAMPLE_HZ > 0 and
ATOM_RAY_STEP_TIMING_DIR is set (benchmarks/multi_gpu.py `--host-sample-hz`); it starts with the rank's first
step and writes `<name>.host.json` at shutdown.

A thread blocked in C code (a GPU sync, a collective, a lock, a socket) shows the Python frame that called
it, so the report covers waiting as well as work: for each thread, the share of samples in which a line was
the innermost Python frame's ("self") and in which a function was anywhere on the stack ("inclusive"). An engine
loop whose inclusive share sits mostly in its waits for the device is device-bound; one that spends it in
scheduling, input preparation or detokenization is what leaves the GPU idle between steps.

Each sample holds the GIL while it walks the stacks, which slows the threads it watches (a TP=2
engine sampled at 200 Hz ran at 1.07x of one GPU against 1.30x unsampled, on two machine starts:
docs/BENCHMARKS.md); a thread waiting to get the GIL back after a blocking call
shows as time in that call. Sample at 50 Hz or less."""
from __future__ import annotations

import json
import sys
import threading
from collections import Counter, defaultdict
from pathlib import Path


def frame_key(code, line: int | None = None) -> str:
    """`name (file:line)`: the function's first line, or `line` (the one running: the innermost frame's)."""
    return f"{code.co_name} ({Path(code.co_filename).name}:{code.co_firstlineno if line is None else line})"


class HostSampler:
    def __init__(self, path: str | Path, hz: float, top: int = 30) -> None:
        self.path, self.interval, self.top = Path(path), 1.0 / hz, top
        self.samples: Counter = Counter()                       # thread name -> samples
        self.own: dict[str, Counter] = defaultdict(Counter)     # thread name -> innermost frame -> samples
        self.inclusive: dict[str, Counter] = defaultdict(Counter)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="host-sampler", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample(skip=threading.get_ident())

    def sample(self, skip: int | None = None) -> None:
        """One sample of every thread's stack but `skip`'s."""
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == skip:
                continue
            name = names.get(ident, f"thread-{ident}")
            self.samples[name] += 1
            self.own[name][frame_key(frame.f_code, frame.f_lineno)] += 1
            seen = set()
            while frame is not None:
                key = frame_key(frame.f_code)
                if key not in seen:  # a recursive function counts once per sample
                    seen.add(key)
                    self.inclusive[name][key] += 1
                frame = frame.f_back

    def report(self) -> dict:
        def shares(counter: Counter, total: int) -> list[list]:
            return [[key, round(count / total, 4)] for key, count in counter.most_common(self.top)]
        return {"interval_s": self.interval, "threads": {
            name: {"samples": total, "self": shares(self.own[name], total),
                   "inclusive": shares(self.inclusive[name], total)}
            for name, total in self.samples.most_common()}}

    def stop(self) -> None:
        """Stop sampling and write the report (once)."""
        if self._thread is None or self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.report()))

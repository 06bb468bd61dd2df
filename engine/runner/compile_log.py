"""Diagnostics: the Triton kernel variants a rank process compiled, or loaded from Triton's disk cache, while it
served (`StepTimer` installs it; docs/BENCHMARKS.md). A variant first met in the middle of a timed run costs
its step seconds of compiling on a machine whose cache is cold, and only the first layout a benchmark runs on
a fresh machine pays it: its figures, and every ratio against them, are then off. The report separates real
compiles (at least COMPILE_S) from loads."""
from __future__ import annotations

import time
from collections import defaultdict

COMPILE_S = 0.2  # a variant that took this long was compiled, not loaded from the disk cache


class CompileLog:
    def __init__(self) -> None:
        self.events: list[tuple[str, float]] = []  # (kernel name, seconds), in order
        self._installed: set[int] = set()

    def install(self, jit_class=None) -> bool:
        """Time every variant `jit_class` (Triton's JITFunction) compiles or loads; False where it cannot."""
        if jit_class is None:
            try:
                from triton.runtime.jit import JITFunction as jit_class
            except ImportError:
                return False
        original = getattr(jit_class, "_do_compile", None)
        if original is None or id(jit_class) in self._installed:
            return original is not None
        events = self.events

        def timed(kernel, *args, **kwargs):
            started = time.perf_counter()
            try:
                return original(kernel, *args, **kwargs)
            finally:
                events.append((getattr(kernel, "__name__", type(kernel).__name__), time.perf_counter() - started))

        jit_class._do_compile = timed
        self._installed.add(id(jit_class))
        return True

    def report(self, since: int = 0, top: int = 10) -> dict:
        """The variants met after the first `since` events: how many, how many were compiled and in how many
        seconds, and the kernels that took longest."""
        events = self.events[since:]
        compiled = [(name, seconds) for name, seconds in events if seconds >= COMPILE_S]
        by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for name, seconds in compiled:
            by_name[name][0] += 1
            by_name[name][1] += seconds
        ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
        return {"variants": len(events), "compiled": len(compiled),
                "compile_s": round(sum(seconds for _, seconds in compiled), 3),
                "kernels": [{"name": name, "compiled": int(count), "seconds": round(seconds, 3)}
                            for name, (count, seconds) in ranked]}


COMPILES = CompileLog()  # one per process: the JIT is

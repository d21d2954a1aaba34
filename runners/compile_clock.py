"""Seconds Triton spends compiling kernels in this process (or loading them from its on-disk cache), counted through
Triton's JIT hooks: `knobs.runtime.jit_cache_hook` runs before a kernel variant compiles, `jit_post_compile_hook`
after. Compiles inside a CUDA-graph capture are the graph runner's (its `capture_s` holds them), so it pauses the
clock there; what the clock counts happened in eager forwards. A task moves those seconds from its forward phase to
its compile phase (results.tables.Phases.captured), so that a first run's compilation does not read as a slow forward
(issue #24). Hooks set before ours still run, and their answer (a pre-compile hook may skip the compile) stands."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from triton import knobs


class CompileClock:
    def __init__(self):
        self.seconds = 0.0  # compile (or cache load) seconds outside graph captures, process-wide
        self.compiles = 0  # kernel variants compiled or loaded
        self._local = threading.local()  # per thread: the start of the compile in progress, whether paused
        self._installed = False

    def install(self) -> None:
        """Set the hooks (once per process), chaining any set before."""
        if self._installed:
            return
        before, after = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook

        def start(*args, **kwargs):
            self._local.start = time.perf_counter()
            return before(*args, **kwargs) if before else None

        def end(*args, **kwargs):
            t0, self._local.start = getattr(self._local, "start", None), None
            if t0 is not None and not getattr(self._local, "paused", False):
                self.seconds += time.perf_counter() - t0
                self.compiles += 1
            return after(*args, **kwargs) if after else None

        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = start, end
        self._installed = True

    @contextmanager
    def paused(self):
        """Compiles in here are not counted (a graph capture times its own)."""
        was = getattr(self._local, "paused", False)
        self._local.paused = True
        try:
            yield
        finally:
            self._local.paused = was


COMPILE_CLOCK = CompileClock()

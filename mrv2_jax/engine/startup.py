"""Where an engine's start-up time goes: named phases with their wall time and the part of it spent
compiling, and how many XLA executables were compiled or loaded from the persistent cache."""

from __future__ import annotations

import contextlib
import logging
import time

from mrv2_jax.process_clock import process_age_s
from mrv2_jax.runner.compile_guard import compile_seconds, executables_made

logger = logging.getLogger(__name__)


class StartupReport:
    """Phases in the order they ran: {name: seconds}, and `phase_compile_s` {name: seconds XLA
    spent compiling or loading from its cache in that phase}; `compiled` / `cache_hits`:
    executables XLA compiled / loaded from the persistent compilation cache while the report was open;
    `process_age_at_start_s`: how long the process had run when the report began (its interpreter's
    start and imports; None where the platform does not say)."""

    def __init__(self):
        self.process_age_at_start_s = process_age_s()
        self.phases: dict[str, float] = {}
        self.phase_compile_s: dict[str, float] = {}
        self._start = time.perf_counter()
        self._made_at_start = executables_made()
        self.total_s = 0.0
        self.compiled = self.cache_hits = 0
        self.from_program_store = 0  # step programs loaded from the engine's program store

    @contextlib.contextmanager
    def phase(self, name: str):
        start, compiling_before = time.perf_counter(), sum(compile_seconds())
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start
            compiling = sum(compile_seconds()) - compiling_before
            self.phase_compile_s[name] = self.phase_compile_s.get(name, 0.0) + compiling

    def finish(self) -> StartupReport:
        self.total_s = time.perf_counter() - self._start
        compiled, loaded = executables_made()
        self.compiled, self.cache_hits = compiled - self._made_at_start[0], loaded - self._made_at_start[1]
        logger.info("engine start-up: %s", self)
        return self

    def as_dict(self) -> dict:
        return {"total_s": self.total_s, "process_age_at_start_s": self.process_age_at_start_s,
                "phases_s": dict(self.phases),
                "phases_compile_s": dict(self.phase_compile_s), "executables_compiled": self.compiled,
                "executables_from_cache": self.cache_hits, "programs_from_store": self.from_program_store}

    def __str__(self) -> str:
        parts = ", ".join(f"{name} {s:.1f} s ({self.phase_compile_s.get(name, 0.0):.1f} s compiling)"
                          for name, s in self.phases.items())
        return (f"{self.total_s:.1f} s ({parts}; {self.compiled} executables compiled, "
                f"{self.cache_hits} from the compilation cache, {self.from_program_store} from the program store)")

"""A child process's CPU time, sampled while it runs (Linux /proc), so that its load over the last
part of its life (a benchmark client's run, without its imports and set-up) can be told apart from
its load over the whole."""

from __future__ import annotations

import os
import threading
import time

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def read_cpu(pid: int) -> tuple[float, bool] | None:
    """(user + system CPU seconds of `pid`, whether it has exited), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS, fields[0] in "ZX"


class CpuSampler:
    """Samples `pid`'s CPU time every `period` seconds on a thread until the process exits."""

    def __init__(self, pid: int, period: float = 0.1):
        self.pid, self.period = pid, period
        self.samples: list[tuple[float, float]] = []  # (time.perf_counter(), CPU seconds)
        self.exited_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"cpu-sampler-{pid}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            got, now = read_cpu(self.pid), time.perf_counter()
            if got is None:
                break
            self.samples.append((now, got[0]))
            if got[1]:
                self.exited_at = now
                break
            self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def busy_over_last(self, seconds: float) -> float | None:
        """CPU seconds per wall second over the last `seconds` before the process exited (None
        without enough samples: a process shorter than the window, or not on Linux)."""
        if len(self.samples) < 2 or seconds <= 0:
            return None
        end, end_cpu = self.samples[-1]
        before = [cpu for t, cpu in self.samples if t <= end - seconds]
        if not before:
            return None
        return (end_cpu - before[-1]) / seconds

"""Benchmark client processes started once and reused for every run (bench/client_worker.py): a
concurrency level hands worker i its command line and waits for its answer, so no level pays for a
client's imports. Each run's CPU time is sampled from /proc while it runs (bench/process_cpu.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mrv2_jax.bench.process_cpu import CpuSampler, read_cpu


@dataclass
class ClientRun:
    """One finished run of one worker: its wall time, CPU seconds, and the sampler of its CPU time."""
    wall_s: float
    cpu_s: float
    sampler: CpuSampler
    error: str | None


class ClientPool:
    """`size` workers of one client kind ("vllm" or "mrv2") under `python` with `env`, started now and
    all importing at once (beside a server that is still starting, say); worker i's stderr goes to
    `log_dir`/client_worker_i.log."""

    def __init__(self, kind: str, size: int, log_dir: str, python: str = sys.executable, env: dict | None = None):
        command = [python, "-m", "mrv2_jax.bench.client_worker", kind]
        self.logs = [Path(log_dir) / f"client_worker_{i}.log" for i in range(size)]
        self.workers = []
        for log in self.logs:
            with open(log, "w") as stderr:
                self.workers.append(subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                     stderr=stderr, text=True, bufsize=1))
        self._ready = False

    def _answer(self, worker: subprocess.Popen) -> dict:
        line = worker.stdout.readline()
        if not line:
            worker.wait()
            log = self.logs[self.workers.index(worker)]
            raise RuntimeError(f"client worker {worker.pid} exited with {worker.returncode}: "
                               f"{log.read_text()[-1500:]}")
        return json.loads(line)

    def wait_ready(self) -> None:
        """Every worker has imported its client (or one failed: RuntimeError with its error)."""
        if not self._ready:
            for worker in self.workers:
                self._answer(worker)
            self._ready = True

    def run(self, argvs: list[list[str]]) -> list[ClientRun]:
        """Worker i runs `argvs[i]`, all side by side; -> one ClientRun each, in order."""
        if len(argvs) > len(self.workers):
            raise ValueError(f"{len(argvs)} client runs asked of a pool of {len(self.workers)}")
        self.wait_ready()
        started = []
        for worker, argv in zip(self.workers, argvs):
            before = read_cpu(worker.pid)
            worker.stdin.write(json.dumps(argv) + "\n")
            worker.stdin.flush()
            started.append((worker, time.perf_counter(), before[0] if before else 0.0, CpuSampler(worker.pid)))
        runs = []
        for worker, start, cpu_before, sampler in started:
            answer = self._answer(worker)
            wall = time.perf_counter() - start
            sampler.stop()
            after = read_cpu(worker.pid)
            runs.append(ClientRun(wall, (after[0] if after else cpu_before) - cpu_before, sampler,
                                  None if answer["ok"] else answer.get("error") or "failed"))
        return runs

    def close(self) -> None:
        for worker in self.workers:
            if worker.stdin and not worker.stdin.closed:
                worker.stdin.close()
        for worker in self.workers:
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

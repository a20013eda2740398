"""Step programs compiled at first use or beside the engine: each program is made exactly once,
whichever threads ask for it and in whatever order; a failed compile raises where the program is
needed; and an engine that compiles in the background gives the tokens of one that compiles at
first use (the demo model, in a process of its own with the persistent compilation cache off:
XLA:CPU must not write that cache while another thread compiles)."""

import contextlib
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from mrv2_jax.runner import lazy_programs
from mrv2_jax.runner.lazy_programs import BackgroundCompile, LazyPrograms
from mrv2_jax.sampling_params import SamplingParams
from tests.server_harness import ENGINE_ARGS, make_llm


def test_each_program_is_made_once_whoever_asks():
    calls = []
    release = threading.Event()

    def make(i):
        calls.append(i)
        release.wait(5)  # every asking thread arrives while the first one is still compiling
        return object()

    programs = LazyPrograms(make, 3)
    got = []
    threads = [threading.Thread(target=lambda: got.append(programs[1])) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    release.set()
    for t in threads:
        t.join(5)
    assert calls == [1] and len(got) == 4 and all(g is got[0] for g in got)
    assert programs.num_compiled == 1 and programs[1] is got[0]


def test_background_compiles_everything_in_order_and_errors_surface_where_needed():
    order = []

    def make(i):
        order.append(i)
        if i == 2:
            raise ValueError("no such program")
        return f"program {i}"

    programs = LazyPrograms(make, 4)
    background = BackgroundCompile([(programs, i) for i in range(4)], workers=1)
    assert background.wait(10)
    assert order == [0, 1, 2, 3] and programs.num_compiled == 3
    assert [programs[i] for i in (0, 1, 3)] == ["program 0", "program 1", "program 3"]
    assert len(background.errors) == 1
    with pytest.raises(ValueError, match="no such program"):
        programs[2]  # compiled again where it is needed, and the error raised there


def test_the_engines_own_compile_comes_first_and_background_threads_trace_one_at_a_time(monkeypatch):
    # Tracing holds the GIL: background threads trace one at a time, and start nothing new while
    # another thread (the engine's step) waits for a program. As on GPUs, compiles need no turns here.
    monkeypatch.setattr(lazy_programs, "_one_compile_at_a_time", contextlib.nullcontext)
    workers, lock, tracing, most_tracing = 4, threading.Lock(), [], [0]
    started = []  # (index, time) of every lower

    def lower(i):
        with lock:
            started.append((i, time.perf_counter()))
            tracing.append(i)
            most_tracing[0] = max(most_tracing[0], sum(j != 39 for j in tracing))
        time.sleep(0.02)
        with lock:
            tracing.remove(i)
        return i

    def compile_(lowered):
        time.sleep(0.6 if lowered == 39 else 0.02)  # the engine's program compiles slowly
        return f"program {lowered}"

    programs = LazyPrograms(lower, 40, compile=compile_)
    background = BackgroundCompile([(programs, i) for i in range(39)], workers=workers)
    time.sleep(0.1)
    asked = time.perf_counter()
    assert programs[39] == "program 39"
    done = time.perf_counter()
    started_meanwhile = [i for i, t in started if asked < t < done and i != 39]
    # Only threads already past the gate when the engine asked may start a trace meanwhile: at most
    # one per worker, where without the gate they would keep going (~0.6 s / 0.04 s per program).
    assert len(started_meanwhile) <= workers
    assert background.wait(10) and programs.num_compiled == 40 and not background.errors
    assert most_tracing[0] == 1


PROMPTS = ["The king said", "ROMEO:\n", "To be, or not"]
ENGINE = ENGINE_ARGS | dict(max_num_seqs=2, max_num_batched_tokens=8, num_gpu_blocks=32, max_model_len=128)
SCRIPT = f"""
import json
from mrv2_jax.llm import LLM
from mrv2_jax.sampling_params import SamplingParams
llm = LLM("demo", compile_mode="background", **{ENGINE!r})
pending_at_start = llm.engine.runner.num_programs_pending
outs = llm.generate({PROMPTS!r}, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
runner = llm.engine.runner
assert runner.background_compile.wait(600) and not runner.background_compile.errors
programs = [p for _, p in list(runner.compiled.values()) + list(runner.fused.values())]
print(json.dumps({{"tokens": [list(o.outputs[0].token_ids) for o in outs],
                  "compiled": sum(p.num_compiled for p in programs), "planned": sum(len(p) for p in programs),
                  "pending_at_start": pending_at_start, "pending_at_end": runner.num_programs_pending}}))
"""


def test_an_engine_compiling_in_the_background_gives_the_tokens_of_one_compiling_at_first_use():
    env = os.environ | {"MRV2_COMPILATION_CACHE": "off"}
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    # The reference runs one decode step per call (one program fewer to compile here) on the greedy
    # sampler variant (a third of `all`'s compile): the same tokens from another program.
    reference = make_llm(**(ENGINE | dict(max_fused_steps=1, sampler_variants="greedy,all"))).generate(
        PROMPTS, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    assert result["tokens"] == [list(o.outputs[0].token_ids) for o in reference]
    # Every planned program got compiled, and no step compiled anything else (MRV2_STRICT_COMPILES,
    # inherited from the test run, would have failed it).
    assert result["compiled"] == result["planned"] > 0
    # What /metrics reports as mrv2_step_programs_pending: some at start, none once all are made.
    assert 0 < result["pending_at_start"] <= result["planned"] and result["pending_at_end"] == 0


def test_at_exit_running_compiles_finish_and_the_rest_are_skipped(tmp_path):
    # A daemon thread killed inside XLA at interpreter exit aborts the process; so the process waits
    # for the compile that runs, and starts no other. Each fake compile leaves a file when it ends.
    script = f"""
import pathlib, threading, time
from mrv2_jax.runner.lazy_programs import BackgroundCompile, LazyPrograms
started = threading.Event()
def make(i):
    started.set()
    time.sleep(1.0)
    pathlib.Path({str(tmp_path)!r}, f"done{{i}}").touch()
    return object()
BackgroundCompile([(LazyPrograms(make, 3), i) for i in range(3)], workers=1)
started.wait(10)
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done0"]

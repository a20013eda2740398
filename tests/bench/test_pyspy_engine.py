"""benchmarks.pyspy_engine: only the engine loop's busy samples count, each function once per sample."""

from benchmarks.pyspy_engine import engine_busy_shares, function_name

LOOP = "EngineCoreProc._loop (/site/mrv2_jax/engine/core_proc.py:150)"
PROFILE = [
    # the engine loop waiting for input: idle
    f'process 7:"python -c spawn_main";BaseProcess.run (/x/process.py:108);{LOOP};'
    "Poller.poll (/site/zmq/poll.py:106) 50\n",
    # a step: the runner's call, reached through a recursive helper (counted once per sample)
    f"process 7;{LOOP};EngineCore.step (/e/engine_core.py:115);helper (/e/h.py:3);helper (/e/h.py:4);"
    "ModelRunnerV2.call_step (/r/v2.py:437) 30\n",
    f"process 7;{LOOP};EngineCore.step (/e/engine_core.py:116);Scheduler.schedule (/e/scheduler.py:9) 20\n",
    # another thread of the process, and the API server: not the engine loop
    "process 7;Thread._bootstrap (/t.py:1);TMonitor.run (/tqdm.py:5) 40\n",
    "process 6;main (/cli.py:1);uvicorn.run (/u.py:2) 70\n",
]


def test_function_names_drop_paths_and_lines():
    assert function_name("EngineCore.step (/a/b/engine_core.py:115)") == "EngineCore.step (engine_core.py)"
    assert function_name("<module>") == "<module>"


def test_only_the_engine_loops_busy_samples_count():
    total, busy, inclusive = engine_busy_shares(PROFILE)
    assert (total, busy) == (50 + 30 + 20, 30 + 20)
    assert inclusive["EngineCore.step (engine_core.py)"] == 50
    assert inclusive["helper (h.py)"] == 30
    assert inclusive["ModelRunnerV2.call_step (v2.py)"] == 30
    assert inclusive["Scheduler.schedule (scheduler.py)"] == 20
    assert not any("Poller.poll" in name or "TMonitor" in name or "uvicorn" in name for name in inclusive)

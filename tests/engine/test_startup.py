"""The start-up report: phase times bounded by the wall clock around them, and the executables
it counts equal the ones the test itself compiled."""

import time

import jax
import jax.numpy as jnp

from mrv2_jax.engine.startup import StartupReport


def test_phases_and_executables_are_counted():
    report = StartupReport()
    with report.phase("sleep"):
        time.sleep(0.05)
    t0 = time.perf_counter()
    with report.phase("compile"):
        # Two programs never compiled before in this process (shapes unique to this test).
        jax.jit(lambda x: x * 3 + 1).lower(jax.ShapeDtypeStruct((17,), jnp.float32)).compile()
        jax.jit(lambda x: x.sum()).lower(jax.ShapeDtypeStruct((19,), jnp.int32)).compile()
    compile_wall = time.perf_counter() - t0
    report.finish()
    assert 0.05 <= report.phases["sleep"] < 1.0 and report.phases["compile"] <= compile_wall
    assert report.total_s >= sum(report.phases.values())
    assert report.compiled + report.cache_hits == 2
    # XLA's own compile (or cache-load) durations: inside the phase's wall time, none while sleeping.
    assert report.phase_compile_s["sleep"] == 0.0
    assert 0.0 < report.phase_compile_s["compile"] <= report.phases["compile"]
    d = report.as_dict()
    assert d["phases_s"] == report.phases and d["executables_compiled"] == report.compiled
    assert d["phases_compile_s"] == report.phase_compile_s
    assert d["process_age_at_start_s"] > 0  # this process ran (imports included) before the report began


def test_an_engine_reports_its_start():
    from mrv2_jax.llm import LLM

    t0 = time.perf_counter()
    llm = LLM("demo", max_num_seqs=2, max_num_batched_tokens=16, num_gpu_blocks=16, max_model_len=128,
              show_progress=False)
    wall = time.perf_counter() - t0
    report = llm.engine.startup
    phases = {"backend", "model config", "weights", "runner (KV cache, tables, compile)"}  # the tokenizer: a thread
    assert phases <= report.phases.keys()
    assert sum(report.phases.values()) <= report.total_s <= wall
    assert "engine start-up" not in str(report) and f"{report.total_s:.1f} s" in str(report)

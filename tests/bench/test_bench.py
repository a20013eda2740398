"""The `mrv2-jax bench` commands run end to end on the tiny fixture model and write well-formed
reports (schema and sane values, not speeds)."""

import json
import subprocess
import sys
import time
from pathlib import Path

from mrv2_jax.bench.dataset import random_prompts
from mrv2_jax.entrypoints import cli

MODEL = str(Path(__file__).parents[1] / "fixtures" / "qwen3-tiny")
# tests/engine/test_engine.py's engine shape: the steps it compiled load from the persistent cache.
ENGINE = ["--model", MODEL, "--dtype", "float32", "--num-gpu-blocks", "128", "--block-size", "4",
          "--max-model-len", "96", "--max-num-batched-tokens", "32", "--max-num-seqs", "8"]
# tests/engine/test_structured_engine.py's engine shape (the demo model): a constrained run loads its steps
# from the persistent cache, or leaves them there for that module.
STRUCTURED_ENGINE = ["--model", "demo", "--dtype", "float32", "--num-gpu-blocks", "48", "--block-size", "4",
                     "--max-model-len", "128", "--max-num-batched-tokens", "32", "--max-num-seqs", "8",
                     "--max-fused-steps", "4", "--sampler-variants", "all"]
ENVIRONMENT_KEYS = {"date", "git_sha", "jax_version", "backend", "device"}


def test_random_prefix_is_shared_by_every_prompt():
    prompts = random_prompts(6, 10, 0.5, 5000, seed=3, prefix_len=7)
    prefix = prompts[0][:7]
    assert all(p[:7] == prefix for p in prompts)
    assert all(5 <= len(p) - 7 <= 15 for p in prompts)
    assert len({tuple(p[7:]) for p in prompts}) == 6  # the rest is each prompt's own
    # Without a prefix the dataset is the same as before the option existed.
    assert [p[7:] for p in prompts] == random_prompts(6, 10, 0.5, 5000, seed=3)
    assert random_prompts(6, 10, 0.5, 5000, seed=4, prefix_len=7)[0][:7] != prefix


def test_bench_help_lists_both_benchmarks():
    run = subprocess.run([sys.executable, "-m", "mrv2_jax.entrypoints.cli", "bench", "--help"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert "throughput" in run.stdout and "ab" in run.stdout


def test_bench_throughput(tmp_path):
    out = tmp_path / "throughput.json"
    assert cli.main(["bench", "throughput", "--num-prompts", "8", "--input-len", "8", "--output-len", "6",
                     "--random-prefix-len", "8", "--runner", "v2", "--output-json", str(out), *ENGINE]) == 0
    result = json.loads(out.read_text())
    assert ENVIRONMENT_KEYS <= result.keys()
    assert result["num_prompts"] == 8 and result["random_prefix_len"] == 8
    assert result["num_input_tokens"] == 8 * (8 + 8)
    assert result["num_output_tokens"] == 8 * 6
    assert result["output_tokens_per_s"] > 0 and result["total_tokens_per_s"] > 0 and result["elapsed_s"] > 0
    assert result["runner"] == "v2"
    assert result["settings"]["max_num_seqs"] == 8 and result["settings"]["block_size"] == 4


def test_bench_throughput_with_a_constraint(tmp_path):
    out = tmp_path / "throughput.json"
    assert cli.main(["bench", "throughput", "--num-prompts", "4", "--input-len", "8", "--output-len", "6",
                     "--structured-outputs", '{"choice": ["yes", "no"]}', "--runner", "v2", "--warmup-prompts", "2",
                     "--output-json", str(out), *STRUCTURED_ENGINE]) == 0  # a model with a tokenizer
    result = json.loads(out.read_text())
    assert result["structured_outputs"] == {"choice": ["yes", "no"]}
    assert 0 < result["num_output_tokens"] < 4 * 6  # "yes" / "no" and EOS
    assert result["structured_validity"] == {"outputs": 4, "complete": 4, "valid": 4}


def test_bench_ab_report_and_plot(tmp_path):
    out, png = tmp_path / "ab.json", tmp_path / "ab.png"
    assert cli.main(["bench", "ab", "--num-prompts", "8", "--input-len", "8", "--output-len", "8",
                     "--capture-step", "2", "--output-json", str(out), "--plot", str(png), *ENGINE]) == 0
    report = json.loads(out.read_text())
    assert ENVIRONMENT_KEYS <= report.keys()
    assert report["settings"]["num_prompts"] == 8 and report["load_s"] > 0
    arms = {r["arm"]: r for r in report["arms"]}
    assert list(arms) == ["v1", "v2-sync", "v2-async"]
    for r in arms.values():
        assert r["output_tokens_per_s"] > 0 and r["num_steps"] > 0 and r["steady_decode_rows"] == 8
    assert arms["v1"]["steady_step_device_ms"] is None  # replay is a V2 feature
    for name in ("v2-sync", "v2-async"):  # the steady-decode step was captured and replayed
        assert arms[name]["steady_step_wall_ms"] > 0 and arms[name]["steady_step_device_ms"] > 0
        assert arms[name]["gpu_busy_fraction"] > 0
        assert 0 < arms[name]["replay_enqueue_ms"] <= arms[name]["steady_step_device_ms"]
        assert arms[name]["steady_step_device_ms_host_ahead"] is None  # GPU only
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_ab_with_every_sampling_feature(tmp_path):
    from mrv2_jax.bench.sampling import sampling_params

    params = sampling_params("all", 8, 1000)
    assert len(params.logit_bias) == 16 and all(0 <= i < 1000 for i in params.logit_bias)
    assert params.temperature > 0 and params.top_k == 50 and params.logprobs == 20 and params.min_tokens == 8
    out = tmp_path / "ab.json"
    assert cli.main(["bench", "ab", "--num-prompts", "8", "--input-len", "8", "--output-len", "8", "--arms",
                     "v2-async", "--sampling", "all", "--capture-step", "2", "--step-timeline",
                     "--output-json", str(out), *ENGINE]) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["sampling"] == "all" and report["settings"]["step_timeline"] is True
    assert [r["arm"] for r in report["arms"]] == ["v2-async"] and report["arms"][0]["steady_step_device_ms"] > 0
    assert "step_timeline" not in report["arms"][0]  # the CPU trace has no device events


def test_step_timeline_summary(monkeypatch):
    """The step timeline's summary from a given event list (the events come from a GPU trace:
    bench/trace.py call_timeline, which the sampler microbenchmark's test runs)."""
    from mrv2_jax.bench import ab, trace

    events = [{"at_us": 0.0, "us": 10.0, "gap_us": 0.0, "kernel": "fusion_1"},
              {"at_us": 30.0, "us": 5.0, "gap_us": 20.0, "kernel": "logit_stats"},
              {"at_us": 35.0, "us": 2.0, "gap_us": 0.0, "kernel": "fusion_2"}]
    monkeypatch.setattr(trace, "call_timeline", lambda fn, inputs: events)
    t = ab.step_timeline(dispatch=None)
    assert t["span_us"] == 37.0 and t["idle_us"] == 20.0 and t["num_events"] == 3
    assert t["largest_gaps"][0] == {"gap_us": 20.0, "at_us": 30.0, "before": "logit_stats"}
    assert t["kernel_us"] == {"fusion": 12.0, "logit_stats": 5.0}
    b = ab.back_to_back_timeline(dispatch=None, steps=2)
    assert b["steps"] == 2 and b["period_us"] == 18.5 and b["idle_us_per_step"] == 10.0
    assert b["largest_gaps"][0] == {"gap_us": 20.0, "at_us": 30.0, "after": "fusion_1", "before": "logit_stats"}
    assert b["idle_us_per_step_by_pair"] == {"fusion -> logit_stats": 10.0, "logit_stats -> fusion": 0.0}


def test_bench_timeline_host_breakdown(tmp_path):
    """On the CPU there are no device events: the host breakdown is complete, the device part is
    None with a note, and the trace of the window is still exported."""
    out = tmp_path / "timeline.json"
    before = time.time()
    assert cli.main(["bench", "timeline", "--num-prompts", "8", "--input-len", "8", "--output-len", "12",
                     "--skip-steps", "2", "--window", "4", "--disable-tqdm", "--runner", "v2", "--settle-s", "1.5",
                     "--output-json", str(out), *ENGINE]) == 0
    report = json.loads(out.read_text())
    # the timed run began after start-up, the warm-up and the wait
    assert report["run_start_epoch_s"] - before >= report["startup_s"] + report["warm_up_s"] + 1.5
    settle = report["settle"]
    assert settle["before"].keys() == settle["after"].keys() == {"Dirty", "Writeback"}
    assert ENVIRONMENT_KEYS <= report.keys()
    assert report["runner"] == "v2" and report["async_scheduling"] is True
    assert report["num_window_steps"] == 4 and report["num_steady_steps"] > 4
    steps = report["steps"]
    assert len(steps) == report["num_steps"] and [s["step"] for s in steps] == list(range(len(steps)))
    for s in steps:
        for key in ("schedule_ms", "dispatch_ms", "wait_ms", "update_ms", "outside_ms", "engine_ms", "wall_ms"):
            assert s[key] >= 0, (key, s)
        assert s["schedule_ms"] + s["dispatch_ms"] + s["wait_ms"] + s["update_ms"] <= s["engine_ms"] + 1e-3
        assert min(s["page_faults"], s["involuntary_switches"], s["voluntary_switches"]) >= 0, s
        assert s["engine_ms"] <= s["wall_ms"] + 1e-3
        host_parts = ("schedule_ms", "dispatch_ms", "update_ms", "host_other_ms", "outside_ms")
        assert abs(s["host_ms"] - sum(s[k] for k in host_parts)) < 1e-3  # all the host did, the wait aside
    assert sum(s["dispatch_ms"] > 0 for s in steps) >= len(steps) - 2
    # Each step's start from the run's start, in order, and within the run (its walls end at elapsed_s).
    starts = [s["start_s"] for s in steps]
    assert starts == sorted(starts) and 0 <= starts[0] and starts[-1] < report["elapsed_s"]
    assert abs(starts[1] - starts[0] - steps[0]["wall_ms"] / 1e3) < 1e-5
    assert abs(report["run_start_epoch_s"] - time.time()) < 600
    # Each prompt is admitted once; its 8 + 12 tokens take five 4-token blocks, the last three added
    # while it decodes. A garbage collection is timed where it ran (none is also possible).
    assert sum(s["new_reqs"] for s in steps) == 8 and sum(s["new_blocks"] for s in steps) >= 8
    assert all(s["gc_ms"] >= 0 and (s["gc_ms"] > 0) == (s["gc_gen"] >= 0) for s in steps)
    assert report["tail"]["slow"]["num_steps"] >= 1 and report["tail"]["all"]["num_steps"] <= len(steps)
    for key in ("steady_median", "window_median"):
        assert report[key]["wall_ms"] > 0 and report[key]["schedule_ms"] > 0
    assert report["device"] == "cpu"  # the environment's device, beside what the trace found
    assert report["device_trace"]["busy_fraction"] is None and "CPU" in report["device_trace"]["note"]
    assert report["window_median"]["device_busy_ms"] is None
    assert (tmp_path / "timeline.trace.json.gz").stat().st_size > 0


def test_timeline_tail_sets_the_slowest_steps_beside_all():
    """The slowest 1% by wall time (2 of 200 steps here), their parts' medians and what they carried."""
    from mrv2_jax.bench.timeline import tail

    steps = [{"traced": False, "num_tokens": 4, "num_reqs": 4, "fused_steps": 1, "wall_ms": float(i),
              "dispatch_ms": 1.0, "gc_ms": 0.0, "new_reqs": 0, "new_blocks": 0, "page_faults": 0,
              "involuntary_switches": 0, "voluntary_switches": 1} for i in range(1, 201)]
    steps[5].update(num_tokens=12, fused_steps=3)  # a fused call of decode rows is no prefill
    steps[198].update(gc_ms=3.0, dispatch_ms=2.0, page_faults=6)
    steps[199].update(new_blocks=1, dispatch_ms=4.0, involuntary_switches=2, voluntary_switches=3)
    steps[0].update(traced=True)  # traced steps are left out
    t = tail(steps, ("dispatch_ms", "wall_ms"))
    assert t["wall_cut_ms"] == 199.0 and t["wall_p50_ms"] == 101.0 and t["all"]["num_steps"] == 199
    slow = t["slow"]
    assert slow["num_steps"] == 2 and slow["median"] == {"dispatch_ms": 3.0, "wall_ms": 199.5, "gc_ms": 1.5,
                                                         "page_faults": 3.0, "involuntary_switches": 1.0,
                                                         "voluntary_switches": 2.0}
    assert slow["share"] == {"with gc": 0.5, "new requests": 0.0, "new blocks": 0.5, "prefill": 0.0,
                             "page faults": 0.5, "preempted": 0.5}
    assert t["all"]["share"]["with gc"] == 1 / 199 and t["all"]["share"]["prefill"] == 0.0


def test_bench_timeline_fused_calls_are_steady_decode(tmp_path):
    """With --max-fused-steps K the steady-decode steps are fused calls of K tokens a row; the window
    is found among them and holds only them."""
    out = tmp_path / "timeline.json"
    assert cli.main(["bench", "timeline", "--num-prompts", "2", "--max-num-seqs", "2", "--input-len", "8",
                     "--output-len", "24", "--max-fused-steps", "4", "--skip-steps", "1", "--window", "2",
                     "--disable-tqdm", "--runner", "v2", "--output-json", str(out), *ENGINE]) == 0
    report = json.loads(out.read_text())
    traced = [s for s in report["steps"] if s["traced"]]
    assert report["num_window_steps"] == 2 and report["window_fused_steps"] == 4
    assert report["num_steady_steps"] >= 3
    assert all(s["fused_steps"] == 4 and s["num_tokens"] == 8 and s["num_reqs"] == 2 for s in traced)


def test_bench_timeline_window_from_a_step(tmp_path):
    """--trace-from-step traces steps N.. whatever they are: here prefill chunks (long prompts,
    a small token budget), which a steady-decode window never covers."""
    out = tmp_path / "timeline.json"
    assert cli.main(["bench", "timeline", "--num-prompts", "4", "--input-len", "40", "--output-len", "4",
                     "--trace-from-step", "1", "--window", "3", "--disable-tqdm", "--runner", "v2",
                     "--no-prefix-caching",  # the warm-up ran these prompts: no cache hits wanted
                     "--output-json", str(out), *ENGINE]) == 0
    report = json.loads(out.read_text())
    traced = [s for s in report["steps"] if s["traced"]]
    assert [s["step"] for s in traced] == [1, 2, 3] and report["num_window_steps"] == 3
    assert any(s["num_tokens"] > s["num_reqs"] for s in traced)  # prefill in the window
    assert report["window_tokens_per_step"] == sorted(s["num_tokens"] for s in traced)[1]
    assert report["window_median"]["wall_ms"] > 0


def test_timeline_device_busy_from_trace_events(tmp_path):
    """The device arithmetic on a synthetic trace: two steps, kernels on a Stream line, a derived
    line that must be ignored."""
    import gzip

    from mrv2_jax.bench.timeline import device_timeline

    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
              {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
              {"ph": "M", "pid": 2, "tid": 8, "name": "thread_name", "args": {"name": "XLA Modules"}},
              {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 50, "name": "mrv2_step", "args": {"step": "5"}},
              {"ph": "X", "pid": 1, "tid": 1, "ts": 100, "dur": 50, "name": "mrv2_step", "args": {"step": "6"}},
              {"ph": "X", "pid": 2, "tid": 8, "ts": 0, "dur": 200, "name": "jit_step"},
              {"ph": "X", "pid": 2, "tid": 7, "ts": 10, "dur": 30, "name": "k1"},
              {"ph": "X", "pid": 2, "tid": 7, "ts": 30, "dur": 40, "name": "k2"},  # overlaps k1
              {"ph": "X", "pid": 2, "tid": 7, "ts": 120, "dur": 20, "name": "loop_add_fusion_3"},
              {"ph": "X", "pid": 2, "tid": 7, "ts": 141, "dur": 4, "name": "loop_add_fusion.12"}]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    d = device_timeline(str(path))
    assert d["device_source"] == "GPU Stream lines"
    assert d["steps"][5] == {"device_busy_ms": 0.06, "device_idle_ms": 0.04, "max_idle_gap_ms": 0.03}
    assert d["steps"][6]["device_busy_ms"] == 0.024 and d["steps"][6]["max_idle_gap_ms"] == 0.02
    assert abs(d["busy_fraction"] - 84 / 150) < 1e-9
    # Kernels by family over the window's 2 steps: k2 40 us, k1 30, the two add fusions 24.
    split = {k["kernel"]: k for k in d["kernels"]}
    assert [k["kernel"] for k in d["kernels"]] == ["k2", "k1", "loop_add_fusion"]
    assert split["loop_add_fusion"]["launches_per_step"] == 1.0
    assert abs(split["loop_add_fusion"]["ms_per_step"] - 0.012) < 1e-12 and abs(split["k2"]["share"] - 40 / 94) < 1e-12


def test_bench_fused_decode(tmp_path):
    out = tmp_path / "fused.json"
    engine = [a for a in ENGINE if a not in ("--max-num-seqs", "8")]
    engine[engine.index("--max-num-batched-tokens") + 1] = "8"  # one bucket: a quick start-up
    engine += ["--sampler-variants", "greedy,all"]  # greedy requests only: the cheapest variant compiles
    assert cli.main(["bench", "fused", "--batches", "1", "2", "--fused-steps", "1", "4", "--in-call", "--input-len",
                     "8", "--output-len", "12", "--output-json", str(out), *engine]) == 0
    report = json.loads(out.read_text())
    assert ENVIRONMENT_KEYS <= report.keys() and report["settings"]["max_num_seqs"] == 2
    rows = {(r["max_fused_steps"], r["stream_in_call"], r["batch"]): r for r in report["results"]}
    assert set(rows) == {(1, False, 1), (1, False, 2), (4, False, 1), (4, False, 2), (4, True, 1), (4, True, 2)}
    for (k, _, _), r in rows.items():
        assert r["output_tokens_per_s"] > 0 and r["ms_per_token"] > 0 and r["device_ms_per_token"] > 0
        assert (r["fused_calls"] > 0) == (k > 1)
    # Fused decode needs fewer dispatches per token; streamed from inside the calls, its tokens
    # still arrive one at a time, where plain fused calls hand over several at once.
    assert rows[4, False, 1]["dispatches_per_token"] < rows[1, False, 1]["dispatches_per_token"]
    assert rows[4, True, 1]["dispatches_per_token"] == rows[4, False, 1]["dispatches_per_token"]
    for b in (1, 2):
        assert rows[1, False, b]["deliveries_per_token"] == rows[4, True, b]["deliveries_per_token"] == 1.0
        assert rows[4, False, b]["deliveries_per_token"] < 0.6


def test_decode_step_capture_keeps_the_chosen_full_decode_dispatch():
    """The capture hooks log every step's shape, copy the state before the `which`-th step in
    which every row decodes one token, and keep that step's dispatch (fakes: no engine)."""
    from types import SimpleNamespace

    import jax.numpy as jnp
    import numpy as np

    from mrv2_jax.bench.capture import DecodeStepCapture
    from mrv2_jax.runner.step_hooks import StepHooks

    runner = SimpleNamespace(state=jnp.arange(3))
    capture = DecodeStepCapture(runner, rows=2, which=2)
    assert isinstance(capture, StepHooks) and not capture.captured
    schedule = [{"a": 5, "b": 3}, {"a": 1, "b": 1}, {"a": 1}, {"a": 1, "b": 1}, {"a": 1, "b": 1}]
    for i, counts in enumerate(schedule):
        scheduled = SimpleNamespace(num_scheduled_tokens=counts, total_num_scheduled_tokens=sum(counts.values()),
                                    num_fused_steps=1)
        capture.step_scheduled(scheduled)
        capture.dispatched(runner, f"compiled{i}", np.full(4, i), call_s=1e-4)
        runner.state = runner.state + 10  # the step's new state (the old one was donated)
        capture.step_finished(float(i), i + 0.5)
    assert capture.steps == [(0.0, 0.5, 8, 2), (1.0, 1.5, 2, 2), (2.0, 2.5, 1, 1), (3.0, 3.5, 2, 2),
                             (4.0, 4.5, 2, 2)]
    assert capture.captured and capture.step_index == 3
    assert capture.dispatch.runner is runner and capture.dispatch.compiled == "compiled3"
    np.testing.assert_array_equal(capture.dispatch.packed, np.full(4, 3))
    capture.restore_state()  # the state that step ran on: three steps of +10 before it
    np.testing.assert_array_equal(runner.state, np.arange(3) + 30)


def test_engine_and_runner_hooks_are_off_by_default():
    from mrv2_jax.bench.step_log import StepLog, attach_hooks
    from mrv2_jax.llm import LLM

    # test_engine's shape with one bucket (test_prompt_logprobs compiles the same steps)
    llm = LLM(MODEL, dtype="float32", num_gpu_blocks=128, block_size=4, max_model_len=96, max_num_batched_tokens=8,
              max_num_seqs=8, runner="v2", show_progress=False)
    engine = llm.engine
    assert engine.hooks is None and engine.runner.hooks is None
    log = StepLog()
    attach_hooks(engine, log)
    assert engine.hooks is log and engine.runner.hooks is log
    llm.generate([[1, 2, 3]], use_tqdm=False)
    assert log.steps and all(start <= end for start, end, _, _ in log.steps)
    assert log.steps[0][2:] == (3, 1)  # the prompt's three tokens, one request
    attach_hooks(engine, None)
    assert engine.hooks is None and engine.runner.hooks is None

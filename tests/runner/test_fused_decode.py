"""Fused decode end to end on the demo model: K = 1, 4 and 16 give the same outputs (greedy and
seeded, stop tokens, stop strings, min_tokens, logprobs, penalties), the same per-token stream,
the fused path is really taken, the device stops rows early, and nothing compiles after
warm-up."""

from pathlib import Path

import jax
import pytest

from mrv2_jax.llm import LLM
from mrv2_jax.runner import v2
from mrv2_jax.runner.compile_guard import num_compiles
from mrv2_jax.sampling_params import SamplingParams

DEMO = Path(__file__).parents[2] / "checkpoints" / "demo-qwen3"
NEWLINE, PERIOD = 202, 17  # demo tokenizer ids of "\n" and "."
K_VALUES = (1, 4, 16)


def make_llm(max_fused_steps: int) -> LLM:
    # One bucket size (16 tokens, 8 rows) and one sampler variant (the widest: the workload mixes
    # greedy and sampled rows): one step and one fused program per engine to compile.
    return LLM(str(DEMO), dtype="float32", max_num_seqs=8, max_num_batched_tokens=16, max_model_len=128,
               num_gpu_blocks=256, block_size=4, show_progress=False, max_fused_steps=max_fused_steps,
               bucket_token_sizes=(16,), sampler_variants="all")


def workload():
    """10 requests for 8 seats: ordinary steps while two wait, fused calls after."""
    prompts = ["To be, or not", "KING.", "Enter", "What", "O", "The man", "I", "First Citizen:",
               "Good", "My lord,"]
    params = [
        SamplingParams(max_tokens=40, temperature=0.0),
        SamplingParams(max_tokens=33, temperature=0.8, seed=7),
        SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[NEWLINE]),
        SamplingParams(max_tokens=30, temperature=0.7, top_p=0.9, seed=3, stop_token_ids=[PERIOD]),
        SamplingParams(max_tokens=25, temperature=0.0, stop=["the"]),
        SamplingParams(max_tokens=37, temperature=0.0, ignore_eos=True, min_tokens=12,
                       stop_token_ids=[NEWLINE, PERIOD]),
        SamplingParams(max_tokens=21, temperature=0.0, logprobs=2),
        SamplingParams(max_tokens=29, temperature=0.9, seed=11, repetition_penalty=1.3),
        SamplingParams(max_tokens=3, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.0, stop=["\n\n"], ignore_eos=True),
    ]
    return prompts, params


class CallLog:
    """Wraps the runner's fused entry point: per fused call, (K, budgets, tokens returned)."""

    def __init__(self, runner):
        self.calls = []
        execute_fused = runner._execute_fused

        def logged(out, req_ids):
            pending = execute_fused(out, req_ids)
            self.calls.append((out.num_fused_steps, dict(out.num_scheduled_tokens), pending))
            return pending

        runner._execute_fused = logged


@pytest.fixture(scope="module")
def runs():
    prompts, params = workload()
    results = {}
    for k in K_VALUES:
        llm = make_llm(k)
        log = CallLog(llm.engine.runner)
        before = num_compiles()
        streams: dict[str, list] = {}
        for out in llm.stream(prompts, params):
            completion = out.outputs[0]
            streams.setdefault(out.request_id, []).append(
                (list(completion.token_ids), out.delta_text, completion.text, completion.finish_reason,
                 completion.stop_reason, out.finished, completion.logprobs))
        results[k] = {"streams": streams, "compiles": num_compiles() - before, "log": log,
                      "guard": llm.engine.compile_guard.num_unexpected, "runner": llm.engine.runner, "llm": llm}
    return prompts, params, results


def test_outputs_and_streams_identical_for_every_k(runs):
    prompts, params, results = runs
    reference = results[1]["streams"]
    assert len(reference) == len(prompts)
    for k in K_VALUES[1:]:
        for req_id, stream in reference.items():
            # The same sequence of per-token outputs: tokens, deltas, text, finish; logprobs with
            # the same tokens and ranks, values to f32 rounding (a fused call computes a row in a
            # bucket of another shape than an ordinary step).
            fused = results[k]["streams"][req_id]
            assert [entry[:6] for entry in fused] == [entry[:6] for entry in stream], (k, req_id)
            for got, want in zip(fused, stream):
                assert_logprobs_close(got[6], want[6])
    finals = [reference[str(i)][-1] for i in range(len(prompts))]
    reasons = {(f[3], f[4]) for f in finals}
    assert ("stop", NEWLINE) in reasons or ("stop", PERIOD) in reasons  # stop tokens were hit
    assert any(reason == "stop" and isinstance(stop, str) for reason, stop in reasons)  # a stop string
    assert ("length", None) in reasons
    for i, final in enumerate(finals):
        tokens, reason = final[0], final[3]
        assert len(tokens) <= params[i].max_tokens
        if reason == "length":
            assert len(tokens) == params[i].max_tokens
        stops = set(params[i].stop_token_ids)
        # A stop token ends the request at its first occurrence after min_tokens, and only there.
        assert not stops & set(tokens[params[i].min_tokens : -1])
        if reason == "stop" and isinstance(final[4], int):
            assert tokens[-1] in stops and len(tokens) >= params[i].min_tokens
    assert finals[6][6] is not None and len(finals[6][6]) == len(finals[6][0])  # logprobs per token


def assert_logprobs_close(got, want):
    if want is None:
        assert got is None
        return
    assert len(got) == len(want)
    for got_position, want_position in zip(got, want):
        assert got_position.keys() == want_position.keys()
        for token, lp in want_position.items():
            assert got_position[token].rank == lp.rank and got_position[token].decoded_token == lp.decoded_token
            assert got_position[token].logprob == pytest.approx(lp.logprob, abs=1e-5)


def test_fused_path_taken_and_device_stops_early(runs):
    _, _, results = runs
    assert results[1]["log"].calls == [] and results[1]["runner"].num_fused_calls == 0
    for k in K_VALUES[1:]:
        calls = results[k]["log"].calls
        assert calls and results[k]["runner"].num_fused_calls == len(calls)
        assert max(num_steps for num_steps, _, _ in calls) == k
        returned = [(budgets, pending.result()) for _, budgets, pending in calls]
        # Some row stopped on the device before its budget (a stop token).
        assert any(len(tokens[r]) < budgets[r] for budgets, tokens in returned for r in tokens)


def test_no_compiles_after_warmup(runs):
    _, _, results = runs
    for k in K_VALUES:
        assert results[k]["compiles"] == 0 and results[k]["guard"] == 0


def test_fused_calls_keep_the_pipeline_asynchronous(runs, monkeypatch):
    """Fused call N+1 is dispatched before call N's tokens are read, with no device->host
    transfer while it is prepared."""
    llm = runs[2][16]["llm"]
    runner, events = llm.engine.runner, []
    real_execute, real_result = runner.execute, v2.PendingStep.result

    def execute(out):
        with jax.transfer_guard_device_to_host("disallow"):
            pending = real_execute(out)
        if isinstance(pending, v2.PendingStep):
            pending.number = len([e for e in events if e[0] == "dispatch"])
            events.append(("dispatch", pending.number, out.num_fused_steps))
        return pending

    def result(self):
        events.append(("read", self.number, None))
        return real_result(self)

    monkeypatch.setattr(runner, "execute", execute)
    monkeypatch.setattr(v2.PendingStep, "result", result)
    llm.generate(["To be", "KING."], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    dispatched = [e for e in events if e[0] == "dispatch"]
    assert sum(k > 1 for _, _, k in dispatched) >= 2
    for _, n, _ in dispatched[:-1]:
        read_at = events.index(("read", n, None))
        assert ("dispatch", n + 1) in [e[:2] for e in events[:read_at]]


@pytest.mark.parametrize("k", [1, 4])
def test_a_row_whose_device_tables_diverged_stops_the_engine_with_its_name(runs, k):
    """The symptom of a step program that lost an update (xla_flags.py): a decoding row's token
    count not one past its computed tokens. One step per call and a fused call both return the
    row as diverged (prepare.diverged_rows), and the engine stops naming the request instead of
    decoding on from wrong inputs. Last in this module: it leaves the engine stopped."""
    llm = runs[2][k]["llm"]
    runner = llm.engine.runner
    llm.add_request("To be, or not", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
                    request_id="diverging")
    while not any(out.outputs[0].token_ids for out in llm.step()):  # until its prompt is computed
        pass
    slot = runner.slots.slots_of(["diverging"])[0]
    state = runner.state
    runner.state = state._replace(scalars=state.scalars.set_at("num_tokens", slot, state.num_tokens[slot] - 1))
    with pytest.raises(RuntimeError, match=r"\['diverging'\] no longer match their schedule"):
        for _ in range(4):
            llm.step()

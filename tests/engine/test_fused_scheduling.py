"""Fused decode, host side: the scheduler's K-step plans against the one-request-at-a-time
reference of test_scheduler.py (a fake runner that plays the fused device loop, stops
included), and the output processor's per-token split of a multi-token output."""

from pathlib import Path

import pytest

from mrv2_jax.config import CacheConfig, SchedulerConfig
from mrv2_jax.engine.output_processor import OutputProcessor
from mrv2_jax.engine.request import Request
from mrv2_jax.engine.scheduler import Scheduler
from mrv2_jax.engine.scheduler_output import EngineCoreOutput
from mrv2_jax.engine.tokenizer import load_tokenizer
from mrv2_jax.sampling_params import SamplingParams
from tests.engine.test_scheduler import (
    BLOCK_SIZE,
    EOS,
    DeviceRequest,
    Driver,
    FakeRunner,
    assert_all_blocks_free,
    assert_matches_reference,
    kv_entry,
    next_token,
    random_workload,
    reference_generate,
)

DEMO = Path(__file__).parents[2] / "checkpoints" / "demo-qwen3"


class FusedFakeRunner(FakeRunner):
    """FakeRunner that also runs fused calls: up to K single-token steps per request, each
    request within its budget, stopping on its stop ids on the 'device' as runner/fused.py does
    (and never decoding a request whose last token already stopped it)."""

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.params: dict[str, tuple[SamplingParams, int]] = {}
        self.prefill_len: dict[str, int] = {}
        self.fused_calls: list[tuple[int, dict, dict]] = []  # (K, budgets, tokens returned)

    def execute(self, out):
        for req_id in out.finished_req_ids:
            self.freed_ids.append(req_id)
            del self.requests[req_id]
        for new in out.new_reqs:
            self.params[new.req_id] = (new.sampling_params, new.num_prompt_tokens)
            self.prefill_len[new.req_id] = len(new.token_ids)
            self.requests[new.req_id] = DeviceRequest(list(new.token_ids), list(new.block_ids),
                                                      new.num_computed_tokens)
        for cached in out.cached_reqs:
            state = self.requests[cached.req_id]
            # A request the device stopped lags behind the host's plan (async): the host
            # finishes it when that stop arrives, and drops whatever it gets meanwhile.
            assert state.num_computed == cached.num_computed_tokens or self._ended(cached.req_id)
            state.block_ids.extend(cached.new_block_ids)
        fused = out.num_fused_steps > 1
        assert not (fused and out.new_reqs)
        sampled = {}
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            state, tokens = self.requests[req_id], []
            if fused:  # up to `num_tokens` single-token steps
                assert 1 <= num_tokens <= out.num_fused_steps
                # Only decodes: the real runner has no prompt tokens to send in a fused call.
                assert state.num_computed >= self.prefill_len[req_id] or self._ended(req_id)
                steps = [1] * num_tokens
            else:
                steps = [num_tokens]
            for n in steps:
                if self._ended(req_id):
                    break
                end = state.num_computed + n
                assert end <= len(state.tokens), "input token not known even on the device"
                assert len(state.block_ids) * BLOCK_SIZE >= end, "no KV slot for a token"
                for position in range(state.num_computed, end):
                    previous = self.kv[self._slot(state, position - 1)] if position else 0
                    self.kv[self._slot(state, position)] = kv_entry(previous, state.tokens[position])
                state.num_computed = end
                if end == len(state.tokens):
                    token = next_token(self.kv[self._slot(state, end - 1)])
                    state.tokens.append(token)
                    tokens.append(token)
            if tokens:
                sampled[req_id] = tokens
                self.num_sampled[req_id] = self.num_sampled.get(req_id, 0) + len(tokens)
        if fused:
            self.fused_calls.append((out.num_fused_steps, dict(out.num_scheduled_tokens), sampled))
        assert set(sampled) <= out.sampling_req_ids
        return sampled

    def _ended(self, req_id: str) -> bool:
        params, num_prompt = self.params[req_id]
        tokens = self.requests[req_id].tokens
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS})
        return len(tokens) - num_prompt >= max(params.min_tokens, 1) and tokens[-1] in stops


def fused_scheduler(max_fused_steps=8, max_fused_rows=8, num_blocks=1024, max_num_seqs=8, budget=16,
                    max_model_len=96, stream_interval=1) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                        max_fused_steps=max_fused_steps, max_fused_rows=max_fused_rows,
                        stream_interval=stream_interval),
        CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=num_blocks), eos_token_id=EOS)


def run_fused(workload, steps_in_flight, **kwargs):
    driver = Driver(fused_scheduler(**kwargs), steps_in_flight)
    driver.runner = FusedFakeRunner(driver.scheduler.kv_cache_manager.num_blocks)
    for req_id, prompt, params in workload:
        driver.add(req_id, prompt, params)
    return driver, driver.run()


@pytest.mark.parametrize("steps_in_flight", [0, 1, 2], ids=["sync", "async", "async2"])
@pytest.mark.parametrize("max_fused_steps", [4, 16])
def test_fused_plans_match_reference(steps_in_flight, max_fused_steps):
    workload = random_workload(seed=0)
    driver, results = run_fused(workload, steps_in_flight, max_fused_steps=max_fused_steps)
    assert_matches_reference(results, workload)
    calls = driver.runner.fused_calls
    assert calls and max(k for k, _, _ in calls) == max_fused_steps
    assert_all_blocks_free(driver)


@pytest.mark.parametrize("steps_in_flight", [0, 1, 2], ids=["sync", "async", "async2"])
def test_fused_with_preemption_keeps_outputs(steps_in_flight):
    workload = random_workload(seed=1)
    driver, results = run_fused(workload, steps_in_flight, num_blocks=30, budget=32)
    assert driver.scheduler.num_preemptions > 0 and driver.runner.fused_calls
    assert_matches_reference(results, workload)
    assert_all_blocks_free(driver)


@pytest.mark.parametrize("steps_in_flight", [0, 1], ids=["sync", "async"])
def test_device_stop_ends_the_call_early(steps_in_flight):
    prompt = [3, 1, 4, 1, 5]
    expected, _ = reference_generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True), 96)
    stop = expected[5]
    params = SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop])
    driver, results = run_fused([("a", prompt, params)], steps_in_flight, max_fused_steps=8)
    assert results["a"].tokens == expected[: expected.index(stop) + 1]
    assert results["a"].finish_reason == "stop"
    returned = [len(tokens.get("a", ())) for _, _, tokens in driver.runner.fused_calls]
    budgets = [budgets["a"] for _, budgets, _ in driver.runner.fused_calls]
    assert returned[0] == expected.index(stop) < budgets[0]  # stopped on the device
    if steps_in_flight:  # the call dispatched before the host knew decoded nothing more
        assert returned[1:] == [0]
    assert_all_blocks_free(driver)


def test_fused_plan_accounting():
    scheduler = fused_scheduler(max_fused_steps=8, max_fused_rows=2)
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True)))
    scheduler.add_request(Request("b", [4, 5], SamplingParams(max_tokens=20, ignore_eos=True)))
    first = scheduler.schedule()
    assert first.num_fused_steps == 1  # prefills
    second = scheduler.schedule()  # both decode on their placeholders; nothing waits
    assert second.num_fused_steps == 8 and not second.new_reqs
    assert second.num_scheduled_tokens == {"a": 4, "b": 8}  # a: max_tokens 5 - 1 in flight
    a, b = scheduler.requests["a"], scheduler.requests["b"]
    assert (a.num_output_placeholders, b.num_output_placeholders) == (5, 9)
    kv = scheduler.kv_cache_manager
    for request in (a, b):  # blocks for every token the call may compute
        assert len(kv.get_block_ids(request.request_id)) * BLOCK_SIZE >= request.num_computed_tokens
    # a has all its tokens in flight: the next call only holds b.
    assert scheduler.schedule().num_scheduled_tokens == {"b": 8}
    scheduler.update_from_output(first, {"a": [7], "b": [8]})
    with pytest.raises(RuntimeError, match="does not stop it"):  # b came back short, no stop
        scheduler.update_from_output(second, {"a": [9, 9, 9, 9], "b": [1, 2]})
    # A waiting request turns fusing off (it is admitted by an ordinary step).
    scheduler = fused_scheduler(max_fused_steps=8, max_fused_rows=2)
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=50)))
    scheduler.schedule()
    scheduler.add_request(Request("c", [6], SamplingParams()))
    assert scheduler.schedule().num_fused_steps == 1
    # So does a batch larger than the runner's fused variants.
    scheduler = fused_scheduler(max_fused_steps=8, max_fused_rows=1)
    for req_id in "ab":
        scheduler.add_request(Request(req_id, [1, 2, 3], SamplingParams(max_tokens=50)))
    scheduler.schedule()
    assert scheduler.schedule().num_fused_steps == 1


def test_a_streaming_request_caps_fused_calls_at_the_stream_interval():
    """While any running request streams, K <= stream_interval for the whole batch; once only
    non-streaming requests run, K is max_fused_steps again."""
    scheduler = fused_scheduler(max_fused_steps=8, max_fused_rows=2, stream_interval=3)
    scheduler.add_request(Request("s", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), streaming=True))
    scheduler.add_request(Request("b", [4, 5], SamplingParams(max_tokens=30, ignore_eos=True)))
    first = scheduler.schedule()  # prefills
    second = scheduler.schedule()
    assert second.num_fused_steps == 3 and second.num_scheduled_tokens == {"s": 3, "b": 3}
    scheduler.update_from_output(first, {"s": [7], "b": [8]})
    scheduler.update_from_output(second, {"s": [7, 7, 7], "b": [8, 8, 8]})  # s reaches max_tokens
    assert "s" not in scheduler.requests
    third = scheduler.schedule()
    assert third.num_fused_steps == 8 and third.num_scheduled_tokens == {"b": 8}


def test_full_batch_with_waiting_requests_fuses_to_the_first_finish():
    """Every slot taken and a request waiting: the fused call lasts until the first running
    request can finish (min over the rows, not max), so its slot never idles while c waits."""
    scheduler = fused_scheduler(max_fused_steps=8, max_fused_rows=2, max_num_seqs=2)
    for req_id, max_tokens in (("a", 5), ("b", 20), ("c", 20)):
        scheduler.add_request(Request(req_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    assert set(scheduler.schedule().num_scheduled_tokens) == {"a", "b"}  # prefills; c waits
    second = scheduler.schedule()
    assert second.num_fused_steps == 4 and second.num_scheduled_tokens == {"a": 4, "b": 4}
    # a's tokens are all in flight: ordinary steps (b alone) until a finishes and c gets its slot.
    assert scheduler.schedule().num_fused_steps == 1


@pytest.mark.parametrize("steps_in_flight", [0, 1, 2], ids=["sync", "async", "async2"])
def test_fused_plans_with_waiting_requests_match_reference(steps_in_flight):
    workload = [(f"r{i}", [1 + i, 2, 3, 4], SamplingParams(max_tokens=3 + 7 * i, ignore_eos=True))
                for i in range(7)]
    workload += random_workload(seed=3)
    driver, results = run_fused(workload, steps_in_flight, max_num_seqs=3, max_fused_rows=4)
    assert_matches_reference(results, workload)
    assert driver.runner.fused_calls
    assert_all_blocks_free(driver)


def test_last_prefill_token_is_not_fused():
    """A prefill with one token left looks like a decode (one token to compute) but its input
    is a prompt token the device does not have yet: it takes an ordinary step."""
    workload = [("a", [1, 2, 3], SamplingParams(max_tokens=12, ignore_eos=True)),
                ("b", [4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=12, ignore_eos=True))]
    scheduler = fused_scheduler(budget=8)
    for req_id, prompt, params in workload:
        scheduler.add_request(Request(req_id, prompt, params))
    assert scheduler.schedule().num_scheduled_tokens == {"a": 3, "b": 5}
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"a": 1, "b": 1} and second.num_fused_steps == 1
    assert scheduler.schedule().num_fused_steps == 8
    _, results = run_fused(workload, 1, budget=8)
    assert_matches_reference(results, workload)


def test_fused_call_short_on_a_stop_token_finishes_the_request():
    scheduler = fused_scheduler(max_fused_steps=8)
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=30, stop_token_ids=[7])))
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert second.num_fused_steps == 8
    scheduler.update_from_output(first, {"a": [5]})
    [out] = scheduler.update_from_output(second, {"a": [6, 7]})
    assert out.new_token_ids == [6, 7] and out.finish_reason == "stop" and out.stop_reason == 7
    assert not scheduler.has_unfinished_requests()


def test_output_processor_streams_a_multi_token_output_per_token():
    tokenizer = load_tokenizer(DEMO)
    text = " the man and the"
    ids = tokenizer.encode(text)
    assert len(ids) >= 4
    for stop, expect_stop in ((None, False), (["man"], True)):
        request = Request("r", [5, 6], SamplingParams(max_tokens=50, stop=stop))
        processor = OutputProcessor(tokenizer)
        processor.add(request)
        outputs, stopped = processor.process([EngineCoreOutput("r", ids + [17])])
        per_token = [len(o.outputs[0].token_ids) for o in outputs]
        assert per_token == list(range(1, len(per_token) + 1))  # one output per token, in order
        if expect_stop:
            assert stopped == ["r"] and outputs[-1].finished and outputs[-1].outputs[0].stop_reason == "man"
            assert outputs[-1].outputs[0].text == " the "
            assert len(per_token) < len(ids)  # the tokens after the stop string were dropped
            assert "r" not in processor.tracked
        else:
            assert not stopped and len(outputs) == len(ids) + 1 and not outputs[-1].finished
            assert outputs[-1].outputs[0].text.startswith("".join(o.delta_text for o in outputs))


@pytest.mark.parametrize("stream_interval", [3, 1])
def test_a_request_streaming_in_the_call_keeps_k_and_one_that_does_not_caps_it(stream_interval):
    """With the engine process streaming from inside fused calls, a streaming request that streams
    in the call keeps max_fused_steps; one that cannot (logprobs, say) still caps K, also when it is
    not the first running request (interval 1 is the server's default, decided before the per-row pass)."""
    for streams_in_call, expected in ((True, 8), (False, stream_interval)):
        scheduler = fused_scheduler(max_fused_steps=8, max_fused_rows=3, stream_interval=stream_interval)
        scheduler.streams_in_call = True
        in_call = Request("a", [1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True), streaming=True)
        in_call.streams_in_call = True
        plain = Request("b", [4, 5], SamplingParams(max_tokens=30, ignore_eos=True))
        request = Request("s", [1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True), streaming=True)
        request.streams_in_call = streams_in_call
        for r in (in_call, plain, request):
            scheduler.add_request(r)
        first = scheduler.schedule()
        scheduler.update_from_output(first, {"a": [7], "b": [8], "s": [7]})
        assert scheduler.schedule().num_fused_steps == expected


def test_streamed_tokens_reach_the_stream_once_whichever_arrives_first():
    """Tokens streamed from inside a call are delivered as they come; the call's step output then
    brings only what was not streamed; a streamed token ahead of its turn waits for the tokens
    before it, a late one is dropped, and a stop string found in streamed tokens ends the request."""
    tokenizer = load_tokenizer(DEMO)
    ids = tokenizer.encode(" the man said yes and the old men wept")
    processor = OutputProcessor(tokenizer)
    processor.add(Request("r", [5, 6], SamplingParams(max_tokens=50)))
    outputs, _ = processor.streamed([("r", 1, ids[1]), ("r", 2, ids[2]), ("r", 4, ids[4])])  # ahead of token 0
    assert outputs == []
    outputs, _ = processor.process([EngineCoreOutput("r", ids[:1])])  # the step before the call: 0, then 1, 2
    assert [list(o.outputs[0].token_ids) for o in outputs] == [ids[:1], ids[:2], ids[:3]]
    outputs, _ = processor.process([EngineCoreOutput("r", ids[1:4])])  # the call's step output: 3, then 4
    assert [list(o.outputs[0].token_ids) for o in outputs] == [ids[:4], ids[:5]]
    assert processor.streamed([("r", 2, ids[2])]) == ([], [])  # late: delivered already
    outputs, _ = processor.streamed([("r", 5, ids[5])])  # the next call streams ahead
    assert [list(o.outputs[0].token_ids) for o in outputs] == [ids[:6]]
    outputs, _ = processor.process([EngineCoreOutput("r", ids[4:6], finish_reason="length")])
    assert len(outputs) == 1 and outputs[0].finished and list(outputs[0].outputs[0].token_ids) == ids[:6]
    assert outputs[0].outputs[0].text == tokenizer.decode(ids[:6])

    processor.add(Request("s", [5, 6], SamplingParams(max_tokens=50, stop=["man"])))
    outputs, stopped = processor.streamed([("s", i, t) for i, t in enumerate(ids)])
    assert stopped == ["s"] and outputs[-1].finished and outputs[-1].outputs[0].stop_reason == "man"
    assert "s" not in processor.tracked and processor.process([EngineCoreOutput("s", ids)]) == ([], [])

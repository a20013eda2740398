"""Scheduler tests against an independent one-request-at-a-time reference.

The fake model is deterministic, and it reads its context only through the paged KV
cache: the "KV" written for position p is a hash chained on the KV of position p-1 (read
back through the block table) and the token at p, and the next token is derived from the
last KV entry. So outputs match the reference only if every request's blocks hold
exactly its own prefix: a wrong prefix-cache hit, a block reused while still in use, a
lost token across preemption, or a wrong input position all change the output.
"""

import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from mrv2_jax.config import CacheConfig, SchedulerConfig
from mrv2_jax.engine.request import Request, RequestStatus
from mrv2_jax.engine.scheduler import Scheduler
from mrv2_jax.runner.scheduler_output import SchedulerOutput
from mrv2_jax.sampling_params import SamplingParams

VOCAB = 50
EOS = 0
BLOCK_SIZE = 4
_MASK = (1 << 61) - 1


# ---- the fake model ----------------------------------------------------------------------

def kv_entry(previous: int, token: int) -> int:
    return ((previous ^ (token + 1)) * 0x100000001B3) & _MASK


def next_token(last_kv: int) -> int:
    return (last_kv >> 29) % VOCAB


def reference_generate(prompt: list[int], params: SamplingParams, max_model_len: int):
    """Plain autoregressive loop for one request: (output tokens, finish reason)."""
    state = 0
    for token in prompt:
        state = kv_entry(state, token)
    limit = max_model_len - len(prompt)
    if params.max_tokens is not None:
        limit = min(limit, params.max_tokens)
    outputs = []
    while True:
        token = next_token(state)
        outputs.append(token)
        if len(outputs) >= params.min_tokens:
            if (token == EOS and not params.ignore_eos) or token in params.stop_token_ids:
                return outputs, "stop"
        if len(outputs) >= limit:
            return outputs, "length"
        state = kv_entry(state, token)


@dataclass
class DeviceRequest:
    """What the runner keeps per request on the 'device'."""

    tokens: list[int]  # includes sampled tokens the host may not have seen yet
    block_ids: list[int]
    num_computed: int


class FakeRunner:
    """Plays the model runner: persistent per-request state plus a paged KV store."""

    def __init__(self, num_blocks: int):
        self.kv = [None] * (num_blocks * BLOCK_SIZE)
        self.requests: dict[str, DeviceRequest] = {}
        self.num_sampled: dict[str, int] = {}  # per request id, over its whole life
        self.freed_ids: list[str] = []

    def _slot(self, state: DeviceRequest, position: int) -> int:
        return state.block_ids[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE

    def execute(self, out) -> dict[str, list[int]]:
        for req_id in out.finished_req_ids:
            self.freed_ids.append(req_id)
            del self.requests[req_id]  # only ids the runner holds are reported
        for new in out.new_reqs:
            assert new.req_id not in self.requests
            assert new.num_computed_tokens % BLOCK_SIZE == 0
            self.requests[new.req_id] = DeviceRequest(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens)
        for cached in out.cached_reqs:
            state = self.requests[cached.req_id]
            assert state.num_computed == cached.num_computed_tokens
            state.block_ids.extend(cached.new_block_ids)
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        sampled = {}
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            state = self.requests[req_id]
            end = state.num_computed + num_tokens
            assert end <= len(state.tokens), "input token not known even on the device"
            assert len(state.block_ids) * BLOCK_SIZE >= end, "no KV slot for a token"
            for position in range(state.num_computed, end):
                previous = self.kv[self._slot(state, position - 1)] if position else 0
                assert previous is not None
                self.kv[self._slot(state, position)] = kv_entry(previous, state.tokens[position])
            state.num_computed = end
            if end == len(state.tokens):
                token = next_token(self.kv[self._slot(state, end - 1)])
                state.tokens.append(token)
                sampled[req_id] = [token]
                self.num_sampled[req_id] = self.num_sampled.get(req_id, 0) + 1
        assert set(sampled) == out.sampling_req_ids
        return sampled


# ---- the engine loop, sync and async -----------------------------------------------------

@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class Driver:
    """A minimal engine loop. ``steps_in_flight`` steps run ahead of the host: with 1 (the
    engine's async mode) step N+1 is scheduled and dispatched to the device before step
    N's sampled tokens reach the scheduler; 0 is sync; 2 is a deeper pipeline."""

    def __init__(self, scheduler: Scheduler, steps_in_flight: int):
        self.scheduler = scheduler
        self.steps_in_flight = steps_in_flight
        self.runner = FakeRunner(scheduler.kv_cache_manager.num_blocks)
        self.results: dict[str, Result] = {}
        self.pending = deque()
        self.num_steps = 0
        self.max_concurrent = 0

    def add(self, req_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.scheduler.add_request(Request(req_id, prompt, params))
        self.results[req_id] = Result()

    def _collect(self, outputs) -> None:
        for output in outputs:
            result = self.results[output.req_id]
            assert result.finish_reason is None, "token delivered after the request finished"
            result.tokens.extend(output.new_token_ids)
            result.finish_reason = output.finish_reason

    def step(self) -> None:
        scheduler = self.scheduler
        running_before = [r.request_id for r in scheduler.running]
        out = scheduler.schedule() if scheduler.has_unfinished_requests() else None
        if out is not None:
            if out.preempted_req_ids:  # victims: the most recently admitted
                victims = running_before[len(running_before) - len(out.preempted_req_ids):]
                assert set(victims) == out.preempted_req_ids
                assert out.preempted_req_ids <= out.finished_req_ids
                assert not out.new_reqs  # nothing is admitted into a full pool
            self.max_concurrent = max(self.max_concurrent, len(scheduler.running))
            self.pending.append((out, self.runner.execute(out)))
        # The host learns a step's tokens only once `steps_in_flight` newer steps have
        # been dispatched, or when there is nothing left to dispatch.
        while self.pending and (len(self.pending) > self.steps_in_flight or out is None):
            self._collect(scheduler.update_from_output(*self.pending.popleft()))
        self.num_steps += 1

    def run(self, max_steps: int = 20_000) -> dict[str, Result]:
        while self.scheduler.has_unfinished_requests() or self.pending:
            self.step()
            assert self.num_steps < max_steps, "scheduler made no progress"
        return self.results


def make_scheduler(num_blocks=1024, max_num_seqs=8, budget=16, max_model_len=96,
                   chunked=True, prefix_caching=True, cap_while_decoding=0) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                        max_model_len=max_model_len, enable_chunked_prefill=chunked,
                        max_tokens_while_decoding=cap_while_decoding),
        CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=num_blocks,
                    enable_prefix_caching=prefix_caching),
        eos_token_id=EOS,
    )


def random_workload(seed: int, num_requests: int = 32, shared_prefix: int = 0):
    rng = random.Random(seed)
    prefix = [rng.randrange(1, VOCAB) for _ in range(shared_prefix)]
    workload = []
    for index in range(num_requests):
        prompt = prefix + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 40))]
        max_tokens = rng.choice([1, 2, 5, 17, 30, 40])
        params = SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            ignore_eos=index % 7 == 3,
            min_tokens=min(max_tokens, rng.choice([0, 0, 0, 1, 4])),
            stop_token_ids=[7] if index % 5 == 1 else None,
        )
        workload.append((f"req{index}", prompt, params))
    return workload


def run_workload(workload, steps_in_flight: int, **scheduler_kwargs):
    driver = Driver(make_scheduler(**scheduler_kwargs), steps_in_flight)
    for req_id, prompt, params in workload:
        driver.add(req_id, prompt, params)
    return driver, driver.run()


def assert_matches_reference(results, workload, max_model_len=96):
    for req_id, prompt, params in workload:
        expected_tokens, expected_reason = reference_generate(prompt, params, max_model_len)
        assert results[req_id].tokens == expected_tokens, req_id
        assert results[req_id].finish_reason == expected_reason, req_id


def assert_all_blocks_free(driver):
    kv = driver.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert all(count == 0 for count in kv.pool.ref_counts)


# ---- tests -------------------------------------------------------------------------------

@pytest.mark.parametrize("steps_in_flight", [0, 1, 2], ids=["sync", "async", "async2"])
def test_continuous_batching_matches_reference(steps_in_flight):
    workload = random_workload(seed=0)
    assert max(len(p) for _, p, _ in workload) > 16  # prompts longer than the budget: chunked
    driver, results = run_workload(workload, steps_in_flight, budget=16, max_num_seqs=8)
    assert_matches_reference(results, workload)
    assert driver.max_concurrent == 8  # batching actually happened, within the cap
    assert {r.finish_reason for r in results.values()} == {"stop", "length"}
    assert_all_blocks_free(driver)


@pytest.mark.parametrize("steps_in_flight", [0, 1, 2], ids=["sync", "async", "async2"])
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["nocache", "cache"])
def test_preemption_keeps_outputs(steps_in_flight, prefix_caching):
    workload = random_workload(seed=1)
    # 24 blocks hold one max_model_len request; 8 concurrent requests need far more.
    driver, results = run_workload(workload, steps_in_flight, num_blocks=30, budget=32,
                                   prefix_caching=prefix_caching)
    assert driver.scheduler.num_preemptions > 0
    assert_matches_reference(results, workload)
    assert_all_blocks_free(driver)


def test_preempted_request_goes_to_the_front_and_resumes_with_its_outputs():
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=2, budget=64, max_model_len=32)
    for token, name in enumerate("abc", start=1):
        params = SamplingParams(max_tokens=2 if name == "a" else 16, ignore_eos=True)
        scheduler.add_request(Request(name, [token] * 16, params))
    first = scheduler.schedule()  # a and b fill all 8 blocks; c has no seat
    assert list(first.num_scheduled_tokens) == ["a", "b"]
    scheduler.update_from_output(first, {"a": [7], "b": [8]})
    second = scheduler.schedule()  # a's next token needs a 9th block: b is preempted
    assert second.preempted_req_ids == {"b"} and second.finished_req_ids == {"b"}
    assert list(second.num_scheduled_tokens) == ["a"] and not second.new_reqs
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert scheduler.requests["b"].status == RequestStatus.PREEMPTED
    scheduler.update_from_output(second, {"a": [9]})  # a reaches max_tokens
    third = scheduler.schedule()
    assert third.finished_req_ids == {"a"}
    # b resumes first, as a new request carrying its output so far; its own blocks are
    # still cached except the one a took (evicted).
    resumed = third.new_reqs[0]
    assert resumed.req_id == "b" and resumed.token_ids == [2] * 16 + [8]
    assert resumed.num_prompt_tokens == 16 and resumed.num_computed_tokens == 12
    assert third.num_scheduled_tokens["b"] == 5


def test_prefix_caching_on_and_off_agree_with_hits_on_shared_prefixes():
    # RAG-like: one long document, different questions.
    workload = random_workload(seed=2, shared_prefix=40)
    outputs = {}
    for prefix_caching in (False, True):
        driver, results = run_workload(workload, steps_in_flight=1, budget=64,
                                       max_model_len=128, prefix_caching=prefix_caching)
        assert_matches_reference(results, workload, max_model_len=128)
        outputs[prefix_caching] = {k: (v.tokens, v.finish_reason) for k, v in results.items()}
        stats = driver.scheduler.get_stats()
    assert outputs[False] == outputs[True]
    assert stats.prefix_cache_hits >= 31 * 40  # every request after the first
    assert 0 < stats.prefix_cache_hit_rate < 1


@pytest.mark.parametrize("steps_in_flight", [0, 1, 2], ids=["sync", "async", "async2"])
def test_prefix_cache_eviction_under_pressure(steps_in_flight):
    workload = random_workload(seed=3, shared_prefix=24)
    driver, results = run_workload(workload, steps_in_flight, num_blocks=36, budget=32,
                                   max_model_len=96)
    stats = driver.scheduler.get_stats()
    assert stats.num_evicted_blocks > 0 and stats.prefix_cache_hits > 0
    assert_matches_reference(results, workload)
    assert_all_blocks_free(driver)


def test_async_discards_tokens_sampled_after_a_stop_and_never_overshoots_limits():
    workload = random_workload(seed=4)
    sync_driver, sync_results = run_workload(workload, steps_in_flight=0)
    async_driver, async_results = run_workload(workload, steps_in_flight=1)
    assert {k: v.tokens for k, v in sync_results.items()} == {
        k: v.tokens for k, v in async_results.items()}
    assert_matches_reference(async_results, workload)
    extra_tokens = {}
    for req_id, result in async_results.items():
        extra = async_driver.runner.num_sampled[req_id] - len(result.tokens)
        # Length limits count placeholders, so no step is wasted on them; a stop is found
        # one step late, so at most one token (in flight at the time) is dropped.
        assert extra == 0 if result.finish_reason == "length" else extra in (0, 1)
        assert sync_driver.runner.num_sampled[req_id] == len(result.tokens)
        extra_tokens[req_id] = extra
    assert sum(extra_tokens.values()) > 0  # the discard path was exercised


def test_max_model_len_limits_output():
    workload = [("a", list(range(1, 90)), SamplingParams(max_tokens=None, ignore_eos=True)),
                ("b", [3] * 95, SamplingParams(max_tokens=100, ignore_eos=True))]
    for steps_in_flight in (0, 1, 2):
        _, results = run_workload(workload, steps_in_flight, max_model_len=96)
        assert len(results["a"].tokens) == 96 - 89 and results["a"].finish_reason == "length"
        assert len(results["b"].tokens) == 1 and results["b"].finish_reason == "length"


def test_prompt_longer_than_max_model_len_is_rejected():
    scheduler = make_scheduler(max_model_len=32)
    with pytest.raises(ValueError, match="must be shorter than max_model_len .32."):
        scheduler.add_request(Request("long", [1] * 32, SamplingParams()))
    scheduler.add_request(Request("ok", [1] * 31, SamplingParams()))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(Request("ok", [1], SamplingParams()))
    with pytest.raises(ValueError, match="cannot hold one request"):
        make_scheduler(num_blocks=7, max_model_len=32)


@pytest.mark.parametrize("steps_in_flight", [0, 1, 2], ids=["sync", "async", "async2"])
def test_abort_running_request_frees_blocks(steps_in_flight):
    workload = random_workload(seed=5, num_requests=6)
    for _, _, params in workload:
        params.max_tokens, params.ignore_eos = 40, True
    driver = Driver(make_scheduler(budget=64), steps_in_flight)
    for req_id, prompt, params in workload:
        driver.add(req_id, prompt, params)
    for _ in range(5):
        driver.step()
    kv = driver.scheduler.kv_cache_manager
    victim = "req2"
    assert driver.scheduler.requests[victim].status == RequestStatus.RUNNING
    held = len(kv.get_block_ids(victim))
    free_before = kv.num_free_blocks
    driver.scheduler.abort_request(victim)
    assert kv.get_block_ids(victim) == []
    assert kv.num_free_blocks == free_before + held
    tokens_at_abort = list(driver.results[victim].tokens)
    results = driver.run()
    assert victim in driver.runner.freed_ids
    assert results[victim].tokens == tokens_at_abort  # in-flight token was dropped
    assert results[victim].finish_reason is None  # abort reports nothing from the scheduler
    assert_matches_reference(results, [w for w in workload if w[0] != victim])
    assert_all_blocks_free(driver)


def test_external_stop_while_a_step_is_in_flight():
    """The detokenizer finds a stop string after step N; step N+1 already sampled again."""
    driver = Driver(make_scheduler(), steps_in_flight=1)
    driver.add("a", [5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True))
    while len(driver.results["a"].tokens) < 3:
        driver.step()
    driver.scheduler.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    driver.run()
    assert driver.results["a"].tokens == reference_generate(
        [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), 96)[0]
    assert driver.runner.num_sampled["a"] == 4
    assert not driver.scheduler.has_unfinished_requests()


def test_decode_first_then_fcfs_and_chunked_prefill():
    scheduler = make_scheduler(budget=8)
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=10)))
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"a": 3} and first.sampling_req_ids == {"a"}
    assert first.num_prefill_tokens == 2  # the prompt's last token samples "a"'s first output
    scheduler.add_request(Request("b", list(range(1, 21)), SamplingParams()))
    scheduler.add_request(Request("c", [9], SamplingParams()))
    # Async: schedule before step 1's token is known. "a" decodes on its placeholder.
    second = scheduler.schedule()
    assert list(second.num_scheduled_tokens.items()) == [("a", 1), ("b", 7)]
    assert second.sampling_req_ids == {"a"}  # b is mid-prefill, c gets no budget
    assert second.num_prefill_tokens == 7  # b's chunk beside a's decode row
    assert scheduler.requests["a"].num_output_placeholders == 2
    assert second.cached_reqs == []  # "a"'s 4th token fits the block that holds its 3 prompt tokens
    assert second.new_reqs[0].num_computed_tokens == 0
    scheduler.update_from_output(first, {"a": [11]})
    assert scheduler.requests["a"].output_token_ids == [11]
    assert scheduler.requests["a"].num_output_placeholders == 1
    third = scheduler.schedule()
    assert list(third.num_scheduled_tokens.items()) == [("a", 1), ("b", 7)]
    # "a"'s 5th token opens its second block; b's 8th-14th fill its second and take a third and fourth.
    assert [(c.req_id, len(c.new_block_ids), c.num_computed_tokens) for c in third.cached_reqs] == [
        ("a", 1, 4), ("b", 2, 7)]
    with pytest.raises(RuntimeError, match="did not sample"):
        scheduler.update_from_output(second, {"a": [12], "b": [1]})


def test_prefill_tokens_leave_out_decode_rows_drafts_and_fused_calls():
    """A plan's prompt tokens: what it computes without sampling (hand-counted plans)."""
    plan = SchedulerOutput(new_reqs=[], cached_reqs=[], num_scheduled_tokens={"a": 4, "b": 10, "c": 6},
                           total_num_scheduled_tokens=20, finished_req_ids=set(), sampling_req_ids={"a", "c"},
                           num_spec_tokens={"a": 3})
    assert plan.num_prefill_tokens == 10 + 5  # a decodes 1 + 3 drafts; b is mid-prefill; c samples after 5
    fused = SchedulerOutput(new_reqs=[], cached_reqs=[], num_scheduled_tokens={"a": 4, "b": 4},
                            total_num_scheduled_tokens=8, finished_req_ids=set(), sampling_req_ids={"a", "b"},
                            num_fused_steps=4)
    assert fused.num_prefill_tokens == 0


def test_steps_while_a_request_decodes_hold_at_most_the_cap():
    """max_tokens_while_decoding: a prompt alone is prefilled whole; one arriving while another
    request decodes is chunked so that each step holds at most the cap; with too many running rows
    to leave a 32-token chunk the cap is not applied."""
    scheduler = make_scheduler(budget=64, cap_while_decoding=40)
    scheduler.add_request(Request("a", list(range(1, 51)), SamplingParams(max_tokens=20)))
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"a": 50}  # nothing decodes yet: the full budget
    scheduler.update_from_output(first, {"a": [5]})
    scheduler.add_request(Request("b", list(range(2, 52)), SamplingParams(max_tokens=20)))  # no prefix hit
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"a": 1, "b": 39} and second.total_num_scheduled_tokens == 40
    scheduler.update_from_output(second, {"a": [6]})
    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {"a": 1, "b": 11}

    wide = make_scheduler(budget=64, cap_while_decoding=36)
    for i in range(5):
        wide.add_request(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=20)))
    step = wide.schedule()
    wide.update_from_output(step, {f"r{i}": [5] for i in range(5)})
    wide.add_request(Request("long", list(range(1, 51)), SamplingParams(max_tokens=20)))
    step = wide.schedule()  # 5 decode rows + 32 > 36: the whole budget, 5 + 50 tokens
    assert step.total_num_scheduled_tokens == 55 and step.num_scheduled_tokens["long"] == 50
    with pytest.raises(ValueError, match="max_tokens_while_decoding must be an int >= 0"):
        SchedulerConfig(max_tokens_while_decoding=-1)


@pytest.mark.parametrize("steps_in_flight", [0, 1], ids=["sync", "async"])
def test_cap_while_decoding_keeps_outputs(steps_in_flight):
    workload = random_workload(seed=4)
    driver, results = run_workload(workload, steps_in_flight, budget=64, max_num_seqs=4, cap_while_decoding=36)
    assert_matches_reference(results, workload)
    assert_all_blocks_free(driver)


def test_prefill_without_chunking_waits_for_a_step_that_fits():
    scheduler = make_scheduler(budget=96, chunked=False)
    scheduler.add_request(Request("a", [1] * 50, SamplingParams()))
    scheduler.add_request(Request("b", [2] * 50, SamplingParams()))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 50}
    workload = random_workload(seed=6)
    driver, results = run_workload(workload, steps_in_flight=1, budget=96, chunked=False)
    assert_matches_reference(results, workload)


def test_stats():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=2)
    for index in range(3):
        scheduler.add_request(Request(f"r{index}", [1] * 10, SamplingParams()))
    scheduler.schedule()
    stats = scheduler.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (2, 1)
    # r1 shares r0's two full blocks (cached when r0's prefill was scheduled, written
    # earlier in the same step) and owns one block for its last, partial block.
    assert stats.kv_cache_usage == 4 / 64
    assert stats.prefix_cache_queries == 20 and stats.prefix_cache_hits == 8
    assert scheduler.get_num_unfinished_requests() == 3

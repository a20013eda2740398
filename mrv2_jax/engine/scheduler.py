"""Continuous-batching scheduler with chunked prefill, prefix caching, preemption by
recompute, and async scheduling.

Each ``schedule()`` call plans one step under two limits: a token budget
(``max_num_batched_tokens``) and a cap on running requests (``max_num_seqs``). Running
requests go first, in admission order (decodes and unfinished prefill chunks), then
waiting requests in FCFS order. When the KV pool runs out, the most recently admitted
running request is preempted: it drops its blocks and returns to the front of the
waiting queue, to be resumed later as a new request that prefills all its tokens so far.

Async scheduling. The engine may call ``schedule()`` for step N+1 before it calls
``update_from_output()`` for step N, so the scheduler never waits for sampled values:

* ``num_computed_tokens`` advances when a step is *scheduled*;
* a step in which a request's computed tokens reach the end of its tokens (known +
  placeholders) samples a token; that token is counted in ``num_output_placeholders``
  until its value arrives;
* a decode whose input is still a placeholder is scheduled anyway; the runner reads the
  value from device memory;
* limits (``max_tokens``, and ``max_model_len`` on prompt + output) count placeholders,
  so nothing is scheduled past them; stops (EOS, stop tokens, stop strings) are found
  only when the token's value arrives, and a token sampled meanwhile for the finished
  request is dropped;
* a preempted request's tokens in flight are kept when they arrive; it is resumed only
  after that, since resuming prefills all its known tokens.

With sync scheduling the engine alternates schedule / update and the same code runs
with at most one placeholder per request.

Speculative decoding (``num_speculative_tokens`` = k > 0). A decoding request is scheduled
1 + n tokens (n <= k drafts, fewer near its limits; none for requests that use penalties or
logprobs): its last known token and n draft placeholders whose values only the runner holds.
Such a step emits 1 .. 1 + n tokens, so it counts 1 + n output placeholders and advances
``num_computed_tokens`` as if every draft were accepted; when the tokens arrive, the rejected
drafts come off both again. With async scheduling the next step may be scheduled before that
correction: its counts are then too high by the rejected drafts, which only over-reserves KV
blocks; the runner places tokens by its own device-side counts. KV written for rejected drafts
stays in the blocks and is overwritten by later steps before anything reads it.

Fused decode. When every running request is decoding, nothing is waiting and the batch is
small enough for the runner's fused variants, ``schedule()`` plans K decode steps in one
runner call (``SchedulerOutput.num_fused_steps``): each request gets its blocks for up to K
more tokens now and counts them all as placeholders, capped per request by what max_tokens
(and max_model_len) leave. The device stops a request early on its stop ids; the tokens
come back as one list per request and are checked here one by one, so whatever follows a
stop (or, in the output processor, a stop string) is dropped, as with async placeholders.

Grammars. A request with a grammar constraint carries an llguidance matcher that the runner
asks for each step's bitmask (runner/grammar_masks.py): ``update_from_output`` feeds it every
token the request receives, and ends the request with "error" when the matcher cannot go on or
EOS came where the grammar is incomplete. While one runs, no call is fused (``grammar_running``
also tells the engine to read each step before it schedules the next).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from mrv2_jax.config import MIN_PREFILL_CHUNK, CacheConfig, SchedulerConfig
from mrv2_jax.engine.kv_cache_manager import KVCacheManager
from mrv2_jax.engine.request import Request, RequestStatus
from mrv2_jax.engine.scheduler_output import EngineCoreOutput, SchedulerStats
from mrv2_jax.runner.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from mrv2_jax.sampling_params import SamplingParams
from mrv2_jax.spec_decode.metrics import SpecDecodeStats

_FINISHED = frozenset(status for status in RequestStatus if status.is_finished)


def may_speculate(params: SamplingParams) -> bool:
    """Drafts are verified by sampling every draft position; penalties (whose counts would have
    to include the drafts before each position) and logprobs are kept to one token per step."""
    return (params.logprobs is None and params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0)


class Scheduler:
    """Decides which requests run each step and turns sampled tokens into request state.

    ``eos_token_id`` may be one id, several (models with more than one end token), or None.
    ``num_gpu_blocks`` in ``cache_config`` and ``max_model_len`` in ``scheduler_config``
    must be resolved (not None) by the time the scheduler is built.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        eos_token_id: int | Iterable[int] | None,
        automaton_pool=None,
    ) -> None:
        """`automaton_pool`: the runner's pool of structured-output automata (`has_room` /
        `reserve`), so that a constrained request is admitted only when its automaton has a place."""
        if scheduler_config.max_model_len is None:
            raise ValueError("SchedulerConfig.max_model_len must be resolved before scheduling")
        if cache_config.num_gpu_blocks is None:
            raise ValueError("CacheConfig.num_gpu_blocks must be resolved before scheduling")
        max_blocks_per_request = -(-scheduler_config.max_model_len // cache_config.block_size)
        # Guarantees progress: a request alone in the engine can always reach max_model_len.
        if max_blocks_per_request > cache_config.num_gpu_blocks:
            raise ValueError(
                f"the KV cache ({cache_config.num_gpu_blocks} blocks of "
                f"{cache_config.block_size} tokens) cannot hold one request of max_model_len "
                f"{scheduler_config.max_model_len} tokens; lower max_model_len or add blocks"
            )
        self.config = scheduler_config
        self.automaton_pool = automaton_pool
        self.max_model_len = scheduler_config.max_model_len
        if eos_token_id is None:
            self.eos_token_ids: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, int):
            self.eos_token_ids = frozenset((eos_token_id,))
        else:
            self.eos_token_ids = frozenset(eos_token_id)
        self.kv_cache_manager = KVCacheManager(
            cache_config.num_gpu_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
        )
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self._finished_since_last_schedule: set[str] = set()
        self._grammar_running: set[str] = set()  # running requests whose grammar the host masks
        # The engine process streams each fused step's tokens from inside the call
        # (EngineCore.attach_token_sink): requests that stream in the call keep K.
        self.streams_in_call = False
        self.num_preemptions = 0
        k = scheduler_config.num_speculative_tokens
        self.spec_stats = SpecDecodeStats(k) if k else None

    # ---- requests in and out ---------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queues a new request. Raises ValueError if its id is in use or its prompt does
        not leave room for one output token within max_model_len."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt has {request.num_prompt_tokens} "
                f"tokens; it must be shorter than max_model_len ({self.max_model_len}) to "
                "leave room for at least one output token"
            )
        params = request.sampling_params
        room_left = self.max_model_len - request.num_prompt_tokens
        request.max_output_tokens = room_left if params.max_tokens is None else min(params.max_tokens, room_left)
        request.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finishes requests from outside (stop string found, client abort). Unknown or
        already finished ids are ignored: the request may have ended on its own meanwhile."""
        if not status.is_finished:
            raise ValueError(f"finish status must be a FINISHED_* status, got {status}")
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is not None:
                self._finish(request, status)

    def abort_request(self, req_id: str) -> None:
        self.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    @property
    def grammar_running(self) -> bool:
        """Whether a running request has a grammar: its next mask needs every token so far."""
        return bool(self._grammar_running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def get_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_evicted_blocks=kv.pool.num_evictions,
            spec_decode=self.spec_stats.copy() if self.spec_stats else None,
        )

    # ---- planning a step -------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        num_fused_steps = self._num_fused_steps()
        if num_fused_steps > 1:
            return self._schedule_fused(num_fused_steps)
        budget = step_budget = self._token_budget()
        num_scheduled: dict[str, int] = {}
        scheduled: dict[str, Request] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: set[str] = set()
        num_spec: dict[str, int] = {}

        # Each scheduled request's computed count advances as soon as its tokens are scheduled
        # (async: the next schedule() may come before the results), and every token the step will
        # sample counts as a placeholder: in step 1 for running requests, in step 2 for admissions.
        sampling_req_ids: set[str] = set()

        # 1. Running requests, oldest admission first. Preemption victims come off the
        #    end of `running`, so they are never requests already scheduled this step.
        #    (This loop runs once per running request every step: it keeps to plain
        #    attribute reads, and skips what is off, e.g. drafts without speculation.)
        running, speculate = self.running, self.config.num_speculative_tokens > 0
        allocate = self.kv_cache_manager.allocate_slots
        no_change_below = self.kv_cache_manager.no_change_below
        lookahead = self.config.num_lookahead_tokens
        chunked = self.config.enable_chunked_prefill
        for request in running:  # (a preemption shortens the list from its end, which ends the loop there)
            if budget <= 0:
                break
            # The tokens to compute: all that remain, a prefill chunk of them (it samples nothing, so
            # no output limit applies), or none while the tokens in flight reach the output limit.
            placeholders = request.num_output_placeholders
            computed = request.num_computed_tokens
            output_token_ids = request.output_token_ids
            num_known = request.num_prompt_tokens + len(output_token_ids)
            num_new = num_known + placeholders - computed
            if num_new > budget:
                if not chunked:
                    continue
                num_new = budget
            elif len(output_token_ids) + placeholders >= request.max_output_tokens:
                continue
            num_draft = self._num_drafts(request, num_new, budget) if speculate else 0
            num_new += num_draft
            req_id = request.request_id
            # Most steps skip this: below the KV cache manager's `no_change_below` the blocks held suffice and
            # nothing is offered to the prefix cache, so allocate_slots would change nothing.
            if lookahead or computed + num_new >= no_change_below.get(req_id, 0):
                new_blocks = None if lookahead else allocate(request, num_new)
                if new_blocks is None:
                    new_blocks = self._allocate_or_preempt(request, num_new, preempted)
                    if new_blocks is None:
                        break  # the request itself was preempted, and with it everything after it
                if new_blocks:  # the runner knows the rest (most decode steps add no block)
                    cached_reqs.append(CachedRequestData(req_id, new_blocks, computed))
            if num_draft:
                num_spec[req_id] = num_draft
            num_scheduled[req_id] = num_new
            scheduled[req_id] = request
            budget -= num_new
            request.num_computed_tokens = computed = computed + num_new
            if computed == num_known + placeholders + num_draft:
                request.num_output_placeholders = placeholders + 1 + num_draft
                sampling_req_ids.add(req_id)

        # 2. Waiting requests in FCFS order. Not after a preemption: the pool is full, and
        #    admitting would only preempt again next step.
        if not preempted:
            budget = self._admit_waiting(budget, num_scheduled, scheduled, new_reqs, sampling_req_ids)

        finished_req_ids = self._finished_since_last_schedule
        self._finished_since_last_schedule = set()
        return SchedulerOutput(
            new_reqs=new_reqs,
            cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=step_budget - budget,
            finished_req_ids=finished_req_ids,
            sampling_req_ids=sampling_req_ids,
            preempted_req_ids=preempted,
            scheduled_requests=scheduled,
            num_spec_tokens=num_spec,
        )

    def _num_outputs_left(self, request: Request) -> int:
        """Tokens the request may still sample beyond those known or in flight."""
        return request.max_output_tokens - request.num_output_tokens - request.num_output_placeholders

    def _num_fused_steps(self) -> int:
        """K for a fused decode call now, or 1 for an ordinary step: K > 1 only when no request
        needs the host before K more tokens (no prefill to do, blocks for every token up front,
        nothing waiting that a free slot could admit) and the batch fits the runner's fused
        variants. With every slot taken and requests waiting, the call stops when the first
        running request can finish, so that its slot does not idle while another request waits.
        While any running request streams, K is at most the stream interval."""
        config = self.config
        full = len(self.running) >= config.max_num_seqs
        if (config.max_fused_steps <= 1 or not self.running or (self.waiting and not full)
                or len(self.running) > min(config.max_fused_rows, config.max_num_batched_tokens)
                or self._grammar_running):
            return 1
        steps_left = []
        streaming = False
        for request in self.running:
            if (request.num_computed_tokens < request.num_prefill_tokens
                    or request.num_tokens_with_placeholders - request.num_computed_tokens != 1):
                return 1  # a prefill (chunk) to schedule
            if request.streaming and not (self.streams_in_call and request.streams_in_call):
                if config.stream_interval == 1:
                    return 1  # a chunk every step (a server's default): known at the first stream, not after every row
                streaming = True
            steps_left.append(min(config.max_fused_steps, self._num_outputs_left(request)))
        num_steps = min(steps_left) if self.waiting else max(steps_left)
        if streaming:  # a stream's client would wait for the whole call: bound the gap between its chunks
            num_steps = min(num_steps, config.stream_interval)
        if num_steps <= 1:
            return 1
        num_blocks = sum(self.kv_cache_manager.num_blocks_to_grow(request, min(n, num_steps))
                         for request, n in zip(self.running, steps_left) if n > 0)
        # Short of blocks: ordinary steps, which may preempt; a fused call never does.
        return num_steps if num_blocks <= self.kv_cache_manager.num_free_blocks else 1

    def _schedule_fused(self, num_steps: int) -> SchedulerOutput:
        """Every running request decodes up to `num_steps` tokens in one runner call."""
        num_scheduled: dict[str, int] = {}
        scheduled: dict[str, Request] = {}
        cached_reqs: list[CachedRequestData] = []
        for request in self.running:
            n = min(num_steps, self._num_outputs_left(request))
            if n <= 0:
                continue  # all its tokens are in flight already
            new_blocks = self.kv_cache_manager.allocate_slots(request, n)
            if new_blocks is None:  # _num_fused_steps counted the blocks
                raise RuntimeError(f"no KV blocks for the fused decode of {request.request_id!r}")
            if new_blocks:
                cached_reqs.append(CachedRequestData(request.request_id, new_blocks, request.num_computed_tokens))
            request.num_computed_tokens += n
            request.num_output_placeholders += n
            num_scheduled[request.request_id] = n
            scheduled[request.request_id] = request
        finished_req_ids = self._finished_since_last_schedule
        self._finished_since_last_schedule = set()
        return SchedulerOutput(
            new_reqs=[],
            cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=finished_req_ids,
            sampling_req_ids=set(num_scheduled),
            scheduled_requests=scheduled,
            num_fused_steps=num_steps,
        )

    def _token_budget(self) -> int:
        """This step's tokens: max_num_batched_tokens, or max_tokens_while_decoding while a request
        decodes if that leaves MIN_PREFILL_CHUNK tokens beside one per running request (SchedulerConfig)."""
        budget = self.config.max_num_batched_tokens
        cap = self.config.max_tokens_while_decoding
        if (cap and len(self.running) + MIN_PREFILL_CHUNK <= cap
                and any(r.num_computed_tokens >= r.num_prefill_tokens for r in self.running)):
            budget = min(budget, cap)
        return budget

    def _num_drafts(self, request: Request, num_new: int, budget: int) -> int:
        """Draft tokens to add to a running request's ``num_new`` tokens this step."""
        k = self.config.num_speculative_tokens
        # Only a decode (one token left, the prefill of this admission done) has drafts: the
        # proposer drafts when a request samples, so a request that has not yet has none.
        if not k or num_new != 1 or request.num_computed_tokens < request.num_prefill_tokens:
            return 0
        if not may_speculate(request.sampling_params):
            return 0
        num_outputs = request.num_output_tokens + request.num_output_placeholders
        room = min(budget - 1, request.max_output_tokens - num_outputs - 1,
                   self.max_model_len - 1 - request.num_computed_tokens)
        return max(0, min(k, room))

    def _lookahead(self, num_scheduled_end: int) -> int:
        """Extra KV slots past the scheduled tokens (a draft model's own drafts), within
        max_model_len."""
        wanted = self.config.num_lookahead_tokens
        return max(0, min(wanted, self.max_model_len - num_scheduled_end)) if wanted else 0

    def _allocate_or_preempt(
        self, request: Request, num_new: int, preempted: set[str]
    ) -> list[int] | None:
        """Allocates KV for the step, preempting the newest running requests until it fits.
        Returns None if ``request`` itself had to be preempted."""
        lookahead = self._lookahead(request.num_computed_tokens + num_new) if self.config.num_lookahead_tokens else 0
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
            if new_blocks is not None:
                return new_blocks
            victim = self.running.pop()
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        """Drops a running request's KV; it will be recomputed from its tokens so far.
        Tokens it has in flight still arrive and are kept (see ``update_from_output``)."""
        self.kv_cache_manager.free(request)
        self._grammar_running.discard(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        # Victims are taken newest first, so appendleft keeps older ones in front.
        self.waiting.appendleft(request)
        self._finished_since_last_schedule.add(request.request_id)

    def _admit_waiting(
        self,
        budget: int,
        num_scheduled: dict[str, int],
        scheduled: dict[str, Request],
        new_reqs: list[NewRequestData],
        sampling_req_ids: set[str],
    ) -> int:
        """Admits waiting requests in FCFS order while budget, seats and blocks last, each with
        its computed count advanced past this step's tokens (and in ``sampling_req_ids`` when its
        prefill ends here). Returns the budget left."""
        kv = self.kv_cache_manager
        not_ready: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_output_placeholders:
                # Preempted with a token in flight: resume it once the token's value is
                # known, since resuming prefills all its tokens.
                not_ready.append(self.waiting.popleft())
                continue
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            lookahead = self._lookahead(num_hit_tokens + num_new)
            constrained = request.automaton is not None and self.automaton_pool is not None
            if constrained and not self.automaton_pool.has_room(request.request_id, request.automaton):
                break  # the automata of running requests fill the pool: wait until one finishes
            if kv.allocate_slots(request, num_new, hit_blocks, num_lookahead_tokens=lookahead) is None:
                break
            if constrained:
                self.automaton_pool.reserve(request.request_id, request.automaton)
            self.waiting.popleft()
            self.running.append(request)
            if request.grammar is not None:
                self._grammar_running.add(request.request_id)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            request.num_prefill_tokens = request.num_tokens
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit_tokens
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    token_ids=request.all_token_ids,
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    block_ids=kv.get_block_ids(request.request_id),
                    num_computed_tokens=num_hit_tokens,
                    automaton=request.automaton,
                )
            )
            num_scheduled[request.request_id] = num_new
            scheduled[request.request_id] = request
            budget -= num_new
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == request.num_tokens_with_placeholders:  # the prefill ends here
                request.num_output_placeholders += 1
                sampling_req_ids.add(request.request_id)
        self.waiting.extendleft(reversed(not_ready))
        return budget

    # ---- results of a step -----------------------------------------------------------------

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: dict[str, list[int]],
    ) -> list[EngineCoreOutput]:
        """Applies one step's sampled tokens: per request in ``sampling_req_ids`` one, with n
        drafts scheduled 1 .. 1 + n (the accepted drafts and the bonus/correction token), or for
        a fused call up to ``num_scheduled_tokens`` of them (fewer only when the last one stops
        the request).

        Returns one ``EngineCoreOutput`` per request that received tokens. A request that
        finished after this step was scheduled gets nothing: its tokens are dropped, as are
        the tokens that follow a stop.
        """
        outputs = []
        now = time.monotonic()
        sampling_req_ids = scheduler_output.sampling_req_ids
        for req_id in sampled_token_ids.keys() - sampling_req_ids:
            if sampled_token_ids[req_id]:
                raise RuntimeError(f"runner returned tokens for {req_id!r}, which did not sample")
        num_spec_tokens = scheduler_output.num_spec_tokens
        fused = scheduler_output.num_fused_steps > 1  # (never with drafts: SchedulerConfig)
        # Once per sampling request every step: plain attribute reads (status compared by
        # identity, no properties), and no per-request lookups of what is off this step.
        finished = _FINISHED
        num_scheduled_tokens = scheduler_output.num_scheduled_tokens
        for req_id, request in scheduler_output.scheduled_requests.items():  # schedule order
            if req_id not in sampling_req_ids or request.status in finished:
                continue
            token_ids = sampled_token_ids.get(req_id, ())
            num_tokens = len(token_ids)
            num_draft = num_spec_tokens.get(req_id, 0) if num_spec_tokens else 0
            # The placeholders schedule() counted for this request's sampled tokens.
            expected = num_scheduled_tokens[req_id] if fused else 1 + num_draft
            if not 1 <= num_tokens <= expected:
                raise RuntimeError(
                    f"runner returned {num_tokens} tokens for {req_id!r}, expected "
                    + (f"1 to {expected}" if num_draft else str(expected))
                )
            request.num_output_placeholders -= expected
            if num_draft:
                self.spec_stats.observe(num_draft, num_tokens - 1)
                if request.status == RequestStatus.RUNNING:  # (a preempted one restarts from 0)
                    # Rejected drafts were counted as computed; their KV is overwritten later.
                    request.num_computed_tokens -= num_draft - (num_tokens - 1)
            if request.first_token_time is None:
                request.first_token_time = now
            grammar = request.grammar
            if num_tokens == 1 and grammar is None:  # a plain step's token, the common case, inlined
                token_id = token_ids[0]
                output_token_ids = request.output_token_ids
                output_token_ids.append(token_id)
                accepted = token_ids
                # The call is skipped where it could only say "not yet": no stop id, below the limit.
                finish_status = (self._check_stop(request, token_id) if token_id in request.stop_ids
                                 or len(output_token_ids) >= request.max_output_tokens else None)
            else:
                finish_status = None
                for num_accepted, token_id in enumerate(token_ids, 1):  # tokens after a stop are dropped
                    request.append_output_token(token_id)
                    finish_status = self._check_stop(request, token_id)
                    if grammar is not None:
                        finish_status = self._check_grammar(request, token_id, finish_status)
                    if finish_status is not None:
                        break
                accepted = token_ids if num_accepted == len(token_ids) else token_ids[:num_accepted]
            if finish_status is not None:
                self._finish(request, finish_status)
                finish_reason = finish_status.finish_reason
            elif fused and num_tokens < expected:
                # A fused row ends early only on a stop; fewer spec tokens means rejected drafts.
                raise RuntimeError(f"runner stopped {req_id!r} after {len(token_ids)} of {expected} "
                                   "tokens, on a token that does not stop it")
            else:
                finish_reason = None  # it was not finished before this step either
            outputs.append(EngineCoreOutput(req_id, accepted, finish_reason, request.stop_reason))
        return outputs

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        """Whether the token just appended ends the request: one of its `stop_ids` once `min_tokens`
        are out (a `stop_token_ids` entry is its stop reason; EOS has none), or the length limit."""
        num_outputs = len(request.output_token_ids)
        if token_id in request.stop_ids and num_outputs >= request.sampling_params.min_tokens:
            if token_id not in self.eos_token_ids or request.sampling_params.ignore_eos:
                request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if num_outputs >= request.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _check_grammar(self, request: Request, token_id: int, status: RequestStatus | None) -> RequestStatus | None:
        """A grammar request's matcher takes each token it keeps; EOS ends it only where the
        grammar is complete, and a matcher that cannot go on ends it at once ("error")."""
        grammar = request.grammar
        if status is None:
            if grammar.consume(token_id):
                return None
            request.stop_reason = f"structured_outputs.grammar: {grammar.error or 'the grammar cannot go on'}"
            return RequestStatus.FINISHED_ERROR
        if status is RequestStatus.FINISHED_STOPPED and token_id in self.eos_token_ids and not grammar.accepting:
            request.stop_reason = "structured_outputs.grammar: no token continues the output, and it is incomplete"
            return RequestStatus.FINISHED_ERROR
        return status

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self._grammar_running.discard(request.request_id)
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            # Only the runner's own requests: a waiting one is unknown to it, or (when
            # preempted) was already reported at preemption.
            self._finished_since_last_schedule.add(request.request_id)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

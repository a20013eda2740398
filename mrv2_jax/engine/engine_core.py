"""The engine loop: schedule -> execute -> (one step later) update, as in mini-sglang's overlap
loop.

With async scheduling the loop dispatches step N+1 before it reads step N's sampled tokens, so
the host schedules and prepares while the device computes; the scheduler counts the unknown
tokens as placeholders. Without it (and always with the V1 runner) every step is read back
before the next is scheduled, and so is every step while a grammar request runs: the host
computes its next mask from the tokens so far (runner/grammar_masks.py).
"""

import time
from collections.abc import Iterable

from mrv2_jax.engine.hand_over import Dispatch
from mrv2_jax.engine.request import Request, RequestStatus
from mrv2_jax.engine.request_checks import check_automaton_fits, check_request
from mrv2_jax.engine.scheduler import Scheduler
from mrv2_jax.engine.scheduler_output import EngineCoreOutput
from mrv2_jax.runner.compile_guard import CompileGuard, num_compiles
from mrv2_jax.runner.fused import stops_on_device
from mrv2_jax.runner.interface import Runner, StepOutcome
from mrv2_jax.runner.scheduler_output import SchedulerOutput
from mrv2_jax.structured.compiler import ConstraintCompiler


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: Runner, async_scheduling: bool,
                 compiler: ConstraintCompiler | None = None):
        """`compiler`: compiles requests' structured-output constraints (None: the model has no
        tokenizer, so a constrained request is refused)."""
        if async_scheduling and not runner.is_async_capable:
            raise ValueError(f"{type(runner).__name__} cannot run with async scheduling "
                             "(it needs each step's tokens on the host to build the next step)")
        self.scheduler = scheduler
        self.runner = runner
        self.async_scheduling = async_scheduling
        self.compiler = compiler
        self._in_flight: tuple[SchedulerOutput, StepOutcome] | None = None
        self.compile_guard = CompileGuard()
        # Benchmarks' instrumentation (runner/step_hooks.py StepHooks); None: nothing is called.
        self.hooks = None
        self.startup = None  # engine/startup.py StartupReport, set by the builder
        # Prompt logprobs gathered chunk by chunk until the request's first output carries them
        # (then None: a preempted request's recomputed prefill brings them again, ignored).
        self._prompt_logprobs: dict[str, list | None] = {}
        # Prompt tokens computed by the step whose outputs step() last returned (0: none returned).
        self.outputs_prefill_tokens = 0
        # The step the last step() call handed to the runner; None when it handed over no tokens. (A
        # fused call that streams from inside holds the host until it ends, so its seconds are the
        # whole call's.)
        self.dispatched: Dispatch | None = None

    def check_request(self, params) -> None:
        """Raise ValueError for what this engine cannot serve."""
        check_request(params, self.runner.supports_prompt_logprobs, self.runner.automaton_capacity[0] > 0)

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        self.check_request(params)
        if params.structured_outputs is not None:  # compiled here, off the step path (cached)
            if self.compiler is None:
                raise ValueError("structured_outputs needs the model's tokenizer, and this model has none")
            request.automaton = self.compiler.compile(params.structured_outputs)
            check_automaton_fits(request.automaton, self.runner.automaton_capacity)
            if not request.automaton.shared:  # a grammar: the request's own matcher
                request.grammar = request.automaton
        # Streamed from inside fused calls: tokens only (no logprobs), and ended on the device.
        request.streams_in_call = (request.streaming and params.logprobs is None
                                   and stops_on_device(params, self.runner.eos_token_ids))
        self.scheduler.add_request(request)
        if request.sampling_params.prompt_logprobs is not None:
            self._prompt_logprobs[request.request_id] = []

    def attach_token_sink(self, sink) -> bool:
        """Stream fused steps' tokens from inside the call: `sink(entries)` gets (req_id, output
        index, token) for each step, on an XLA thread, for requests that `streams_in_call`; False
        (nothing attached) when the runner was not built for it (EngineConfig.stream_in_call).
        None detaches the sink."""
        if not self.runner.stream_in_call:
            return False
        if sink is None:
            self.runner.token_sink = None
            self.scheduler.streams_in_call = False
            return True
        requests = self.scheduler.requests

        def to_streams(entries):
            entries = [e for e in entries if (r := requests.get(e[0])) is not None and r.streams_in_call]
            if entries:
                sink(entries)

        self.runner.token_sink = to_streams
        self.scheduler.streams_in_call = True
        return True

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.scheduler.abort_request(req_id)
            self._prompt_logprobs.pop(req_id, None)

    def finish_requests(self, req_ids: Iterable[str]) -> None:
        """Finish requests that matched a stop string (found by the detokenizer)."""
        req_ids = list(req_ids)
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_STOPPED)
        for req_id in req_ids:
            self._prompt_logprobs.pop(req_id, None)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self) -> list[EngineCoreOutput]:
        """Advance by one step; returns what changed for each request (one step late when
        async)."""
        compiles_before = num_compiles()
        start = time.perf_counter()
        self.outputs_prefill_tokens = 0
        self.dispatched = None
        outputs = self._step()
        self.compile_guard.report(num_compiles() - compiles_before, "an engine step")
        if self.hooks is not None:
            self.hooks.step_finished(start, time.perf_counter())
        return outputs

    def _step(self) -> list[EngineCoreOutput]:
        # A running grammar's next mask needs the tokens in flight: read them first, then step
        # synchronously while one runs. (A grammar admitted by an async step needs no earlier
        # token for its first mask; that step stays in flight, and the next call reads it.)
        synchronous = not self.async_scheduling or self.scheduler.grammar_running
        if synchronous and self._in_flight is not None:
            previous, self._in_flight = self._in_flight, None
            return self._update(*previous)
        scheduled = self.scheduler.schedule()
        if self.hooks is not None:
            self.hooks.step_scheduled(scheduled)
        read_early = []
        if self.scheduler.streams_in_call and scheduled.num_fused_steps > 1 and self._in_flight is not None:
            read_early = self._read_and_stream_in_flight()
        # Always handed to the runner, even with no tokens: it may carry finished requests
        # whose slots the runner must free.
        handed, handed_cpu, calls = time.perf_counter(), time.thread_time(), self.runner.call_seconds
        result = self.runner.execute(scheduled)
        if scheduled.total_num_scheduled_tokens:
            self.dispatched = Dispatch(time.perf_counter() - handed, scheduled.num_prefill_tokens,
                                       time.thread_time() - handed_cpu, self.runner.call_seconds - calls)
        if synchronous:
            return self._update(scheduled, result)
        previous = self._in_flight
        self._in_flight = (scheduled, result) if scheduled.total_num_scheduled_tokens else None
        if previous is None:
            return read_early
        return self._update(*previous)

    def _read_and_stream_in_flight(self) -> list[EngineCoreOutput]:
        """Before a fused call that streams from inside: such a call holds the host until it ends
        (each step's callback waits for the device), so the step in flight is read now and its
        tokens go to the streams first: a request's first token does not wait for K steps."""
        previous, self._in_flight = self._in_flight, None
        outputs = self._update(*previous)
        if previous[0].num_fused_steps > 1:
            return outputs  # a fused call streamed its own tokens
        entries = []
        for out in outputs:
            request = self.scheduler.requests.get(out.req_id)
            if request is not None and out.new_token_ids:
                first = request.num_output_tokens - len(out.new_token_ids)
                entries += [(out.req_id, first + i, t) for i, t in enumerate(out.new_token_ids)]
        if entries and self.runner.token_sink is not None:
            self.runner.token_sink(entries)
        return outputs

    def _update(self, scheduled: SchedulerOutput, result: StepOutcome) -> list[EngineCoreOutput]:
        self.outputs_prefill_tokens = scheduled.num_prefill_tokens
        outputs = self.scheduler.update_from_output(scheduled, result.result())
        # Logprobs travel beside the tokens: each output carries this step's tokens of one
        # request, so it takes that request's logprobs (dropped tokens drop theirs too: a
        # fused call's tokens after a stop).
        logprobs = result.logprobs()
        if logprobs:
            for out in outputs:
                entries = logprobs.get(out.req_id)
                if entries is not None:  # (None is the output's default)
                    n = len(out.new_token_ids)
                    out.new_logprobs = entries if len(entries) <= n else entries[:n]  # no copy: one per step
        if self._prompt_logprobs:
            self._attach_prompt_logprobs(outputs, result)
        return outputs

    def _attach_prompt_logprobs(self, outputs, result: StepOutcome) -> None:
        """Gather this step's prompt logprobs; hand them over with a request's first output."""
        for req_id, (first, entries) in result.prompt_logprobs().items():
            gathered = self._prompt_logprobs.get(req_id)
            if gathered is not None:  # a prefill restarted by a preemption overwrites its entries
                del gathered[first:]
                gathered.extend(entries)
        for out in outputs:
            if out.req_id in self._prompt_logprobs:
                if self._prompt_logprobs[out.req_id] is not None:
                    out.prompt_logprobs = self._prompt_logprobs[out.req_id]
                    self._prompt_logprobs[out.req_id] = None
                if out.finish_reason is not None:
                    del self._prompt_logprobs[out.req_id]

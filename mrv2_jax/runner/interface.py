"""What the engine may use of a model runner, declared once.

The engine (engine/engine_core.py, engine/builder.py) talks to either runner, ModelRunnerV1
(runner/v1.py) or ModelRunnerV2 (runner/v2.py), only through `Runner`, and to what a step
returns only through `StepOutcome`. Both are `runtime_checkable`, so a test can check that a
runner (or a stand-in one) provides every member; anything else a runner holds is its own.
"""

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from mrv2_jax.runner.automaton_pool import AutomatonPool
from mrv2_jax.runner.scheduler_output import SchedulerOutput
from mrv2_jax.runner.token_logprobs import LogprobRow, TokenLogprobs


@runtime_checkable
class StepOutcome(Protocol):
    """The result of one `Runner.execute`: StepResult (values already on the host, runner/step_result.py)
    or PendingStep (read one step later, runner/v2.py)."""

    def result(self) -> dict[str, list[int]]:
        """{req_id: tokens sampled this call} for every request that sampled; blocks until they are
        on the host. Several tokens per request for fused decode and speculative decoding."""

    def logprobs(self) -> dict[str, list[LogprobRow | TokenLogprobs]]:
        """{req_id: one entry per token in `result()[req_id]`} for the requests that asked for
        logprobs (the engine trims it to the tokens it keeps)."""

    def prompt_logprobs(self) -> dict[str, tuple[int, list[LogprobRow | TokenLogprobs]]]:
        """{req_id: (prompt position of the first entry, one entry per prompt position computed this
        call)} for the requests that asked for prompt logprobs."""


@runtime_checkable
class Runner(Protocol):
    """A model runner: holds the persistent per-request state, runs one scheduled step per call."""

    # False: the runner needs a step's tokens on the host to build the next step, so the engine
    # must read every step before scheduling the next (no async scheduling).
    is_async_capable: bool
    # Whether a request may ask for prompt logprobs with this runner's configuration; the engine
    # rejects such requests otherwise.
    supports_prompt_logprobs: bool
    # The largest batch that one call may decode several steps for (fused decode,
    # SchedulerOutput.num_fused_steps > 1); 0: the runner never fuses steps.
    max_fused_rows: int
    # Fused decode calls run so far (benchmarks report it); always 0 when max_fused_rows is 0.
    num_fused_calls: int
    # Host seconds spent inside compiled step calls so far (argument handling, the input's copy, the
    # launch; not the device's work), summed over every call: the rest of an `execute` is the runner's
    # own Python.
    call_seconds: float
    # Step programs planned but not compiled yet: lazy makes each at its first use, background
    # beside the engine; 0 in compile mode eager.
    num_programs_pending: int
    # Structured outputs: (states, exception entries) the device's automaton pool holds, the
    # largest automaton a request may bring; (0, 0): this runner cannot run constraints.
    automaton_capacity: tuple[int, int]
    # The pool's host bookkeeping (runner/automaton_pool.py), which the scheduler reserves places
    # in when it admits a constrained request; None when the runner cannot run constraints.
    automaton_pool: AutomatonPool | None
    # The model's EOS ids (a request stops on them unless it ignores EOS).
    eos_token_ids: tuple[int, ...]
    # Fused decode hands each step's tokens to `token_sink` from inside the call (EngineCore.
    # attach_token_sink sets it); False: it never does, and `token_sink` stays None.
    stream_in_call: bool
    token_sink: Callable[[list[tuple[str, int, int]]], None] | None

    def execute(self, out: SchedulerOutput) -> StepOutcome:
        """Apply the scheduler's changes (finished, new and continuing requests) and run the step it
        scheduled. Called for every schedule, even one with no tokens (it may free slots)."""

    def warm_up(self) -> None:
        """Run every step program ready now once on a batch with no requests (before the first
        request), so that its first real use records no command buffers and loads no kernels."""

    def wait_for_compiles(self, timeout: float | None = None) -> bool:
        """Block until every planned step program is compiled (compile mode background compiles
        them beside the engine; other modes return at once); False if `timeout` seconds passed."""

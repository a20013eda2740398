"""The instrumentation interface of an engine step, for benchmarks.

`EngineCore.hooks` and `ModelRunnerV2.hooks` are None unless a benchmark sets them (to the same
object, usually); when None nothing is called. A benchmark subclasses `StepHooks` and overrides
what it watches; the engine and the runner only call these methods, never read anything back.
"""


class StepHooks:
    """No-op callbacks, in the order of one engine step: scheduled, dispatched (V2 runner only;
    once per compiled call), finished."""

    def step_scheduled(self, scheduled) -> None:
        """The engine scheduled a step (a SchedulerOutput), before the runner executes it: the
        runner's device state is still the one that step will run on."""

    def dispatched(self, runner, compiled, packed, call_s: float) -> None:
        """The runner called `compiled` (the step's executable) with its host input buffer
        `packed`; `call_s` is the host time of that call alone (argument handling, the input
        copy, the launch), not of the device work."""

    def step_finished(self, start_s: float, end_s: float) -> None:
        """`EngineCore.step` ran from start_s to end_s (time.perf_counter seconds)."""

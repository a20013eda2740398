"""Watching an engine's steps from a benchmark: attaching instrumentation hooks, and the simplest
hooks, a log of each step's interval and shape."""

from mrv2_jax.runner.step_hooks import StepHooks


def attach_hooks(engine, hooks: StepHooks | None) -> None:
    """Set `hooks` on the engine core and on its runner where the runner takes them (V2); None
    detaches them (and frees what they hold of the engine)."""
    engine.hooks = hooks
    if hasattr(engine.runner, "hooks"):
        engine.runner.hooks = hooks


class StepLog(StepHooks):
    """`steps`: (start, end, num_tokens, num_reqs) per engine step, perf_counter seconds."""

    def __init__(self):
        self.steps: list[tuple[float, float, int, int]] = []
        self._shape = (0, 0)

    def step_scheduled(self, scheduled) -> None:
        self._shape = (scheduled.total_num_scheduled_tokens, len(scheduled.num_scheduled_tokens))

    def step_finished(self, start_s: float, end_s: float) -> None:
        self.steps.append((start_s, end_s, *self._shape))

"""Catching one steady-decode step of a V2 engine, to replay it alone afterwards.

The runner's `execute` is wrapped (on the instance, nothing else changes): at the `which`-th
step in which every one of `rows` rows decodes one token, a copy of the device state is taken
before the step donates it, and the step's compiled call and packed input are kept.
`runner.replay` then runs exactly that step again on the copy, back to back or one at a time.
"""

import jax
import jax.numpy as jnp


class DecodeStepCapture:
    def __init__(self, engine, rows: int, which: int):
        self.engine, self.rows, self.which = engine, rows, which
        self.dispatch = self.state = self.step_index = None
        runner = engine.runner
        execute, seen = runner.execute, [0]
        # Compile the state copy now: a compile inside the captured step would inflate its wall
        # time (and is an error under MRV2_STRICT_COMPILES=1).
        jax.block_until_ready(jax.tree.map(jnp.copy, runner.state))

        def execute_and_capture(out):
            snapshot = None
            if out.total_num_scheduled_tokens == len(out.num_scheduled_tokens) == rows:
                seen[0] += 1
                if seen[0] == which:  # copy before the step donates the state
                    snapshot = jax.tree.map(jnp.copy, runner.state)
            pending = execute(out)
            if snapshot is not None:
                self.dispatch, self.state = runner.last_dispatch, snapshot
                self.step_index = len(engine.step_log) if engine.step_log is not None else None
            return pending

        runner.execute = execute_and_capture

    @property
    def captured(self) -> bool:
        return self.dispatch is not None

    def release(self) -> None:
        """Unwrap `execute` (this also breaks the closure's reference cycle, so the engine's
        memory can be freed once nothing else holds it)."""
        self.engine.runner.__dict__.pop("execute", None)

    def restore_state(self) -> None:
        """Put a fresh copy of the captured state into the runner (replays advance it)."""
        self.engine.runner.state = jax.tree.map(jnp.copy, self.state)

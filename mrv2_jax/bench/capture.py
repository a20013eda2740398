"""Catching one steady-decode dispatch of a V2 engine, to replay it alone afterwards.

`DecodeStepCapture` is a step log (bench/step_log.py) that also watches the runner's dispatches:
at the `which`-th step in which every one of `rows` rows decodes `steps` tokens, it copies the
device state before the step donates it and keeps the step's compiled call and packed input.
`replay` then runs exactly that step again on the copy, back to back or one at a time.
"""

import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from mrv2_jax.bench.step_log import StepLog


@dataclass(frozen=True)
class Dispatch:
    """One compiled call of a V2 runner as its hook saw it: enough to make the call again."""

    runner: object
    compiled: object
    packed: np.ndarray


def replay(dispatch: Dispatch, repeats: int, head_start=None) -> tuple[float, float]:
    """Run a captured step `repeats` times back to back on the runner's current state (it
    advances that state: restore it first) -> (seconds per step, host seconds per step to
    enqueue them). Near the first, the host (or a sync inside the step) is what limits the
    replay, not the GPU. head_start: a callable that enqueues GPU work first (its time is in the
    result), so that the host has enqueued the steps before the GPU reaches them."""
    runner = dispatch.runner
    packed = jax.device_put(dispatch.packed)
    jax.block_until_ready(runner.state)
    start = time.perf_counter()
    if head_start is not None:
        head_start()
    for _ in range(repeats):
        result = runner.call_step(dispatch.compiled, packed)
    enqueue_s = (time.perf_counter() - start) / repeats
    jax.block_until_ready(result.tokens)
    return (time.perf_counter() - start) / repeats, enqueue_s


class DecodeStepCapture(StepLog):
    """Attach it with `attach_hooks`; after the run, `dispatch` is the captured call (None if no
    such step came), `state` the device state it ran on and `step_index` its index in `steps`."""

    def __init__(self, runner, rows: int, which: int, steps: int = 1):
        super().__init__()
        self.runner, self.rows, self.which, self.decode_steps = runner, rows, which, steps
        self.dispatch: Dispatch | None = None
        self.state = self.step_index = self._snapshot = None
        self._seen = 0
        # Compile the state copy now: a compile inside the captured step would inflate its wall
        # time (and is an error under MRV2_STRICT_COMPILES=1).
        jax.block_until_ready(jax.tree.map(jnp.copy, runner.state))

    def step_scheduled(self, scheduled) -> None:
        super().step_scheduled(scheduled)
        # No row gets more than the step count, so the total says that every row gets all of
        # them (checked in O(1): this runs inside every measured step).
        steps = self.decode_steps
        if (len(scheduled.num_scheduled_tokens) == self.rows and scheduled.num_fused_steps == steps
                and scheduled.total_num_scheduled_tokens == self.rows * steps):
            self._seen += 1
            if self._seen == self.which:  # copy before the step donates the state
                self._snapshot = jax.tree.map(jnp.copy, self.runner.state)

    def dispatched(self, runner, compiled, packed, call_s: float) -> None:
        if self._snapshot is not None:
            self.dispatch, self.state, self._snapshot = Dispatch(runner, compiled, packed), self._snapshot, None
            self.step_index = len(self.steps)

    @property
    def captured(self) -> bool:
        return self.dispatch is not None

    def restore_state(self) -> None:
        """Put a fresh copy of the captured state into the runner (replays advance it)."""
        self.runner.state = jax.tree.map(jnp.copy, self.state)

"""Calling a compiled step so that no buffer its CUDA graphs use moves between calls.

XLA records a step's kernels into command buffers (CUDA graphs) once. Before every later call it
compares the device address of each buffer those graphs touch with the recorded one; if any has
moved it records the graphs again and CUDA uploads them again, which for a 28-layer decode step
costs the host more than the whole step costs the GPU (docs/benchmarks.md, "The host cost of one
XLA call"). Donated buffers that come back as outputs keep their address; weights never move. What
moves is a fresh input (the packed step buffer) and a fresh output (the sampler's result). So a
`StableStep` keeps both at fixed addresses:

- the packed input is copied into a device buffer the step owns, by a small upload call that
  donates that buffer and writes the new contents in place;
- the step gets a donated result buffer and writes its result there, so the result never moves;
- the caller gets a copy of the result, made by a small call of its own right after the step: the
  next call donates the result buffer, and the engine reads a step's tokens one step late.

The two small calls are compiled without command buffers, so their fresh buffers cost nothing to
track. A StableStep is called exactly like the compiled step it wraps.
"""

import jax
import jax.numpy as jnp

# XLA options for the two small calls: no command buffer (a graph must hold at least this many
# commands), so their fresh input and output addresses never trigger a re-record.
SMALL_CALL_GPU_OPTIONS = {"xla_gpu_graph_min_graph_size": 1 << 20}


def with_result_slot(step, num_state: int):
    """step(params, *state, packed, spec_params, spec_state) -> (*state, result, spec_state)
    => fn(params, *state, result_slot, packed, spec_params, spec_state) with the same outputs, for
    compiling with `result_slot` donated (the result then lands in its buffer)."""

    def fn(param_leaves, *args):
        state, (_result_slot, packed, spec_params, spec_state) = args[:num_state], args[num_state:]
        return step(param_leaves, *state, packed, spec_params, spec_state)

    return fn


def donated_argnums(num_state: int) -> tuple[int, ...]:
    """The donated arguments of a `with_result_slot` step: the state, the result slot, spec state."""
    return (*range(1, 2 + num_state), num_state + 4)


def _upload(buffer, contents):
    return jax.lax.dynamic_update_slice(buffer, contents, (0,))


def _copy_result(result):
    return jax.tree.map(jnp.copy, result)


class StableStep:
    """A compiled `with_result_slot` step with its own packed buffer and result slot."""

    def __init__(self, step, upload, copy_result, packed_shape, result_shapes):
        self._step, self._upload, self._copy_result = step, upload, copy_result
        self._packed = jnp.zeros(packed_shape.shape, packed_shape.dtype)
        self._result = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), result_shapes)

    def __call__(self, param_leaves, *args):
        *state, packed, spec_params, spec_state = args
        self._packed = self._upload(self._packed, packed)
        *state, self._result, spec_state = self._step(param_leaves, *state, self._result, self._packed,
                                                      spec_params, spec_state)
        return (*state, self._copy_result(self._result), spec_state)


def lower_small_calls(packed_shape, result_shapes):
    """(lowered upload, lowered result copy) for one step's packed buffer and result."""
    upload = jax.jit(_upload, donate_argnums=0).lower(packed_shape, packed_shape)
    copy_result = jax.jit(_copy_result).lower(result_shapes)
    return upload, copy_result

"""The V2 step made so that no buffer its command buffers use moves between calls (issue 25).

XLA records a step program's CUDA graph again whenever an allocation the graph uses sits at
another address than in the call before. In the engine's step two groups move: the packed input
(a fresh host->device copy per call) and the step's result buffers (the previous call's result is
still alive when the next call is made). Here both live inside one donated "io" tree that the step
takes and gives back, so every argument and result of the big program aliases a donated buffer:

  exchange(io, packed) -> (io with packed in it, a copy of io's result)   small: a few copies
  step(params, kv, state, slots, io, spec...) -> (kv, state, slots, io with its result, spec)

One engine step is then two calls, exchange and step; the result of step N comes out of the
exchange of step N + 1 (or of `drain`). Whether the big program then records nothing per call is
what `TF_CPP_VMODULE=command_buffer_thunk=3` says (`updated_allocs`).
"""

import jax
import jax.numpy as jnp

from mrv2_jax.xla_flags import step_compiler_options


def step_program_of(runner, compiled):
    """(bucket, layout, sampler variant index) of one of a V2 runner's compiled step programs."""
    for bucket, (layout, variants) in runner.compiled.items():
        for i in range(len(variants)):
            if variants[i] is compiled:
                return bucket, layout, i
    raise ValueError("not one of the runner's step programs")


class StableStep:
    """One captured step of `runner`, recompiled with its packed input and result in a donated io
    tree. `call(packed)` runs exchange then step and returns the result of the call before."""

    def __init__(self, runner, compiled, packed):
        bucket, layout, variant = step_program_of(runner, compiled)
        step = runner._step_fn(layout, runner.sampler_variants[variant], unroll_layers=runner._unrolled(bucket))
        self.runner = runner

        def stable(param_leaves, kv_cache, state, slot_state, io, spec_params, spec_state):
            kv_cache, state, slot_state, result, spec_state = step(
                param_leaves, kv_cache, state, slot_state, io["packed"], spec_params, spec_state)
            return kv_cache, state, slot_state, {"packed": io["packed"], "result": result}, spec_state

        def exchange(io, packed):
            return {"packed": packed, "result": io["result"]}, jax.tree.map(jnp.copy, io["result"])

        args = (runner.params.leaves, runner.kv_cache, runner.state, runner.slot_state)
        packed_spec = jax.ShapeDtypeStruct(packed.shape, packed.dtype)
        result_spec = jax.eval_shape(step, *args, packed_spec, runner.spec_params, runner.spec_state)[3]
        self.io = {"packed": jax.device_put(packed), "result": jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                                                            result_spec)}
        options = step_compiler_options(runner.params.leaves) or None
        # keep_unused: the io result is never read, only overwritten; pruned, it could not be aliased.
        self.step = jax.jit(stable, donate_argnums=(1, 2, 3, 4, 6), keep_unused=True).lower(
            *args, self.io, runner.spec_params, runner.spec_state).compile(options)
        self.exchange = jax.jit(exchange, donate_argnums=(0,)).lower(self.io, packed_spec).compile()

    def call(self, packed):
        """Put `packed` in, run the step -> the result of the step before (a device tree)."""
        self.io, result = self.exchange(self.io, packed)
        self.call_step_only()
        return result

    def call_step_only(self):
        """The step on whatever packed input io holds (no exchange: nothing moves at all)."""
        r = self.runner
        r.kv_cache, r.state, r.slot_state, self.io, r.spec_state = self.step(
            r.params.leaves, r.kv_cache, r.state, r.slot_state, self.io, r.spec_params, r.spec_state)
        return self.io

    def drain(self):
        """The result of the last step (copied out, as the next exchange would)."""
        return jax.tree.map(jnp.copy, self.io["result"])

"""Tensor parallelism, the runner's side: the device mesh and where each of the engine's arrays
lives on it.

One `TensorParallel` is built by the engine builder when `tensor_parallel_size` > 1 and handed
to the runner as configuration. Layer weights are split over the mesh's AXIS by the family's
rules (ModelState.tensor_parallel_rules, models/tensor_parallel.py), the KV cache by its KV-head
axis; everything else (embeddings, norms, lm_head, the runner's device state, the sampler's
tables, the packed step input and the step's outputs) is replicated, so the host side of a step
is the same as on one device. With size 1 none of this exists: the runner gets None.

Expert parallelism (`expert_parallel`, MoE families): the experts' stacked weights are split on
their expert axis over the same mesh, whole experts per device; the family's MoE block runs each
device's experts under shard_map (models/moe.py::expert_parallel_experts).
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mrv2_jax.models.tensor_parallel import AXIS, interleave_shards

FLAG = "tensor_parallel_size"


class TensorParallel:
    """The mesh over the first `size` local devices and the shardings of the engine's arrays."""

    def __init__(self, size: int, expert_parallel: bool = False):
        devices = jax.local_devices()
        if size > len(devices):
            raise ValueError(f"{FLAG}={size} exceeds the {len(devices)} local device(s) "
                             f"({devices[0].platform}); multi-host tensor parallelism is not supported yet")
        self.size = size
        self.expert_parallel = expert_parallel
        self.mesh = Mesh(np.array(devices[:size]), (AXIS,))
        self.replicated = NamedSharding(self.mesh, P())
        # [layers, blocks, KV heads, block_size, head_dim]: each device holds its heads' pages.
        self.kv = NamedSharding(self.mesh, P(None, None, AXIS, None, None))

    def shard_model(self, model_state, lm) -> None:
        """Split `lm`'s layer weights over the mesh by the family's rules (fused ones re-ordered
        into their per-device layout first) and replicate the rest, in place; from now on the
        family's layer math expects that layout (ModelState.tp_size)."""
        rules = model_state.set_tensor_parallel(self.size, self.mesh if self.expert_parallel else None)
        groups = model_state.layer_groups()
        for path, param in nnx.iter_graph(lm):
            if not isinstance(param, nnx.Param):
                continue
            rule = rules.get(path[-1]) if len(path) == 2 and path[0] in groups else None
            value = param.get_value()
            if rule is None:
                param.set_value(jax.device_put(value, self.replicated))
                continue
            axis = rule.axis + 1  # stacked: the layer axis comes first
            if rule.widths:
                value = interleave_shards(value, rule.widths, self.size, axis)
            spec = [None] * value.ndim
            spec[axis] = AXIS
            param.set_value(jax.device_put(value, NamedSharding(self.mesh, P(*spec))))

    def replicate(self, tree):
        """Every array of `tree` copied to every device of the mesh."""
        return jax.device_put(tree, self.replicated)

    def kv_zeros(self, shape, dtype) -> jax.Array:
        """A zero KV cache made directly in its sharded layout (never whole on one device)."""
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=self.kv)()

    def step_shardings(self, device_state: tuple):
        """-> (the packed input's sharding, the step outputs' shardings): the device state keeps
        the shardings it has (donated buffers are reused only if in and out agree), the sampler
        output and the spec state are replicated."""
        state = tuple(jax.tree.map(lambda a: a.sharding, s) for s in device_state)
        return self.replicated, (*state, self.replicated, self.replicated)

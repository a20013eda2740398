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
    """The mesh over `size` devices and the shardings of the engine's arrays. One process: its first
    `size` local devices. Several (engine/distributed.py): the first size / P devices of each of
    the P processes, process 0's first; every array is then global, each process holding its own
    devices' shards, built from the same host values in every process."""

    def __init__(self, size: int, expert_parallel: bool = False):
        self.size = size
        self.expert_parallel = expert_parallel
        self.multi_process = jax.process_count() > 1
        self.mesh = Mesh(np.array(mesh_devices(size)), (AXIS,))
        self.attention_mesh = self.mesh  # PagedAttention splits the heads over it
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
                param.set_value(self.put(value, self.replicated))
                continue
            axis = rule.axis + 1  # stacked: the layer axis comes first
            if rule.widths:
                value = interleave_shards(value, rule.widths, self.size, axis)
            spec = [None] * value.ndim
            spec[axis] = AXIS
            param.set_value(self.put(value, NamedSharding(self.mesh, P(*spec))))

    def put(self, value, sharding) -> jax.Array:
        """`value` placed with `sharding`. Across processes each process builds its own devices'
        shards from its host copy (the same in every process): an array on one device cannot
        move to another host's devices."""
        if not self.multi_process:
            return jax.device_put(value, sharding)
        host = np.asarray(value)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    def replicate(self, tree):
        """Every array of `tree` copied to every device of the mesh."""
        return jax.tree.map(lambda a: self.put(a, self.replicated), tree)

    def local(self, tree):
        """This process's own copy of every replicated array of `tree` (a step's outputs), so
        that reading it back moves nothing between processes."""
        return tree if not self.multi_process else jax.tree.map(lambda a: a.addressable_data(0), tree)

    def shared_seed(self) -> int | None:
        """Across processes: a seed drawn by process 0, for the random seeds of requests that give
        none (a sampled token must be the same in every process). One process: None."""
        if not self.multi_process:
            return None
        from jax.experimental import multihost_utils

        return int(multihost_utils.broadcast_one_to_all(np.random.default_rng().integers(1 << 30, dtype=np.int32)))

    def smallest(self, value: int) -> int:
        """The smallest of every process's `value` (the KV blocks each host's memory allows: every
        process must build the same cache)."""
        if not self.multi_process:
            return value
        from jax.experimental import multihost_utils

        return int(np.min(multihost_utils.process_allgather(np.int32(value))))

    def kv_zeros(self, shape, dtype) -> jax.Array:
        """A zero KV cache made directly in its sharded layout (never whole on one device)."""
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=self.kv)()

    def step_shardings(self, device_state: tuple):
        """-> (the packed input's sharding, the step outputs' shardings): the device state keeps
        the shardings it has (donated buffers are reused only if in and out agree), the sampler
        output and the spec state are replicated."""
        state = tuple(jax.tree.map(lambda a: a.sharding, s) for s in device_state)
        return self.replicated, (*state, self.replicated, self.replicated)


def mesh_devices(size: int, flag: str = FLAG) -> list:
    """The mesh's devices: the first `size` of this host's, or size / P of each of P processes';
    errors name `flag`."""
    processes, local = jax.process_count(), jax.local_devices()
    if processes == 1:
        if size > len(local):
            raise ValueError(f"{flag}={size} exceeds the {len(local)} local device(s) ({local[0].platform}); "
                             "several hosts take num_processes (docs/parallelism.md)")
        return local[:size]
    per = size // processes
    by_process: dict[int, list] = {}
    for device in jax.devices():
        by_process.setdefault(device.process_index, []).append(device)
    if size % processes or any(len(devices) < per for devices in by_process.values()):
        raise ValueError(f"{flag}={size} over {processes} processes needs {per} device(s) from each; they have "
                         f"{sorted(len(d) for d in by_process.values())}")
    return [device for p in sorted(by_process) for device in by_process[p][:per]]

"""Pipeline parallelism, the runner's side: the mesh of the stages and where each of the engine's
arrays lives on it.

One `PipelineParallel` is built by the engine builder when `pipeline_parallel_size` > 1 and handed
to the runner in TensorParallel's place (the same interface). The layer weights of the model's one
layer group and the KV cache are split on their layer axis over PP_AXIS, each device holding a
contiguous slice (a stage); everything else is replicated, as with tensor parallelism, so the host
side of a step is the same as on one device. The decoder runs the stages (models/pipeline_parallel.py).
"""

import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mrv2_jax.models.pipeline_parallel import PP_AXIS
from mrv2_jax.runner.tensor_parallel import TensorParallel, mesh_devices

FLAG = "pipeline_parallel_size"


class PipelineParallel(TensorParallel):
    """The mesh of `size` stages (this host's first `size` devices, one process) and the shardings
    of the engine's arrays."""

    # The attention runs whole inside each stage: no head split (PagedAttention(mesh=None)).
    attention_mesh = None

    def __init__(self, size: int):
        self.size = size
        self.expert_parallel = False
        self.multi_process = False
        self.mesh = Mesh(np.array(mesh_devices(size, FLAG)), (PP_AXIS,))
        self.replicated = NamedSharding(self.mesh, P())
        # [layers, blocks, KV heads, block_size, head_dim]: each stage holds its layers' pages.
        self.kv = NamedSharding(self.mesh, P(PP_AXIS))

    def shard_model(self, model_state, lm) -> None:
        """Split `lm`'s stacked layer weights on their layer axis over the stages and replicate the
        rest, in place; from now on the decoder runs its layers as stages (CausalLM.pipeline_mesh)."""
        groups = model_state.layer_groups()
        layers = NamedSharding(self.mesh, P(PP_AXIS))
        for path, param in nnx.iter_graph(lm):
            if isinstance(param, nnx.Param):
                stacked = len(path) == 2 and path[0] in groups
                param.set_value(self.put(param.get_value(), layers if stacked else self.replicated))
        lm.pipeline_mesh = self.mesh

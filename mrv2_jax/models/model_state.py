"""The `ModelState` interface: everything that differs between model families.

The runner, scheduler and sampler only ever talk to a `ModelState`; a family module
(qwen3.py, glm4.py, ...) implements it and registers itself under the Hugging Face
`architectures` name. Nothing outside the family module branches on the family.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import jax.numpy as jnp
from flax import nnx

from mrv2_jax.models.decoder import CausalLM, layer_runs
from mrv2_jax.models.pipeline_parallel import check_pipeline
from mrv2_jax.models.tensor_parallel import ShardRule


@dataclass(frozen=True)
class WeightSource:
    """How one stacked parameter is assembled from Hugging Face tensors.

    `hf_names` are concatenated along the output axis. `linear` tensors are linear weights, stored
    by HF as [out, in]; we keep that layout (models/layers.py's `linear`), except for routed experts.
    Per-layer names contain `{i}`. With `experts=E`, the names also contain `{e}` and the E
    per-expert tensors are stacked on a new leading axis and transposed, [E, in, out], the grouped
    GEMM kernels' layout: the hub stores MoE experts one module per expert.
    """

    hf_names: tuple[str, ...]
    linear: bool = False
    widths: tuple[int, ...] = ()  # output width of each name, needed when there are several
    experts: int = 0

    def __post_init__(self):
        if len(self.hf_names) > 1 and len(self.widths) != len(self.hf_names):
            raise ValueError(f"fused weight {self.hf_names} needs one width per name")

    @property
    def transposed(self) -> bool:
        """Whether each HF tensor is transposed into our layout (the routed experts' linear weights)."""
        return self.linear and bool(self.experts)

    @property
    def output_axis(self) -> int:
        """The axis of one HF tensor in our layout that fused names are concatenated along."""
        return 0 if self.linear and not self.experts else -1


@dataclass(frozen=True)
class LayerGroup:
    """Decoder layers that share one parameter layout and one forward function.

    Each group's parameters are stacked over its layers (`[len(layers), ...]`), and the model
    runs every maximal run of consecutive layers of one group as one `lax.scan`. A dense family
    has a single group; a MoE family with dense layers in between (GLM's first dense layers,
    Qwen3-MoE's `mlp_only_layers`) has two, so the parameter leaves stay few whatever the
    per-layer pattern is.
    """

    layers: tuple[int, ...]  # global layer indices, ascending
    shapes: dict[str, tuple[int, ...]]
    sources: dict[str, "WeightSource"]
    forward: Callable  # (params, x, rope, attention, layer, kv_cache) -> (x, kv_cache)
    dtypes: dict[str, Any] = field(default_factory=dict)  # parameters not in the model dtype


class ModelState(ABC):
    """A model family: config parsing, parameter layout, weight names and the layer math."""

    architecture: ClassVar[str]
    # Devices the decoder layers are split over (tensor parallelism, models/tensor_parallel.py);
    # set by `set_tensor_parallel` before the model is traced. With N > 1 the fused weights are in
    # the per-device layout and the layer math splits them accordingly.
    tp_size: int = 1
    # Expert parallelism (with tensor parallelism): the jax.sharding.Mesh whose AXIS splits the
    # experts whole over the devices, each running its own under shard_map (models/moe.py); set by
    # `set_tensor_parallel`. None: the experts are not split.
    expert_mesh = None
    num_experts: int = 0  # routed experts per MoE layer (0: a dense family)
    # Layer weights the layer hands on as they come (a LayerWeight: the stack and the layer) to code
    # that reads them through models/layer_weight.py's weight_array or passes the stack to a kernel
    # (the q/k norms of QKNormRope): a kernel reads the stack in place instead of a copied slice.
    in_place_weights: ClassVar[tuple[str, ...]] = ()
    # Layer weights the layer reads through models/gemv_projections.py (its projections and the norms
    # before them): in a one-token program (CausalLM.gemv_projections) they come as LayerWeights too,
    # which the GEMV kernel reads in place. () : the family has no GEMV path.
    gemv_weights: ClassVar[tuple[str, ...]] = ()

    def __init__(self, hf_config):
        self.hf_config = hf_config
        c = hf_config
        self.vocab_size: int = c.vocab_size
        self.hidden_size: int = c.hidden_size
        self.num_layers: int = c.num_hidden_layers
        self.num_heads: int = c.num_attention_heads
        self.num_kv_heads: int = c.num_key_value_heads
        self.head_dim: int = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.rms_norm_eps: float = c.rms_norm_eps
        self.tie_word_embeddings: bool = bool(getattr(c, "tie_word_embeddings", False))
        self.max_model_len: int = c.max_position_embeddings
        rope = c.rope_parameters or {}
        if rope.get("rope_type", "default") != "default":
            raise NotImplementedError(f"rope_type {rope['rope_type']!r} is not supported yet")
        self.rope_theta: float = float(rope["rope_theta"])
        eos = c.eos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(eos) if isinstance(eos, (list, tuple)) else (
            (eos,) if eos is not None else ())

    # --- the parameter layout -------------------------------------------------------
    def layer_groups(self) -> dict[str, LayerGroup]:
        """The decoder layers by parameter layout; the key is the model attribute holding the
        group's stacked parameters. Families with one layout implement the three `layer_*`
        methods below; families with several override this."""
        return {"layers": LayerGroup(tuple(range(self.num_layers)), self.layer_param_shapes(),
                                     self.layer_weight_sources(), self.layer_forward)}

    def mtp_group(self) -> LayerGroup | None:
        """Multi-token-prediction layers (loaded as `lm.mtp`), or None. Their `layers` are
        the hub's layer indices (after the decoder layers)."""
        return None

    @property
    def has_mtp(self) -> bool:
        return self.mtp_group() is not None

    def layer_param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of ONE layer's parameters, by our name (stacked over layers in the model)."""
        raise NotImplementedError

    def layer_weight_sources(self) -> dict[str, WeightSource]:
        """For each layer parameter, the HF tensors (with `{i}`) that it is built from."""
        raise NotImplementedError

    def global_weight_sources(self) -> dict[str, WeightSource]:
        sources = {
            "embed_tokens": WeightSource(("model.embed_tokens.weight",)),
            "final_norm": WeightSource(("model.norm.weight",)),
        }
        if not self.tie_word_embeddings:
            sources["lm_head"] = WeightSource(("lm_head.weight",), linear=True)
        return sources

    def qkv_widths(self) -> tuple[int, int, int]:
        kv = self.num_kv_heads * self.head_dim
        return (self.num_heads * self.head_dim, kv, kv)

    # --- tensor parallelism ------------------------------------------------------------
    def tensor_parallel_rules(self, n: int, expert_parallel: bool = False) -> dict[str, ShardRule]:
        """{layer parameter: ShardRule} for splitting the layers over n devices (parameters not
        named are replicated); `expert_parallel`: the experts too, whole ones per device (MoE
        families). ValueError when this model cannot be split that way."""
        raise ValueError(f"tensor_parallel_size={n}: {self.architecture} is not supported yet "
                         "(tensor parallelism covers the dense Qwen3 family, and Qwen3-MoE with "
                         "enable_expert_parallel)")

    def check_tensor_parallel(self, n: int, expert_parallel: bool = False) -> dict[str, ShardRule]:
        """What no family can split yet (MTP layers; expert parallelism without experts), then the
        family's rules for n > 1 devices: ValueError naming the flag, or the rules."""
        if expert_parallel and not self.num_experts:
            raise ValueError(f"enable_expert_parallel: {self.architecture} has no experts to split")
        if self.has_mtp:
            raise ValueError(f"tensor_parallel_size={n}: MTP layers are not supported with tensor parallelism yet")
        return self.tensor_parallel_rules(n, expert_parallel)

    def set_tensor_parallel(self, n: int, expert_mesh=None) -> dict[str, ShardRule]:
        """Split the layers over n devices from now on (checked first) -> the family's rules.
        `expert_mesh`: the mesh the experts are split over too (expert parallelism), or None."""
        rules = self.check_tensor_parallel(n, expert_mesh is not None) if n > 1 else {}
        self.tp_size = n
        self.expert_mesh = expert_mesh if n > 1 else None
        return rules

    # --- pipeline parallelism -----------------------------------------------------------
    def check_pipeline_parallel(self, n: int) -> None:
        """ValueError naming the flag unless the decoder layers split into n equal stages: one layer
        group, no MTP layers (models/pipeline_parallel.py). Under stages a layer's `layer` argument is
        its index in the stage's own KV cache, so the layer math may use it for the attention only."""
        if self.has_mtp:
            raise ValueError(f"pipeline_parallel_size={n}: MTP layers are not supported with pipeline parallelism yet")
        check_pipeline("pipeline_parallel_size", n, self.num_layers, layer_runs(self.layer_groups()))

    # --- the math --------------------------------------------------------------------
    @abstractmethod
    def rope(self, positions):
        """Per-token rotary tables shared by all layers of one forward pass."""

    def layer_forward(self, params, x, rope, attention, layer, kv_cache):
        """One decoder layer: (params of this layer, hidden [T, H]) -> (hidden, kv_cache)."""
        raise NotImplementedError

    # --- helpers the engine uses -------------------------------------------------------
    def build_model(self, dtype=jnp.bfloat16, seed: int = 0) -> CausalLM:
        return CausalLM(self, dtype=dtype, rngs=nnx.Rngs(seed))

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (self.num_layers, num_blocks, self.num_kv_heads, block_size, self.head_dim)

    def kv_bytes_per_token(self, dtype=jnp.bfloat16) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * jnp.dtype(dtype).itemsize


_REGISTRY: dict[str, type[ModelState]] = {}


def register_model_state(cls: type[ModelState]) -> type[ModelState]:
    _REGISTRY[cls.architecture] = cls
    return cls


def model_state_for(hf_config) -> ModelState:
    """Pick the family by the config's `architectures` entry."""
    import mrv2_jax.models.families  # noqa: F401  (registers the families)

    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in _REGISTRY:
            return _REGISTRY[name](hf_config)
    raise ValueError(
        f"unsupported architecture {names or '(none given)'}; supported: {sorted(_REGISTRY)}")

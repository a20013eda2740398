"""GLM-4.5 / 4.6 / 4.7 (Glm4MoeForCausalLM): the Qwen3-MoE layer structure with
  - partial "halves" RoPE (`partial_rotary_factor`, 0.5), optional q/k norm, q/k/v bias;
  - sigmoid routing with a per-expert score-correction bias (kept in float32: it only
    reorders experts, by small margins), grouped top-k (`n_group`/`topk_group`),
    `routed_scaling_factor`, and a dense shared expert added to every MoE layer;
  - `first_k_dense_replace` dense layers first;
  - optional multi-token-prediction (MTP) layers, stored after the decoder layers in the hub
    checkpoint (`model.layers.{num_hidden_layers + j}`), loaded as `lm.mtp` when
    `num_nextn_predict_layers > 0` for speculative decoding (see `mtp_forward`).
"""

import jax.numpy as jnp

from mrv2_jax.models import fp8
from mrv2_jax.models.layers import linear, rms_norm
from mrv2_jax.models.model_state import LayerGroup, WeightSource, register_model_state
from mrv2_jax.models.moe import grouped_sigmoid_router
from mrv2_jax.models.qwen3_moe import Qwen3MoeModelState

_L = "model.layers.{i}."


@register_model_state
class Glm4MoeModelState(Qwen3MoeModelState):
    architecture = "Glm4MoeForCausalLM"
    fp8_exempt = ("router", "router_bias", "eh_proj")

    def __init__(self, hf_config):
        super().__init__(hf_config)
        c = hf_config
        self.attention_bias = bool(getattr(c, "attention_bias", False))
        self.o_bias = False
        self.qk_norm = bool(getattr(c, "use_qk_norm", False))
        factor = (c.rope_parameters or {}).get("partial_rotary_factor",
                                               getattr(c, "partial_rotary_factor", 0.5))
        self.rotary_dim = int(self.head_dim * factor)
        self.num_groups, self.topk_groups = c.n_group, c.topk_group
        self.routed_scaling_factor = float(c.routed_scaling_factor)
        self.shared_intermediate_size = c.moe_intermediate_size * c.n_shared_experts
        self.num_mtp_layers = int(getattr(c, "num_nextn_predict_layers", 0) or 0)

    @staticmethod
    def config_num_experts(hf_config) -> int:
        return hf_config.n_routed_experts

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.hf_config.first_k_dense_replace

    def moe_layout(self):
        shapes, sources, dtypes = super().moe_layout()
        shapes["router_bias"] = (self.num_experts,)
        sources["router_bias"] = WeightSource((_L + "mlp.gate.e_score_correction_bias",))
        dtypes["router_bias"] = jnp.float32
        sh_shapes, sh_sources, _ = self.dense_mlp_layout("shared", self.shared_intermediate_size,
                                                         _L + "mlp.shared_experts.")
        return shapes | sh_shapes, sources | sh_sources, dtypes

    def tensor_parallel_rules(self, n, expert_parallel=False):
        # No rules yet for its shared expert, router bias and partial rotary (nor its MTP layers).
        raise ValueError(f"tensor_parallel_size={n}: {self.architecture} is not supported yet "
                         "(expert parallelism covers the Qwen3-MoE family)")

    def route(self, p, h):
        # As the reference: router logits in float32 from float32 inputs.
        logits = linear(h.astype(jnp.float32), p["router"].astype(jnp.float32))
        return grouped_sigmoid_router(logits, p["router_bias"], self.top_k, self.num_groups,
                                      self.topk_groups, self.norm_topk_prob, self.routed_scaling_factor)

    def moe_mlp(self, p, h):
        return super().moe_mlp(p, h) + self.dense_mlp(p, h, "shared")

    # --- multi-token prediction --------------------------------------------------------
    def mtp_group(self) -> LayerGroup | None:
        if not self.num_mtp_layers:
            return None
        h = self.hidden_size
        layers = tuple(range(self.num_layers, self.num_layers + self.num_mtp_layers))
        extra = ({"enorm": (h,), "hnorm": (h,), "eh_proj": (h, 2 * h), "post_norm": (h,)},
                 {"enorm": WeightSource((_L + "enorm.weight",)),
                  "hnorm": WeightSource((_L + "hnorm.weight",)),
                  "eh_proj": WeightSource((_L + "eh_proj.weight",), linear=True),
                  "post_norm": WeightSource((_L + "shared_head.norm.weight",))},
                 {})
        return self._group(layers, self.moe_layout(), self.mtp_forward, extra)

    def mtp_forward(self, p, embeds, prev_hidden, rope, attention, layer, kv_cache):
        """One MTP layer: (embeddings of the next tokens [T, H], the previous model's hidden
        states at the same positions [T, H]) -> (hidden [T, H] for `compute_logits` (after the
        shared head's norm), the same before that norm, kv)."""
        eps = self.rms_norm_eps
        x = jnp.concatenate([rms_norm(embeds, p["enorm"], eps), rms_norm(prev_hidden, p["hnorm"], eps)], axis=-1)
        x = fp8.linear(x, p, "eh_proj", self.fp8_block or 128)
        x, kv_cache = self.moe_layer_forward(p, x, rope, attention, layer, kv_cache)
        return rms_norm(x, p["post_norm"], eps), x, kv_cache

"""GLM-4-0414 (Glm4ForCausalLM): partial interleaved RoPE, q/k/v bias, fused gate_up,
and two extra norms (after attention and after the MLP, before each residual add)."""

from mrv2_jax.models.gemv_projections import norm_linear, norm_swiglu, project
from mrv2_jax.models.layers import apply_rope_interleaved_partial, rms_norm, rope_angles, split_qkv
from mrv2_jax.models.model_state import ModelState, WeightSource, register_model_state

_LAYER = "model.layers.{i}."


@register_model_state
class Glm4ModelState(ModelState):
    architecture = "Glm4ForCausalLM"
    gemv_weights = ("input_norm", "qkv_proj", "o_proj", "post_attention_norm", "gate_up_proj", "down_proj")

    def __init__(self, hf_config):
        super().__init__(hf_config)
        self.attention_bias = bool(getattr(hf_config, "attention_bias", True))
        self.intermediate_size = hf_config.intermediate_size
        factor = (hf_config.rope_parameters or {}).get(
            "partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 0.5))
        self.rotary_dim = int(self.head_dim * factor)

    def layer_param_shapes(self):
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        qkv = (self.num_heads + 2 * self.num_kv_heads) * d
        shapes = {
            "input_norm": (h,), "qkv_proj": (qkv, h), "o_proj": (h, self.num_heads * d),
            "post_self_attn_norm": (h,), "post_attention_norm": (h,),
            "gate_up_proj": (2 * i, h), "down_proj": (h, i), "post_mlp_norm": (h,),
        }
        if self.attention_bias:
            shapes["qkv_bias"] = (qkv,)
        return shapes

    def layer_weight_sources(self):
        attn = _LAYER + "self_attn."
        sources = {
            "input_norm": WeightSource((_LAYER + "input_layernorm.weight",)),
            "qkv_proj": WeightSource(tuple(attn + f"{p}_proj.weight" for p in "qkv"), linear=True,
                                     widths=self.qkv_widths()),
            "o_proj": WeightSource((attn + "o_proj.weight",), linear=True),
            "post_self_attn_norm": WeightSource((_LAYER + "post_self_attn_layernorm.weight",)),
            "post_attention_norm": WeightSource((_LAYER + "post_attention_layernorm.weight",)),
            "gate_up_proj": WeightSource((_LAYER + "mlp.gate_up_proj.weight",), linear=True),
            "down_proj": WeightSource((_LAYER + "mlp.down_proj.weight",), linear=True),
            "post_mlp_norm": WeightSource((_LAYER + "post_mlp_layernorm.weight",)),
        }
        if self.attention_bias:
            sources["qkv_bias"] = WeightSource(tuple(attn + f"{p}_proj.bias" for p in "qkv"),
                                               widths=self.qkv_widths())
        return sources

    def rope(self, positions):
        return rope_angles(positions, self.rotary_dim, self.rope_theta)

    def layer_forward(self, p, x, rope, attention, layer, kv_cache):
        eps = self.rms_norm_eps
        qkv = norm_linear(x, p["input_norm"], p["qkv_proj"], eps)
        if self.attention_bias:
            qkv = qkv + p["qkv_bias"]
        q, k, v = split_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim)
        cos, sin = rope
        q = apply_rope_interleaved_partial(q, cos, sin)
        k = apply_rope_interleaved_partial(k, cos, sin)
        out, kv_cache = attention(q, k, v, layer, kv_cache, self.head_dim**-0.5)
        x = x + rms_norm(project(out.reshape(x.shape[0], -1), p["o_proj"]), p["post_self_attn_norm"], eps)
        mlp = project(norm_swiglu(x, p["post_attention_norm"], p["gate_up_proj"], eps), p["down_proj"])
        x = x + rms_norm(mlp, p["post_mlp_norm"], eps)
        return x, kv_cache

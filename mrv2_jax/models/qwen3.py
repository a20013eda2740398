"""Qwen3 (dense): per-head RMSNorm on q and k, full "halves" RoPE, SwiGLU MLP."""

from mrv2_jax.models.attention import QKNormRope
from mrv2_jax.models.gemv_projections import linear_add, norm_linear, norm_swiglu, project
from mrv2_jax.models.layers import gated_mlp, rms_norm, rope_angles
from mrv2_jax.models.model_state import ModelState, WeightSource, register_model_state
from mrv2_jax.models.tensor_parallel import ShardRule, check_divides, row_parallel

_ATTN = "model.layers.{i}.self_attn."


@register_model_state
class Qwen3ModelState(ModelState):
    architecture = "Qwen3ForCausalLM"
    in_place_weights = ("q_norm", "k_norm")
    gemv_weights = ("input_norm", "qkv_proj", "o_proj", "post_attention_norm", "gate_up_proj", "down_proj")

    def __init__(self, hf_config):
        super().__init__(hf_config)
        if getattr(hf_config, "use_sliding_window", False):
            raise NotImplementedError("Qwen3 with use_sliding_window=True is not supported yet")
        self.attention_bias = bool(getattr(hf_config, "attention_bias", False))
        self.intermediate_size = hf_config.intermediate_size

    def layer_param_shapes(self):
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        qkv = (self.num_heads + 2 * self.num_kv_heads) * d
        shapes = {
            "input_norm": (h,), "qkv_proj": (qkv, h), "q_norm": (d,), "k_norm": (d,),
            "o_proj": (h, self.num_heads * d), "post_attention_norm": (h,),
            "gate_up_proj": (2 * i, h), "down_proj": (h, i),
        }
        if self.attention_bias:
            shapes |= {"qkv_bias": (qkv,), "o_bias": (h,)}
        return shapes

    def layer_weight_sources(self):
        qkv = tuple(_ATTN + f"{p}_proj.weight" for p in "qkv")
        qkv_widths = self.qkv_widths()
        sources = {
            "input_norm": WeightSource(("model.layers.{i}.input_layernorm.weight",)),
            "qkv_proj": WeightSource(qkv, linear=True, widths=qkv_widths),
            "q_norm": WeightSource((_ATTN + "q_norm.weight",)),
            "k_norm": WeightSource((_ATTN + "k_norm.weight",)),
            "o_proj": WeightSource((_ATTN + "o_proj.weight",), linear=True),
            "post_attention_norm": WeightSource(("model.layers.{i}.post_attention_layernorm.weight",)),
            "gate_up_proj": WeightSource(("model.layers.{i}.mlp.gate_proj.weight",
                                          "model.layers.{i}.mlp.up_proj.weight"), linear=True,
                                         widths=(self.intermediate_size,) * 2),
            "down_proj": WeightSource(("model.layers.{i}.mlp.down_proj.weight",), linear=True),
        }
        if self.attention_bias:
            sources["qkv_bias"] = WeightSource(tuple(_ATTN + f"{p}_proj.bias" for p in "qkv"),
                                               widths=qkv_widths)
            sources["o_bias"] = WeightSource((_ATTN + "o_proj.bias",))
        return sources

    def tensor_parallel_rules(self, n, expert_parallel=False):
        """q/k/v and gate/up split by output features (whole heads, whole MLP units per device), o and
        down by input features; the fused ones interleaved per device (models/tensor_parallel.py).
        Linear weights are [out, in]."""
        check_divides("tensor_parallel_size", n, {"attention heads": self.num_heads, "KV heads": self.num_kv_heads,
                                                  "intermediate_size": self.intermediate_size})
        rules = {"qkv_proj": ShardRule(0, self.qkv_widths()), "o_proj": ShardRule(1),
                 "gate_up_proj": ShardRule(0, (self.intermediate_size,) * 2), "down_proj": ShardRule(1)}
        if self.attention_bias:
            rules["qkv_bias"] = ShardRule(0, self.qkv_widths())  # o_bias is added after the all-reduce
        return rules

    def rope(self, positions):
        return rope_angles(positions, self.head_dim, self.rope_theta)

    def layer_forward(self, p, x, rope, attention, layer, kv_cache):
        eps = self.rms_norm_eps
        qkv = norm_linear(x, p["input_norm"], p["qkv_proj"], eps)
        if self.attention_bias:
            qkv = qkv + p["qkv_bias"]
        norm_rope = QKNormRope(p["q_norm"], p["k_norm"], eps, *rope)
        out, kv_cache = attention.attend_qkv(qkv, (self.num_heads, self.num_kv_heads, self.head_dim), norm_rope,
                                             layer, kv_cache, self.head_dim**-0.5, self.tp_size)
        out = out.reshape(x.shape[0], -1)
        if self.tp_size > 1:  # row-parallel o and down, summed in f32 by one all-reduce each
            out = row_parallel(out, p["o_proj"], self.tp_size)
            x = x + (out + p["o_bias"] if self.attention_bias else out)
            return x + gated_mlp(rms_norm(x, p["post_attention_norm"], eps), p["gate_up_proj"], p["down_proj"],
                                 self.tp_size), kv_cache
        if self.attention_bias:
            x = x + (project(out, p["o_proj"]) + p["o_bias"])
        else:
            x = linear_add(out, p["o_proj"], x)
        x = linear_add(norm_swiglu(x, p["post_attention_norm"], p["gate_up_proj"], eps), p["down_proj"], x)
        return x, kv_cache

"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (q/k RMSNorm per head, full "halves"
RoPE); each layer's MLP is either a dense SwiGLU or a softmax top-k mixture of experts
(`decoder_sparse_step`, `mlp_only_layers` pick which).

The two kinds of layer have different parameters, so they form two layer groups
("dense_layers", "moe_layers"), each stacked over its own layers; the model scans each run
of consecutive layers of one kind. Experts are stacked `[layers, E, in, out]` (the grouped GEMM's
layout); every other linear weight is `[out, in]`.
GLM-4.5 (glm4_moe.py) shares this layer structure and overrides the router, the rotary and
the shared experts.
"""

import functools

import jax
import jax.numpy as jnp

from mrv2_jax.models import fp8
from mrv2_jax.models.attention import QKNormRope
from mrv2_jax.models.layers import gated_mlp, linear, rms_norm, rope_angles
from mrv2_jax.models.model_state import (
    LayerGroup,
    ModelState,
    WeightSource,
    register_model_state,
)
from mrv2_jax.models.moe import expert_parallel_experts, routed_experts, softmax_topk_router
from mrv2_jax.models.tensor_parallel import ShardRule, check_divides, row_parallel

_L = "model.layers.{i}."
_ATTN = _L + "self_attn."


@register_model_state
class Qwen3MoeModelState(ModelState):
    architecture = "Qwen3MoeForCausalLM"
    in_place_weights = ("q_norm", "k_norm")  # when the family has them (GLM-4-MoE may not)
    fp8_exempt = ("router",)  # FP8 checkpoints keep the router gate in bf16
    # Which grouped GEMM runs the experts (moe.BACKENDS); an engine sets its KernelConfig.moe_backend here.
    moe_backend = "auto"

    def __init__(self, hf_config):
        super().__init__(hf_config)
        c = hf_config
        if getattr(c, "use_sliding_window", False):
            raise NotImplementedError("Qwen3-MoE with use_sliding_window=True is not supported yet")
        self.attention_bias = bool(getattr(c, "attention_bias", False))
        self.o_bias = self.attention_bias
        self.qk_norm = True
        self.rotary_dim = self.head_dim
        self.intermediate_size = c.intermediate_size
        self.moe_intermediate_size = c.moe_intermediate_size
        self.num_experts = self.config_num_experts(c)
        self.top_k = c.num_experts_per_tok
        self.norm_topk_prob = bool(c.norm_topk_prob)
        self.fp8_block = fp8.fp8_block_size(c)

    @staticmethod
    def config_num_experts(hf_config) -> int:
        return hf_config.num_experts

    def is_moe_layer(self, i: int) -> bool:
        c = self.hf_config
        return (i not in set(c.mlp_only_layers or ()) and self.num_experts > 0
                and (i + 1) % c.decoder_sparse_step == 0)

    # --- parameter layout ------------------------------------------------------------------
    def layer_groups(self):
        moe = tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))
        dense = tuple(i for i in range(self.num_layers) if not self.is_moe_layer(i))
        groups = {}
        if dense:
            groups["dense_layers"] = self._group(dense, self.dense_mlp_layout(), self.dense_layer_forward)
        if moe:
            groups["moe_layers"] = self._group(moe, self.moe_layout(), self.moe_layer_forward)
        return groups

    def _group(self, layers, mlp_layout, forward, extra=None) -> LayerGroup:
        shapes, sources, dtypes = self.attention_layout()
        for part in (mlp_layout, extra):
            if part:
                shapes, sources, dtypes = shapes | part[0], sources | part[1], dtypes | part[2]
        if self.fp8_block:
            shapes, sources, dtypes = fp8.quantize_layout(shapes, sources, dtypes, self.fp8_block,
                                                          self.fp8_exempt)
        return LayerGroup(tuple(layers), shapes, sources, forward, dtypes)

    def attention_layout(self):
        h, d = self.hidden_size, self.head_dim
        qkv = (self.num_heads + 2 * self.num_kv_heads) * d
        shapes = {"input_norm": (h,), "qkv_proj": (qkv, h), "o_proj": (h, self.num_heads * d),
                  "post_attention_norm": (h,)}
        sources = {
            "input_norm": WeightSource((_L + "input_layernorm.weight",)),
            "qkv_proj": WeightSource(tuple(_ATTN + f"{p}_proj.weight" for p in "qkv"), linear=True,
                                     widths=self.qkv_widths()),
            "o_proj": WeightSource((_ATTN + "o_proj.weight",), linear=True),
            "post_attention_norm": WeightSource((_L + "post_attention_layernorm.weight",)),
        }
        if self.qk_norm:
            shapes |= {"q_norm": (d,), "k_norm": (d,)}
            sources |= {"q_norm": WeightSource((_ATTN + "q_norm.weight",)),
                        "k_norm": WeightSource((_ATTN + "k_norm.weight",))}
        if self.attention_bias:
            shapes["qkv_bias"] = (qkv,)
            sources["qkv_bias"] = WeightSource(tuple(_ATTN + f"{p}_proj.bias" for p in "qkv"),
                                               widths=self.qkv_widths())
        if self.o_bias:
            shapes["o_bias"] = (h,)
            sources["o_bias"] = WeightSource((_ATTN + "o_proj.bias",))
        return shapes, sources, {}

    def dense_mlp_layout(self, prefix="gate_up_proj", size=None, hf=_L + "mlp."):
        h, i = self.hidden_size, size or self.intermediate_size
        names = _mlp_names(prefix)
        shapes = {names[0]: (2 * i, h), names[1]: (h, i)}
        sources = {names[0]: WeightSource((hf + "gate_proj.weight", hf + "up_proj.weight"), linear=True,
                                          widths=(i, i)),
                   names[1]: WeightSource((hf + "down_proj.weight",), linear=True)}
        return shapes, sources, {}

    def moe_layout(self):
        h, i, e = self.hidden_size, self.moe_intermediate_size, self.num_experts
        ex = _L + "mlp.experts.{e}."
        shapes = {"router": (e, h), "experts_gate_up": (e, h, 2 * i), "experts_down": (e, i, h)}
        sources = {
            "router": WeightSource((_L + "mlp.gate.weight",), linear=True),
            "experts_gate_up": WeightSource((ex + "gate_proj.weight", ex + "up_proj.weight"), linear=True,
                                            widths=(i, i), experts=e),
            "experts_down": WeightSource((ex + "down_proj.weight",), linear=True, experts=e),
        }
        return shapes, sources, {}

    # --- tensor and expert parallelism -----------------------------------------------------
    def tensor_parallel_rules(self, n, expert_parallel=False):
        """With expert parallelism only: attention (and the dense layers' MLP) split as dense Qwen3's,
        the experts whole over the devices (E/N each, on their expert axis); the router replicated."""
        if not expert_parallel:
            raise ValueError(f"tensor_parallel_size={n}: {self.architecture} is not supported yet without "
                             "enable_expert_parallel (splitting each expert's matrices is not implemented)")
        if self.fp8_block:
            raise ValueError(f"tensor_parallel_size={n}: FP8 checkpoints are not supported with tensor "
                             "parallelism yet")
        dense = any(not self.is_moe_layer(i) for i in range(self.num_layers))
        check_divides("tensor_parallel_size", n, {"attention heads": self.num_heads, "KV heads": self.num_kv_heads}
                      | ({"intermediate_size": self.intermediate_size} if dense else {}))
        if self.num_experts % n:
            raise ValueError(f"enable_expert_parallel: tensor_parallel_size={n} must divide the model's "
                             f"{self.num_experts} experts")
        rules = {"qkv_proj": ShardRule(0, self.qkv_widths()), "o_proj": ShardRule(1),
                 "experts_gate_up": ShardRule(0), "experts_down": ShardRule(0)}
        if dense:
            rules |= {"gate_up_proj": ShardRule(0, (self.intermediate_size,) * 2), "down_proj": ShardRule(1)}
        if self.attention_bias:
            rules["qkv_bias"] = ShardRule(0, self.qkv_widths())  # o_bias is added after the all-reduce
        return rules

    # --- the math --------------------------------------------------------------------------
    def rope(self, positions):
        return rope_angles(positions, self.rotary_dim, self.rope_theta)

    def linear(self, x, p, name):
        return fp8.linear(x, p, name, self.fp8_block or 128)

    def attention_block(self, p, x, rope, attention, layer, kv_cache):
        """x -> x + self-attention(input_norm(x))."""
        eps = self.rms_norm_eps
        qkv = self.linear(rms_norm(x, p["input_norm"], eps), p, "qkv_proj")
        if self.attention_bias:
            qkv = qkv + p["qkv_bias"]
        norms = (p["q_norm"], p["k_norm"]) if self.qk_norm else (None, None)
        norm_rope = QKNormRope(*norms, eps, *rope)
        out, kv_cache = attention.attend_qkv(qkv, (self.num_heads, self.num_kv_heads, self.head_dim), norm_rope,
                                             layer, kv_cache, self.head_dim**-0.5, self.tp_size)
        out = out.reshape(x.shape[0], -1)
        # Tensor parallelism (no FP8 then): o_proj is row-parallel, summed in f32 by one all-reduce.
        out = row_parallel(out, p["o_proj"], self.tp_size) if self.tp_size > 1 else self.linear(out, p, "o_proj")
        if self.o_bias:
            out = out + p["o_bias"]
        return x + out, kv_cache

    def dense_mlp(self, p, h, prefix="gate_up_proj"):
        """SwiGLU over `gate_up_proj`/`down_proj`, or `<prefix>_gate_up`/`<prefix>_down`."""
        gate_up, down = _mlp_names(prefix)
        if self.tp_size > 1:  # column- then row-parallel, as dense Qwen3's (no FP8 then)
            return gated_mlp(h, p[gate_up], p[down], self.tp_size)
        gate, up = jnp.split(self.linear(h, p, gate_up), 2, axis=-1)
        return self.linear(jax.nn.silu(gate) * up, p, down)

    def route(self, p, h):
        return softmax_topk_router(linear(h, p["router"]), self.top_k, self.norm_topk_prob)

    def moe_mlp(self, p, h):
        weights, ids = self.route(p, h)
        experts = routed_experts if self.expert_mesh is None else functools.partial(expert_parallel_experts,
                                                                                  mesh=self.expert_mesh)
        return experts(h, weights, ids, p["experts_gate_up"], p["experts_down"],
                       backend=self.moe_backend, gate_up_scale=p.get("experts_gate_up_scale"),
                       down_scale=p.get("experts_down_scale"), scale_block=self.fp8_block or 128)

    def dense_layer_forward(self, p, x, rope, attention, layer, kv_cache):
        x, kv_cache = self.attention_block(p, x, rope, attention, layer, kv_cache)
        return x + self.dense_mlp(p, rms_norm(x, p["post_attention_norm"], self.rms_norm_eps)), kv_cache

    def moe_layer_forward(self, p, x, rope, attention, layer, kv_cache):
        x, kv_cache = self.attention_block(p, x, rope, attention, layer, kv_cache)
        return x + self.moe_mlp(p, rms_norm(x, p["post_attention_norm"], self.rms_norm_eps)), kv_cache


def _mlp_names(prefix: str) -> tuple[str, str]:
    """Parameter names of a SwiGLU MLP: the layer's dense MLP, or a named one (shared experts)."""
    if prefix == "gate_up_proj":
        return "gate_up_proj", "down_proj"
    return f"{prefix}_gate_up", f"{prefix}_down"

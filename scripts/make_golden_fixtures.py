"""Write the golden parity fixtures: tiny random Hugging Face checkpoints + their logits.

Needs torch and transformers (not part of CI): run it wherever torch is installed,
    python scripts/make_golden_fixtures.py [--out tests/fixtures]
It writes, per family, `<name>/config.json`, `<name>/model.safetensors` (float32) and
`<name>/expected.npz` (input ids, positions, segment ids, logits). Every weight, norms and
biases included, is random so that every weight path is checked by the parity test.
"""

import argparse
from pathlib import Path

import numpy as np
import torch
import transformers

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)

FAMILIES = {
    # Qwen3 with attention_bias=True exercises the optional q/k/v/o bias path too.
    "qwen3-tiny": transformers.Qwen3Config(**TINY, attention_bias=True, rope_theta=10000.0,
                                           architectures=["Qwen3ForCausalLM"]),
    "qwen3-tiny-tied": transformers.Qwen3Config(**(TINY | {"tie_word_embeddings": True}),
                                                rope_theta=1e6, architectures=["Qwen3ForCausalLM"]),
    "glm4-tiny": transformers.Glm4Config(**TINY, attention_bias=True, partial_rotary_factor=0.5,
                                         rope_theta=10000.0, architectures=["Glm4ForCausalLM"]),
}

# MoE families: smaller still (8 experts make the weights add up), 3 layers so that a dense
# layer sits between MoE layers (Qwen3-MoE) or before them (GLM), exercising both layer groups.
TINY_MOE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES |= {
    "qwen3-moe-tiny": transformers.Qwen3MoeConfig(
        **TINY_MOE, num_experts=8, norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
        attention_bias=True, rope_theta=10000.0, architectures=["Qwen3MoeForCausalLM"]),
    # Grouped routing (2 groups, 1 kept), scaled weights, q/k norm, bias, and one MTP layer.
    "glm4-moe-tiny": transformers.Glm4MoeConfig(
        **TINY_MOE, n_routed_experts=8, n_shared_experts=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, use_qk_norm=True,
        attention_bias=True, partial_rotary_factor=0.5, rope_theta=10000.0,
        num_nextn_predict_layers=1, architectures=["Glm4MoeForCausalLM"]),
    # GLM-4.5-Air's switches: no q/k norm, one group, unnormalised weights, no MTP layer.
    "glm4-moe-tiny-plain": transformers.Glm4MoeConfig(
        **(TINY_MOE | {"num_hidden_layers": 2}), n_routed_experts=8, n_shared_experts=1, n_group=1,
        topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False, first_k_dense_replace=1,
        use_qk_norm=False, attention_bias=False, partial_rotary_factor=0.5, rope_theta=10000.0,
        num_nextn_predict_layers=0, architectures=["Glm4MoeForCausalLM"]),
}

# Two sequences of different lengths, run separately through the HF model and concatenated:
# the flattened ragged layout our model takes.
SEQ_LENS = (7, 12)


def randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer, not a parameter
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def write_mtp_layer(model, config, out_dir: Path, seed: int, seq_len: int = 9) -> dict:
    """GLM-4.5's multi-token-prediction layer: random weights appended to the checkpoint under
    the hub's names (`model.layers.{num_hidden_layers}.*`), and the output of Hugging Face's
    `MtpLayer` for random (embedding, previous hidden state) inputs of one sequence."""
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpLayer
    from transformers.models.glm4_moe import modeling_glm4_moe as hf

    mtp_config = config.get_mtp_config()
    mtp_config._attn_implementation = "eager"
    layer = MtpLayer(mtp_config, hf.Glm4MoeDecoderLayer, hf.Glm4MoeRMSNorm, 0, use_post_norm=True).eval()
    randomize(layer, seed)
    prefix = f"model.layers.{config.num_hidden_layers}."
    tensors = {}
    for name, value in layer.state_dict().items():
        name = name.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        if name.endswith("mlp.experts.gate_up_proj"):
            inter = value.shape[1] // 2
            for e in range(value.shape[0]):
                tensors[prefix + f"mlp.experts.{e}.gate_proj.weight"] = value[e, :inter]
                tensors[prefix + f"mlp.experts.{e}.up_proj.weight"] = value[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(value.shape[0]):
                tensors[prefix + f"mlp.experts.{e}.down_proj.weight"] = value[e]
        else:
            tensors[prefix + name] = value
    path = out_dir / "model.safetensors"
    save_file(load_file(path) | {k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})

    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, config.vocab_size, (seq_len,), generator=gen)
    prev_hidden = torch.randn((1, seq_len, config.hidden_size), generator=gen)
    positions = torch.arange(seq_len)[None]
    with torch.no_grad():
        embeds = model.model.embed_tokens(ids[None])
        rope = model.model.rotary_emb(embeds, position_ids=positions)
        causal = torch.full((seq_len, seq_len), float("-inf")).triu(1)[None, None]
        hidden = layer(embeds, prev_hidden, rope, causal, positions, None)
        logits = model.lm_head(hidden)
    return {"mtp_input_ids": ids.numpy().astype(np.int32), "mtp_prev_hidden": prev_hidden[0].numpy(),
            "mtp_hidden": hidden[0].numpy(), "mtp_logits": logits[0].numpy()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "fixtures"))
    ap.add_argument("--only", nargs="*", help="fixture names to (re)write; default all")
    args = ap.parse_args()
    for i, (name, config) in enumerate(FAMILIES.items()):
        if args.only and name not in args.only:
            continue
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        randomize(model, seed=100 + i)
        rng = np.random.default_rng(i)
        ids, positions, segments, logits = [], [], [], []
        for seg, n in enumerate(SEQ_LENS):
            seq = rng.integers(0, config.vocab_size, size=n)
            with torch.no_grad():
                out = model(torch.tensor(seq)[None]).logits[0].numpy()
            ids.append(seq), positions.append(np.arange(n)), segments.append(np.full(n, seg))
            logits.append(out)
        out_dir = Path(args.out) / name
        model.save_pretrained(out_dir, safe_serialization=True)
        extra = {}
        if getattr(config, "num_nextn_predict_layers", 0):
            extra = write_mtp_layer(model, config, out_dir, seed=200 + i)
        np.savez(out_dir / "expected.npz", input_ids=np.concatenate(ids).astype(np.int32),
                 positions=np.concatenate(positions).astype(np.int32),
                 segment_ids=np.concatenate(segments).astype(np.int32),
                 logits=np.concatenate(logits).astype(np.float32), **extra)
        print(f"wrote {out_dir}")


if __name__ == "__main__":
    main()

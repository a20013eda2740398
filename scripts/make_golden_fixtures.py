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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "fixtures"))
    args = ap.parse_args()
    for i, (name, config) in enumerate(FAMILIES.items()):
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
        np.savez(out_dir / "expected.npz", input_ids=np.concatenate(ids).astype(np.int32),
                 positions=np.concatenate(positions).astype(np.int32),
                 segment_ids=np.concatenate(segments).astype(np.int32),
                 logits=np.concatenate(logits).astype(np.float32))
        print(f"wrote {out_dir}")


if __name__ == "__main__":
    main()

"""Quantise a Hugging Face checkpoint to FP8 with block-wise scales, the layout of the
DeepSeek-V3 / Qwen3-FP8 / GLM-4.5-FP8 checkpoints (`quant_method: fp8`).

    python scripts/quantize_fp8.py SRC_DIR OUT_DIR [--block 128] [--dequantized DEQ_DIR]

Every linear projection weight of the decoder layers (attention q/k/v/o, dense and shared MLPs,
routed experts) becomes float8_e4m3fn plus a float32 `<name>_scale_inv` of shape
[cdiv(out, block), cdiv(in, block)]: per block, scale = max|W| / 448 and W_fp8 = W / scale.
Norms, biases, embeddings, the LM head and the MoE router stay as they are.
`--dequantized` also writes W_fp8 * scale (float32) as an unquantised checkpoint: the exact
weights the FP8 model computes with, i.e. its reference.
"""

import argparse
import json
import re
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from mrv2_jax.models.loader import _TensorReader

FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
QUANTISED = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")


def quantize_blocks(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float -> (float8 [out, in], float32 scale_inv [cdiv(out, b), cdiv(in, b)])."""
    out_dim, in_dim = w.shape
    nb_out, nb_in = -(-out_dim // block), -(-in_dim // block)
    padded = np.zeros((nb_out * block, nb_in * block), np.float32)
    padded[:out_dim, :in_dim] = w
    blocks = padded.reshape(nb_out, block, nb_in, block)
    scale = np.abs(blocks).max(axis=(1, 3)) / FP8_MAX
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:out_dim, :in_dim]
    return q.astype(ml_dtypes.float8_e4m3fn), scale


def dequantize(q: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    full = np.repeat(np.repeat(scale, block, 0), block, 1)[: q.shape[0], : q.shape[1]]
    return q.astype(np.float32) * full


def quantize_checkpoint(src: Path, out: Path, block: int = 128, dequantized: Path | None = None):
    reader = _TensorReader(Path(src))
    fp8, deq = {}, {}
    for name in sorted(reader.where):
        t = reader.get(name)
        if QUANTISED.search(name) and t.ndim == 2:
            q, s = quantize_blocks(np.asarray(t, np.float32), block)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            deq[name] = dequantize(q, s, block).astype(t.dtype)
        else:
            fp8[name] = deq[name] = t
    config = json.loads((Path(src) / "config.json").read_text())
    for target, tensors, quant in ((out, fp8, True), (dequantized, deq, False)):
        if target is None:
            continue
        target = Path(target)
        target.mkdir(parents=True, exist_ok=True)
        for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            if (Path(src) / extra).is_file():
                shutil.copy2(Path(src) / extra, target / extra)
        save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
        cfg = dict(config)
        if quant:
            cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [block, block]}
        (target / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--dequantized", help="also write the dequantised float32 reference here")
    args = ap.parse_args()
    quantize_checkpoint(Path(args.src), Path(args.out), args.block, args.dequantized and Path(args.dequantized))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

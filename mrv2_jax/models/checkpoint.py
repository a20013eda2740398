"""Save and restore a model's parameters with orbax (what `mrv2-jax convert` writes).

A converted model directory holds the Hugging Face `config.json` (and tokenizer files, copied
from the source) next to an orbax `params/` folder. Restoring skips safetensors parsing,
name mapping and layer stacking: the arrays come back already in our layout.
"""

import json
import shutil
from pathlib import Path

import orbax.checkpoint as ocp
from flax import nnx

from mrv2_jax.models.decoder import CausalLM

# The parameter layout a converted directory holds, written next to `params/`: 2 since linear weights
# are stored [out, in] (before, [in, out], with no file). Restoring another layout is refused.
LAYOUT_VERSION = 2
LAYOUT_FILE = "params_layout.json"

_COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")


def save_params(lm: CausalLM, params_dir) -> None:
    params_dir = Path(params_dir).absolute()
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(params_dir, nnx.to_pure_dict(nnx.state(lm, nnx.Param)), force=True)
    (params_dir.parent / LAYOUT_FILE).write_text(json.dumps({"layout_version": LAYOUT_VERSION}))


def restore_params(lm: CausalLM, params_dir) -> None:
    """Fill `lm` (abstract or concrete) with the arrays saved in `params_dir`."""
    params_dir = Path(params_dir).absolute()
    layout = params_dir.parent / LAYOUT_FILE
    version = json.loads(layout.read_text()).get("layout_version") if layout.is_file() else 1
    if version != LAYOUT_VERSION:
        raise ValueError(f"{params_dir} holds parameter layout {version}, this mrv2-jax reads layout "
                         f"{LAYOUT_VERSION} (linear weights [out, in]); convert the model again")
    target = nnx.state(lm, nnx.Param)
    abstract = nnx.to_pure_dict(target)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(params_dir, abstract)
    nnx.replace_by_pure_dict(target, restored)
    nnx.update(lm, target)


def convert(src_dir: Path, lm: CausalLM, out_dir) -> Path:
    """Write `lm` (loaded from `src_dir`) as a converted model directory."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in _COPIED:
        if (Path(src_dir) / name).is_file():
            shutil.copy2(Path(src_dir) / name, out_dir / name)
    save_params(lm, out_dir / "params")
    return out_dir

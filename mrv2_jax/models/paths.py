"""Where a model's files are: a preset name, `demo`, or a directory holding config.json. Light on
purpose (no jax): API server processes resolve a model's tokenizer with it."""

import os
from pathlib import Path

from mrv2_jax import envs

CHECKPOINTS_DIR = Path(envs.read("MRV2_CHECKPOINTS") or Path(__file__).resolve().parents[2] / "checkpoints")
DEFAULT_MODEL = "demo"


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """A preset name, `demo`, or a directory -> the directory holding config.json."""
    model = str(model or DEFAULT_MODEL)
    candidates = [Path(model).expanduser()]
    if model == DEFAULT_MODEL:
        candidates.insert(0, CHECKPOINTS_DIR / "demo-qwen3")
    candidates.append(CHECKPOINTS_DIR / "presets" / model.lower())
    for path in candidates:
        if (path / "config.json").is_file():
            return path
    presets = sorted(p.name for p in (CHECKPOINTS_DIR / "presets").glob("*") if p.is_dir())
    raise FileNotFoundError(
        f"model {model!r} is neither a directory with a config.json nor a preset ({', '.join(presets)})")

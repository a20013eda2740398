"""The model's Hugging Face tokenizer, loaded the same way by the engine and by the API server
processes (which detokenize)."""

from pathlib import Path


def load_tokenizer(path: Path | None):
    """The Hugging Face tokenizer in `path`, or None when there is none (presets)."""
    if path is None or not (Path(path) / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))

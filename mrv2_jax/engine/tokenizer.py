"""The model's Hugging Face tokenizer, loaded the same way by the engine (for structured outputs, on
first use) and by the API server processes (which detokenize; on a thread while the engine starts)."""

import threading
from pathlib import Path

from mrv2_jax.transformers_lock import TRANSFORMERS_LOCK


def has_tokenizer(path: Path | str | None) -> bool:
    """Whether `path` holds a Hugging Face tokenizer (presets hold none)."""
    return path is not None and (Path(path) / "tokenizer_config.json").is_file()


def load_tokenizer(path: Path | None):
    """The Hugging Face tokenizer in `path`, or None when there is none (presets)."""
    if not has_tokenizer(path):
        return None
    with TRANSFORMERS_LOCK:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))


class TokenizerPreload:
    """The tokenizer in `path` loaded on a thread while this process waits for something else (an
    API server process for its engine process, which reports the tokenizer it uses once ready)."""

    def __init__(self, path: Path | None):
        self.path = None if path is None else str(path)
        self._tokenizer = self._error = None
        self._thread = threading.Thread(target=self._load, name="mrv2-tokenizer-preload", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        try:
            self._tokenizer = load_tokenizer(self.path and Path(self.path))
        except Exception as exc:  # noqa: BLE001 - `get` loads again, so the caller sees the error
            self._error = exc

    def get(self, path: str | None):
        """The tokenizer in `path`: the preloaded one when it is that path, else loaded now."""
        self._thread.join()
        if path is not None and path == self.path and self._error is None:
            return self._tokenizer
        return load_tokenizer(Path(path) if path else None)

"""The model's Hugging Face config and tokenizer, as the engine and the API server processes load
them (the API processes detokenize), and a thread that loads both while the process does something
else."""

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


class HuggingFacePreload:
    """The model's config (when `config_path` is given) and then the tokenizer in `path`, loaded on a
    thread: an engine process starts its backend meanwhile, an API server process waits for its
    engine process (which reports the tokenizer it uses once ready)."""

    def __init__(self, path: Path | None, config_path: Path | None = None):
        self.path = None if path is None else str(path)
        self._config_path = config_path
        self._config = self._config_error = self._tokenizer = self._error = None
        self._config_done = threading.Event()
        self._thread = threading.Thread(target=self._load, name="mrv2-hf-preload", daemon=True)
        self._thread.start()

    @property
    def has_tokenizer(self) -> bool:
        return has_tokenizer(self.path)

    def _load(self) -> None:
        if self._config_path is not None:
            try:
                from mrv2_jax.models.loader import load_hf_config  # the engine process has it imported

                self._config = load_hf_config(self._config_path)
            except Exception as exc:  # noqa: BLE001 - raised by `config`, in the caller's thread
                self._config_error = exc
        self._config_done.set()
        try:
            self._tokenizer = load_tokenizer(self.path and Path(self.path))
        except Exception as exc:  # noqa: BLE001 - raised by `tokenizer`; `get` loads again
            self._error = exc

    def config(self):
        """The model's config (waits for it, not for the tokenizer)."""
        self._config_done.wait()
        if self._config_error is not None:
            raise self._config_error
        return self._config

    def tokenizer(self):
        """The tokenizer in `path` (None for a path without one); waits for it."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._tokenizer

    def get(self, path: str | None):
        """The tokenizer in `path`: the preloaded one when it is that path, else loaded now."""
        self._thread.join()
        if path is not None and path == self.path and self._error is None:
            return self._tokenizer
        return load_tokenizer(Path(path) if path else None)

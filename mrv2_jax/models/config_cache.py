"""A model's Hugging Face config as transformers reads it, kept as JSON so that a warm start reads it
without importing transformers (which takes over a second, the largest part of a warm engine start).

transformers stays the one reader of `config.json`: the first load goes through `AutoConfig`, and the
cache holds its full result (every default filled in, `rope_parameters` standardised) with the
class's attribute aliases. The key is the bytes of `config.json` and transformers' version, so an
edited config or another transformers reads afresh. Only attribute reads are served (what a
`ModelState` does); anything that needs the real object (saving it) loads it with transformers.
"""

import hashlib
import importlib.metadata
import json
import os
import tempfile
from pathlib import Path

FORMAT = 1  # bump when what an entry holds changes


class CachedConfig:
    """The attributes of a transformers config, read from its cached JSON (aliases included)."""

    def __init__(self, values: dict, attribute_map: dict[str, str]):
        self.__dict__.update(values)
        self._attribute_map = dict(attribute_map)

    def __getattr__(self, name: str):  # only for names not set in __init__: the aliases
        canonical = self.__dict__.get("_attribute_map", {}).get(name)
        if canonical is None or canonical not in self.__dict__:
            raise AttributeError(f"the model's config has no attribute {name!r}")
        return self.__dict__[canonical]


def cache_key(config_json: bytes) -> str:
    version = importlib.metadata.version("transformers")
    return hashlib.sha256(b"%d\0%s\0" % (FORMAT, version.encode()) + config_json).hexdigest()[:32]


def load_hf_config_cached(path: Path, cache_dir: Path | None, load):
    """The config of the model in `path`: from `cache_dir` when an entry for its config.json is
    there (a CachedConfig), else `load(path)` (transformers' AutoConfig) whose result is then kept
    there. `cache_dir` None: no cache."""
    config_file = Path(path) / "config.json"
    if cache_dir is None or not config_file.is_file():
        return load(path)
    entry = Path(cache_dir) / f"{cache_key(config_file.read_bytes())}.json"
    try:
        saved = json.loads(entry.read_text())
        return CachedConfig(saved["values"], saved["attribute_map"])
    except (OSError, ValueError, KeyError):  # no entry yet, or an unreadable one: read it afresh
        pass
    config = load(path)
    _write_atomically(entry, json.dumps({"values": json.loads(config.to_json_string(use_diff=False)),
                                         "attribute_map": dict(type(config).attribute_map)}))
    return config


def _write_atomically(path: Path, text: str) -> None:
    """Write `path` whole or not at all: several processes may start from one cache at once."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    except OSError:  # a read-only disk: the next start reads with transformers again
        return
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:  # a full disk: likewise
        Path(tmp).unlink(missing_ok=True)

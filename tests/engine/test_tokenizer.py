"""The tokenizer loads: preloaded on a thread (an API process while its engine process starts), and
from several threads at once in a process that has not imported transformers yet."""

import subprocess
import sys

from mrv2_jax.engine.tokenizer import TokenizerPreload, load_tokenizer
from mrv2_jax.models.loader import load_hf_config
from mrv2_jax.models.paths import CHECKPOINTS_DIR

DEMO = CHECKPOINTS_DIR / "demo-qwen3"
TEXT = "The king said, to be or not to be"


def test_a_preload_hands_over_the_tokenizer_of_its_path():
    preload = TokenizerPreload(DEMO)
    tokenizer = preload.get(str(DEMO))
    assert tokenizer.encode(TEXT) == load_tokenizer(DEMO).encode(TEXT)
    assert preload.get(str(DEMO)) is tokenizer  # handed over, not loaded again


def test_a_preload_of_another_path_loads_the_one_asked_for():
    assert TokenizerPreload(None).get(str(DEMO)).encode(TEXT) == load_tokenizer(DEMO).encode(TEXT)
    assert TokenizerPreload(DEMO).get(None) is None  # the engine has no tokenizer (a preset)
    assert TokenizerPreload(CHECKPOINTS_DIR / "no-such-model").get(str(DEMO)) is not None


def test_threads_loading_at_once_before_transformers_is_imported():
    code = f"""
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from mrv2_jax.engine.tokenizer import load_tokenizer
from mrv2_jax.models.loader import load_hf_config
assert "transformers" not in sys.modules
path = Path({str(DEMO)!r})
with ThreadPoolExecutor(4) as pool:
    tokenizers = [pool.submit(load_tokenizer, path) for _ in range(3)]
    config = pool.submit(load_hf_config, path)
    ids = {{tuple(t.result().encode({TEXT!r})) for t in tokenizers}}
print(len(ids), config.result().vocab_size)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", str(load_hf_config(DEMO).vocab_size)]


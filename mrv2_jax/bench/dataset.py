"""The random dataset shared by every benchmark (offline, serving, the vLLM comparison).

Only numpy: the vLLM arm of `bench compare` imports this in a process that must not start JAX.
"""

import json
from pathlib import Path

import numpy as np


def random_prompts(num_prompts, input_len, range_ratio, vocab_size, seed, prefix_len=0):
    """Random token prompts, as vllm's random dataset: each `prefix_len` shared tokens (the same
    for every prompt) followed by `input_len` (+- range_ratio) tokens of its own."""
    rng = np.random.default_rng(seed)
    lo, hi = int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio))
    lengths = rng.integers(max(lo, 1), hi + 1, num_prompts)
    # Avoid the top of the vocabulary, where special tokens live.
    top = vocab_size - 1000 if vocab_size > 2000 else vocab_size
    prompts = [rng.integers(0, top, n).tolist() for n in lengths]
    if prefix_len:
        prefix = np.random.default_rng([seed, prefix_len]).integers(0, top, prefix_len).tolist()
        prompts = [prefix + p for p in prompts]
    return prompts


def vocab_size_of(model_dir) -> int:
    """`vocab_size` from a model directory's config.json (no transformers, no JAX)."""
    with open(Path(model_dir) / "config.json") as f:
        config = json.load(f)
    return int(config.get("vocab_size") or config["text_config"]["vocab_size"])

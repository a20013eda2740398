"""What the CPU-only host benchmarks share: the demo tokenizer, and numpy arrays that stand in
for a step's device results (already on the host)."""

from pathlib import Path

import numpy as np

DEMO_TOKENIZER = Path(__file__).resolve().parents[1] / "checkpoints" / "demo-qwen3"


def load_tokenizer_arg(value: str):
    """The host benchmarks' --tokenizer: a tokenizer directory, or 'none' (no detokenizing)."""
    if value == "none":
        return None
    from mrv2_jax.engine.tokenizer import load_tokenizer

    return load_tokenizer(Path(value))


class HostArray(np.ndarray):
    """A numpy array that answers PendingStep's `copy_to_host_async` (it is already there)."""

    def copy_to_host_async(self):
        pass

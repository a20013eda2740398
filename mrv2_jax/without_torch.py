"""Keep PyTorch out of a process of ours that never uses it.

transformers imports torch at import time whenever torch is installed (its utilities do), which
costs seconds on a GPU machine with a CUDA build of torch, while the engine core process and the
API server processes use only transformers' configs and tokenizers. Marking torch as absent in
`sys.modules` makes transformers see no torch (`importlib.util.find_spec` answers None) and any
`import torch` fail at once. Called first thing in the processes that `mrv2-jax serve` starts;
never in a user's own process (a notebook may want torch beside the engine)."""

import sys


def keep_torch_out() -> None:
    """Mark torch as not installed for this process, unless it is already imported."""
    sys.modules.setdefault("torch", None)

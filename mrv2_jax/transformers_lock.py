"""transformers imports parts of itself on first use, and two threads importing it at once may see a
half-imported module (an ImportError). Every config or tokenizer load through transformers in
mrv2_jax holds this lock, so one process's loads go one at a time."""

import threading

TRANSFORMERS_LOCK = threading.RLock()

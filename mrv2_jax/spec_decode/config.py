"""`SpeculativeConfig`: which proposer drafts tokens, how many, and how drafts are verified.

Given as a dict (offline API: `LLM(speculative_config={...})`) or a JSON string (CLI and
server: `--speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'`). A bad
value raises ValueError naming the key, at engine construction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model", "mtp", "synthetic")
REJECTION_METHODS = ("strict", "probabilistic")
MAX_SPECULATIVE_TOKENS = 16  # each extra draft widens every decode row of every compiled step
ALIASES = {"k": "num_speculative_tokens", "draft_model": "model", "ngram_min": "prompt_lookup_min",
           "ngram_max": "prompt_lookup_max"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """`method`:
      * ngram        prompt lookup: the longest match (prompt_lookup_max down to _min tokens)
                     of the request's last tokens earlier in its own tokens, on the device;
      * draft_model  a smaller model with the same tokenizer (`model`), its own paged KV cache;
      * mtp          the target model's own multi-token-prediction layer (families that have one);
      * synthetic    no real proposer: each draft is accepted with probability
                     `acceptance_rate` (given the drafts before it were), for benchmarking the
                     machinery independently of draft quality.
    `rejection_sampling`: "strict" (the target samples every position with the request's
    (seed, position) Gumbel noise, which the draft shares; drafts are accepted while equal:
    outputs are exactly what the target alone would sample) or "probabilistic" (accept with
    min(1, p/q), resample the first rejected position from max(0, p - q))."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None
    load_format: str = "auto"
    rejection_sampling: str = "strict"
    acceptance_rate: float | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an int in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) or not 1 <= lo <= hi:
            raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max "
                             f"(ints), got {lo!r} and {hi!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config.model (the draft model) is required for method "
                             "'draft_model' and only allowed with it")
        if self.rejection_sampling not in REJECTION_METHODS:
            raise ValueError(f"speculative_config.rejection_sampling must be one of {REJECTION_METHODS}, "
                             f"got {self.rejection_sampling!r}")
        rate = self.acceptance_rate
        if self.method == "synthetic":
            if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0.0 <= rate <= 1.0:
                raise ValueError(f"speculative_config.acceptance_rate must be a number in [0, 1] for "
                                 f"method 'synthetic', got {rate!r}")
        elif rate is not None:
            raise ValueError("speculative_config.acceptance_rate is only used by method 'synthetic'")

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, a dict or a JSON object string -> SpeculativeConfig | None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or a JSON object, got {type(value).__name__}")
        value = {ALIASES.get(key, key): v for key, v in value.items()}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s): {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known | set(ALIASES)))}")
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise ValueError(f"speculative_config needs {required!r}")
        return cls(**value)

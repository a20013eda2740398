"""Per-request sampling parameters, validated once at construction.

Everything downstream (scheduler, sampler, detokenizer) trusts these values, so every
check lives here and a bad value fails with a message that names the field and the
allowed range, before the request reaches the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from mrv2_jax.structured.params import StructuredOutputsParams

# Below this temperature a request is sampled greedily (argmax); dividing logits by a
# value this small would only amplify numerical noise.
GREEDY_TEMPERATURE_EPS = 1e-5

# Upper bound on the number of top logprobs a request may ask for per token.
MAX_LOGPROBS = 20


def _is_int(value) -> bool:
    # bool is a subclass of int; `max_tokens=True` is a bug, not the number 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require_int(name: str, value) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")


FLOAT32_MAX = 3.4028234663852886e38


def _require_number(name: str, value) -> None:
    if not _is_number(value):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if abs(value) > FLOAT32_MAX:  # the device holds it as a float32
        raise ValueError(f"{name} must be at most {FLOAT32_MAX:.4g} in magnitude, got {value}")


@dataclass
class SamplingParams:
    """How to sample one request's output tokens and when to stop.

    Conventions:
      * ``temperature == 0`` (below ``GREEDY_TEMPERATURE_EPS``) means greedy decoding.
      * ``top_k``: ``0`` means "off" (consider the whole vocabulary). ``-1`` is accepted as
        the older spelling of "off" and normalised to ``0``, so consumers test ``top_k > 0``.
      * ``max_tokens=None`` means "until EOS, a stop condition, or max_model_len".
      * ``stop`` is normalised to a list of non-empty strings, ``stop_token_ids`` to a list.
      * ``logprobs`` / ``prompt_logprobs``: ``None`` = not returned; ``k`` in 0..20 returns
        the sampled token's logprob plus the top ``k``.
      * ``n`` exists for API compatibility; only ``n == 1`` is supported.
      * ``structured_outputs``: a constraint on the output (``StructuredOutputsParams`` or a dict
        of its fields: json, json_object, regex, choice), enforced on the device
        (docs/structured_outputs.md).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = field(default=None)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._validate_lengths()
        self._validate_sampling()
        self._validate_penalties()
        self._validate_stops()
        self._validate_outputs()
        self._validate_structured()

    # ---- validation, grouped by concern -------------------------------------------------

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None:
            _require_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _require_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        _require_int("n", self.n)
        if self.n != 1:
            raise ValueError(f"n must be 1 (n > 1 is not supported), got {self.n}")

    def _validate_sampling(self) -> None:
        _require_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _require_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _require_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (off) or >= 1, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        _require_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _require_int("seed", self.seed)
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.min_p = float(self.min_p)

    def _validate_penalties(self) -> None:
        _require_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require_number(name, value)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, float(value))
        self.repetition_penalty = float(self.repetition_penalty)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(
                    f"logit_bias must be a dict[int, float], got {type(self.logit_bias).__name__}"
                )
            for token_id, bias in self.logit_bias.items():
                if not _is_int(token_id) or token_id < 0:
                    raise ValueError(
                        f"logit_bias keys must be token ids (ints >= 0), got {token_id!r}"
                    )
                _require_number(f"logit_bias[{token_id}]", bias)
                if not -100 <= bias <= 100:
                    raise ValueError(f"logit_bias[{token_id}] must be in [-100, 100], got {bias}")
            self.logit_bias = {token_id: float(bias) for token_id, bias in self.logit_bias.items()}

    def _validate_stops(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a str or a list of str, got {type(self.stop).__name__}")
        for stop_str in self.stop:
            if not isinstance(stop_str, str) or not stop_str:
                raise ValueError(f"stop strings must be non-empty str, got {stop_str!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple, set, frozenset)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(
                f"stop_token_ids must be a list of int, got {type(self.stop_token_ids).__name__}"
            )
        for token_id in self.stop_token_ids:
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"stop_token_ids must be token ids (ints >= 0), got {token_id!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def _validate_outputs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            _require_int(name, value)
            if not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be None or in [0, {MAX_LOGPROBS}], got {value}")

    def _validate_structured(self) -> None:
        so = self.structured_outputs
        if so is None:
            return
        if isinstance(so, dict):
            unknown = set(so) - {f.name for f in fields(StructuredOutputsParams)}
            if unknown:
                raise ValueError(f"structured_outputs has unknown field(s) {', '.join(sorted(unknown))}")
            self.structured_outputs = so = StructuredOutputsParams(**so)
        elif not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, got {type(so).__name__}")
        # The automaton allows EOS exactly where the output is complete: neither may move it.
        if self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with structured_outputs")
        if self.min_tokens:
            raise ValueError("min_tokens cannot be combined with structured_outputs")

    # ---- derived properties ----------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        """True when the request is decoded by argmax (no randomness involved)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

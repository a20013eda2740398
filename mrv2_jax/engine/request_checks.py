"""The checks a request passes before any engine sees it: what the engine's runner can serve, and
whether its sampler lists and constraint fit the compiled shapes. Plain Python with no JAX, so the
API server processes (entrypoints/) run them without importing the engine's device code."""

from __future__ import annotations

from mrv2_jax.config import MAX_LOGIT_BIAS, MAX_STOP_IDS
from mrv2_jax.sampling_params import SamplingParams


def check_request(params, supports_prompt_logprobs: bool, supports_structured_outputs: bool = True) -> None:
    """Raise ValueError for what an engine whose runner has these abilities cannot serve."""
    if params.prompt_logprobs is not None and not supports_prompt_logprobs:
        raise ValueError("prompt_logprobs is not supported with this runner configuration "
                         "(speculative decoding, or no sampler variant computing them)")
    if params.structured_outputs is not None and not supports_structured_outputs:
        raise ValueError("structured_outputs is not supported with this runner configuration "
                         "(speculative decoding, or the v1 runner)")


def check_automaton_fits(automaton, capacity: tuple[int, int]) -> None:
    """Raise ValueError when a compiled constraint is larger than the runner's automaton pool."""
    if automaton.num_states > capacity[0] or automaton.num_exceptions > capacity[1]:
        raise ValueError(
            f"structured_outputs: the constraint compiles to {automaton.num_states} states and "
            f"{automaton.num_exceptions} exception entries; the device pool holds {capacity[0]} and "
            f"{capacity[1]} (MRV2_STRUCTURED_STATES, MRV2_STRUCTURED_EXCEPTIONS)")


def check_request_fits(params: SamplingParams, vocab_size: int, max_bias: int = MAX_LOGIT_BIAS,
                       max_stop: int = MAX_STOP_IDS, num_eos: int = 1) -> None:
    """Raise ValueError when a request's token ids or list lengths do not fit this engine
    (called when the request is added, so the engine loop never sees a bad one)."""
    bias = params.logit_bias or {}
    bad = [t for t in list(bias) + list(params.stop_token_ids) if t >= vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} in logit_bias / stop_token_ids is outside the "
                         f"vocabulary (size {vocab_size})")
    if len(bias) > max_bias:
        raise ValueError(f"logit_bias has {len(bias)} entries; at most {max_bias} are supported")
    if params.min_tokens and len(params.stop_token_ids) + num_eos > max_stop:
        raise ValueError(f"stop_token_ids has {len(params.stop_token_ids)} ids; with min_tokens at "
                         f"most {max_stop - num_eos} are supported")

"""A request's known tokens: its prompt and its outputs kept as two lists (engine/request.py)."""

from mrv2_jax.engine.request import Request
from mrv2_jax.sampling_params import SamplingParams


def test_token_slices_match_the_prompt_and_outputs_joined():
    prompt, outputs = [11, 12, 13, 14, 15], [21, 22, 23, 24]
    request = Request("r", prompt, SamplingParams(max_tokens=8))
    for token in outputs:
        request.append_output_token(token)
    known = prompt + outputs
    assert request.num_tokens == len(known) and request.all_token_ids == known
    for start in range(len(known) + 1):
        for end in range(start, len(known) + 1):
            assert request.token_ids_between(start, end) == known[start:end], (start, end)


def test_the_known_tokens_are_a_copy():
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=4))
    request.all_token_ids.append(9)
    request.token_ids_between(0, 3).append(9)
    assert request.all_token_ids == [1, 2, 3] and request.prompt_token_ids == [1, 2, 3]

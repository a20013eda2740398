import math

import pytest

from mrv2_jax.config import CacheConfig, SchedulerConfig
from mrv2_jax.sampling_params import SamplingParams


def test_defaults():
    params = SamplingParams()
    assert params.max_tokens == 16
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.top_k == 0
    assert params.stop == [] and params.stop_token_ids == []
    assert params.skip_special_tokens and not params.include_stop_str_in_output
    assert not params.is_greedy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1}, "temperature must be >= 0, got -1"),
        ({"temperature": math.nan}, "temperature must be finite"),
        ({"top_p": 0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"top_k": -2}, "top_k must be"),
        ({"min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be <= max_tokens (10)"),
        ({"n": 2}, "n > 1 is not supported"),
        ({"logprobs": 21}, "logprobs must be None or in [0, 20], got 21"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be None or in [0, 20]"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0, got 0"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3"),
        ({"logit_bias": {5: 101}}, "logit_bias[5] must be in [-100, 100], got 101"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids"),
        ({"stop": ["ok", ""]}, "stop strings must be non-empty"),
        ({"stop_token_ids": [3, -4]}, "stop_token_ids must be token ids"),
    ],
)
def test_out_of_range_values_name_field_and_range(kwargs, message):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    assert message in str(excinfo.value)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": "16"}, "max_tokens must be an int"),
        ({"max_tokens": 16.0}, "max_tokens must be an int"),
        ({"max_tokens": True}, "max_tokens must be an int"),
        ({"top_k": False}, "top_k must be an int"),
        ({"seed": 1.5}, "seed must be an int"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"temperature": True}, "temperature must be a number"),
        ({"logprobs": True}, "logprobs must be an int"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a dict"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be token ids"),
        ({"stop": 5}, "stop must be a str or a list of str"),
        ({"stop": [5]}, "stop strings must be non-empty str"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool"),
    ],
)
def test_wrong_types_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_normalisation():
    params = SamplingParams(top_k=-1, stop="###", stop_token_ids=(7, 8), logit_bias={3: 2})
    assert params.top_k == 0  # -1 and 0 both mean "off"; stored as 0
    assert params.stop == ["###"]
    assert params.stop_token_ids == [7, 8]
    assert params.logit_bias == {3: 2.0} and isinstance(params.logit_bias[3], float)
    assert isinstance(SamplingParams(temperature=1).temperature, float)


def test_accepted_edge_values():
    SamplingParams(max_tokens=None, top_k=1, min_p=1.0, logprobs=0, prompt_logprobs=20,
                   presence_penalty=-2, frequency_penalty=2, logit_bias={0: -100, 9: 100},
                   seed=0, min_tokens=16)


def test_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-7).is_greedy
    assert not SamplingParams(temperature=0.1).is_greedy


def test_scheduler_config_validation():
    SchedulerConfig(max_model_len=4096)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1, got 0"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be an int"):
        SchedulerConfig(max_num_batched_tokens="2048")
    with pytest.raises(ValueError, match="must be >= max_model_len .4096. when chunked"):
        SchedulerConfig(max_num_batched_tokens=2048, max_model_len=4096,
                        enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="async_scheduling must be a bool"):
        SchedulerConfig(async_scheduling="yes")


def test_cache_config_validation():
    CacheConfig(block_size=32, num_gpu_blocks=10)
    with pytest.raises(ValueError, match="block_size must be a power of two, got 24"):
        CacheConfig(block_size=24)
    with pytest.raises(ValueError, match="num_gpu_blocks must be >= 1"):
        CacheConfig(num_gpu_blocks=0)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 1.5"):
        CacheConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        CacheConfig(gpu_memory_utilization=0)


@pytest.mark.parametrize("name", ["temperature", "repetition_penalty"])
def test_a_number_past_float32_is_refused_by_name(name):
    # The device holds sampling numbers as float32: 1e39 would become inf there.
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: 1e39})
    assert getattr(SamplingParams(**{name: 3e38}), name) == 3e38

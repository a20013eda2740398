"""The sampling settings that the engine benchmarks share (`bench ab`, `bench timeline`)."""


def sampling_params(kind: str, max_tokens: int, vocab_size: int):
    """greedy: argmax only. all: every sampler feature on every request (as the sampler
    benchmark's all_used case): temperature, top-k 50, top-p 0.9, min-p 0.05, the three
    penalties, 16 biased token ids, min_tokens, 20 logprobs; the difference between the two is
    what the features cost a real step."""
    from mrv2_jax.sampling_params import SamplingParams

    if kind == "greedy":
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if kind == "all":
        bias = {int(i): (-1.0) ** i * 2.0 for i in range(7, vocab_size, max(1, vocab_size // 16))[:16]}
        return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_k=50, top_p=0.9, min_p=0.05,
                              repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.2,
                              logit_bias=bias, min_tokens=min(16, max_tokens), logprobs=20, ignore_eos=True)
    raise ValueError(f"unknown --sampling {kind!r}; known: greedy, all")

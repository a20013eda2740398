"""Building the proposer and the SpecDecoder a runner needs, from a SpeculativeConfig."""

from mrv2_jax.spec_decode.config import SpeculativeConfig
from mrv2_jax.spec_decode.decoder import SpecDecoder
from mrv2_jax.spec_decode.mtp import build_mtp_proposer
from mrv2_jax.spec_decode.ngram import NgramProposer
from mrv2_jax.spec_decode.proposer import SyntheticProposer


def proposer_kv_bytes_per_token(config: SpeculativeConfig | None, model_state, draft_state, kv_dtype) -> int:
    """KV bytes per token of the proposer's own cache (it has as many blocks as the target's, so
    the KV budget pays for both): the draft model's cache, or the MTP layer's (one layer of the
    target's shape); ngram and synthetic keep none."""
    if config is None:
        return 0
    if config.method == "draft_model":
        return draft_state.kv_bytes_per_token(kv_dtype)
    if config.method == "mtp":
        return model_state.kv_bytes_per_token(kv_dtype) // model_state.num_layers
    return 0


def build_spec_decoder(config: SpeculativeConfig, model_state, lm, *, num_blocks: int, block_size: int,
                       max_num_seqs: int, max_model_len: int, kv_dtype, dtype, use_kernels: bool,
                       draft_model=None) -> SpecDecoder:
    """`draft_model`: a `load_model` result to use instead of loading `config.model`."""
    k = config.num_speculative_tokens
    if config.method == "ngram":
        proposer = NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
    elif config.method == "synthetic":
        proposer = SyntheticProposer(k)
    elif config.method == "draft_model":
        from mrv2_jax.models.loader import load_model
        from mrv2_jax.spec_decode.draft_model import DraftModelProposer

        draft_state, draft_lm, _ = draft_model or load_model(config.model, dtype, config.load_format)
        if draft_state.vocab_size != model_state.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft_state.vocab_size} tokens) differs from "
                             f"the target's ({model_state.vocab_size}); a draft must share the tokenizer")
        proposer = DraftModelProposer(
            draft_state, draft_lm, k, num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
            kv_dtype=kv_dtype, use_kernels=use_kernels, with_probs=config.rejection_sampling == "probabilistic")
    else:  # mtp
        proposer = build_mtp_proposer(model_state, lm, k, num_blocks=num_blocks, block_size=block_size,
                                      max_model_len=max_model_len, kv_dtype=kv_dtype, use_kernels=use_kernels,
                                      with_probs=config.rejection_sampling == "probabilistic")
    return SpecDecoder(config, proposer, num_slots=max_num_seqs, vocab_size=model_state.vocab_size)

"""MTP proposer: the target model's own multi-token-prediction layer(s) draft the tokens.

Which families have MTP layers and how their weights load is per-family logic in the family's
ModelState (`mtp_group`, `mtp_forward`); the drafting itself is the generic `MtpProposer`
(spec_decode/mtp_proposer.py), which runs the layer through `lm.forward_mtp`.
"""

from mrv2_jax.spec_decode.mtp_proposer import MtpProposer


def build_mtp_proposer(model_state, lm, k: int, **runner_info) -> MtpProposer:
    """A proposer drafting with the family's MTP layer(s). `runner_info` carries num_blocks,
    block_size, max_model_len, kv_dtype, use_kernels and with_probs for the proposer's own KV cache."""
    if not model_state.has_mtp:
        raise NotImplementedError(
            f"speculative method 'mtp' needs a multi-token-prediction layer, and the "
            f"{model_state.architecture} family ({type(model_state).__name__}) has none; use 'ngram' or 'draft_model'")
    return MtpProposer(model_state, lm, k, **runner_info)

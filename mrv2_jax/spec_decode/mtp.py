"""MTP proposer: the target model's own multi-token-prediction layer(s) draft the tokens.

This is per-family logic (GLM-4.5's `num_nextn_predict_layers` layers, their weights, how they
combine the target's hidden state with the next token's embedding), so it lives in the
family's ModelState: `ModelState.build_mtp_proposer(lm, k, **runner_info)` returns a
`Proposer` (spec_decode/proposer.py) whose `propose` reads `ProposeInputs.hidden`. The base
ModelState raises NotImplementedError naming the family; a family with MTP weights overrides it.
"""


def build_mtp_proposer(model_state, lm, k: int, **runner_info):
    return model_state.build_mtp_proposer(lm, k, **runner_info)

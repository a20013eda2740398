"""MTP proposer: the target model's own multi-token-prediction layer(s) draft the tokens.

Which families have MTP layers, their weights and how they combine the target's hidden state
with the next token's embedding is per-family logic, so it lives in the family's ModelState:
`ModelState.build_mtp_proposer(lm, k, **runner_info)` returns a `Proposer` (spec_decode/proposer.py)
whose `propose` reads `ProposeInputs.hidden`. GLM-4-MoE (models/glm4_moe.py) returns the generic
`MtpProposer` (spec_decode/mtp_proposer.py), which runs the layer through `lm.forward_mtp`; the
base ModelState raises NotImplementedError naming the family.
"""


def build_mtp_proposer(model_state, lm, k: int, **runner_info):
    return model_state.build_mtp_proposer(lm, k, **runner_info)

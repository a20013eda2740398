"""StructuredOutputsParams and SamplingParams.structured_outputs: every bad constraint fails at
construction with a message naming the field, and a constraint survives the engine process's
msgpack wire format."""

import pytest

from mrv2_jax.engine import core_messages as M
from mrv2_jax.sampling_params import SamplingParams
from mrv2_jax.structured.params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

BAD = {
    "no kind": ({}, "exactly one of"),
    "two kinds": (dict(regex="a", choice=["a"]), "got regex, choice"),
    "invalid regex": (dict(regex="(ab"), "structured_outputs.regex: invalid regular expression"),
    "empty regex": (dict(regex=""), "structured_outputs.regex"),
    "empty choice": (dict(choice=[]), "structured_outputs.choice"),
    "choice of numbers": (dict(choice=[1, 2]), "structured_outputs.choice"),
    "schema not JSON": (dict(json="{x"), "structured_outputs.json: the schema is not valid JSON"),
    "schema not an object": (dict(json=[1]), "structured_outputs.json"),
    "invalid schema": (dict(json={"type": "object", "properties": 5}), "structured_outputs.json: invalid JSON schema"),
    "unknown type": (dict(json={"type": "foo"}), "structured_outputs.json"),
    "json_object false": (dict(json_object="yes"), "structured_outputs.json_object"),
    "invalid grammar": (dict(grammar="start: ("), "structured_outputs.grammar: invalid grammar"),
    "GBNF that does not parse": (dict(grammar="root ::= 'a'"), "structured_outputs.grammar: Failed to convert"),
    "unknown field": (dict(regexp="a"), "unknown field(s) regexp"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_constraints_name_the_field(case):
    fields, message = BAD[case]
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SamplingParams(structured_outputs=fields)


def test_constraints_that_would_move_eos_are_refused():
    with pytest.raises(ValueError, match="ignore_eos cannot be combined with structured_outputs"):
        SamplingParams(ignore_eos=True, structured_outputs=dict(regex="a"))
    with pytest.raises(ValueError, match="min_tokens cannot be combined with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs=dict(regex="a"))


def test_kinds_and_their_patterns():
    assert StructuredOutputsParams(choice=["a.b", "c"]).pattern == r"(a\.b|c)"
    assert StructuredOutputsParams(regex="[0-9]+").key == ("regex", "[0-9]+")
    as_str = StructuredOutputsParams(json='{"type": "object", "properties": {"a": {"type": "integer"}}, '
                                          '"required": ["a"]}')
    assert as_str.key == StructuredOutputsParams(json=SCHEMA).key  # a schema as str or dict: one automaton
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


def test_constraint_survives_the_engine_wire_format():
    params = SamplingParams(max_tokens=5, structured_outputs=dict(json=SCHEMA))
    frame = M.encoder().encode(M.AddRequest("r", [1, 2], params, False))
    back = M.to_engine_decoder().decode(frame).params
    assert back.structured_outputs == params.structured_outputs
    assert back.structured_outputs.key == params.structured_outputs.key

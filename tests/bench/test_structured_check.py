"""The benchmarks' validity check of constrained outputs, on outputs whose validity is plain to see."""

import pytest

from mrv2_jax.bench.structured_check import count_valid, satisfies

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


@pytest.mark.parametrize("text,ok", [('{"a": 3}', True), ('{"a": "3"}', False), ('{"b": 3}', False),
                                     ('{"a": 3', False), ("[3]", False)])
def test_json_schema(text, ok):
    assert satisfies(text, {"json": SCHEMA}) is ok
    assert satisfies(text, {"json": '{"type": "object", "required": ["a"]}'}) is (ok or text == '{"a": "3"}')


def test_regex_choice_and_json_object():
    assert satisfies("abc", {"regex": "[a-c]+"}) and not satisfies("abcd", {"regex": "[a-c]+"})
    assert satisfies("no", {"choice": ["yes", "no"]}) and not satisfies("n", {"choice": ["yes", "no"]})
    assert satisfies('{"x": [1]}', {"json_object": True}) and not satisfies("[1]", {"json_object": True})
    with pytest.raises(ValueError, match="no checker"):
        satisfies("x", {"grammar": "root ::= 'x'"})


def test_only_outputs_that_ended_by_the_constraint_are_checked():
    outputs = [('{"a": 1}', "stop"), ('{"a": true}', "stop"), ('{"a": 12', "length"), ('{"a": 2}', "abort")]
    assert count_valid(outputs, {"json": SCHEMA}) == {"outputs": 4, "complete": 2, "valid": 1}
    assert count_valid(outputs, {"grammar": 'start: "x"'}) == {"outputs": 4, "complete": 2, "valid": None}

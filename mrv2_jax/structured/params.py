"""One request's structured-output constraint (vLLM's `StructuredOutputsParams`), checked when it
is built, and the regular expression it stands for.

Exactly one kind is given: `json` (a JSON schema, dict or str), `json_object` (any JSON object),
`regex`, `choice` (a list of strings) or `grammar` (a context-free grammar, Lark or GBNF: no
regex, it runs through llguidance on the host, structured/grammar.py). Every error names the
field, e.g. "structured_outputs.regex: ...".
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from mrv2_jax.structured.grammar import grammar_of

KINDS = ("json", "json_object", "regex", "choice", "grammar")

# JSON's pieces as outlines-core writes them ([ ]? between tokens).
_WS = r"[ ]?"
_STRING = r'"([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])*"'
_NUMBER = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"
_SCALAR = rf"({_STRING}|{_NUMBER}|true|false|null)"


def _object(value: str) -> str:
    member = rf"{_STRING}{_WS}:{_WS}{value}"
    return rf"\{{{_WS}({member}({_WS},{_WS}{member})*)?{_WS}\}}"


def _array(value: str) -> str:
    return rf"\[{_WS}({value}({_WS},{_WS}{value})*)?{_WS}\]"


# "Any JSON object" as a finite automaton: values nest two levels deep (objects and arrays of
# scalars inside the top object). outlines-core's own {"type": "object"} nests deeper and
# compiles ~25x slower.
JSON_OBJECT_REGEX = _object(rf"({_SCALAR}|{_object(_SCALAR)}|{_array(_SCALAR)})")


def _fail(kind: str, why: str):
    raise ValueError(f"structured_outputs.{kind}: {why}")


@dataclass
class StructuredOutputsParams:
    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must give exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        self.kind = given[0]
        if self.kind == "grammar":
            self._regex, self._grammar = None, grammar_of(self.grammar)
        else:
            self._regex, self._grammar = self._to_regex(), None

    def _to_regex(self) -> str:
        kind = self.kind
        if kind == "json_object":
            if self.json_object is not True:
                _fail("json_object", f"must be true, got {self.json_object!r}")
            return JSON_OBJECT_REGEX
        if kind == "regex":
            if not isinstance(self.regex, str) or not self.regex:
                _fail("regex", f"must be a non-empty string, got {self.regex!r}")
            try:
                re.compile(self.regex)
            except re.error as e:
                _fail("regex", f"invalid regular expression: {e}")
            return self.regex
        if kind == "choice":
            choice = self.choice
            if not isinstance(choice, (list, tuple)) or not choice:
                _fail("choice", f"must be a non-empty list of strings, got {choice!r}")
            if not all(isinstance(c, str) and c for c in choice):
                _fail("choice", "every choice must be a non-empty string")
            self.choice = list(choice)
            return "(" + "|".join(re.escape(c) for c in choice) + ")"
        return self._schema_regex()

    def _schema_regex(self) -> str:
        from outlines_core.json_schema import build_regex_from_schema

        schema = self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                _fail("json", f"the schema is not valid JSON: {e}")
        if not isinstance(schema, dict):
            _fail("json", f"the schema must be a JSON object, got {type(schema).__name__}")
        _check_schema(schema)
        try:
            return build_regex_from_schema(json.dumps(schema))
        except Exception as e:  # noqa: BLE001 - outlines-core's errors vary by type; all mean "cannot"
            _fail("json", f"unsupported or invalid schema: {e}")

    @property
    def pattern(self) -> str:
        """The regular expression the constraint stands for (outlines-core's syntax); a grammar
        has none."""
        if self._regex is None:
            raise ValueError("structured_outputs.grammar stands for no regular expression")
        return self._regex

    @property
    def llguidance_grammar(self) -> str:
        """A grammar constraint as llguidance's grammar (checked when built)."""
        return self._grammar

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the compiled constraint (with the tokenizer): the kind and its regex
        (a grammar: llguidance's form of it)."""
        return self.kind, self._regex if self._regex is not None else self._grammar


def _check_schema(schema: dict) -> None:
    """The schema against its JSON Schema meta-schema, when jsonschema is installed."""
    try:
        import jsonschema
    except ImportError:
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        _fail("json", f"invalid JSON schema: {e.message}")

"""Whether constrained outputs satisfy their constraint: the validity count that `bench throughput`
and `bench compare` report beside a constrained run's speed. Pure Python (json, re, jsonschema),
so that vLLM's arm process can use it without JAX."""

from __future__ import annotations

import json
import re


def satisfies(text: str, constraint: dict) -> bool:
    """True when `text` is a complete output allowed by `constraint` (StructuredOutputsParams fields)."""
    if constraint.get("json") is not None:
        import jsonschema

        schema = constraint["json"]
        schema = json.loads(schema) if isinstance(schema, str) else schema
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return jsonschema.Draft202012Validator(schema).is_valid(value)
    if constraint.get("json_object"):
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if constraint.get("regex") is not None:
        return re.fullmatch(constraint["regex"], text) is not None
    if constraint.get("choice") is not None:
        return text in constraint["choice"]
    raise ValueError(f"no checker for the constraint {sorted(constraint)}")


def count_valid(outputs: list[tuple[str, str | None]], constraint: dict) -> dict:
    """Over (text, finish_reason) pairs: how many finished by the constraint's own end ("stop"),
    and how many of those satisfy it. An output cut by max_tokens is incomplete, so not checked."""
    complete = [text for text, reason in outputs if reason == "stop"]
    # (no checker for a grammar: None)
    valid = None if constraint.get("grammar") is not None else sum(satisfies(text, constraint) for text in complete)
    return {"outputs": len(outputs), "complete": len(complete), "valid": valid}

"""Structured outputs: constraints (JSON schema, any JSON object, regex, choice) compiled on the
host into token-level automata that the device masks and advances inside its steps.

A leaf package (it imports only numpy, outlines-core and sampling parameters), so the engine,
the runner and the server all use it: `params.py` (the constraint and its checks),
`vocabulary.py` (a tokenizer's tokens as bytes), `automaton.py` (one compiled automaton and its
compact tables), `compiler.py` (compile with a cache). docs/structured_outputs.md has the picture.
"""

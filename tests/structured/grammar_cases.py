"""Grammars the grammar tests share, each with an independent way to check its outputs, and the engine
shape of the structured-output engine tests."""

import re

DEMO = "checkpoints/demo-qwen3"

# The engine of tests/engine/test_structured_engine.py and test_grammar_engine.py: one shape, so the two
# share their step programs through the persistent compilation cache; the widest sampler variant alone
# serves their greedy and seeded, constrained and free rows.
STRUCTURED_ENGINE_ARGS = dict(dtype="float32", runner="v2", max_num_seqs=8, max_num_batched_tokens=32,
                              max_model_len=128, block_size=4, num_gpu_blocks=48, max_fused_steps=4,
                              sampler_variants="all", show_progress=False)

# One language three ways: a regex (the device automaton's), Lark and GBNF (llguidance's).
REGEX = r"[A-Z][a-z]{1,6}( [a-z]{1,6}){1,4}[.!?]"
LARK = 'start: NAME (" " WORD){1,4} END\nNAME: /[A-Z][a-z]{1,6}/\nWORD: /[a-z]{1,6}/\nEND: /[.!?]/'
GBNF = 'root ::= [A-Z] [a-z]{1,6} (" " [a-z]{1,6}){1,4} [.!?]'

# Not regular: balanced parentheses around one word.
NESTED = 'start: item\nitem: WORD | "(" item ")"\nWORD: /[a-z]{1,5}/'


def is_nested(text: str) -> bool:
    m = re.fullmatch(r"(\(*)([a-z]{1,5})(\)*)", text)
    return m is not None and len(m.group(1)) == len(m.group(3))

# Long enough that eight requests outgrow the engine tests' KV pool.
WORDS_REGEX = r"[a-z]{1,8}( [a-z]{1,8}){24,30}\."
WORDS_LARK = 'start: WORD (" " WORD){24,30} "."\nWORD: /[a-z]{1,8}/'

"""Probe: how often the incremental detokenizer holds a token's text back, for random tokens.

    python -m benchmarks.held_back_text --tokenizer /tmp/qwen3-0.6b

A token whose text ends in half a UTF-8 character has an empty delta: its text comes with a later
token. Dummy weights sample nearly uniform tokens, so this is the share of a serving benchmark's
steps that bring a stream tokens but no text (docs/benchmarks.md, session 22: the server sends a
chunk for them since). Draws `--requests` x `--tokens` ids uniformly from the tokenizer's ordinary
vocabulary (special tokens left out), each request after a random prompt, through
`IncrementalDetokenizer` one token at a time, and counts the empty deltas.
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.host_fakes import DEMO_TOKENIZER, load_tokenizer_arg
from mrv2_jax.bench.environment import describe_environment, write_report
from mrv2_jax.engine.detokenizer import IncrementalDetokenizer


def draw(tokenizer, requests: int, tokens: int, prompt_len: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, output ids) per request, uniform over the ids that are not special tokens."""
    ordinary = np.setdiff1d(np.arange(len(tokenizer)), [i for i in tokenizer.all_special_ids if i is not None])
    rng = np.random.default_rng(seed)
    return [(rng.choice(ordinary, prompt_len).tolist(), rng.choice(ordinary, tokens).tolist())
            for _ in range(requests)]


def empty_deltas(tokenizer, requests) -> int:
    """Tokens whose delta text was empty when the detokenizer took them one at a time."""
    empty = 0
    for prompt, output in requests:
        detok = IncrementalDetokenizer(tokenizer, prompt)
        empty += sum(detok.update([t])[0] == "" for t in output)
    return empty


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", default=str(DEMO_TOKENIZER), help="a tokenizer directory")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    tokenizer = load_tokenizer_arg(args.tokenizer)
    requests = draw(tokenizer, args.requests, args.tokens, args.prompt_len, args.seed)
    empty = empty_deltas(tokenizer, requests)
    total = args.requests * args.tokens
    print(f"{args.tokenizer}: {empty} of {total} random tokens held their text back ({100 * empty / total:.2f}%)")
    report = {**describe_environment(probe_device=False), "settings": vars(args), "tokens": total,
              "empty_deltas": empty, "share": empty / total}
    if args.output_json:
        write_report(report, args.output_json)
    return report


if __name__ == "__main__":
    main()

"""The host cost of grammar constraints per engine step (runner/grammar_masks.py), on the CPU demo
model: the bitmask fill and its write dispatch before each step, and the matcher's advance with
each received token; and, for context, the wall time of the same run with the language given as a
regex (the device automaton: async steps, fused decode) and unconstrained.

    python -m benchmarks.grammar_masks --batch 1 8 --tokens 64
"""

import argparse
import statistics
import time

from mrv2_jax.llm import LLM
from mrv2_jax.sampling_params import SamplingParams
from mrv2_jax.structured.grammar import GrammarMatcher

# One language as a grammar and as a regex: words, ended by a character the model hardly ever
# writes, so outputs run to max_tokens.
GRAMMAR = 'start: WORD (" " WORD)* "#"\nWORD: /[a-z]{1,8}/'
REGEX = r"[a-z]{1,8}( [a-z]{1,8})*#"
PROMPTS = ["The king said", "ROMEO:\n", "To be, or not", "JULIET:\nO Romeo", "First Citizen:\n",
           "HAMLET:\nAlas, poor Yorick!", "Speak, my lord", "MACBETH:\n"]


def _timed_masks(llm):
    """Wrap the runner's mask writer and the matchers' fill and advance; -> (writes [(s, masks)],
    fills [s], advances [s])."""
    masks, writes, fills, advances = llm.engine.runner.grammar_masks, [], [], []
    write, fill, consume = masks.write, GrammarMatcher.fill, GrammarMatcher.consume

    def timed_write(tables, req_ids):
        tables = write(tables, req_ids)
        if masks.last_num_masks:
            writes.append((masks.last_write_s, masks.last_num_masks))
        return tables

    def timed_fill(self, row):
        start = time.perf_counter()
        fill(self, row)
        fills.append(time.perf_counter() - start)

    def timed_consume(self, token):
        start = time.perf_counter()
        ok = consume(self, token)
        advances.append(time.perf_counter() - start)
        return ok

    masks.write = timed_write
    GrammarMatcher.fill, GrammarMatcher.consume = timed_fill, timed_consume
    return writes, fills, advances


def _run(llm, batch: int, tokens: int, constraint) -> tuple[float, int]:
    params = [SamplingParams(max_tokens=tokens, temperature=0.8, seed=i, structured_outputs=constraint)
              for i in range(batch)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    llm = LLM("demo", dtype="float32", max_num_seqs=max(args.batch), max_model_len=256, show_progress=False)
    writes, fills, advances = _timed_masks(llm)
    for constraint in ({"grammar": GRAMMAR}, {"regex": REGEX}, None):  # warm-up: compile what each run needs
        _run(llm, max(args.batch), 8, constraint)
    for batch in args.batch:
        for name, constraint in (("grammar", {"grammar": GRAMMAR}), ("regex", {"regex": REGEX}),
                                 ("unconstrained", None)):
            for timings in (writes, fills, advances):
                timings.clear()
            runs = [_run(llm, batch, args.tokens, constraint) for _ in range(args.repeats)]
            wall = statistics.median(r[0] for r in runs)
            line = f"batch {batch:3d} {name:13s} {wall * 1e3:8.1f} ms/run, {runs[0][1] / wall:7.1f} tok/s"
            if writes:
                per_step = [s * 1e6 for s, _ in writes]
                line += (f" | fill+write per step {statistics.median(per_step):7.1f} us"
                         f" (p90 {statistics.quantiles(per_step, n=10)[-1]:7.1f}),"
                         f" fill per mask {statistics.median(fills) * 1e6:6.1f} us,"
                         f" advance per token {statistics.median(advances) * 1e6:5.1f} us")
            print(line, flush=True)


if __name__ == "__main__":
    main()

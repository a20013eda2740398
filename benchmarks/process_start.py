"""What a fresh process spends before the engine's own start-up report begins: Python imports and
the accelerator backend's start, each timed in a fresh interpreter.

    python -m benchmarks.process_start [--output-json out.json]

Each row runs `python -c` with the statements of the rows above it untimed and its own statement
timed, so the figures add up to one process start: importing jax, starting its backend (CUDA
context, client, memory pool), the first tiny program, and importing the engine's modules
(transformers, FastAPI and the rest), and making --model's dummy weights once the backend runs.
Then, each alone in a fresh interpreter, what reading a model's config through transformers costs
with torch importable and with torch kept out (mrv2_jax/without_torch.py, as the engine process does).
"""

import argparse
import json
import subprocess
import sys

from mrv2_jax import envs

STEPS = (
    ("import jax", "import jax"),
    ("start the backend (jax.devices)", "jax.devices()"),
    ("first tiny program", "import jax.numpy as jnp; jnp.ones(4).sum().block_until_ready()"),
    ("import the engine (mrv2_jax.llm)", "import mrv2_jax.llm"),
    ("import the server (entrypoints.openai_server)", "import mrv2_jax.entrypoints.openai_server"),
    ("dummy weights of --model (the backend started)",
     "from mrv2_jax.models.loader import load_model; _, lm, _ = load_model(MODEL, load_format='dummy'); "
     "jax.block_until_ready(jax.tree.leaves(lm))"),
)

CONFIG = "from transformers import AutoConfig; AutoConfig.from_pretrained(resolve_model_path(MODEL))"
ALONE = (
    ("load a config through transformers", CONFIG),
    ("the same, torch kept out", f"keep_torch_out(); {CONFIG}"),
)
ALONE_SETUP = ["from mrv2_jax.models.loader import resolve_model_path",
               "from mrv2_jax.without_torch import keep_torch_out"]


def time_step(before: list[str], statement: str, model: str) -> float:
    code = "\n".join([f"MODEL = {model!r}", *before, "import time", "t = time.perf_counter()", statement,
                      "print(time.perf_counter() - t)"])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=envs.subprocess_env())
    if out.returncode != 0:  # e.g. the server's packages missing on this machine
        print(out.stderr.strip().splitlines()[-1], file=sys.stderr)
        return float("nan")
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b", help="a preset for the dummy-weights row")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    results, before = {}, []
    for name, statement in STEPS:
        results[name] = time_step(before, statement, args.model)
        if results[name] == results[name]:  # a step that failed is left out of the later ones
            before.append(statement)
        print(f"{name:48} {results[name]:7.2f} s", flush=True)
    for name, statement in ALONE:
        results[name] = time_step(ALONE_SETUP, statement, args.model)
        print(f"{name:48} {results[name]:7.2f} s", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()

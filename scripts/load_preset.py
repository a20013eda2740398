"""Load a preset with dummy weights and run one forward pass; print the times (GPU check)."""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from mrv2_jax.bench.environment import describe_environment
from mrv2_jax.models.loader import load_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    spec, lm, _ = load_model(args.model, dtype=args.dtype, load_format="dummy")
    jax.block_until_ready(jax.tree.leaves(lm))
    load_s = time.perf_counter() - t0
    ids = jnp.asarray(np.random.default_rng(0).integers(0, spec.vocab_size, 128), jnp.int32)
    forward = jax.jit(lambda ids: lm.forward_dense(ids, jnp.arange(128, dtype=jnp.int32), jnp.zeros(128, jnp.int32)))
    t0 = time.perf_counter()
    logits = jax.block_until_ready(forward(ids))
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(forward(ids))
        times.append(time.perf_counter() - t0)
    result = {**describe_environment(), "model": args.model, "dtype": args.dtype, "load_s": load_s,
              "first_forward_s_incl_compile": first_s, "forward_128_tokens_ms": 1e3 * float(np.median(times)),
              "logits_finite": bool(jnp.isfinite(logits).all()), "logits_shape": list(logits.shape)}
    print(json.dumps(result, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

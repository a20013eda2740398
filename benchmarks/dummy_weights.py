"""Where making a preset's dummy weights goes (engine start-up's "weights" phase): the abstract
model, then every parameter's init program timed alone (waited for), and the same again with every
program already compiled, so the table splits tracing + compiling from running.

    python -m benchmarks.dummy_weights --model qwen3-0.6b
"""

import argparse
import json
import time

import jax
import numpy as np

from mrv2_jax.engine import compilation_cache
from mrv2_jax.models.decoder import init_kind
from mrv2_jax.models.loader import _dummy_param, init_model, load_hf_config, resolve_dtype, resolve_model_path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    compilation_cache.enable()
    t0 = time.perf_counter()
    jax.block_until_ready(jax.numpy.zeros(()))
    backend_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf_config = load_hf_config(resolve_model_path(args.model))
    config_s = time.perf_counter() - t0
    from flax import nnx

    t0 = time.perf_counter()
    lm = nnx.eval_shape(lambda: init_model(hf_config, resolve_dtype(args.dtype)))
    abstract_s = time.perf_counter() - t0
    params = [(str(path[-1]), node.get_value()) for path, node in nnx.iter_graph(lm) if isinstance(node, nnx.Param)]
    rounds = []
    for _ in range(2):  # the first round traces and compiles (or loads) each program; the second only runs
        times = {}
        for i, (name, value) in enumerate(params):
            t0 = time.perf_counter()
            jax.block_until_ready(_dummy_param(init_kind(name), tuple(value.shape), np.dtype(value.dtype), 0, i))
            times[f"{name} {tuple(value.shape)}"] = time.perf_counter() - t0
        rounds.append(times)
    result = {"backend_start_s": backend_s, "hf_config_s": config_s, "abstract_model_s": abstract_s,
              "first_round_s": sum(rounds[0].values()), "second_round_s": sum(rounds[1].values()),
              "per_parameter_s": {name: [rounds[0][name], rounds[1][name]] for name in rounds[0]}}
    for name in ("backend_start_s", "hf_config_s", "abstract_model_s", "first_round_s", "second_round_s"):
        print(f"{name:18} {result[name]:8.3f}")
    slowest = sorted(result["per_parameter_s"].items(), key=lambda kv: -kv[1][0])[:8]
    for name, (first, second) in slowest:
        print(f"  {name:44} first {first:7.3f} s   again {second:7.3f} s")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()

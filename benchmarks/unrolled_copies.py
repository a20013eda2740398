"""What XLA allocates for one decode step with the layer loop as a scan and unrolled: the step
program's memory analysis and its copies of large buffers (the KV cache above all), per
`--layer-unroll` value.

    python -m benchmarks.unrolled_copies --model qwen3-0.6b --load-format dummy --rows 256 \
        --max-model-len 1024 --max-num-batched-tokens 8192

With the layers unrolled (`--layer-unroll 0`) the H200 asked for ~274 GiB at serving size and its
fused decode returned no tokens, while the CPU tests (jnp references, not the Pallas kernels) give
the scan's tokens. This compiles only the step program of the decode bucket for `--rows` rows
and of fused decode (cheapest sampler variant), once per unroll value, and lists every copy in the optimized program
whose result is at least `--min-mib`: a copy of the stacked KV cache per layer would show there.
"""

import argparse
import json
import re

import numpy as np

from mrv2_jax.bench.environment import describe_environment
from mrv2_jax.entrypoints.cli import add_engine_args, engine_kwargs

SHAPE = re.compile(r"=\s*(\w+)\[([\d,]*)\][^ ]*\s+copy\(")
BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1}


def large_copies(hlo_text: str, min_bytes: int) -> list[dict]:
    """Every `copy` instruction of the optimized HLO whose result is at least min_bytes."""
    found = []
    for line in hlo_text.splitlines():
        m = SHAPE.search(line)
        if not m:
            continue
        dims = [int(d) for d in m.group(2).split(",") if d]
        size = int(np.prod(dims or [1])) * BYTES.get(m.group(1), 4)
        if size >= min_bytes:
            found.append({"dtype": m.group(1), "shape": dims, "mib": size / 2**20, "line": line.strip()[:200]})
    return found


def analyse(unroll: int, args) -> list[dict]:
    """The step program and the fused-decode program of the `--rows` bucket, for one unroll value."""
    from mrv2_jax.llm import LLM

    # The step program follows --layer-unroll alone (no bucket unrolled by the GPU default).
    kwargs = engine_kwargs(args) | {"layer_unroll": unroll, "unrolled_layers_max_tokens": 0, "compile_mode": "lazy"}
    # A cache just big enough for --rows full sequences: two engines (one per unroll value) must fit
    # on one device, and a serving-size cache takes most of it.
    if args.max_model_len and not args.num_gpu_blocks:
        kwargs["num_gpu_blocks"] = args.rows * -(-args.max_model_len // args.block_size)
    llm = LLM(**kwargs)
    runner = llm.engine.runner
    bucket = runner.buckets.pick(args.rows, args.rows)
    programs = {"step": runner.compiled[bucket][1]}
    fused = [b for b in runner.fused_buckets if b.num_reqs >= args.rows]
    if fused:
        programs["fused"] = runner.fused[fused[0]][1]
    kv_bytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in runner.kv_cache)
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes")
    results = []
    for kind, variants in programs.items():
        compiled = variants[0]
        memory = compiled.memory_analysis()
        results.append({"layer_unroll": unroll, "program": kind, "bucket": str(bucket),
                        "kv_cache_gib": kv_bytes / 2**30, **{f: getattr(memory, f, None) for f in fields},
                        "large_copies": large_copies(compiled.as_text(), args.min_mib << 20)})
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--unroll-values", type=int, nargs="+", default=[1, 0])
    p.add_argument("--min-mib", type=int, default=64, help="copies at least this large are listed")
    p.add_argument("--output-json", default=None)
    add_engine_args(p)
    args = p.parse_args(argv)
    results = [r for u in args.unroll_values for r in analyse(u, args)]
    print(f"{'unroll':>6} {'program':>7} {'KV GiB':>7} {'args GiB':>9} {'temp GiB':>9} {'alias GiB':>10} "
          f"{'large copies':>13}")
    for r in results:
        gib = lambda b: (b or 0) / 2**30  # noqa: E731
        print(f"{r['layer_unroll']:>6} {r['program']:>7} {r['kv_cache_gib']:7.2f} "
              f"{gib(r['argument_size_in_bytes']):9.2f} {gib(r['temp_size_in_bytes']):9.2f} "
              f"{gib(r['alias_size_in_bytes']):10.2f} {len(r['large_copies']):>13}")
        for c in r["large_copies"][:8]:
            print(f"         copy {c['dtype']}{c['shape']} {c['mib']:.0f} MiB")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({**describe_environment(), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()

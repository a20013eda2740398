"""Microbenchmark: V2 input preparation and post-update, Pallas kernels vs the jnp reference.

Run on the GPU machine:

    python -m mrv2_jax.bench.prepare_inputs --output-json $OUT/prepare_inputs.json
    python -m mrv2_jax.bench.prepare_inputs --sweep     # also: mixed bucket, block_t x num_splits

State: 1024 slots, max_model_len 4096, block size 16 (a 16.8 MB token table, 256 blocks per
row), random contents. Cases (the batch rows are random distinct slots, in random order):
  decode_r256_t256  256 decode rows, one token each, context 128..3000;
  mixed_r256_t8192  224 decode rows + one 2048-token prefill chunk + 15 chunks of 384 (all
                    with prior context) = 8032 tokens, 16 padding rows, 160 padding tokens.

Ops: ``prepare_inputs`` (input ids, positions, slot mapping, metadata, batch block tables, the
chunk written into the token table) and ``post_update`` (advance num_computed, append the
sampled tokens). Both are idempotent on the state for a fixed batch, so each is timed on
its own, repeated on the state it returns. Two figures per op and implementation, each the
median of --runs calls (after --warmup), each call ended by block_until_ready:
  call_us  one op per jitted call: what a step pays, host dispatch included;
  op_us    --inner ops chained in one jitted call (each on the state the last returned,
           all outputs kept live), divided by --inner: the device time of one op.
The kernel's outputs are checked against the reference's first (``match``). Off the GPU the
kernels run in the Pallas interpreter (a smoke test only: use tiny --runs/--inner).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from mrv2_jax.bench.environment import describe_environment, write_report
from mrv2_jax.runner import prepare
from mrv2_jax.runner.device_state import init_device_state
from pallas_kernels import prepare_inputs as pk

NUM_SLOTS, MAX_MODEL_LEN, BLOCK_SIZE = 1024, 4096, 16
MAX_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE
INTERPRET = jax.default_backend() != "gpu"


def make_case(name: str, seed: int = 0):
    """(state, (idx_mapping, num_scheduled, num_reqs, chunk_tokens), sampled) for a case."""
    rng = np.random.default_rng(seed)
    if name == "decode_r256_t256":
        rows, tokens, chunks = 256, 256, [1] * 256
    elif name == "mixed_r256_t8192":
        rows, tokens, chunks = 256, 8192, [1] * 224 + [2048] + [384] * 15
    else:
        raise ValueError(name)
    num_reqs = len(chunks)
    slots = rng.permutation(NUM_SLOTS)[:num_reqs]
    num_computed = np.zeros(NUM_SLOTS, np.int32)
    prefill_len = np.zeros(NUM_SLOTS, np.int32)
    num_tokens = np.zeros(NUM_SLOTS, np.int32)
    for slot, n in zip(slots, chunks):
        if n == 1:  # decoding: all context computed but the last sampled token
            num_computed[slot] = rng.integers(128, 3000)
            prefill_len[slot] = rng.integers(1, num_computed[slot])
            num_tokens[slot] = num_computed[slot] + 1
        else:  # a prefill chunk after earlier chunks, with more of the prompt to come
            num_computed[slot] = BLOCK_SIZE * rng.integers(1, (MAX_MODEL_LEN - n - 16) // BLOCK_SIZE)
            prefill_len[slot] = num_tokens[slot] = num_computed[slot] + n + 8
    state = init_device_state(NUM_SLOTS, MAX_MODEL_LEN, MAX_BLOCKS)._replace(
        token_ids=jnp.asarray(rng.integers(0, 150_000, (NUM_SLOTS, MAX_MODEL_LEN + 1)), jnp.int32),
        num_tokens=jnp.asarray(num_tokens), prefill_len=jnp.asarray(prefill_len),
        num_computed=jnp.asarray(num_computed),
        block_table=jnp.asarray(rng.permutation(NUM_SLOTS * MAX_BLOCKS).reshape(NUM_SLOTS, MAX_BLOCKS),
                                jnp.int32))
    idx = np.zeros(rows, np.int32)
    idx[:num_reqs] = slots
    counts = np.zeros(rows, np.int32)
    counts[:num_reqs] = chunks
    batch = (jnp.asarray(idx), jnp.asarray(counts), jnp.int32(num_reqs),
             jnp.asarray(rng.integers(0, 150_000, tokens), jnp.int32))
    sampled = jnp.asarray(rng.integers(0, 150_000, rows), jnp.int32)
    return state, batch, sampled


def chained(op, inner):
    """``inner`` dependent calls of ``op(state) -> (state, outputs)`` in one jitted function
    that donates the state; every call's outputs are returned, so none is dead code."""
    def run(state):
        outs = []
        for _ in range(inner):  # unrolled: each call reads the state the previous one wrote
            state, out = op(state)
            outs.append(out)
        return state, outs
    return jax.jit(run, donate_argnums=0)


def time_op(op, state, inner, runs, warmup):
    """Median seconds per op over ``runs`` calls of ``inner`` chained ops."""
    fn = chained(op, inner)
    state = jax.tree.map(jnp.copy, state)  # the caller's state is not donated away
    for _ in range(warmup):
        state, out = fn(state)
        jax.block_until_ready(out)
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        state, out = fn(state)
        jax.block_until_ready((state, out))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) / inner


def ops_for(impl, batch, sampled, inputs, tuning):
    """(prepare op, post_update op) of an implementation, as state -> (state, outputs)."""
    if impl == "kernel":
        prep = functools.partial(pk.prepare_inputs, interpret=INTERPRET, **tuning)
        post = functools.partial(pk.post_update, interpret=INTERPRET)
    else:
        prep, post = prepare.prepare_inputs, prepare.post_update
    idx, _, num_reqs, _ = batch
    return {
        "prepare_inputs": lambda s: prep(s, *batch, BLOCK_SIZE),
        "post_update": lambda s: (post(s, idx, num_reqs, inputs, sampled), ()),
    }


def check_match(state, batch, sampled, tuning):
    """Whether the kernels reproduce the reference exactly; also returns the reference's
    StepInputs (post_update's input in the timings)."""
    idx, _, num_reqs, _ = batch
    results = []
    for prep, post in ((prepare.prepare_inputs, prepare.post_update),
                       (functools.partial(pk.prepare_inputs, interpret=INTERPRET, **tuning),
                        functools.partial(pk.post_update, interpret=INTERPRET))):
        new_state, inputs = jax.jit(prep, static_argnums=5)(state, *batch, BLOCK_SIZE)
        after = jax.jit(post)(new_state, idx, num_reqs, inputs, sampled)
        results.append((new_state, inputs, after))
    want, got = results
    match = all(bool(jnp.array_equal(g, w)) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    return match, want[1]


def run_case(name, args, tuning):
    state, batch, sampled = make_case(name)
    T, R = batch[3].shape[0], batch[0].shape[0]
    resolved = pk.default_tuning(T, R) | tuning
    match, inputs = check_match(state, batch, sampled, resolved)
    result = dict(case=name, num_tokens=T, num_rows=R, tuning=resolved, match=match)
    for impl in ("kernel", "reference"):
        for op_name, op in ops_for(impl, batch, sampled, inputs, resolved).items():
            call = time_op(op, state, 1, args.runs, args.warmup)
            chain = time_op(op, state, args.inner, args.runs, args.warmup)
            result[f"{op_name}/{impl}"] = dict(call_us=call * 1e6, op_us=chain * 1e6)
            print(f"{name:18s} {op_name:15s} {impl:9s} call {call * 1e6:8.1f} us   "
                  f"op {chain * 1e6:8.1f} us", flush=True)
    return result


def run_sweep(args):
    state, batch, sampled = make_case("mixed_r256_t8192")
    rows = []
    for block_t in (64, 128, 256, 512, 1024):
        for num_splits in (1, 2, 4, 8, 16):
            for num_warps in (4, 8) if block_t >= 512 else (4,):
                tuning = dict(block_t=block_t, num_splits=num_splits, num_warps=num_warps)
                op = ops_for("kernel", batch, sampled, None, tuning)["prepare_inputs"]
                us = time_op(op, state, args.inner, args.runs, args.warmup) * 1e6
                rows.append(dict(tuning=tuning, op_us=us))
                print(f"sweep mixed prepare_inputs {tuning} op {us:8.1f} us", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", default=["decode_r256_t256", "mixed_r256_t8192"])
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--inner", type=int, default=20, help="ops chained per call for op_us")
    p.add_argument("--block-t", type=int, default=None)
    p.add_argument("--num-splits", type=int, default=None)
    p.add_argument("--num-warps", type=int, default=None)
    p.add_argument("--sweep", action="store_true", help="also sweep the mixed bucket's tuning")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    given = dict(block_t=args.block_t, num_splits=args.num_splits, num_warps=args.num_warps)
    tuning = {k: v for k, v in given.items() if v is not None}

    print(f"prepare_inputs: {NUM_SLOTS} slots, max_model_len {MAX_MODEL_LEN}, block size "
          f"{BLOCK_SIZE} on {jax.devices()[0].device_kind}")
    report = {**describe_environment(), "num_slots": NUM_SLOTS, "max_model_len": MAX_MODEL_LEN,
              "block_size": BLOCK_SIZE, "runs": args.runs, "inner": args.inner,
              "results": [run_case(name, args, tuning) for name in args.cases]}
    if args.sweep:
        report["sweep"] = run_sweep(args)
    if args.output_json:
        write_report(report, args.output_json)
    return report


if __name__ == "__main__":
    main()

"""Host cost of one decode step's jitted call, taken apart.

    python -m benchmarks.dispatch_cost --model qwen3-0.6b --load-format dummy --rows 1
    python -m benchmarks.dispatch_cost --model qwen3-0.6b --load-format dummy --rows 128 --admit 10

Runs `--rows` requests into steady decode, keeps one decode dispatch (the compiled step and its
packed input buffer), then calls that step again and again on the runner's live state, each way
below from a copy of the state the capture left (every call advances the captured rows by one
token, so `--calls` must leave them inside `--max-model-len`: it is checked). With `--admit N`,
the step kept is instead the one that admits N new prompts of `--input-len` tokens beside the
`--rows` decoding rows (what a server's prompt step is; each call prefills them again):

  numpy packed    a fresh host buffer per call, as the engine sends it (a host->device copy and
                  a new device allocation every call)
  device packed   the same device-resident buffer every call (no copy; the argument's address
                  never changes, so XLA's command buffers need no update for it)
  prefetched      numpy packed, put on the device one call ahead (`jax.device_put`), so the
                  transfer of call N+1 is under way while call N is made
  put, held       numpy packed, put on the device by a transfer of its own inside the timed call,
                  and kept alive until the next call's is made (as a runner holding its last
                  packed input would): the new buffer cannot take the chunk the old one leaves
  copied, held    the same, the transfer made by a jitted copy (a call of jax's C++ fast path
                  instead of `jax.device_put`'s Python)
  pinned          numpy packed, copied into pinned host memory first, then onto the device
                  (GPUs only: a DMA from page-locked memory need not wait for the device; left
                  out under XLA_PYTHON_CLIENT_ALLOCATOR=vmm, where jax 0.11.2 crashed in it)
  twins (GPUs)    numpy packed, calls alternating between two loaded copies of the same
                  executable: each copy keeps its own recorded command buffers, and the result
                  buffers it sees recur from its own call before (the engine's results alternate
                  between two sets of addresses, as each call's result is still alive when the
                  next call is made)
  device twins    the twins, called on the same device-resident buffer every call: no
                  allocation a recorded command uses moves, so no command buffer is updated
                  (what a step with stable input and result addresses would cost)
  hollow          a program with the step's arguments, donation and results that computes nothing
                  (the donated state returned as it came, the result zeros), on the device-resident
                  input: the floor jax and PJRT put under a call of this signature, before any of
                  the step's own kernels, thunks or command buffers
  among decodes   (`--admit` only) numpy packed, each timed call after 4 calls of the decode step
                  that ran just before the admission, as a server interleaves them: what the
                  prompt step costs when other programs ran since its last call (its
                  `pipelined ms` is the wall time of the four decode calls and the prompt step's)

For each: `call ms`, the host time of the call alone, each call waited for before the next
(nothing queued in front of it); `pipelined ms`, wall time per call when calls are issued back
to back and waited for once at the end (the device's pace if the host keeps ahead). Run it
under different XLA_FLAGS to see what the host pays for (command buffers, loops, slices).

Then, per group of the step's arguments and results, how many of its device buffers sit at
another address than in the call before (median over the calls), with the packed input put on
the device fresh for every call: XLA records a command buffer again whenever an allocation it
uses moved, and its log (`TF_CPP_VMODULE=command_buffer_thunk=3`) counts them (`updated_allocs`);
what this table does not account for is XLA's own temp buffer.
"""

import argparse
import statistics
import sys
import time
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.command_buffer_updates import kernel_launches
from mrv2_jax import envs
from mrv2_jax.bench.capture import DecodeStepCapture, Dispatch
from mrv2_jax.bench.dataset import random_prompts
from mrv2_jax.bench.environment import flag_probe_report
from mrv2_jax.bench.step_log import StepLog, attach_hooks
from mrv2_jax.entrypoints.cli import add_engine_args, engine_kwargs
from mrv2_jax.runner.base import donated_arguments
from mrv2_jax.runner.step_twins import load_twin
from mrv2_jax.sample import slot_state


def one_step_engine(args):
    """The engine of the parsed engine arguments, one decode step per call, its programs compiled."""
    from mrv2_jax.llm import LLM

    kwargs = engine_kwargs(args)
    kwargs["max_fused_steps"] = 1
    llm = LLM(**kwargs)
    llm.wait_for_compiles()
    return llm


def capture_decode_dispatch(llm, rows: int, output_len: int, input_len: int):
    """(compiled step, packed numpy buffer) of a mid-run decode step with `rows` rows."""
    from mrv2_jax.sampling_params import SamplingParams

    capture = DecodeStepCapture(llm.engine.runner, rows, which=output_len // 2)
    attach_hooks(llm.engine, capture)
    prompts = random_prompts(rows, input_len, 0.0, llm.model_state.vocab_size, 0)
    llm.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True), use_tqdm=False)
    attach_hooks(llm.engine, None)
    if not capture.captured:
        raise SystemExit("no steady decode step was seen: raise --output-len")
    return capture.dispatch.compiled, capture.dispatch.packed


class PromptStepCapture(StepLog):
    """Keeps the first dispatch of a step that admits new requests beside running ones."""

    def __init__(self):
        super().__init__()
        self.dispatch = None
        self.decode = None  # the last decode-only dispatch before the admission
        self.armed = False  # set once the first prompts are in (their chunks admit beside others too)
        self._admitting = self._decoding = False

    def step_scheduled(self, scheduled) -> None:
        super().step_scheduled(scheduled)
        new = len(scheduled.new_reqs)  # admitted beside rows already running
        self._admitting = self.armed and 0 < new < len(scheduled.num_scheduled_tokens)
        self._decoding = scheduled.num_prefill_tokens == 0

    def dispatched(self, runner, compiled, packed, call_s: float) -> None:
        if self._admitting and self.dispatch is None:
            self.dispatch = Dispatch(runner, compiled, packed)
        elif self._decoding and self.dispatch is None:
            self.decode = Dispatch(runner, compiled, packed)


def capture_prompt_dispatch(llm, rows: int, admit: int, input_len: int, output_len: int):
    """(the step that admits `admit` prompts of `input_len` tokens while `rows` requests decode,
    the decode step before it), each a Dispatch; the rows get `output_len` tokens, the prompts
    come at half."""
    from mrv2_jax.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    vocab = llm.model_state.vocab_size
    for prompt in random_prompts(rows, input_len, 0.0, vocab, 0):
        llm.add_request(prompt, params)
    capture = PromptStepCapture()
    attach_hooks(llm.engine, capture)
    for _ in range(output_len // 2):
        llm.step()
    capture.armed = True
    for prompt in random_prompts(admit, input_len, 0.0, vocab, 1):
        llm.add_request(prompt, params)
    while llm.engine.has_work():
        llm.step()
    attach_hooks(llm.engine, None)
    if capture.dispatch is None or capture.decode is None:
        raise SystemExit("no step admitted the prompts beside decoding rows: raise --output-len")
    return capture.dispatch, capture.decode


def replay_room(runner, compiled, packed, max_model_len: int) -> int:
    """How many more calls of the captured step its rows have room for. Each call advances its
    rows by one token on the device (the step reads their lengths from the runner's state), and a
    row past max_model_len indexes past its block table: out of bounds on a GPU."""
    layout = next(layout for layout, programs in runner.compiled.values() if compiled in programs)
    slots = layout.view(packed, "idx_mapping")[: int(layout.view(packed, "num_reqs"))]
    return max_model_len - int(np.asarray(runner.state.num_tokens)[slots].max())


def hollow_of(runner, compiled, packed):
    """A compiled program with `compiled`'s arguments, donation and results that computes nothing:
    its donated arguments come back as they went in (aliased, no copy), its result is zeros. It keeps
    the arguments it does not read (the weights, the sampler tables), as the step's call passes them."""
    result_info = compiled.out_info[3]  # (kv_cache, state, counts, result, spec_state[, packed])

    def hollow(param_leaves, kv_cache, state, counts, tables, packed, spec_params, spec_state):
        result = jax.tree.map(lambda info: jnp.zeros(info.shape, info.dtype), result_info)
        outputs = (kv_cache, state, counts, result, spec_state)
        return (*outputs, packed) if runner.returns_its_input else outputs

    counts, tables = slot_state.split(runner.slot_state)
    packed_info = jax.ShapeDtypeStruct(packed.shape, packed.dtype)
    carried = 2  # kv_cache, state
    return jax.jit(hollow, donate_argnums=donated_arguments(carried), keep_unused=True).lower(
        runner.params.leaves, runner.kv_cache, runner.state, counts, tables, packed_info, runner.spec_params,
        runner.spec_state).compile()


def prefetching(make):
    """`make`, called one call ahead: returns what the call before started."""
    ahead = [make()]

    def next_one():
        ahead.append(make())
        return ahead.pop(0)
    return next_one


def phase_mark(name: str) -> None:
    """A line in stderr between XLA's log lines, to count its command-buffer updates per phase."""
    print(f"=== phase {name}", file=sys.stderr, flush=True)


def alternating(runner, programs: list):
    """A call of the step that takes `programs` in turn."""
    turn = iter(range(10**9))
    return lambda packed: runner.call_step(programs[next(turn) % len(programs)], packed)


def put_and_hold(step, put=jax.device_put):
    """The step called on its packed input put on the device first (by `put`), each call's buffer
    held until the next call's exists."""
    held = []

    def call(packed):
        on_device = put(packed)
        held[:] = [on_device]  # the previous call's buffer is released only now
        return step(on_device)

    return call


def time_calls(call, make_packed, calls: int, before=None) -> dict:
    """`before()`, if given, runs ahead of each call: untimed for `call_ms`, inside the wall time
    of `pipelined_ms`."""
    jax.block_until_ready(call(make_packed()))
    host = []
    for _ in range(calls):
        if before is not None:
            before()
        packed = make_packed()
        start = time.perf_counter()
        result = call(packed)
        host.append(time.perf_counter() - start)
        jax.block_until_ready(result)
    start = time.perf_counter()
    for _ in range(calls):
        if before is not None:
            before()
        result = call(make_packed())
    jax.block_until_ready(result)
    pipelined = (time.perf_counter() - start) / calls
    return {"call_ms": 1e3 * statistics.median(host), "call_p90_ms": 1e3 * sorted(host)[int(0.9 * (calls - 1))],
            "pipelined_ms": 1e3 * pipelined}


def moved_buffers(runner, compiled, packed, calls: int) -> dict:
    """{"arguments"|"results": {group: median count of buffers that moved since the call before}}."""
    def addresses(groups: dict) -> dict:
        return {name: [x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)] for name, tree in groups.items()}

    def moved(now: dict, before: dict) -> dict:
        return {name: sum(a != b for a, b in zip(now[name], before[name])) for name in now}

    counts = {"arguments": defaultdict(list), "results": defaultdict(list)}
    before = None
    for _ in range(calls + 1):
        fresh = jax.device_put(packed)
        args = addresses({"params": runner.params.leaves, "kv_cache": runner.kv_cache, "state": runner.state,
                          "slot_state": runner.slot_state, "packed input": fresh,
                          "spec_params": runner.spec_params, "spec_state": runner.spec_state})
        result = runner.call_step(compiled, fresh)
        jax.block_until_ready(result)
        results = addresses({"kv_cache": runner.kv_cache, "state": runner.state, "slot_state": runner.slot_state,
                             "result": result, "spec_state": runner.spec_state})
        if before is not None:
            for kind, now in (("arguments", args), ("results", results)):
                for name, n in moved(now, before[kind]).items():
                    counts[kind][name].append(n)
        before = {"arguments": args, "results": results}
    return {kind: {name: statistics.median(ns) for name, ns in groups.items()} for kind, groups in counts.items()}


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--admit", type=int, default=0,
                   help="time the step that admits this many prompts beside --rows decoding rows (0: a decode step)")
    p.add_argument("--output-json", default=None)
    add_engine_args(p)
    args = p.parse_args(argv)
    llm = one_step_engine(args)
    runner = llm.engine.runner
    decode = None
    if args.admit:
        prompt, decode = capture_prompt_dispatch(llm, args.rows, args.admit, args.input_len, args.output_len)
        compiled, packed = prompt.compiled, prompt.packed
    else:
        compiled, packed = capture_decode_dispatch(llm, args.rows, args.output_len, args.input_len)
    # Every way replays the step from the captured state, and no way walks a row past max_model_len.
    calls_per_way = (2 * args.calls + 1) * (5 if decode is not None else 1)  # among decodes: 4 decodes a call
    room = replay_room(runner, compiled, packed, llm.config.max_model_len)
    if calls_per_way > room:
        raise SystemExit(f"--calls {args.calls} advances the captured rows by {calls_per_way} tokens per way, but they "
                         f"have room for {room} before --max-model-len {llm.config.max_model_len}: lower --calls "
                         "or --output-len, or raise --max-model-len")
    captured_state = jax.tree.map(jnp.copy, runner.state)
    on_device = jax.device_put(packed)
    step = alternating(runner, [compiled])
    ways = [("numpy packed", step, lambda: np.array(packed)),
            ("device packed", step, lambda: on_device),
            ("prefetched", step, prefetching(lambda: jax.device_put(np.array(packed)))),
            ("put, held", put_and_hold(step), lambda: np.array(packed)),
            ("copied, held", put_and_hold(step, jax.jit(jnp.copy)), lambda: np.array(packed)),
            ("hollow", alternating(runner, [hollow_of(runner, compiled, packed)]), lambda: on_device)]
    if jax.default_backend() == "gpu":
        device = jax.devices()[0]
        pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        on_gpu = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
        if envs.get_xla_allocator() == "vmm":
            print("pinned: left out under the VMM allocator (the process crashed in it)", file=sys.stderr)
        else:
            ways.append(("pinned", step, lambda: jax.device_put(jax.device_put(np.array(packed), pinned), on_gpu)))
        # (XLA:CPU cannot serialize the step's executables, so no twin there)
        twins = alternating(runner, [compiled, load_twin(compiled)])
        ways.append(("twins", twins, lambda: np.array(packed)))
        ways.append(("device twins", twins, lambda: on_device))
    def from_the_capture():
        runner.state = jax.tree.map(jnp.copy, captured_state)

    results = {}
    for name, call, make_packed in ways:
        phase_mark(name)
        from_the_capture()
        results[name] = time_calls(call, make_packed, args.calls)
    if decode is not None:
        def four_decodes():
            for _ in range(4):
                runner.call_step(decode.compiled, np.array(decode.packed))
        phase_mark("among decodes")
        from_the_capture()
        results["among decodes"] = time_calls(step, lambda: np.array(packed), args.calls, before=four_decodes)
    phase_mark("moved buffers")
    bucket = next((b for b, (_, programs) in runner.compiled.items() if compiled in programs), None)
    unrolled = bucket is not None and runner.unrolls_layers(bucket)
    launches = kernel_launches(compiled)
    print(f"rows {args.rows}, prompts admitted {args.admit}, bucket {bucket} (layers unrolled: {unrolled}), "
          f"{launches} kernel launches in the program, XLA_FLAGS={envs.get_xla_flags()}")
    print(f"{'packed input':16} {'call ms':>8} {'call p90':>9} {'pipelined ms':>13}")
    for name, r in results.items():
        print(f"{name:16} {r['call_ms']:8.3f} {r['call_p90_ms']:9.3f} {r['pipelined_ms']:13.3f}")
    results["kernel_launches"] = launches
    results["bucket"] = None if bucket is None else {"tokens": bucket.num_tokens, "rows": bucket.num_reqs,
                                                     "layers_unrolled": unrolled}
    from_the_capture()
    results["buffers moved per call"] = moves = moved_buffers(runner, compiled, packed, min(args.calls, 20))
    for kind, groups in moves.items():
        print(f"{kind} moved per call: " + ", ".join(f"{name} {n:g}" for name, n in groups.items()))
    return flag_probe_report(args, results, args.output_json)


if __name__ == "__main__":
    main()

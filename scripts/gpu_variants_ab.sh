#!/usr/bin/env bash
# Sampler variants and XLA conditionals in an S1 step (temperature 1, as bench compare), one
# machine, arms one after another, each bounded so that the call fits what is left:
#   plain      default variants (greedy, plain, all): a temperature-only batch runs no conditional
#   two        --sampler-variants greedy,all (before 2026-11-30: conditionals in every step)
#   b1-plain   batch 1 (10 prompts, one seat, as compare-batch1) with the default variants
#   plain-f256 default variants, fused decode compiled up to 256 rows
#   two-cond   greedy,all with +CONDITIONAL (measured in session 6: XLA records conditionals in
#              its command buffers by default already, `benchmarks.conditionals`; kept for completeness)
set -uo pipefail
OUT=${OUT:-/tmp/mrv2_out}; mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
S1=(--model qwen3-0.6b --load-format dummy --input-len 128 --output-len 512 --num-prompts 512 --max-num-seqs 256
    --max-num-batched-tokens 8192 --max-model-len 768 --temperature 1.0 --warmup-prompts 32)
arm() {  # name, seconds, env/args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" env "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?: $(grep '^Throughput' "$OUT/$name.log")"
}
arm plain 110 python3 -m mrv2_jax.bench.throughput "${S1[@]}" --output-json "$OUT/variants_plain.json"
arm two 70 python3 -m mrv2_jax.bench.throughput "${S1[@]}" --sampler-variants greedy,all --output-json "$OUT/variants_two.json"
arm b1-plain 70 python3 -m mrv2_jax.bench.throughput "${S1[@]}" --num-prompts 10 --max-num-seqs 1 --warmup-prompts 4 \
  --output-json "$OUT/variants_b1_plain.json"
arm plain-f256 80 python3 -m mrv2_jax.bench.throughput "${S1[@]}" --max-fused-rows 256 --output-json "$OUT/variants_plain_f256.json"
arm two-cond 80 XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL python3 -m mrv2_jax.bench.throughput "${S1[@]}" \
  --sampler-variants greedy,all --output-json "$OUT/variants_two_cond.json"

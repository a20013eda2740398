#!/usr/bin/env bash
# Downloads, into .whl/ (git-ignored), what `gpu_check.sh structured` needs beside the vLLM payload:
# outlines-core and llguidance for mrv2-jax's constraints, and lm-format-enforcer + interegular, which
# vLLM 0.22.1 imports to check any structured request and its payload lacks. Needs PyPI; ~12 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  outlines-core==0.2.14 llguidance==1.9.1 lm-format-enforcer==0.11.3 interegular==0.3.3
du -sh .whl && ls .whl

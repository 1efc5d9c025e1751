#!/usr/bin/env bash
# Pack a kernel cache directory (default: $MIXGEMM_CACHE_DIR or ~/.cache/mixgemm) into
# .gpu/cache.tgz, the form tools/gpu_session.sh unpacks on the GPU machine.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
src=${1:-${MIXGEMM_CACHE_DIR:-$HOME/.cache/mixgemm}}
mkdir -p .gpu
tar czf .gpu/cache.tgz -C "$src" kernels
ls -la .gpu/cache.tgz

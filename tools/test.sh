#!/usr/bin/env bash
# Builds kvt (installing what it needs) and runs every test. GPU tests skip themselves with a
# reason when there is no CUDA device. Extra arguments go to ctest (e.g. -L gpu, -R Pool).
# With CI=true or KVT_FUZZ=1 the fuzz targets then run too (tools/ci/fuzz.sh: a few minutes).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/tools/setup.sh"
cd "${KVT_BUILD_DIR:-$root/build}"
ctest --output-on-failure --timeout 300 -j "${KVT_TEST_JOBS:-2}" "$@"
if [[ "${CI:-}" == "true" || "${KVT_FUZZ:-0}" == "1" ]]; then
  "$root/tools/ci/fuzz.sh"
fi

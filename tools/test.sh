#!/usr/bin/env bash
# Builds kvt (installing what it needs) and runs every test. GPU tests skip themselves with a
# reason when there is no CUDA device. Extra arguments go to ctest (e.g. -L gpu, -R Pool).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/tools/setup.sh"
cd "${KVT_BUILD_DIR:-$root/build}"
ctest --output-on-failure --timeout 300 -j "${KVT_TEST_JOBS:-2}" "$@"

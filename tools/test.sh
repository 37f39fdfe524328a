#!/usr/bin/env bash
# Builds kvt (installing what it needs) and runs every test. GPU tests skip themselves with a
# reason when there is no CUDA device. Extra arguments go to ctest (e.g. -L gpu, -R Pool).
# With CI=true or KVT_SANITIZE_TESTS=1 the tests then run under the sanitizers too
# (tools/ci/sanitize.sh: ASan+UBSan on every suite that needs no GPU, TSan on the engine and
# control plane); with CI=true or KVT_FUZZ=1 the fuzz targets run (tools/ci/fuzz.sh), in the
# same clang build folder as the ASan run.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/tools/setup.sh"
cd "${KVT_BUILD_DIR:-$root/build}"
ctest --output-on-failure --timeout 300 -j "${KVT_TEST_JOBS:-2}" "$@"
if [[ "${CI:-}" == "true" || "${KVT_SANITIZE_TESTS:-0}" == "1" ]]; then
  "$root/tools/ci/sanitize.sh"
fi
if [[ "${CI:-}" == "true" || "${KVT_FUZZ:-0}" == "1" ]]; then
  "$root/tools/ci/fuzz.sh"
fi

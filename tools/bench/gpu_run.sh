#!/usr/bin/env bash
# One device-machine run of the kernels work: library check, CPU + GPU kernel tests, the
# kernels benchmark (with the tuning sweep), and a memcheck pass over the GPU tests.
# Usage (from the repo root, binaries copied into .device/ beforehand):
#   tools/bench/gpu_run.sh .device "$OUT"
set -uo pipefail
bin=${1:-.device}
out=${2:-/tmp/kvt-out}
mkdir -p "$out"
echo "== ldd"; for b in kernels_test kernels_gpu_test kvt-bench; do
  ldd "$bin/$b" | grep 'not found' && echo "MISSING LIBS for $b"; done
echo "== card"; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu \
  --format=csv 2>&1 | tee "$out/card.txt"
echo "== cpu tests"; timeout 120 "$bin/kernels_test" --gtest_brief=1 2>&1 | tail -3
echo "== gpu tests"; timeout 180 "$bin/kernels_gpu_test" --gtest_brief=1 2>&1 |
  tee "$out/gpu_test.log" | tail -25
echo "== bench"; timeout 300 "$bin/kvt-bench" kernels --sweep --json "$out/kernels.json" 2>&1 |
  tee "$out/bench.log"
if [ "${KVT_MEMCHECK:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  echo "== memcheck"
  timeout 90 compute-sanitizer --tool memcheck --print-limit 5 "$bin/kernels_gpu_test" \
    --gtest_brief=1 --gtest_filter='Layouts/PageCopyGpuTest.MatchesCpuReference/*:PageCopyGpuRandomTest.*:Pairs/*:TiledCopyGpuTest.*:PatternGpuTest.*:PackGpuTest.*' \
    2>&1 | tail -8
fi

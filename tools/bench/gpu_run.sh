#!/usr/bin/env bash
# A GPU machine's full check: library check, the CPU kernel tests, every GPU test binary present,
# the transfer benchmark on CUDA pools (cuda_ipc, then UCX's staged path), the kernels benchmark
# (with the tuning sweep) and, if time is left, a memcheck pass over the kernel GPU tests.
# Every step has a time cap and the whole run a budget (KVT_BUDGET_S, default 360 s), so the
# JSON of the steps that ran is in OUT_DIR even when a later step hangs.
# Usage (from the repo root): tools/bench/gpu_run.sh BIN_DIR OUT_DIR
#   BIN_DIR: a folder holding kvt-bench and the test binaries (copied out of a build tree);
#   OUT_DIR: where the JSON, logs and card.txt go (created if missing).
# Skip steps with KVT_RUN_TESTS=0, KVT_RUN_TRANSFER=0, KVT_RUN_STAGED=0, KVT_RUN_KERNELS=0,
# KVT_MEMCHECK=0.
set -uo pipefail
if (($# != 2)); then
  echo "usage: $0 BIN_DIR OUT_DIR" >&2
  exit 2
fi
bin=$1
out=$2
mkdir -p "$out"
deadline=$((SECONDS + ${KVT_BUDGET_S:-360}))

# cap N: N, or the seconds left before the deadline if fewer (0 when under 10 s are left).
cap() {
  local want=$1 left=$((deadline - SECONDS))
  ((left < want)) && want=$left
  ((want < 10)) && want=0
  echo "$want"
}
# step NAME CAP CMD...: runs CMD under `timeout` with the capped time, or says it was skipped
# (its own lines go to stderr, so they survive a `| tail` on the command's output).
step() {
  local name=$1 t
  t=$(cap "$2")
  shift 2
  if ((t == 0)); then
    echo "== $name: SKIPPED (budget spent)" >&2
    return 0
  fi
  echo "== $name (cap ${t}s, $((deadline - SECONDS))s of budget left)" >&2
  local start=$SECONDS
  timeout -k 5 "$t" "$@"
  local rc=$?
  echo "== $name: rc $rc in $((SECONDS - start))s" >&2
  return 0
}

echo "== ldd"
for b in "$bin"/*; do
  [ -x "$b" ] && [ -f "$b" ] || continue
  ldd "$b" 2>/dev/null | grep 'not found' && echo "MISSING LIBS for $b"
done
echo "== card"; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu \
  --format=csv 2>&1 | tee "$out/card.txt"

if [ "${KVT_RUN_TESTS:-1}" = 1 ]; then
  [ -x "$bin/kernels_test" ] &&
    step "cpu tests" 60 "$bin/kernels_test" --gtest_brief=1 2>&1 | tail -3
  for t in "$bin"/*_gpu_test; do
    [ -x "$t" ] || continue
    name=$(basename "$t")
    # The kernel tests sweep every layout and dtype against the CPU reference: minutes.
    limit=60
    [ "$name" = kernels_gpu_test ] && limit=240
    step "$name" "$limit" "$t" --gtest_brief=1 2>&1 | tee "$out/$name.log" | tail -25
  done
fi

if [ "${KVT_RUN_TRANSFER:-1}" = 1 ]; then
  # The control threads busy-polling (as kvt-agent runs on CUDA pools), then sleeping between
  # frames (the library's default).
  step "transfer cuda_ipc" 120 "$bin/kvt-bench" transfer --backend cuda_ipc --iters 20 --verify \
    --control-busy-poll-us 1000 --layerwise-requests 30 --json "$out/transfer-cuda-ipc.json" 2>&1 |
    tee "$out/transfer-cuda-ipc.log"
  step "transfer cuda_ipc, control threads sleeping" 120 "$bin/kvt-bench" transfer \
    --backend cuda_ipc --iters 20 --verify --layerwise-requests 30 \
    --json "$out/transfer-cuda-ipc-sleeping.json" 2>&1 | tee "$out/transfer-cuda-ipc-sleeping.log"
  # The control plane alone on the same host: the floor under the to-prefill and done phases.
  step "control plane" 60 "$bin/kvt-bench" control --json "$out/control.json" 2>&1 |
    tee "$out/control.log"
fi
if [ "${KVT_RUN_STAGED:-1}" = 1 ]; then
  step "transfer ucx staged" 120 "$bin/kvt-bench" transfer --backend ucx --device cuda:0 \
    --ucx-cuda-mode staged --iters 5 --warmup 1 --latency-requests 200 --layerwise-requests 3 \
    --control-busy-poll-us 1000 \
    --verify --json "$out/transfer-ucx-staged.json" 2>&1 | tee "$out/transfer-ucx-staged.log"
fi

if [ "${KVT_RUN_KERNELS:-1}" = 1 ]; then
  step "kernels bench" 120 "$bin/kvt-bench" kernels --sweep --json "$out/kernels.json" 2>&1 |
    tee "$out/bench.log"
fi

if [ "${KVT_MEMCHECK:-1}" = 1 ] && command -v compute-sanitizer >/dev/null &&
  [ -x "$bin/kernels_gpu_test" ]; then
  step "memcheck" 90 compute-sanitizer --tool memcheck --print-limit 5 "$bin/kernels_gpu_test" \
    --gtest_brief=1 --gtest_filter='Layouts/PageCopyGpuTest.MatchesCpuReference/*:PageCopyGpuRandomTest.*:Pairs/*:TiledCopyGpuTest.*:PatternGpuTest.*:PackGpuTest.*' \
    2>&1 | tail -8
fi
echo "== done in ${SECONDS}s"

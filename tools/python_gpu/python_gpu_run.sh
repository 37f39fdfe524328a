#!/usr/bin/env bash
# On a GPU machine with Python 3.12 and torch: builds the `kvt` Python package against the kvt
# prepared by tools/python_gpu/python_gpu.sh, runs python/tests (test_gpu.py included: CUDA pools
# over cuda_ipc and staged UCX in two processes) and python/bench/bench_python.py.
# Usage (from the repository root): tools/python_gpu/python_gpu_run.sh DEST OUT_DIR
#   DEST: the folder python_gpu.sh prepared (e.g. build-gpu-kit);
#   OUT_DIR: where pytest.log, junit.xml, bench.json, bench.log and card.txt go.
# KVT_PY_BUILD: the extension's build folder (default /tmp/kvt-python-build);
# KVT_RUN_OTHER_TESTS=0 runs only test_gpu.py; KVT_RUN_BENCH=0 skips the benchmark;
# KVT_BENCH_ARGS adds arguments to it.
set -uo pipefail
if (($# != 2)); then
  echo "usage: $0 DEST OUT_DIR" >&2
  exit 2
fi
dest=$(cd "$1" && pwd) || exit 2
out=$2
mkdir -p "$out"
build=${KVT_PY_BUILD:-/tmp/kvt-python-build}
python=$(command -v python3)
export NCCL_NVLS_ENABLE=0

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv \
  2>&1 | tee "$out/card.txt"
"$python" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
  "cuda", torch.cuda.is_available())' 2>&1 | tee -a "$out/card.txt"
for tool in g++ cmake ninja nvcc pkg-config; do
  printf '%s: %s\n' "$tool" "$(command -v "$tool" || echo missing)"
done
ldd "$dest/kvt/bin/kvt-bench" | grep 'not found' && echo "kvt-bench: MISSING LIBRARIES"

echo "== build the extension"
pybind11_dir=$("$python" -c 'import pybind11; print(pybind11.get_cmake_dir())') || {
  echo "pybind11 is not importable by $python: pip install pybind11" >&2
  exit 1
}
cuda_root=()
[ -d /usr/local/cuda ] && cuda_root=(-DCUDAToolkit_ROOT=/usr/local/cuda)
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
rm -rf "$build"
cmake -S tools/python_gpu/python_ext -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$dest/kvt;$dest/deps" -DPython_EXECUTABLE="$python" \
  -Dpybind11_DIR="$pybind11_dir" "${cuda_root[@]}" 2>&1 | tee "$out/build.log" | tail -15 ||
  exit 1
cmake --build "$build" -j "$(nproc)" 2>&1 | tee -a "$out/build.log" | tail -5
[ "${PIPESTATUS[0]}" = 0 ] || { echo "the extension did not build (see build.log)"; exit 1; }
export PYTHONPATH=$build/python KVT_BOOTSTRAP=$dest/kvt/bin/kvt-bootstrap PYTHONDONTWRITEBYTECODE=1
"$python" -c 'import kvt; print("kvt", kvt.__version__, kvt.__file__, kvt.backend_names())' ||
  exit 1

# The GPU tests first, then the rest; a test that runs past 150 s dumps its threads' stacks,
# and each pytest run is stopped after 360 s (the tests bound their own waits well inside it).
tests_rc=0
for tests in python/tests/test_gpu.py "python/tests --ignore=python/tests/test_gpu.py"; do
  name=$([ "$tests" = python/tests/test_gpu.py ] && echo gpu || echo others)
  echo "== pytest $tests"
  # shellcheck disable=SC2086
  timeout -k 10 360 "$python" -m pytest -q -rfEs --tb=short -p no:cacheprovider \
    -o faulthandler_timeout=150 \
    --junitxml="$out/junit-$name.xml" $tests 2>&1 | tee "$out/pytest-$name.log" | tail -40
  rc=${PIPESTATUS[0]}
  echo "pytest $name rc $rc"
  ((rc == 0)) || tests_rc=$rc
  [ "${KVT_RUN_OTHER_TESTS:-1}" = 1 ] || break
done

bench_rc=0
if [ "${KVT_RUN_BENCH:-1}" = 1 ]; then
  echo "== python/bench/bench_python.py"
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 timeout -k 10 220 "$python" python/bench/bench_python.py \
    --kvt-bench "$dest/kvt/bin/kvt-bench" --json "$out/bench.json" ${KVT_BENCH_ARGS:-} 2>&1 |
    tee "$out/bench.log" | tail -30
  bench_rc=${PIPESTATUS[0]}
  echo "bench rc $bench_rc"
fi
((tests_rc == 0 && bench_rc == 0))

#!/usr/bin/env bash
# Builds kvt with clang-14's sanitizers and runs the tests under them; any report fails.
#   asan  AddressSanitizer + UndefinedBehaviorSanitizer (KVT_SANITIZE=address,undefined): every
#         suite that needs no GPU (the target kvt_host_tests, with the tools they start). The
#         build folder is the fuzz targets' (tools/ci/fuzz.sh, same compiler, flags and
#         sanitizers), so the two share kvt::common and kvt::proto and CI compiles one clang tree.
#   tsan  ThreadSanitizer (KVT_SANITIZE=thread): the engine and control-plane suites, the code
#         with threads of its own (progress threads, the Asio strand, the poster), in build-tsan.
#         Suppressions: tools/ci/tsan.supp, each entry with its reason.
#   tools/ci/sanitize.sh [asan|tsan]...     (default: both)
# From scratch on 2 cores: asan about 9 minutes to build and 1.5 to run, tsan 3 and 1.
# Environment: KVT_FUZZ_BUILD_DIR (the asan folder, default build-fuzz), KVT_TSAN_BUILD_DIR
# (default build-tsan), KVT_JOBS (parallel build jobs, default: number of cores),
# KVT_TEST_JOBS (parallel tests, default 2).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
jobs=${KVT_JOBS:-$(nproc)}
test_jobs=${KVT_TEST_JOBS:-2}
modes=(asan tsan)
(($#)) && modes=("$@")

if ! command -v clang++-14 >/dev/null || ! command -v clang-14 >/dev/null; then
  echo "sanitize: clang-14 is missing; install the Debian package clang-14" >&2
  exit 1
fi

# Not run under sanitizers: GPU suites (they skip without a device, and their kernels are device
# code, which is not instrumented), lint (scripts: no kvt code runs), package (installs and
# builds a consumer with the host compiler), multinode (network namespaces, root). A suite that
# was not built (not among the targets built below) shows as <name>_NOT_BUILT and is left out.
ctest_select=(-LE 'gpu|lint|package|multinode' -E '_NOT_BUILT$')

symbolizer=$(command -v llvm-symbolizer-14 || command -v llvm-symbolizer || true)

configure() {  # configure BUILD_DIR CMAKE_ARGS...
  local build=$1
  shift
  local generator=(-G Ninja)
  [[ -f "$build/CMakeCache.txt" ]] && generator=()
  local launcher=()
  command -v ccache >/dev/null &&
    launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  # -O1 with line tables: the speed the sanitizers' docs suggest and readable stacks, and much
  # quicker to compile than -O2 -g. NDEBUG is left undefined, so asserts run too.
  CC=clang-14 CXX=clang++-14 cmake -S "$root" -B "$build" "${generator[@]}" "${launcher[@]}" \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O1 -gline-tables-only" "$@" >/dev/null
}

run_tests() {  # run_tests NAME BUILD_DIR
  local name=$1 build=$2 start=$SECONDS
  # Timeouts twice the usual: instrumented code runs two to five times slower.
  if (cd "$build" && ctest --output-on-failure --timeout 600 -j "$test_jobs" "${ctest_select[@]}"); then
    echo "sanitize: $name passed ($((SECONDS - start)) s of tests)"
  else
    echo "sanitize: $name FAILED; the sanitizer's report is in the failed tests' output above" >&2
    return 1
  fi
}

asan() {
  local build=${KVT_FUZZ_BUILD_DIR:-$root/build-fuzz} start=$SECONDS
  configure "$build" -DKVT_SANITIZE=address,undefined -DKVT_BUILD_FUZZERS=ON \
    -DKVT_BUILD_TESTS=ON -DKVT_BUILD_TOOLS=ON
  cmake --build "$build" --target kvt_host_tests -j "$jobs"
  echo "sanitize: asan build took $((SECONDS - start)) s"
  # halt_on_error: the first report ends the process with an error, so its test fails.
  ASAN_OPTIONS=halt_on_error=1:detect_leaks=1:check_initialization_order=1:strict_init_order=1:detect_stack_use_after_return=1 \
    UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    ASAN_SYMBOLIZER_PATH=$symbolizer \
    run_tests asan "$build"
}

tsan() {
  local build=${KVT_TSAN_BUILD_DIR:-$root/build-tsan} start=$SECONDS
  configure "$build" -DKVT_SANITIZE=thread -DKVT_BUILD_TESTS=ON -DKVT_BUILD_TOOLS=OFF
  cmake --build "$build" -j "$jobs" --target engine_test engine_tp_test engine_fault_test engine_layout_test \
    transfer_control_test transfer_control_server_test
  echo "sanitize: tsan build took $((SECONDS - start)) s"
  # UCX's memory hooks (libucm) patch mmap/munmap/brk in the loaded libraries' relocation tables
  # and hook malloc, to see memory released under a registration. Calls through the patched
  # entries pass ThreadSanitizer's interceptors by, so it would not learn that a range was
  # unmapped and reused. With the hooks off UCX only loses its registration cache, which these
  # tests do not measure. (The asan run keeps them on: AddressSanitizer and UCX 1.13's hooks get
  # on, and the tests then run UCX as the library does.)
  UCX_MEM_MALLOC_HOOKS=no UCX_MEM_MMAP_HOOK_MODE=none UCX_MEM_EVENTS=no \
    TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$root/tools/ci/tsan.supp:external_symbolizer_path=$symbolizer" \
    run_tests tsan "$build"
}

for m in "${modes[@]}"; do
  case $m in
    asan | tsan) "$m" ;;
    *)
      echo "sanitize: unknown mode '$m' (asan or tsan)" >&2
      exit 2
      ;;
  esac
done

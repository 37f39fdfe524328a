#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz: every decoder a peer can reach) with clang-14 in a
# build folder of their own, and runs each for a bounded time on a copy of its seed corpus
# (tests/fuzz/corpus/<target>). Fails when a target crashes, leaks, or an input runs too long;
# the input that did it is kept under <build>/fuzz-artifacts/ (replay it with the target's
# binary and the file as its argument).
#   tools/ci/fuzz.sh [TARGET...]     (default: every target; names without the fuzz_ prefix)
# Environment: KVT_FUZZ_SECONDS (seconds per target, default 20), KVT_FUZZ_BUILD_DIR (default
# build-fuzz), KVT_JOBS (parallel build jobs, default: number of cores).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${KVT_FUZZ_BUILD_DIR:-$root/build-fuzz}
seconds=${KVT_FUZZ_SECONDS:-20}
jobs=${KVT_JOBS:-$(nproc)}
targets=(frame message hello registry agent_rpc backend_codec)
(($#)) && targets=("$@")

if ! command -v clang++-14 >/dev/null || ! command -v clang-14 >/dev/null; then
  echo "fuzz: clang-14 is missing; install the Debian packages clang-14 and libfuzzer-14-dev" >&2
  exit 1
fi
if ! compgen -G "/usr/lib/llvm-14/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a" >/dev/null; then
  echo "fuzz: libFuzzer's runtime for clang-14 (libclang_rt.fuzzer) is missing; install the" \
    "Debian packages libclang-common-14-dev and libfuzzer-14-dev" >&2
  exit 1
fi

generator=(-G Ninja)
[[ -f "$build/CMakeCache.txt" ]] && generator=()
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
# -O1 with line tables: what libFuzzer's docs suggest, and much quicker to compile than -O2 -g.
CC=clang-14 CXX=clang++-14 cmake -S "$root" -B "$build" "${generator[@]}" "${launcher[@]}" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O1 -gline-tables-only" \
  -DKVT_SANITIZE=address,undefined -DKVT_BUILD_FUZZERS=ON -DKVT_BUILD_TESTS=OFF \
  -DKVT_BUILD_TOOLS=OFF >/dev/null
cmake --build "$build" --target kvt_fuzzers -j "$jobs"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
artifacts="$build/fuzz-artifacts"
mkdir -p "$artifacts"
failed=()
for t in "${targets[@]}"; do
  binary="$build/tests/fuzz/fuzz_$t"
  corpus="$root/tests/fuzz/corpus/$t"
  if [[ ! -x "$binary" || ! -d "$corpus" ]]; then
    echo "fuzz: no target '$t' (looked for $binary and $corpus)" >&2
    failed+=("$t")
    continue
  fi
  # A copy: what the run adds to its corpus stays out of the repository.
  cp -r "$corpus" "$work/$t"
  start=$SECONDS
  if timeout $((seconds + 120)) "$binary" -max_total_time="$seconds" -timeout=10 \
    -artifact_prefix="$artifacts/$t-" "$work/$t" >"$work/$t.log" 2>&1; then
    echo "fuzz: $t ok ($((SECONDS - start)) s, $(grep -o 'DONE.*cov: [0-9]*' "$work/$t.log" |
      grep -o 'cov: [0-9]*' || echo 'cov: ?'))"
  else
    echo "fuzz: $t FAILED; the last lines of its log:" >&2
    tail -n 60 "$work/$t.log" >&2
    failed+=("$t")
  fi
done
if ((${#failed[@]})); then
  echo "fuzz: ${failed[*]} failed; the inputs are under $artifacts" >&2
  exit 1
fi

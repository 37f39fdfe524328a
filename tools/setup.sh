#!/usr/bin/env bash
# Installs the Debian packages kvt builds against (only the missing ones; apt-get update once),
# then configures and builds kvt into ${KVT_BUILD_DIR:-build}.
#   tools/setup.sh              install what is missing, configure, build
#   tools/setup.sh --deps-only  install what is missing, nothing else
# Environment: KVT_BUILD_DIR (build folder), KVT_BUILD_TYPE (Release), KVT_CMAKE_ARGS (extra),
# KVT_JOBS (parallel build jobs, default: number of cores).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
packages=(
  cmake g++ make ninja-build pkg-config
  libucx-dev ucx-utils
  libboost-dev
  libprotobuf-dev protobuf-compiler
  libgtest-dev libgmock-dev libbenchmark-dev
  libspdlog-dev libfmt-dev libcli11-dev nlohmann-json3-dev libxxhash-dev libssl-dev
  iproute2 procps nftables
  clang-14 libfuzzer-14-dev libclang-rt-14-dev  # libFuzzer; the ASan, UBSan and TSan runtimes
  # The Python package (python/, KVT_BUILD_PYTHON) and its tests; setuptools and venv for
  # `pip install --no-build-isolation .`; torch for the tests' torch pools (numpy without it).
  pybind11-dev python3-dev python3-numpy python3-pytest python3-setuptools python3-venv
  python3-pip
  python3-torch
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]})); then
  echo "kvt setup: installing ${missing[*]}"
  if [[ $(id -u) -ne 0 ]]; then
    echo "kvt setup: these Debian packages are missing and installing them needs root:" >&2
    echo "  apt-get install ${missing[*]}" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [[ ! -x /usr/local/cuda/bin/nvcc ]] && ! command -v nvcc >/dev/null; then
  echo "kvt setup: no CUDA toolkit found (looked for /usr/local/cuda/bin/nvcc and nvcc on PATH)." >&2
  echo "  kvt needs the CUDA Toolkit (12 or newer) to build, even on machines without a GPU." >&2
  exit 1
fi

[[ "${1:-}" == "--deps-only" ]] && exit 0

build_dir=${KVT_BUILD_DIR:-$root/build}
jobs=${KVT_JOBS:-$(nproc)}
# shellcheck disable=SC2086
generator=(-G Ninja)
# An existing build folder keeps the generator it was configured with.
[[ -f "$build_dir/CMakeCache.txt" ]] && generator=()
cmake -S "$root" -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE="${KVT_BUILD_TYPE:-Release}" \
  ${KVT_CMAKE_ARGS:-} >/dev/null
cmake --build "$build_dir" -j "$jobs"

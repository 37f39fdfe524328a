#!/usr/bin/env bash
# Prepares the folder that builds and checks the `kvt` Python package on a GPU machine whose
# Python is not the one kvt was built with (e.g. a GPU machine with Python 3.12 and torch, kvt
# built on Debian 12 with Python 3.11): an extension module is built for one Python, so it is
# built there, against kvt's libraries built here.
#
# Usage (from the repository root, after a Release build):
#   tools/python_gpu/python_gpu.sh [BUILD_DIR [DEST]]      # default: build build-gpu-kit
# then copy DEST with the repository to the GPU machine and run there, from the repository root:
#   tools/python_gpu/python_gpu_run.sh DEST OUT_DIR
#
# DEST holds (about 40 MiB):
#   kvt/   `cmake --install BUILD_DIR --strip`: kvt's static libraries, public headers and CMake
#          package, and of the tools kvt-bench and kvt-bootstrap (the rest are left out);
#   deps/  what find_package(kvt) asks for that such a machine may lack and that only CMake reads
#          or the link needs, copied from this machine: fmt's and spdlog's CMake packages with
#          their headers and libraries (kvt uses both header-only), Boost's header-only CMake
#          package, protobuf's and OpenSSL's headers (their Find modules read the version from
#          them). UCX, protobuf and libcrypto themselves are the GPU machine's own runtime
#          libraries (tools/python_gpu/python_ext/CMakeLists.txt finds them by soname).
# The GPU machine needs g++ (C++20), CMake >= 3.24, the CUDA toolkit (CUDA::cudart_static and
# its headers; /usr/local/cuda or nvcc on PATH), python3 with its development headers, pybind11
# (pip's is enough), and the runtime libraries of UCX 1.x, protobuf 3.21 (libprotobuf.so.32),
# OpenSSL 3 and zlib. Its python3 needs torch with CUDA for the GPU tests and the benchmark.
set -euo pipefail
build=${1:-build}
dest=${2:-build-gpu-kit}
if [ ! -f "$build/CMakeCache.txt" ]; then
  echo "$build is not a kvt build folder (no CMakeCache.txt): build kvt first" \
       "(cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=Release && cmake --build $build)" >&2
  exit 2
fi
if ! grep -q '^CMAKE_BUILD_TYPE:STRING=Release' "$build/CMakeCache.txt"; then
  echo "$build is not a Release build: the figures are measured on Release builds" >&2
  exit 2
fi
case $dest in
  /* | "" | . | ..) echo "DEST=$dest: give a folder inside the repository (e.g. build-gpu-kit)" >&2
                    exit 2 ;;
esac
nice -n 15 cmake --build "$build" --target kvt_package
rm -rf "$dest"
mkdir -p "$dest/deps/include" "$dest/deps/lib/x86_64-linux-gnu/cmake"
cmake --install "$build" --prefix "$dest/kvt" --strip >/dev/null
for tool in "$dest"/kvt/bin/*; do
  case $(basename "$tool") in
    kvt-bench | kvt-bootstrap) ;;
    *) rm -f "$tool" ;;
  esac
done

arch=/usr/lib/x86_64-linux-gnu
deps=$dest/deps
# fmt and spdlog: CMake packages, headers and the libraries their targets name.
for pkg in fmt spdlog; do
  cp -r "$arch/cmake/$pkg" "$deps/lib/x86_64-linux-gnu/cmake/"
  cp -r "/usr/include/$pkg" "$deps/include/"
  cp -P "$arch"/lib"$pkg".so* "$deps/lib/x86_64-linux-gnu/"
done
# Boost: the header-only package (kvt's public headers include no Boost header).
cp -r "$arch"/cmake/Boost-* "$arch"/cmake/boost_headers-* "$arch"/cmake/BoostDetectToolset-* \
  "$deps/lib/x86_64-linux-gnu/cmake/"
mkdir -p "$deps/include/boost"
cp /usr/include/boost/version.hpp "$deps/include/boost/"
# protobuf and OpenSSL: headers only.
mkdir -p "$deps/include/google"
cp -r /usr/include/google/protobuf "$deps/include/google/"
cp -r /usr/include/openssl "$deps/include/"
cp /usr/include/x86_64-linux-gnu/openssl/*.h "$deps/include/openssl/"
du -sh "$dest"

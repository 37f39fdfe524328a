#!/usr/bin/env bash
# Checks that kvt::transfer's public headers (transfer/include) are the user API only: each one
# compiles on its own with nothing but the public include folders of kvt's components (and
# CUDA's), so none reaches a private header (transfer/src), a generated protobuf header or
# spdlog. Headers still allowed to include generated protobuf are listed in PROTOBUF_ALLOWED
# with the reason.
#   tools/ci/public_headers.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cxx=${CXX:-$(command -v g++ || command -v c++)}
cuda_include=${CUDA_INCLUDE_DIR:-/usr/local/cuda/include}
# registry.h: RegistryClient / RegistryServer take and return kvt.v1 AgentInfo messages.
PROTOBUF_ALLOWED=(kvt/transfer/registry.h)
includes=(-I"$root/transfer/include" -I"$root/common/include" -I"$root/pool/include"
          -I"$root/kernels/include" -I"$cuda_include")
failed=0
checked=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
while IFS= read -r header; do
  checked=$((checked + 1))
  if grep -nE '#include *[<"](spdlog/|kvt/common/log\.h)' "$root/transfer/include/$header"; then
    echo "public_headers: $header includes spdlog (log from the .cc instead)" >&2
    failed=$((failed + 1))
    continue
  fi
  allowed=0
  for a in "${PROTOBUF_ALLOWED[@]}"; do [[ "$header" == "$a" ]] && allowed=1; done
  [[ $allowed == 1 ]] && continue
  printf '#include "%s"\n' "$header" > "$tmp/check.cc"
  if ! "$cxx" -std=c++20 -fsyntax-only "${includes[@]}" "$tmp/check.cc" 2> "$tmp/err"; then
    echo "public_headers: $header does not compile with the public include folders alone:" >&2
    grep -m3 'error' "$tmp/err" >&2 || cat "$tmp/err" >&2
    failed=$((failed + 1))
  fi
done < <(cd "$root/transfer/include" && find . -name '*.h' | sed 's#^\./##' | sort)
echo "public_headers: $((checked - failed)) of $checked public transfer headers pass"
exit $((failed > 0))

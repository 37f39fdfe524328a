#!/usr/bin/env bash
# Checks that kvt's public headers (<component>/include) are the user API only:
#   - no public header includes a generated protobuf header (*.pb.h) or spdlog, except the
#     logging headers of kvt::common listed in LOGGING_HEADERS (kvt::common's logging API: its
#     macros and the log-level parser are spdlog's by design; no other component's public header
#     includes them);
#   - each public header of kvt::pool and kvt::transfer compiles on its own with nothing but the
#     public include folders of kvt's components (and CUDA's), so none reaches a private header
#     (<component>/src) or a generated one.
#   tools/ci/public_headers.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cxx=${CXX:-$(command -v g++ || command -v c++)}
cuda_include=${CUDA_INCLUDE_DIR:-/usr/local/cuda/include}
LOGGING_HEADERS=(common/include/kvt/common/log.h common/include/kvt/common/log_level.h)
COMPONENTS=(common kernels pool transfer)
COMPILED=(pool transfer)
includes=()
for c in "${COMPONENTS[@]}"; do includes+=(-I"$root/$c/include"); done
includes+=(-I"$cuda_include")
failed=0
checked=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for component in "${COMPONENTS[@]}"; do
  while IFS= read -r header; do
    path="$component/include/$header"
    checked=$((checked + 1))
    if grep -nE '#include *[<"][^>"]*\.pb\.h[>"]' "$root/$path"; then
      echo "public_headers: $path includes a generated protobuf header (convert to plain C++" \
        "types in the .cc instead)" >&2
      failed=$((failed + 1))
      continue
    fi
    logging=0
    for a in "${LOGGING_HEADERS[@]}"; do [[ "$path" == "$a" ]] && logging=1; done
    if [[ $logging == 0 ]] &&
      grep -nE '#include *[<"](spdlog/|kvt/common/log\.h|kvt/common/log_level\.h)' "$root/$path"; then
      echo "public_headers: $path includes spdlog or kvt's logging header (log from the .cc" \
        "instead)" >&2
      failed=$((failed + 1))
      continue
    fi
    compiled=0
    for c in "${COMPILED[@]}"; do [[ "$component" == "$c" ]] && compiled=1; done
    [[ $compiled == 0 ]] && continue
    printf '#include "%s"\n' "$header" > "$tmp/check.cc"
    if ! "$cxx" -std=c++20 -fsyntax-only "${includes[@]}" "$tmp/check.cc" 2> "$tmp/err"; then
      echo "public_headers: $path does not compile with the public include folders alone:" >&2
      grep -m3 'error' "$tmp/err" >&2 || cat "$tmp/err" >&2
      failed=$((failed + 1))
    fi
  done < <(cd "$root/$component/include" && find . -name '*.h' | sed 's#^\./##' | sort)
done
echo "public_headers: $((checked - failed)) of $checked public headers pass"
exit $((failed > 0))

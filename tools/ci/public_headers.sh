#!/usr/bin/env bash
# Checks that kvt's public headers (<component>/include) are the user API only:
#   - each includes only kvt's own public headers ("kvt/..."), the C++ standard library
#     (<vector>, <cstdint>, ...) and the CUDA runtime API's types (<cuda_runtime_api.h>,
#     <driver_types.h>, <vector_types.h>); no generated protobuf header (*.pb.h), no spdlog, no
#     Boost, no POSIX or other library header;
#   - the exception: kvt::common's logging headers (INTERNAL_HEADERS: its macros and the
#     log-level parser are spdlog's API by design) serve kvt's own components and tools, are not
#     installed (cmake/KvtInstall.cmake), and no other public header includes them;
#   - each public header compiles on its own with nothing but the public include folders of kvt's
#     components (and CUDA's), so none reaches a private header (<component>/src) or a generated
#     one.
#   tools/ci/public_headers.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cxx=${CXX:-$(command -v g++ || command -v c++)}
cuda_include=${CUDA_INCLUDE_DIR:-/usr/local/cuda/include}
INTERNAL_HEADERS=(common/include/kvt/common/log.h common/include/kvt/common/log_level.h)
COMPONENTS=(common kernels pool transfer)
# The C++20 standard library's headers (the C ones in their <c...> form).
STD_HEADERS=" algorithm any array atomic barrier bit bitset charconv chrono compare complex
  concepts condition_variable coroutine deque exception execution filesystem format forward_list
  fstream functional future initializer_list iomanip ios iosfwd iostream istream iterator latch
  limits list locale map memory memory_resource mutex new numbers numeric optional ostream queue
  random ranges ratio regex scoped_allocator semaphore set shared_mutex source_location span
  sstream stack stdexcept stop_token streambuf string string_view syncstream system_error thread
  tuple type_traits typeindex typeinfo unordered_map unordered_set utility valarray variant vector
  version cassert cctype cerrno cfenv cfloat cinttypes climits clocale cmath csetjmp csignal
  cstdarg cstddef cstdint cstdio cstdlib cstring ctime cuchar cwchar cwctype "
STD_HEADERS="${STD_HEADERS//$'\n'/ } "
CUDA_HEADERS=" cuda_runtime_api.h driver_types.h vector_types.h "
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
    internal=0
    for a in "${INTERNAL_HEADERS[@]}"; do [[ "$path" == "$a" ]] && internal=1; done
    [[ $internal == 1 ]] && continue
    bad=0
    while IFS= read -r line; do
      included=$(sed -E 's/^[^#]*# *include *[<"]([^>"]*)[>"].*/\1/' <<< "${line#*:}")
      why=""
      if [[ "$included" == kvt/* ]]; then
        found=0
        for c in "${COMPONENTS[@]}"; do [[ -f "$root/$c/include/$included" ]] && found=1; done
        for a in "${INTERNAL_HEADERS[@]}"; do [[ "$a" == */include/"$included" ]] && found=2; done
        if [[ $found == 0 ]]; then
          why="is not a public header of common, kernels, pool or transfer"
        elif [[ $found == 2 ]]; then
          why="is kvt's internal logging header (spdlog; not installed): log from the .cc instead"
        fi
      elif [[ "$STD_HEADERS" != *" $included "* && "$CUDA_HEADERS" != *" $included "* ]]; then
        why="is neither kvt's, the C++ standard library's nor the CUDA runtime API's (include it in the .cc and keep the header to plain C++ types)"
      fi
      if [[ -n "$why" ]]; then
        echo "public_headers: $path:${line%%:*} includes <$included>, which $why" >&2
        bad=1
      fi
    done < <(grep -nE '^[[:space:]]*#[[:space:]]*include' "$root/$path")
    if [[ $bad == 1 ]]; then
      failed=$((failed + 1))
      continue
    fi
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

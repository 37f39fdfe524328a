#!/usr/bin/env bash
# Compiles the transfer library's sources with Clang's thread-safety analysis as errors
# (-Wthread-safety -Werror=thread-safety), so a lock mistake in the annotated code (kvt::Mutex,
# KVT_GUARDED_BY, KVT_REQUIRES, ...) fails CI. Syntax only: it takes each file's flags from the
# main build's compile_commands.json and produces no objects.
#   tools/ci/thread_safety.sh [BUILD_DIR]     (default: ${KVT_BUILD_DIR:-build})
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${1:-${KVT_BUILD_DIR:-$root/build}}
clang=$(command -v clang++-14 || command -v clang++ || true)
if [[ -z "$clang" ]]; then
  echo "thread_safety: clang++ not found; install the Debian package clang-14" >&2
  exit 1
fi
if [[ ! -f "$build/compile_commands.json" ]]; then
  echo "thread_safety: $build/compile_commands.json is missing; configure the build first" >&2
  exit 1
fi
python3 - "$build/compile_commands.json" "$clang" "$root" <<'PY'
import json, os, shlex, subprocess, sys
db, clang, root = sys.argv[1], sys.argv[2], sys.argv[3]
units = [e for e in json.load(open(db))
         if e["file"].startswith(root + "/transfer/src/") and e["file"].endswith(".cc")]
if not units:
    sys.exit("thread_safety: no transfer sources in " + db)
def check(e):
    args = shlex.split(e["command"]) if "command" in e else list(e["arguments"])
    flags, skip = [], False
    for a in args[1:]:
        if skip:
            skip = False
            continue
        if a in ("-o", "-c"):
            skip = True
            continue
        if a.startswith("-O") or a == e["file"]:
            continue
        flags.append(a)
    cmd = [clang, "-fsyntax-only", "-Wno-unknown-warning-option", "-Wthread-safety",
           "-Werror=thread-safety", *flags, e["file"]]
    return subprocess.run(cmd, cwd=e["directory"], capture_output=True, text=True)
from concurrent.futures import ThreadPoolExecutor
failed = 0
with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
    for r in pool.map(check, units):
        if r.returncode != 0:
            failed += 1
            sys.stderr.write(r.stderr)
print(f"thread_safety: {len(units) - failed} of {len(units)} transfer sources pass "
      f"-Werror=thread-safety")
sys.exit(1 if failed else 0)
PY

#!/usr/bin/env bash
# The main job: builds kvt (installing what it needs), then runs the end-to-end demo — a
# bootstrap registry, a prefill agent and a decode agent on this machine moving real KV pages
# and verifying every byte. Extra arguments go to kvt-demo (see `kvt-demo --help`).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/tools/setup.sh"
build=${KVT_BUILD_DIR:-$root/build}
"$build/tools/info/kvt-info"
exec "$build/tools/demo/kvt-demo" "$@"

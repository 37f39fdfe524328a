#!/usr/bin/env bash
# The main job: builds kvt (installing what it needs), then runs the end-to-end demo — a
# bootstrap registry, a prefill agent and a decode agent on this machine moving real KV pages
# and verifying every byte. Extra arguments go to kvt-demo (see `kvt-demo --help`).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/tools/setup.sh"
build=${KVT_BUILD_DIR:-$root/build}
if [[ -x "$build/tools/demo/kvt-demo" ]]; then
  exec "$build/tools/demo/kvt-demo" "$@"
fi
# Until the transfer demo is built: what kvt sees, and the layout of a Llama-3-8B-like pool.
"$build/tools/info/kvt-info"
exec "$build/tools/info/kvt-info" layout --layers 32 --heads 8 --head-dim 128 --dtype bf16 \
  --page-size 16 --tokens 65536 --pd

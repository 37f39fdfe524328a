#!/usr/bin/env bash
# Session 4 device run: cuda_ipc end to end with the control threads sleeping (default) and
# busy polling, with and without the prefill poller's long device spin; then the kernels sweep.
# Usage (repo root, binaries in .device/): bash tools/bench/experiments/s4_busy_poll.sh "$OUT"
set -u
out=${1:-/tmp/kvt-out}; o=/tmp/o; mkdir -p $o
common="--iters 20 --latency-requests 1000 --layerwise-requests 30 --verify"
run() {
  local name=$1; shift
  timeout 150 .device/kvt-bench transfer --backend cuda_ipc $common "$@" --json $o/$name.json > $o/$name.log 2>&1
  echo "== $name rc $?"
  sed -n '/^tokens  wr\/req/,/^$/p;/^where a whole/,/^$/p;/^layerwise/,/^(T =/p;/^one-page/,/^$/p' $o/$name.log | grep -v "^(T ="
}
run bp0
run bp1000 --control-busy-poll-us 1000
run bp1000-spin5000 --control-busy-poll-us 1000 --device-spin-us 5000
timeout 200 .device/kvt-bench kernels --sweep --json $o/kernels.json > $o/kernels.log 2>&1; echo "== kernels rc $?"
grep -E "^ *(1|16|64) |plain|pipe|async|default|contig" $o/kernels.log | tail -60
cd $o && tar czf "$out/s4.tgz" .

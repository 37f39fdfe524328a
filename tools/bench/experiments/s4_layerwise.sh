#!/usr/bin/env bash
# Session 4 device run 2: the layerwise tail split (prefill part / done message) at the default
# 200 us layers, with the prefill poller's 5 ms device spin, and with 1 ms layers.
# Usage (repo root, binaries in .device/): bash tools/bench/experiments/s4_layerwise.sh
set -u
o=/tmp/o; mkdir -p $o
common="--iters 3 --warmup 1 --latency-requests 100 --inflight 0 --peer-items 1024 --layerwise-requests 30"
timeout 150 .device/kvt-bench transfer --backend cuda_ipc $common --verify --json $o/lw-default.json > $o/lw-default.log 2>&1; echo rc $?
timeout 150 .device/kvt-bench transfer --backend cuda_ipc $common --device-spin-us 5000 --json $o/lw-spin5000.json > $o/lw-spin5000.log 2>&1; echo rc $?
timeout 150 .device/kvt-bench transfer --backend cuda_ipc $common --layer-time-us 1000 --json $o/lw-t1000.json > $o/lw-t1000.log 2>&1; echo rc $?
for f in $o/lw-*.log; do echo "== $f"; sed -n '/^layerwise/,/^(T =/p' $f; grep -A4 "^where a whole" $f; done
cd $o && tar czf "${OUT:-/tmp}/lw.tgz" .

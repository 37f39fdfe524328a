// Host copies of a write's runs at memory speed, for writes far larger than the caches (the
// ucx backend's shared-memory path copies whole requests this way).
//
// Why not memcpy per run: a request of 1024 random pages is thousands of runs of 2–128 KiB.
// glibc copies each with temporal stores (a read for ownership of every destination line, and
// the request evicts the caches it passes through) and the hardware prefetcher starts over at
// every run. StreamCopyRuns stores whole destination lines non-temporally and prefetches the
// source a fixed distance ahead of the copy, across run boundaries, so the next run's first
// lines are on their way while this run finishes; it gains most on many small runs (1-token
// pages), and a request no longer evicts the caches it passes through.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvt/transfer/plan.h"

namespace kvt::transfer {

// Source bytes the prefetch runs ahead of the copy (4–8 KiB measured best on the VM above).
inline constexpr uint64_t kStreamPrefetchBytes = 8192;

// Copies runs[i] from src[run.buffer] + run.src_offset to dst[run.DstBuffer()] +
// run.dst_offset, in order. `stop` (may be null) is read before every run; once it reads true no further run is
// started. Returns the number of runs copied completely. Before returning it fences the
// non-temporal stores, so a release store after the call publishes every copied byte. Runs must
// not overlap their destinations or each other's; buffers are not range-checked here
// (CheckRuns does that before any write is posted).
size_t StreamCopyRuns(std::span<const CopyRun> runs, std::span<const uint8_t* const> src,
                      std::span<uint8_t* const> dst, const std::atomic<bool>* stop = nullptr);

// Cuts `runs` into at most `parts` consecutive slices of about equal bytes, none smaller than
// min_slice_bytes (fewer slices when the write is small), for copies by several threads. A run
// that a slice boundary falls inside is cut in two, at a multiple of 4 KiB into the run. Returns
// the boundaries as run indices into the (possibly longer) `runs`: slice i is
// runs[bounds[i], bounds[i + 1]), and bounds.front() == 0, bounds.back() == runs.size().
std::vector<size_t> SplitRuns(std::vector<CopyRun>& runs, int parts, uint64_t min_slice_bytes);

}  // namespace kvt::transfer

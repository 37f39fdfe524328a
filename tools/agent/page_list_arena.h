// Device-resident page lists for the agent's CUDA kernels without cudaMalloc on the hot path.
//
// The pattern kernels read a request's page list from device memory. cudaMalloc and cudaFree
// synchronise the device (they would stall every request's forward and copies), so the agent
// allocates one block of device memory at start-up, with a pinned host mirror at the same
// offsets, and hands out runs of it per request: the caller writes the list into the mirror and
// enqueues one asynchronous copy to the device run.
//
// RangeAllocator is the bookkeeping alone (first fit over a coalesced free list), so that it is
// tested without a GPU.
//
// Thread safety: both classes are thread-safe (one mutex each).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "kvt/common/status.h"
#include "kvt/kernels/cuda_util.h"

namespace kvt::tools {

struct Range {
  int64_t offset = -1;
  int64_t length = 0;
  bool valid() const { return offset >= 0; }
};

class RangeAllocator {
 public:
  explicit RangeAllocator(int64_t capacity);
  RangeAllocator(const RangeAllocator&) = delete;
  RangeAllocator& operator=(const RangeAllocator&) = delete;

  // A run of `length` (> 0) units. ResourceExhausted when no free run is that long now (runs in
  // use are freed as their requests finish; retry then); InvalidArgument for length <= 0 or
  // beyond the capacity.
  StatusOr<Range> Allocate(int64_t length);
  // Returns a run from Allocate; neighbours merge. Invalid ranges are ignored.
  void Free(const Range& range);

  int64_t capacity() const { return capacity_; }
  int64_t free_units() const;
  // Free runs (1 when nothing is allocated).
  size_t free_runs() const;

 private:
  const int64_t capacity_;
  mutable std::mutex mu_;            // guards the fields below
  std::map<int64_t, int64_t> free_;  // offset -> length, no two adjacent
  int64_t free_units_ = 0;
};

class PageListArena {
 public:
  // Room for `capacity` int32 entries on `device`, plus the pinned mirror.
  static StatusOr<std::unique_ptr<PageListArena>> Create(int64_t capacity, int device);

  StatusOr<Range> Allocate(int64_t entries) { return ranges_.Allocate(entries); }
  // Call only once the device work that read the run has completed.
  void Free(const Range& range) { ranges_.Free(range); }

  int32_t* host(const Range& r) const { return mirror_.as<int32_t>() + r.offset; }
  int32_t* device(const Range& r) const { return device_.as<int32_t>() + r.offset; }
  int64_t capacity() const { return ranges_.capacity(); }

 private:
  PageListArena(int64_t capacity, cuda::DeviceBuffer device, cuda::PinnedBuffer mirror)
      : ranges_(capacity), device_(std::move(device)), mirror_(std::move(mirror)) {}

  RangeAllocator ranges_;
  cuda::DeviceBuffer device_;
  cuda::PinnedBuffer mirror_;
};

}  // namespace kvt::tools

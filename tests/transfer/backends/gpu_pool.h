// A CUDA pool for the GPU backend tests, laid out as kvt's pool lays one out; whole images of it
// go up and down for expectations. Header-only, test-only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kvt/common/status.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/transfer/backend.h"

namespace kvt::transfer::testing {

// A CUDA pool as kvt's pool lays it out: one cudaMalloc holding 2L buffers (K of every layer,
// then V) of `pages` pages of `item` bytes each, after a gap so that buffers sit at non-zero
// offsets of their allocation.
class GpuPool {
 public:
  static constexpr uint64_t kGap = 8192;

  Status Init(int layers, int32_t pages, uint64_t item, int device = 0, uint64_t gap = kGap) {
    gap_ = gap;
    layers_ = layers;
    pages_ = pages;
    item_ = item;
    device_ = device;
    auto memory = cuda::DeviceBuffer::Allocate(gap_ + bytes(), device);
    if (!memory.ok()) return memory.status();
    memory_ = std::move(memory).value();
    return OkStatus();
  }
  uint64_t buffer_bytes() const { return static_cast<uint64_t>(pages_) * item_; }
  uint64_t bytes() const { return 2 * static_cast<uint64_t>(layers_) * buffer_bytes(); }
  uint64_t Base(int b) const {
    return reinterpret_cast<uint64_t>(memory_.data()) + gap_ + b * buffer_bytes();
  }
  void* data() const { return reinterpret_cast<void*>(Base(0)); }
  std::vector<LocalRegion> Regions() const {
    std::vector<LocalRegion> regions;
    for (int b = 0; b < 2 * layers_; ++b) {
      regions.push_back({Base(b), buffer_bytes(), item_, MemoryKind::kCuda, device_, b % layers_});
    }
    return regions;
  }
  Status Upload(const std::vector<uint8_t>& image) const {
    return cuda::Copy(data(), image.data(), image.size());
  }
  StatusOr<std::vector<uint8_t>> Download() const {
    std::vector<uint8_t> image(bytes());
    Status s = cuda::Copy(image.data(), data(), image.size());
    if (!s.ok()) return s;
    return image;
  }
  Status Fill(uint8_t value) const {
    Status s = cuda::ToStatus(cudaSetDevice(device_), "cudaSetDevice");
    if (!s.ok()) return s;
    s = cuda::ToStatus(cudaMemset(data(), value, bytes()), "cudaMemset");
    if (!s.ok()) return s;
    return cuda::ToStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  int layers() const { return layers_; }
  uint64_t item() const { return item_; }

 private:
  cuda::DeviceBuffer memory_;
  uint64_t gap_ = kGap;
  int layers_ = 0;
  int32_t pages_ = 0;
  uint64_t item_ = 0;
  int device_ = 0;
};

}  // namespace kvt::transfer::testing

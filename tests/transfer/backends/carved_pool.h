// A CUDA pool whose buffers are sub-ranges of one or a few large cudaMalloc allocations, the way
// a serving engine's caching allocator (PyTorch's) hands out pieces of big blocks: 2L buffers
// (K of every layer, then V), dealt round-robin over the allocations, each at a 256-byte-aligned
// offset after an irregular gap, none at an allocation's base, and a tail after the last. Images
// cover whole allocations, gaps and tails included, so a check also proves that nothing outside
// the buffers was written. Header-only, test-only; one thread.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "backend_test_util.h"
#include "kvt/common/status.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/transfer/backend.h"

namespace kvt::transfer::testing {

class CarvedPool {
 public:
  static constexpr uint64_t kAlign = 256;

  Status Init(int layers, int32_t pages, uint64_t item, int allocations = 1, int device = 0) {
    layers_ = layers;
    pages_ = pages;
    item_ = item;
    device_ = device;
    std::vector<uint64_t> cursor(allocations, 0);
    allocation_of_.clear();
    offset_.clear();
    for (int b = 0; b < 2 * layers; ++b) {
      const int a = b % allocations;
      const uint64_t gap = kAlign * (1 + (b * 5 + 3) % 7);  // 256 .. 1792 bytes, irregular
      const uint64_t start = (cursor[a] + gap + kAlign - 1) / kAlign * kAlign;
      allocation_of_.push_back(a);
      offset_.push_back(start);
      cursor[a] = start + buffer_bytes();
    }
    memory_.clear();
    image_offset_.clear();
    uint64_t image_bytes = 0;
    for (int a = 0; a < allocations; ++a) {
      auto memory = cuda::DeviceBuffer::Allocate(cursor[a] + 3 * kAlign + 40, device);
      if (!memory.ok()) return memory.status();
      image_offset_.push_back(image_bytes);
      image_bytes += memory->size();
      memory_.push_back(std::move(memory).value());
    }
    bytes_ = image_bytes;
    return OkStatus();
  }

  uint64_t buffer_bytes() const { return static_cast<uint64_t>(pages_) * item_; }
  uint64_t item() const { return item_; }
  int layers() const { return layers_; }
  // Every allocation's bytes, one after the other: the size of an image.
  uint64_t bytes() const { return bytes_; }
  size_t allocations() const { return memory_.size(); }
  uint64_t AllocationBase(size_t a) const { return reinterpret_cast<uint64_t>(memory_[a].data()); }
  uint64_t AllocationBytes(size_t a) const { return memory_[a].size(); }
  uint32_t AllocationOf(int b) const { return allocation_of_[b]; }
  uint64_t Offset(int b) const { return offset_[b]; }
  uint64_t Base(int b) const { return AllocationBase(allocation_of_[b]) + offset_[b]; }

  std::vector<LocalRegion> Regions() const {
    std::vector<LocalRegion> regions;
    for (int b = 0; b < 2 * layers_; ++b) {
      LocalRegion r{Base(b), buffer_bytes(), item_, MemoryKind::kCuda, device_};
      r.layer = b % layers_;
      regions.push_back(r);
    }
    return regions;
  }

  // Where page `page` of buffer `b` sits in an image.
  uint64_t ImageOffset(int b, int32_t page) const {
    return image_offset_[allocation_of_[b]] + offset_[b] + static_cast<uint64_t>(page) * item_;
  }

  Status Upload(const std::vector<uint8_t>& image) const {
    for (size_t a = 0; a < memory_.size(); ++a) {
      KVT_RETURN_IF_ERROR(
          cuda::Copy(memory_[a].data(), image.data() + image_offset_[a], memory_[a].size()));
    }
    return OkStatus();
  }
  StatusOr<std::vector<uint8_t>> Download() const {
    std::vector<uint8_t> image(bytes_);
    for (size_t a = 0; a < memory_.size(); ++a) {
      Status s = cuda::Copy(image.data() + image_offset_[a], memory_[a].data(), memory_[a].size());
      if (!s.ok()) return s;
    }
    return image;
  }

 private:
  std::vector<cuda::DeviceBuffer> memory_;
  std::vector<uint64_t> image_offset_;   // by allocation
  std::vector<uint32_t> allocation_of_;  // by buffer
  std::vector<uint64_t> offset_;         // by buffer, in its allocation
  uint64_t bytes_ = 0;
  int layers_ = 0;
  int32_t pages_ = 0;
  uint64_t item_ = 0;
  int device_ = 0;
};

// Applies a page write from the image of `src` to the image of `dst`, as the backend must.
inline void ApplyCarvedPageWrite(const PageWrite& w, const CarvedPool& src,
                                 const std::vector<uint8_t>& src_image, const CarvedPool& dst,
                                 std::vector<uint8_t>& dst_image) {
  ApplyPageWrite(
      w, dst.item(),
      [&](int32_t b, int32_t page) { return src_image.data() + src.ImageOffset(b, page); },
      [&](int32_t b, int32_t page) { return dst_image.data() + dst.ImageOffset(b, page); });
}

// "" when two images of `pool` are equal, else how many bytes differ and where the first is
// (which buffer and page, or outside every buffer).
inline std::string DescribeCarvedMismatch(const CarvedPool& pool, const std::vector<uint8_t>& want,
                                          const std::vector<uint8_t>& got) {
  if (want.size() != got.size()) {
    return "image of " + std::to_string(got.size()) + " bytes, expected " +
           std::to_string(want.size());
  }
  size_t differ = 0, first = want.size();
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i] != got[i]) {
      if (differ++ == 0) first = i;
    }
  }
  if (differ == 0) return "";
  std::string where = "outside every buffer (a gap or tail)";
  for (int b = 0; b < 2 * pool.layers(); ++b) {
    const uint64_t start = pool.ImageOffset(b, 0);
    if (first >= start && first < start + pool.buffer_bytes()) {
      where = "buffer " + std::to_string(b) + " page " +
              std::to_string((first - start) / pool.item()) + " byte " +
              std::to_string((first - start) % pool.item());
    }
  }
  return std::to_string(differ) + " bytes differ; the first at image byte " +
         std::to_string(first) + ", " + where + ": " + std::to_string(got[first]) + " instead of " +
         std::to_string(want[first]);
}

}  // namespace kvt::transfer::testing

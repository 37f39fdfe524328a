// Test helpers: host byte buffers at chosen misalignments, random distinct indices.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "kvt/testing/random.h"

namespace kvt::kernels::testing {

// `size` bytes starting `misalign` bytes past a 64-byte boundary, filled with random bytes.
class HostBytes {
 public:
  HostBytes(size_t size, size_t misalign, std::mt19937& rng) : storage_(size + 128), size_(size) {
    const uintptr_t raw = reinterpret_cast<uintptr_t>(storage_.data());
    start_ = ((raw + 63) & ~uintptr_t{63}) - raw + misalign;
    for (auto& b : storage_) b = static_cast<uint8_t>(rng());
  }
  uint8_t* data() { return storage_.data() + start_; }
  const uint8_t* data() const { return storage_.data() + start_; }
  size_t size() const { return size_; }
  uint64_t addr() const { return reinterpret_cast<uint64_t>(data()); }
  void Fill(uint8_t v) { std::fill(data(), data() + size_, v); }
  std::vector<uint8_t> Bytes() const { return {data(), data() + size_}; }

 private:
  std::vector<uint8_t> storage_;
  size_t start_;
  size_t size_;
};

using ::kvt::testing::DistinctIndices;

inline int64_t Uniform(std::mt19937& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

}  // namespace kvt::kernels::testing

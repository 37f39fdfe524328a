// Random test data from seeded generators, so that a failure reproduces.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <span>
#include <vector>

namespace kvt::testing {

// Overwrites `bytes` with bytes drawn from `rng`.
inline void FillRandom(std::span<uint8_t> bytes, std::mt19937& rng) {
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
}

// `size` bytes drawn from a generator seeded with `seed`.
inline std::vector<uint8_t> RandomBytes(size_t size, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> bytes(size);
  FillRandom(bytes, rng);
  return bytes;
}

// `n` distinct values from [first, range) in random order (n <= range - first).
inline std::vector<int32_t> DistinctIndices(int64_t n, int64_t range, std::mt19937& rng,
                                            int64_t first = 0) {
  std::vector<int32_t> all(static_cast<size_t>(range - first));
  std::iota(all.begin(), all.end(), static_cast<int32_t>(first));
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<size_t>(n));
  return all;
}

}  // namespace kvt::testing

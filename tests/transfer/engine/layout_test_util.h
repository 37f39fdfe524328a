// Helpers for tests of engines over TransferLayouts: a model's groups in short, and the byte
// pattern a request's pages carry.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvt/transfer/layout.h"

namespace kvt::transfer::testing {

// One KV group of a test layout (bf16).
struct GroupSpec {
  KvShape shape = KvShape::kKeyValue;
  uint32_t layers = 2;
  uint32_t heads = 2;
  uint32_t head_dim = 16;
};

// Byte `offset` of the page at `position` of request `seed`, in buffer `buffer`.
inline uint8_t PatternByte(uint64_t seed, size_t buffer, size_t position, uint64_t offset) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ (buffer + 1) * 0xC2B2AE3D27D4EB4Full ^
               (position + 1) * 0x165667B19E3779F9ull ^ (offset + 1) * 0x27D4EB2F165667C5ull;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return static_cast<uint8_t>(x);
}

}  // namespace kvt::transfer::testing

// Private to kvt::kernels: the test pattern as a pure host/device function, so that fill and
// verify on either side compute identical bytes. Thread safety: pure functions.
#pragma once

#include <cstdint>

#include "kvt/kernels/host_device.h"

namespace kvt::kernels::internal {

KVT_HOST_DEVICE uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// One seed per (request, layer, kv, token) row, so a fill or verify pass hashes once per row
// and once per 8-byte word.
KVT_HOST_DEVICE uint64_t PatternRowSeed(uint64_t request, int32_t layer, int32_t kv,
                                        int64_t token) {
  uint64_t h = SplitMix64(request);
  h = SplitMix64(h ^ ((static_cast<uint64_t>(static_cast<uint32_t>(layer)) << 1) |
                      static_cast<uint64_t>(kv & 1)));
  return SplitMix64(h ^ static_cast<uint64_t>(token));
}

// The 8 pattern bytes of word `word` (bytes 8*word .. 8*word+7) of a row, byte k at bits 8k.
KVT_HOST_DEVICE uint64_t PatternWord(uint64_t row_seed, int64_t word) {
  return SplitMix64(row_seed ^ (static_cast<uint64_t>(word) * 0xD6E8FEB86659FD93ull));
}

KVT_HOST_DEVICE uint8_t PatternByte(uint64_t request, int32_t layer, int32_t kv, int64_t token,
                                    int64_t byte) {
  uint64_t w = PatternWord(PatternRowSeed(request, layer, kv, token), byte >> 3);
  return static_cast<uint8_t>(w >> (8 * (byte & 7)));
}

}  // namespace kvt::kernels::internal

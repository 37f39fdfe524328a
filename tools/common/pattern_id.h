// The pattern seed of a request's shard: both agents derive it from the room id and the TP
// rank, so the decode side can verify pages without any data from the prefill side, and pages
// of another rank's shard (same room, other heads) never verify.
#pragma once

#include <cstdint>
#include <string_view>

namespace kvt::tools {

// FNV-1a 64 of the room id, then of the TP rank's four bytes (little-endian first).
inline uint64_t PatternRequestId(std::string_view room, uint32_t tp_rank) {
  constexpr uint64_t kPrime = 1099511628211ull;
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : room) {
    h ^= c;
    h *= kPrime;
  }
  for (int i = 0; i < 4; ++i) {
    h ^= (tp_rank >> (8 * i)) & 0xffu;
    h *= kPrime;
  }
  return h;
}

}  // namespace kvt::tools

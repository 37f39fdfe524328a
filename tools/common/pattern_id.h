// The pattern seed of a request: both agents derive it from the room id alone, so the decode
// side can verify pages without any data from the prefill side.
#pragma once

#include <cstdint>
#include <string_view>

namespace kvt::tools {

// FNV-1a 64 of the room id.
inline uint64_t PatternRequestId(std::string_view room) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : room) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace kvt::tools

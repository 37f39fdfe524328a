// How messages and logs show addresses, offsets and 64-bit ids: "0x" and lower-case hex digits.
#pragma once

#include <cstdint>
#include <string>

namespace kvt {

// "0x" and the lower-case hex digits of `value` ("0x0" for 0).
std::string Hex(uint64_t value);

}  // namespace kvt

#include "kvt/common/hex.h"

#include <fmt/format.h>

namespace kvt {

std::string Hex(uint64_t value) { return fmt::format("0x{:x}", value); }

}  // namespace kvt

#include "kvt/common/random.h"

#include <random>

namespace kvt {

uint64_t RandomU64() {
  std::random_device device;
  static_assert(sizeof(std::random_device::result_type) == 4);
  return (static_cast<uint64_t>(device()) << 32) | device();
}

uint64_t RandomNonZeroU64() {
  const uint64_t value = RandomU64();
  return value != 0 ? value : 1;
}

}  // namespace kvt

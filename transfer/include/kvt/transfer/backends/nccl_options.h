// Options of the nccl backend (NCCL point-to-point sends of packed pages between GPUs, within
// and across hosts; two-sided: the receiving side takes part in every transfer).
//
// Plain values; CreateBackend (backends.h) validates them and names the option, the value and
// the allowed range of any it refuses.
#pragma once

#include <chrono>
#include <cstdint>

namespace kvt::transfer {

struct NcclOptions {
  // Bytes of one device staging slot per step: a step's header plus a page of one layer (K and
  // V), which must fit. Larger slots amortise the per-step cost.
  uint64_t slot_bytes = uint64_t{8} << 20;
  // How long a pair's communicator may take to come up after Connect / Accept (writes posted
  // before wait for it and fail after it). At least 1 ms.
  std::chrono::milliseconds connect_timeout{60000};
  // How long a posted step may stall before the pair is declared dead (its communicator
  // aborted). At least 1 ms.
  std::chrono::milliseconds stall_timeout{30000};
};

}  // namespace kvt::transfer

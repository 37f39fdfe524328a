// Whether host memory handed to a backend is mapped in this process: a backend that registers
// an address nothing is mapped at would fail later, where the peer's write lands (in UCX's
// receive path, or a copy thread), instead of at registration.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "kvt/common/status.h"
#include "kvt/transfer/backend.h"

namespace kvt::transfer {

// Whether [ptr, ptr + length) is mapped in this process (mincore fails with ENOMEM on a hole).
// Checked a window at a time, so a large buffer costs a bounded vector.
bool HostRangeMapped(uint64_t ptr, uint64_t length);

// InvalidArgument naming the first host region (MemoryKind::kHost) that is not mapped whole in
// this process, with its range; CUDA regions are the backend's own to check.
Status CheckHostRegionsMapped(std::span<const LocalRegion> regions, std::string_view backend);

}  // namespace kvt::transfer

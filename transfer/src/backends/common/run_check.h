// Checks of copy runs against the registered regions of both sides, shared by every backend so
// that a bad plan fails the same way everywhere, before any byte moves.
#pragma once

#include <span>

#include "kvt/common/status.h"
#include "kvt/transfer/backend.h"
#include "kvt/transfer/plan.h"

namespace kvt::transfer {

// OK when every run's buffer exists on both sides and its byte ranges lie inside both buffers.
Status CheckRuns(std::span<const CopyRun> runs, std::span<const LocalRegion> local,
                 std::span<const RemoteRegion> remote);

// OK when the peer publishes as many regions as we registered.
Status CheckRegionCount(size_t local, size_t remote);

}  // namespace kvt::transfer

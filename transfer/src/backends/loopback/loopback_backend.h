// The loopback backend: in-process copies between loopback backends of this process (host
// memory only), for tests of the engine and the backend conformance suite.
#pragma once

#include <memory>

#include "kvt/common/status.h"
#include "kvt/transfer/backend.h"
#include "kvt/transfer/backends/loopback_options.h"

namespace kvt::transfer {

// InvalidArgument naming the option, its value and the allowed range for a negative delay.
StatusOr<std::unique_ptr<Backend>> CreateLoopbackBackend(const LoopbackOptions& options);

}  // namespace kvt::transfer

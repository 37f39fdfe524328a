#pragma once

#include <memory>

#include "kvt/transfer/backend.h"
#include "kvt/transfer/backends.h"

namespace kvt::transfer {

std::unique_ptr<Backend> CreateLoopbackBackend(const BackendOptions& options);

}  // namespace kvt::transfer

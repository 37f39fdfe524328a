#pragma once

#include <memory>

#include "kvt/common/status.h"
#include "kvt/transfer/backend.h"
#include "kvt/transfer/backends.h"

namespace kvt::transfer {

// UCX backend: one UCP context and worker, a progress thread, pool buffers registered once with
// ucp_mem_map, rkeys in the descriptor, ucp_put_nbx per run and an endpoint flush before a
// write counts as complete.
StatusOr<std::unique_ptr<Backend>> CreateUcxBackend(const BackendOptions& options);

// The UCX library version string, e.g. "1.13.1".
const char* UcxVersion();

}  // namespace kvt::transfer

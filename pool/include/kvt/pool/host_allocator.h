// HostAllocator: where a host pool's buffers come from, when not from the pool's own mmap.
//
// A transfer backend can move pages fastest out of and into memory it allocated itself (UCX's
// shared-memory transports, for example, write straight into a peer's segment only when UCX
// allocated it). The pool knows nothing of backends; a higher layer hands it an allocator.
// Memory it returns must be page-aligned; the pool zeroes it. The allocator must stay alive
// until every block it gave out is freed (the pool holds a shared_ptr to it).
//
// Thread safety: implementations must allow Allocate / Free from any thread.
#pragma once

#include <cstdint>
#include <string_view>

#include "kvt/common/status.h"

namespace kvt::pool {

class HostAllocator {
 public:
  virtual ~HostAllocator() = default;
  // `bytes` of page-aligned host memory (contents undefined), or why not.
  virtual StatusOr<void*> Allocate(int64_t bytes) = 0;
  // Returns a block from Allocate. Never fails (failures are logged).
  virtual void Free(void* block, int64_t bytes) = 0;
  // For log lines and kvt-info: "ucx", ...
  virtual std::string_view name() const = 0;
};

}  // namespace kvt::pool

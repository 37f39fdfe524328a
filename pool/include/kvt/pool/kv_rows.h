// KvRows: the caller's K and V rows handed to KvPool::SetKvBuffer — pointers, element type and
// where they live. Non-owning; the memory must stay valid for the duration of the call.
#pragma once

#include "kvt/common/dtype.h"
#include "kvt/pool/pool_options.h"

namespace kvt::pool {

struct KvRows {
  const void* k = nullptr;     // [num_rows, head_num, head_dim] elements of `dtype`
  const void* v = nullptr;     // same shape
  DType dtype = DType::kBF16;  // a pool element type (converted when it differs from the pool's)
  MemoryKind memory = MemoryKind::kHost;  // host or CUDA device memory
};

}  // namespace kvt::pool

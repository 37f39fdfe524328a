// BufferView: a non-owning description of one pool buffer (a K or V buffer, or a state slab).
//
// The pool owns the memory; a view stays valid as long as the KvPool that returned it. The
// bytes are `store_dtype` elements; `dtype` is the type to view them as (fp8 pools store uint8
// and view it back as fp8, as the reference's `buf.view(self.dtype)` does).
// Thread safety: a value; reading the memory it points at is the caller's to synchronise.
#pragma once

#include <cstdint>
#include <vector>

#include "kvt/common/dtype.h"
#include "kvt/pool/pool_options.h"

namespace kvt::pool {

struct BufferView {
  void* data = nullptr;
  DType dtype = DType::kBF16;        // element type to interpret the bytes as
  DType store_dtype = DType::kBF16;  // element type the bytes are stored as
  std::vector<int64_t> shape;        // e.g. [size + page_size, head_num, head_dim]
  int64_t bytes = 0;
  MemoryKind memory = MemoryKind::kHost;
  int device = 0;  // CUDA device of kCuda memory
};

}  // namespace kvt::pool

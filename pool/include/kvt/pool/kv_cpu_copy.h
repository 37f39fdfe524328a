// KvCpuCopy: a host copy of some rows of every layer's K and V, made by KvPool::GetCpuCopy and
// restored by KvPool::LoadCpuCopy (tokenspeed's get_cpu_copy / load_cpu_copy). Rows are kept
// per layer in chunks of the pool's offload_chunk_page_num indices, as the reference does:
// layers[l][c] holds chunk c of layer l. Owns its memory; a value (movable and copyable).
#pragma once

#include <cstdint>
#include <vector>

namespace kvt::pool {

struct KvCpuChunk {
  int64_t num_rows = 0;
  std::vector<uint8_t> k;  // num_rows * row_bytes bytes, rows in index order
  std::vector<uint8_t> v;
};

struct KvCpuCopy {
  int64_t row_bytes = 0;  // bytes of one token row (head_num * head_dim * itemsize)
  std::vector<std::vector<KvCpuChunk>> layers;
};

}  // namespace kvt::pool

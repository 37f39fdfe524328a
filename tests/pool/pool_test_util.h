// Helpers shared by the pool tests: small layouts, random bytes and row access on host pools.
#pragma once

#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kvt/pool/kv_pool.h"
#include "kvt/pool/pool_options.h"
#include "kvt/testing/random.h"

namespace kvt::pool::testing {

// 2 heads x 8 dims of bf16: 32-byte rows; 16 tokens in pages of 4 (20 rows per buffer).
inline PoolOptions SmallOptions(int64_t layers = 2) {
  PoolOptions o;
  o.size = 16;
  o.page_size = 4;
  o.head_num = 2;
  o.head_dim = 8;
  o.layer_num = layers;
  o.dtype = DType::kBF16;
  o.pin_host_memory = false;
  return o;
}

using ::kvt::testing::RandomBytes;

// Random bf16 values that are finite (exponent field never all ones), so conversions are sane.
inline std::vector<uint8_t> RandomFiniteBf16(size_t elems, uint32_t seed) {
  std::vector<uint8_t> out = RandomBytes(elems * 2, seed);
  for (size_t i = 0; i < elems; ++i) out[2 * i + 1] &= 0xBF;  // clear the top exponent bit
  return out;
}

inline std::vector<int32_t> AllRows(const KvPool& pool) {
  std::vector<int32_t> rows(static_cast<size_t>(pool.layout().rows_per_buffer()));
  std::iota(rows.begin(), rows.end(), 0);
  return rows;
}

// Row `row` of a host buffer.
inline const uint8_t* Row(const BufferView& view, int64_t row, int64_t row_bytes) {
  return static_cast<const uint8_t*>(view.data) + row * row_bytes;
}

// Fills every row of every layer's K and V of a host or CUDA pool (without state layers) with
// random bytes through Transfer; returns the flat [2, L, rows, row_bytes] image written.
inline std::vector<uint8_t> FillRandom(KvPool& pool, uint32_t seed) {
  const std::vector<int32_t> rows = AllRows(pool);
  std::vector<uint8_t> flat =
      RandomBytes(static_cast<size_t>(pool.FlatDataBytes(static_cast<int64_t>(rows.size()))), seed);
  if (!pool.Transfer(rows, flat.data(), static_cast<int64_t>(flat.size()), MemoryKind::kHost)
           .ok()) {
    return {};
  }
  return flat;
}

}  // namespace kvt::pool::testing

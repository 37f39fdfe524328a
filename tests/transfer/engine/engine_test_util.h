// Helpers for engine tests: small host pools, pattern fill/verify of a request's pages.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "kvt/kernels/kernels.h"
#include "kvt/pool/kv_pool.h"
#include "kvt/transfer/backends.h"
#include "kvt/transfer/engine.h"

namespace kvt::transfer::testing {

// A loopback backend for a test's engine (null, with the test failed, when it cannot be made).
inline std::shared_ptr<Backend> Loopback(LoopbackOptions options = {}) {
  auto backend = CreateBackend(BackendConfig(std::move(options)));
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? std::shared_ptr<Backend>(std::move(backend).value()) : nullptr;
}

// Bytes of every K and V page of `pages` in the pool, in order.
inline std::vector<uint8_t> Snapshot(const pool::KvPool& pool, const std::vector<int32_t>& pages) {
  auto infos = pool.GetContiguousBufInfos();
  std::vector<uint8_t> out;
  for (size_t b = 0; b < infos->data_ptrs.size(); ++b) {
    const auto item = static_cast<size_t>(infos->item_lens[b]);
    for (int32_t p : pages) {
      const auto* src = reinterpret_cast<const uint8_t*>(infos->data_ptrs[b]) + p * item;
      out.insert(out.end(), src, src + item);
    }
  }
  return out;
}

// A test engine's options: its name, its role and its rooms' default deadline.
inline EngineOptions NamedEngine(const std::string& name, bool prefill,
                                 std::chrono::milliseconds default_deadline) {
  EngineOptions o;
  o.name = name;
  o.prefill = prefill;
  o.default_deadline = default_deadline;
  return o;
}

inline pool::PoolOptions SmallPoolOptions(int64_t layers = 4, int64_t page_size = 16,
                                          int64_t pages = 64) {
  pool::PoolOptions o;
  o.size = page_size * pages;
  o.page_size = page_size;
  o.head_num = 2;
  o.head_dim = 64;
  o.layer_num = layers;
  o.dtype = DType::kBF16;
  o.pd_disaggregation_enabled = true;
  o.pin_host_memory = false;
  return o;
}

inline std::unique_ptr<pool::KvPool> MakePool(const pool::PoolOptions& o) {
  auto pool = pool::KvPool::Create(o);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? std::move(pool).value() : nullptr;
}

// Pattern arguments for `pages` of `pool`, layers [first, first + count).
struct PatternTables {
  std::vector<uint64_t> k, v;
  kernels::PatternArgs args;
};

inline PatternTables MakePattern(const pool::KvPool& pool, uint64_t request,
                                 const std::vector<int32_t>& pages, int64_t num_tokens,
                                 int32_t first = 0, int32_t count = -1) {
  PatternTables t;
  auto infos = pool.GetContiguousBufInfos();
  const int32_t layers = static_cast<int32_t>(pool.options().layer_num);
  if (count < 0) count = layers - first;
  for (int32_t l = first; l < first + count; ++l) {
    t.k.push_back(infos->data_ptrs[l]);
    t.v.push_back(infos->data_ptrs[layers + l]);
  }
  t.args.request = request;
  t.args.k_bases = t.k.data();
  t.args.v_bases = t.v.data();
  t.args.first_layer = first;
  t.args.num_layers = count;
  t.args.pages = pages.data();
  t.args.num_tokens = num_tokens;
  t.args.page_size = pool.options().page_size;
  t.args.row_bytes =
      pool.options().head_num * pool.options().head_dim * ItemSize(pool.options().dtype);
  return t;
}

inline void Fill(const pool::KvPool& pool, uint64_t request, const std::vector<int32_t>& pages,
                 int32_t first = 0, int32_t count = -1) {
  auto t = MakePattern(pool, request, pages,
                       static_cast<int64_t>(pages.size()) * pool.options().page_size, first, count);
  ASSERT_TRUE(kernels::FillPatternCpu(t.args).ok());
}

inline uint64_t Mismatches(const pool::KvPool& pool, uint64_t request,
                           const std::vector<int32_t>& pages) {
  auto t = MakePattern(pool, request, pages,
                       static_cast<int64_t>(pages.size()) * pool.options().page_size);
  auto check = kernels::VerifyPatternCpu(t.args);
  EXPECT_TRUE(check.ok()) << check.status();
  return check.ok() ? check->mismatches : ~0ull;
}

}  // namespace kvt::transfer::testing

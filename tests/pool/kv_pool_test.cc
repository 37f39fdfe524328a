// KvPool on host memory: allocation, views, guards and the data round trips, with expected
// values recomputed by hand from the buffers.
#include "kvt/pool/kv_pool.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <set>

#include "kvt/kernels/cuda_util.h"
#include "pool_test_util.h"

namespace kvt::pool {
namespace {

using testing::AllRows;
using ::testing::ElementsAre;
using testing::FillRandom;
using ::testing::HasSubstr;
using testing::RandomBytes;
using testing::Row;
using testing::SmallOptions;

constexpr LayerType kFull = LayerType::kFullAttention;
constexpr LayerType kSliding = LayerType::kSlidingAttention;
constexpr LayerType kLinear = LayerType::kLinearAttention;

std::unique_ptr<KvPool> MustCreate(const PoolOptions& o) {
  StatusOr<std::unique_ptr<KvPool>> pool = KvPool::Create(o);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? std::move(pool).value() : nullptr;
}

PoolOptions SlabOptions() {
  PoolOptions o = SmallOptions(4);
  o.layer_types = {kFull, kSliding, kFull, kSliding};
  o.enable_hybrid_slab = true;
  return o;
}

PoolOptions StateOptions() {
  PoolOptions o = SmallOptions(4);
  o.layer_types = {kFull, kLinear, kFull, kLinear};
  o.conv_state_shape = {4, 8};
  o.ssm_state_shape = {2, 4, 8};
  o.ssm_dtype = DType::kFP32;
  return o;
}

bool AllZero(const BufferView& view) {
  const auto* p = static_cast<const uint8_t*>(view.data);
  for (int64_t i = 0; i < view.bytes; ++i) {
    if (p[i] != 0) return false;
  }
  return true;
}

// The whole K (side 0) or V (side 1) buffer of a layer as bytes.
std::vector<uint8_t> Snapshot(const KvPool& pool, int64_t layer, int side) {
  StatusOr<BufferView> view = side == 0 ? pool.GetKeyBuffer(layer) : pool.GetValueBuffer(layer);
  EXPECT_TRUE(view.ok());
  const auto* p = static_cast<const uint8_t*>(view->data);
  return std::vector<uint8_t>(p, p + view->bytes);
}

TEST(KvPoolTest, BuffersAreZeroedPageAlignedAndShaped) {
  auto pool = MustCreate(SmallOptions(2));
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->memory_kind(), MemoryKind::kHost);
  EXPECT_FALSE(pool->host_memory_pinned());
  for (int64_t l = 0; l < 2; ++l) {
    auto kv = pool->GetKvBuffer(l);
    ASSERT_TRUE(kv.ok());
    for (const BufferView* v : {&kv->first, &kv->second}) {
      EXPECT_THAT(v->shape, ElementsAre(20, 2, 8));
      EXPECT_EQ(v->bytes, 640);
      EXPECT_EQ(v->dtype, DType::kBF16);
      EXPECT_EQ(v->memory, MemoryKind::kHost);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(v->data) % 4096, 0u);
      EXPECT_TRUE(AllZero(*v));
    }
    EXPECT_NE(kv->first.data, kv->second.data);
  }
  EXPECT_TRUE(pool->StateSlabs().empty());
  EXPECT_TRUE(pool->SupportsPdTransfer());
}

TEST(KvPoolTest, ContiguousBufInfosMatchTheBuffers) {
  auto pool = MustCreate(SmallOptions(2));
  auto infos = pool->GetContiguousBufInfos();
  ASSERT_TRUE(infos.ok());
  ASSERT_EQ(infos->data_ptrs.size(), 4u);
  // K of layers 0..L-1, then V.
  EXPECT_EQ(infos->data_ptrs[0], reinterpret_cast<uint64_t>(pool->GetKeyBuffer(0)->data));
  EXPECT_EQ(infos->data_ptrs[1], reinterpret_cast<uint64_t>(pool->GetKeyBuffer(1)->data));
  EXPECT_EQ(infos->data_ptrs[2], reinterpret_cast<uint64_t>(pool->GetValueBuffer(0)->data));
  EXPECT_EQ(infos->data_ptrs[3], reinterpret_cast<uint64_t>(pool->GetValueBuffer(1)->data));
  EXPECT_THAT(infos->data_lens, ElementsAre(640, 640, 640, 640));
  EXPECT_THAT(infos->item_lens, ElementsAre(128, 128, 128, 128));
  EXPECT_THAT(*pool->GetContiguousBufUnitLens(), ElementsAre(16, 16, 16, 16));
  EXPECT_EQ(pool->GetKvSizeBytes(), std::make_pair(int64_t{1280}, int64_t{1280}));
  EXPECT_EQ(pool->GetLayerwiseBufInfoOffsets(4)[1], (std::array<int64_t, 2>{5, 7}));
}

TEST(KvPoolTest, HybridSlabLayersAliasOneBuffer) {
  auto pool = MustCreate(SlabOptions());
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->GetKeyBuffer(0)->data, pool->GetKeyBuffer(1)->data);
  EXPECT_EQ(pool->GetValueBuffer(2)->data, pool->GetValueBuffer(3)->data);
  EXPECT_NE(pool->GetKeyBuffer(0)->data, pool->GetKeyBuffer(2)->data);
  EXPECT_EQ(pool->GetKvSizeBytes(), std::make_pair(int64_t{1280}, int64_t{1280}));
  auto infos = pool->GetContiguousBufInfos();
  ASSERT_TRUE(infos.ok());
  EXPECT_EQ(infos->data_ptrs.size(), 8u);
  EXPECT_EQ(std::set<uint64_t>(infos->data_ptrs.begin(), infos->data_ptrs.end()).size(), 4u);
  EXPECT_FALSE(pool->SupportsHierarchicalKvCache());
}

TEST(KvPoolTest, SlabWithPdIsRefusedBeforeAllocation) {
  PoolOptions o = SlabOptions();
  o.pd_disaggregation_enabled = true;
  auto pool = KvPool::Create(o);
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(pool.status().message(), HasSubstr("hybrid slab KV layout is incompatible with PD"));
}

TEST(KvPoolTest, StateLayersCarrySlabsAndRefuseKvAccess) {
  auto pool = MustCreate(StateOptions());
  ASSERT_NE(pool, nullptr);
  auto key = pool->GetKeyBuffer(1);
  ASSERT_FALSE(key.ok());
  EXPECT_THAT(key.status().message(), HasSubstr("layer 1 is a state layer"));
  EXPECT_FALSE(pool->GetValueBuffer(3).ok());
  EXPECT_TRUE(pool->GetKeyBuffer(2).ok());

  auto infos = pool->GetContiguousBufInfos();
  ASSERT_FALSE(infos.ok());
  EXPECT_EQ(infos.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(infos.status().message(), HasSubstr("no per-layer KV"));
  EXPECT_FALSE(pool->GetContiguousBufUnitLens().ok());

  auto slabs = pool->StateSlabs();
  ASSERT_EQ(slabs.size(), 2u);
  auto state = pool->GetStateBuffers(3);
  ASSERT_TRUE(state.ok());
  EXPECT_EQ(state->first.data, slabs[1].first.data);
  EXPECT_EQ(state->second.data, slabs[1].second.data);
  EXPECT_THAT(state->first.shape, ElementsAre(5, 4, 8));
  EXPECT_EQ(state->first.bytes, 5 * 64);
  EXPECT_THAT(state->second.shape, ElementsAre(5, 2, 8, 4));
  EXPECT_EQ(state->second.dtype, DType::kFP32);
  EXPECT_EQ(state->second.bytes, 5 * 256);
  EXPECT_TRUE(AllZero(state->first));
  EXPECT_TRUE(AllZero(state->second));

  auto not_state = pool->GetStateBuffers(0);
  ASSERT_FALSE(not_state.ok());
  EXPECT_THAT(not_state.status().message(), HasSubstr("layer 0 is not a state layer"));
  EXPECT_EQ(pool->GetKvSizeBytes(), std::make_pair(int64_t{1280}, int64_t{1280}));

  // Offload and flat transfers read every layer's K/V, so they refuse state pools.
  const std::vector<int32_t> rows = {4, 5};
  auto flat = pool->GetFlatData(rows);
  ASSERT_FALSE(flat.ok());
  EXPECT_THAT(flat.status().message(), HasSubstr("layer 1 is a state layer"));
  EXPECT_FALSE(pool->GetCpuCopy(rows).ok());
  std::vector<uint8_t> bytes(static_cast<size_t>(pool->FlatDataBytes(2)));
  EXPECT_FALSE(
      pool->Transfer(rows, bytes.data(), static_cast<int64_t>(bytes.size()), MemoryKind::kHost)
          .ok());
}

TEST(KvPoolTest, SetKvBufferScattersRows) {
  auto pool = MustCreate(SmallOptions(2));
  const std::vector<int32_t> loc = {7, 0, 19};
  const auto k = RandomBytes(3 * 32, 1);
  const auto v = RandomBytes(3 * 32, 2);
  ASSERT_TRUE(pool->SetKvBuffer(1, loc, KvRows{k.data(), v.data(), DType::kBF16}).ok());
  const BufferView kb = *pool->GetKeyBuffer(1);
  const BufferView vb = *pool->GetValueBuffer(1);
  for (size_t i = 0; i < loc.size(); ++i) {
    EXPECT_EQ(std::memcmp(Row(kb, loc[i], 32), k.data() + i * 32, 32), 0) << i;
    EXPECT_EQ(std::memcmp(Row(vb, loc[i], 32), v.data() + i * 32, 32), 0) << i;
  }
  // Other rows and the other layer are untouched.
  EXPECT_TRUE(std::all_of(Row(kb, 8, 32), Row(kb, 8, 32) + 32, [](uint8_t b) { return b == 0; }));
  EXPECT_TRUE(AllZero(*pool->GetKeyBuffer(0)));
}

TEST(KvPoolTest, SetKvBufferConvertsWithScale) {
  PoolOptions o = SmallOptions(1);
  o.dtype = DType::kFP16;
  auto pool = MustCreate(o);
  // fp32 rows of 16 elements: 4.0 / scale 2 = 2.0 (fp16 0x4000) for K, 3.0 / 1 = 0x4200 for V.
  std::vector<float> k(16, 4.0f), v(16, 3.0f);
  const std::vector<int32_t> loc = {5};
  ASSERT_TRUE(pool->SetKvBuffer(0, loc, KvRows{k.data(), v.data(), DType::kFP32}, 2.0f).ok());
  const auto* krow = reinterpret_cast<const uint16_t*>(Row(*pool->GetKeyBuffer(0), 5, 32));
  const auto* vrow = reinterpret_cast<const uint16_t*>(Row(*pool->GetValueBuffer(0), 5, 32));
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(krow[i], 0x4000) << i;
    EXPECT_EQ(vrow[i], 0x4200) << i;
  }
  // Same dtype: bytes are copied and the scale is ignored.
  std::vector<uint16_t> h(16, 0x3C00);  // 1.0
  ASSERT_TRUE(pool->SetKvBuffer(0, loc, KvRows{h.data(), h.data(), DType::kFP16}, 8.0f, 8.0f).ok());
  EXPECT_EQ(krow[0], 0x3C00);
}

TEST(KvPoolTest, Fp8PoolStoresBytesAndViewsBack) {
  PoolOptions o = SmallOptions(1);
  o.dtype = DType::kFP8E4M3;
  auto pool = MustCreate(o);
  const BufferView kb = *pool->GetKeyBuffer(0);
  EXPECT_EQ(kb.dtype, DType::kFP8E4M3);
  EXPECT_EQ(kb.store_dtype, DType::kUInt8);
  EXPECT_EQ(kb.bytes, 20 * 16);
  const auto k = RandomBytes(16, 3);
  const std::vector<int32_t> loc = {9};
  ASSERT_TRUE(pool->SetKvBuffer(0, loc, KvRows{k.data(), k.data(), DType::kFP8E4M3}).ok());
  EXPECT_EQ(std::memcmp(Row(kb, 9, 16), k.data(), 16), 0);
  // fp32 2.0 / scale 2 = 1.0 -> e4m3 0x38.
  std::vector<float> f(16, 2.0f);
  ASSERT_TRUE(pool->SetKvBuffer(0, loc, KvRows{f.data(), f.data(), DType::kFP32}, 2.0f, 2.0f).ok());
  EXPECT_EQ(Row(kb, 9, 16)[0], 0x38);
}

TEST(KvPoolTest, SetKvBufferGuards) {
  auto pool = MustCreate(SmallOptions(2));
  const auto k = RandomBytes(64, 1);
  const KvRows rows{k.data(), k.data(), DType::kBF16};
  const std::vector<int32_t> bad = {3, 20};
  Status st = pool->SetKvBuffer(0, bad, rows);
  EXPECT_EQ(st.code(), StatusCode::kOutOfRange);
  EXPECT_THAT(st.message(), HasSubstr("loc[1] = 20"));
  const std::vector<int32_t> ok = {3, 4};
  EXPECT_EQ(pool->SetKvBuffer(2, ok, rows).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(pool->SetKvBuffer(0, ok, KvRows{nullptr, k.data(), DType::kBF16}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(pool->SetKvBuffer(0, ok, KvRows{k.data(), k.data(), DType::kUInt8}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(pool->SetKvBuffer(0, {}, rows).ok());

  auto state_pool = MustCreate(StateOptions());
  Status state = state_pool->SetKvBuffer(1, ok, rows);
  EXPECT_THAT(state.message(), HasSubstr("layer 1 is a state layer"));
}

class MoveTest : public ::testing::TestWithParam<bool> {};

TEST_P(MoveTest, MovesRowsInEveryBuffer) {
  PoolOptions o = SmallOptions(3);
  o.enable_kv_cache_copy = GetParam();
  auto pool = MustCreate(o);
  ASSERT_FALSE(FillRandom(*pool, 11).empty());
  std::vector<std::vector<uint8_t>> before[2];
  for (int side = 0; side < 2; ++side) {
    for (int64_t l = 0; l < 3; ++l) before[side].push_back(Snapshot(*pool, l, side));
  }
  const std::vector<int32_t> tgt = {4, 5, 18};
  const std::vector<int32_t> src = {12, 0, 7};
  ASSERT_TRUE(pool->MoveKvCache(tgt, src).ok());
  for (int side = 0; side < 2; ++side) {
    for (int64_t l = 0; l < 3; ++l) {
      std::vector<uint8_t> expected = before[side][l];
      for (size_t i = 0; i < tgt.size(); ++i) {
        std::memcpy(expected.data() + tgt[i] * 32, before[side][l].data() + src[i] * 32, 32);
      }
      EXPECT_EQ(Snapshot(*pool, l, side), expected) << "side " << side << " layer " << l;
    }
  }
}

TEST_P(MoveTest, Guards) {
  PoolOptions o = SmallOptions(1);
  o.enable_kv_cache_copy = GetParam();
  auto pool = MustCreate(o);
  const std::vector<int32_t> two = {1, 2}, one = {3};
  EXPECT_THAT(pool->MoveKvCache(two, one).message(), HasSubstr("tgt_loc has 2 entries"));
  const std::vector<int32_t> out = {1, 25};
  Status st = pool->MoveKvCache(two, out);
  EXPECT_EQ(st.code(), StatusCode::kOutOfRange);
  EXPECT_THAT(st.message(), HasSubstr("src_loc[1] = 25"));
  const std::vector<int32_t> dup = {4, 4};
  EXPECT_THAT(pool->MoveKvCache(dup, two).message(), HasSubstr("repeats tgt_loc[0]"));
  EXPECT_TRUE(pool->MoveKvCache({}, {}).ok());
}

TEST_P(MoveTest, OverlapOnlyInThePerBufferPath) {
  PoolOptions o = SmallOptions(1);
  o.enable_kv_cache_copy = GetParam();
  auto pool = MustCreate(o);
  ASSERT_FALSE(FillRandom(*pool, 5).empty());
  const auto before = Snapshot(*pool, 0, 0);
  const std::vector<int32_t> tgt = {2, 3}, src = {1, 2};
  Status st = pool->MoveKvCache(tgt, src);
  if (GetParam()) {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(), HasSubstr("disjoint"));
    EXPECT_EQ(Snapshot(*pool, 0, 0), before);
  } else {
    // torch's k[tgt] = k[src]: every source is read before any target is written.
    ASSERT_TRUE(st.ok()) << st;
    auto expected = before;
    std::memcpy(expected.data() + 2 * 32, before.data() + 1 * 32, 32);
    std::memcpy(expected.data() + 3 * 32, before.data() + 2 * 32, 32);
    EXPECT_EQ(Snapshot(*pool, 0, 0), expected);
  }
}

INSTANTIATE_TEST_SUITE_P(TiledAndPerBuffer, MoveTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Tiled" : "PerBuffer"; });

TEST(KvPoolTest, MoveOnSlabAndStatePools) {
  for (const PoolOptions& base : {SlabOptions(), StateOptions()}) {
    for (bool tiled : {false, true}) {
      PoolOptions o = base;
      o.enable_kv_cache_copy = tiled;
      auto pool = MustCreate(o);
      const auto k = RandomBytes(32, 9), v = RandomBytes(32, 10);
      const std::vector<int32_t> at = {6};
      ASSERT_TRUE(pool->SetKvBuffer(2, at, KvRows{k.data(), v.data(), DType::kBF16}).ok());
      const std::vector<int32_t> tgt = {13};
      ASSERT_TRUE(pool->MoveKvCache(tgt, at).ok());
      EXPECT_EQ(std::memcmp(Row(*pool->GetKeyBuffer(2), 13, 32), k.data(), 32), 0);
      EXPECT_EQ(std::memcmp(Row(*pool->GetValueBuffer(2), 13, 32), v.data(), 32), 0);
    }
  }
}

TEST(KvPoolTest, FlatDataIsTwoByLayersByRows) {
  auto pool = MustCreate(SmallOptions(3));
  const auto image = FillRandom(*pool, 21);
  ASSERT_FALSE(image.empty());
  const std::vector<int32_t> idx = {9, 2, 17, 2};
  auto flat = pool->GetFlatData(idx);
  ASSERT_TRUE(flat.ok()) << flat.status();
  ASSERT_EQ(flat->size(), static_cast<size_t>(2 * 3 * 4 * 32));
  for (int side = 0; side < 2; ++side) {
    for (int64_t l = 0; l < 3; ++l) {
      const auto buffer = Snapshot(*pool, l, side);
      for (size_t i = 0; i < idx.size(); ++i) {
        const uint8_t* got = flat->data() + ((side * 3 + l) * 4 + i) * 32;
        EXPECT_EQ(std::memcmp(got, buffer.data() + idx[i] * 32, 32), 0)
            << side << "/" << l << "/" << i;
      }
    }
  }
  // The image written by Transfer of all rows is the same [2, L, rows, row] layout.
  auto all = pool->GetFlatData(AllRows(*pool));
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(*all, image);
}

TEST(KvPoolTest, FlatRoundTripBetweenPools) {
  auto a = MustCreate(SmallOptions(2));
  auto b = MustCreate(SmallOptions(2));
  ASSERT_FALSE(FillRandom(*a, 31).empty());
  const std::vector<int32_t> src = {4, 5, 6, 7}, dst = {12, 13, 14, 15};
  auto flat = a->GetFlatData(src);
  ASSERT_TRUE(flat.ok());
  ASSERT_TRUE(
      b->Transfer(dst, flat->data(), static_cast<int64_t>(flat->size()), MemoryKind::kHost).ok());
  auto back = b->GetFlatData(dst);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, *flat);
  // Rows outside dst stay zero.
  EXPECT_TRUE(std::all_of(Row(*b->GetKeyBuffer(0), 4, 32), Row(*b->GetKeyBuffer(0), 5, 32),
                          [](uint8_t x) { return x == 0; }));
}

TEST(KvPoolTest, FlatGuards) {
  auto pool = MustCreate(SmallOptions(2));
  const std::vector<int32_t> idx = {1, 2};
  std::vector<uint8_t> flat(static_cast<size_t>(pool->FlatDataBytes(2)));
  Status st =
      pool->Transfer(idx, flat.data(), static_cast<int64_t>(flat.size()) - 1, MemoryKind::kHost);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("need 256"));
  st = pool->GetFlatDataInto(idx, flat.data(), 100, MemoryKind::kHost);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  const std::vector<int32_t> bad = {1, -7};
  EXPECT_THAT(pool->GetFlatData(bad).status().message(), HasSubstr("indices[1] = -7"));
  auto empty = pool->GetFlatData({});
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
}

TEST(KvPoolTest, TransferIntoSlabPoolLastLayerWins) {
  auto pool = MustCreate(SlabOptions());  // layers 0 and 1 share slab 0
  const std::vector<int32_t> idx = {8};
  const auto flat = RandomBytes(static_cast<size_t>(pool->FlatDataBytes(1)), 41);
  ASSERT_TRUE(
      pool->Transfer(idx, flat.data(), static_cast<int64_t>(flat.size()), MemoryKind::kHost).ok());
  // K of layer 1 (flat entry 1) overwrote K of layer 0 in the shared slab, as the reference's
  // per-layer loop does.
  EXPECT_EQ(std::memcmp(Row(*pool->GetKeyBuffer(0), 8, 32), flat.data() + 1 * 32, 32), 0);
  EXPECT_EQ(std::memcmp(Row(*pool->GetValueBuffer(2), 8, 32), flat.data() + (4 + 3) * 32, 32), 0);
}

TEST(KvPoolTest, CpuCopyRoundTripInChunks) {
  PoolOptions o = SmallOptions(3);
  o.offload_chunk_page_num = 3;
  auto pool = MustCreate(o);
  ASSERT_FALSE(FillRandom(*pool, 51).empty());
  const std::vector<int32_t> idx = {1, 2, 3, 10, 11, 12, 19};
  auto copy = pool->GetCpuCopy(idx);
  ASSERT_TRUE(copy.ok()) << copy.status();
  ASSERT_EQ(copy->layers.size(), 3u);
  for (const auto& layer : copy->layers) {
    ASSERT_EQ(layer.size(), 3u);  // 3 + 3 + 1
    EXPECT_EQ(layer[0].num_rows, 3);
    EXPECT_EQ(layer[2].num_rows, 1);
    EXPECT_EQ(layer[2].k.size(), 32u);
  }
  // Chunk 1 of layer 2's V holds rows 10, 11, 12.
  const auto v2 = Snapshot(*pool, 2, 1);
  EXPECT_EQ(std::memcmp(copy->layers[2][1].v.data(), v2.data() + 10 * 32, 3 * 32), 0);

  std::vector<std::vector<uint8_t>> before[2];
  for (int side = 0; side < 2; ++side) {
    for (int64_t l = 0; l < 3; ++l) before[side].push_back(Snapshot(*pool, l, side));
  }
  ASSERT_TRUE(pool->ClearKvBuffers().ok());
  EXPECT_TRUE(AllZero(*pool->GetKeyBuffer(0)));
  ASSERT_TRUE(pool->LoadCpuCopy(*copy, idx).ok());
  for (int side = 0; side < 2; ++side) {
    for (int64_t l = 0; l < 3; ++l) {
      std::vector<uint8_t> expected(before[side][l].size(), 0);
      for (int32_t r : idx)
        std::memcpy(expected.data() + r * 32, before[side][l].data() + r * 32, 32);
      EXPECT_EQ(Snapshot(*pool, l, side), expected);
    }
  }
}

TEST(KvPoolTest, LoadCpuCopyRefusesMismatchedCopies) {
  PoolOptions o = SmallOptions(2);
  o.offload_chunk_page_num = 2;
  auto pool = MustCreate(o);
  const std::vector<int32_t> idx = {1, 2, 3};
  auto copy = pool->GetCpuCopy(idx);
  ASSERT_TRUE(copy.ok());
  const std::vector<int32_t> fewer = {1, 2};
  Status st = pool->LoadCpuCopy(*copy, fewer);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("need 1"));
  KvCpuCopy broken = *copy;
  broken.layers[1][1].v.pop_back();
  st = pool->LoadCpuCopy(broken, idx);
  EXPECT_THAT(st.message(), HasSubstr("layer 1 chunk 1"));
  broken = *copy;
  broken.layers.pop_back();
  EXPECT_THAT(pool->LoadCpuCopy(broken, idx).message(), HasSubstr("1 layers but the pool has 2"));
  broken = *copy;
  broken.row_bytes = 64;
  EXPECT_THAT(pool->LoadCpuCopy(broken, idx).message(), HasSubstr("64-byte rows"));
}

class CountingWaiter : public LayerDoneWaiter {
 public:
  void WaitUntil(int64_t layer_id) override { waited.push_back(layer_id); }
  std::vector<int64_t> waited;
};

TEST(KvPoolTest, LayerTransferCounterIsWaitedOn) {
  auto pool = MustCreate(SmallOptions(2));
  CountingWaiter waiter;
  pool->RegisterLayerTransferCounter(&waiter);
  ASSERT_TRUE(pool->GetKeyBuffer(1).ok());
  ASSERT_TRUE(pool->GetValueBuffer(0).ok());
  EXPECT_THAT(waiter.waited, ElementsAre(1, 0));
  // Buffer infos are for information, not attention: no wait.
  ASSERT_TRUE(pool->GetContiguousBufInfos().ok());
  EXPECT_EQ(waiter.waited.size(), 2u);
  pool->RegisterLayerTransferCounter(nullptr);
}

TEST(KvPoolTest, CudaPoolWithoutDeviceIsUnavailable) {
  if (kvt::cuda::HasDevice()) GTEST_SKIP() << "a CUDA device is present";
  PoolOptions o = SmallOptions(1);
  o.memory = MemoryKind::kCuda;
  auto pool = KvPool::Create(o);
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(pool.status().message(), HasSubstr("no CUDA device"));
}

TEST(KvPoolTest, BadOptionsFailBeforeAllocation) {
  PoolOptions o = SmallOptions(2);
  o.layer_types = {kFull};
  auto pool = KvPool::Create(o);
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(pool.status().message(), HasSubstr("layer_types has 1 entries but layer_num=2"));
}

TEST(KvPoolTest, LargeInspectionPoolCostsNoMemory) {
  // 64 layers x 2 x 1M tokens x 8 x 128 bf16 = 256 GiB of address space: mapped lazily, never
  // touched.
  PoolOptions o;
  o.size = 1 << 20;
  o.page_size = 64;
  o.head_num = 8;
  o.head_dim = 128;
  o.layer_num = 64;
  o.pin_host_memory = false;
  auto pool = KvPool::Create(o);
  if (!pool.ok()) GTEST_SKIP() << "address space limited here: " << pool.status();
  EXPECT_EQ((*pool)->GetKvSizeBytes().first, int64_t{64} * ((1 << 20) + 64) * 8 * 128 * 2);
}

}  // namespace
}  // namespace kvt::pool

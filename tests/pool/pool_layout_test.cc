// PoolLayout: the reference pool's layout rules, recomputed by hand.
#include "kvt/pool/pool_layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "pool_test_util.h"

namespace kvt::pool {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::SmallOptions;

constexpr LayerType kFull = LayerType::kFullAttention;
constexpr LayerType kSliding = LayerType::kSlidingAttention;
constexpr LayerType kLinear = LayerType::kLinearAttention;

PoolLayout MustCompute(const PoolOptions& o) {
  StatusOr<PoolLayout> layout = PoolLayout::Compute(o);
  EXPECT_TRUE(layout.ok()) << layout.status();
  return std::move(layout).value();
}

void ExpectError(const PoolOptions& o, StatusCode code, const std::string& substring) {
  StatusOr<PoolLayout> layout = PoolLayout::Compute(o);
  ASSERT_FALSE(layout.ok()) << "expected failure containing: " << substring;
  EXPECT_EQ(layout.status().code(), code) << layout.status();
  EXPECT_THAT(layout.status().message(), HasSubstr(substring));
}

std::vector<int32_t> SlabIndices(const PoolLayout& l) {
  std::vector<int32_t> out;
  for (const auto& layer : l.layers()) out.push_back(layer.slab_index);
  return out;
}

std::vector<int32_t> KvBuffers(const PoolLayout& l) {
  std::vector<int32_t> out;
  for (const auto& layer : l.layers()) out.push_back(layer.kv_buffer);
  return out;
}

TEST(PoolLayoutTest, TwoLayerBufferInfosByHand) {
  const PoolLayout l = MustCompute(SmallOptions(2));
  // [16 + 4, 2, 8] bf16: rows of 2*8*2 = 32 bytes, 20 rows = 640 bytes per buffer.
  EXPECT_EQ(l.rows_per_buffer(), 20);
  EXPECT_EQ(l.row_bytes(), 32);
  EXPECT_EQ(l.buffer_bytes(), 640);
  EXPECT_EQ(l.item_len(), 4 * 32);
  EXPECT_EQ(l.unit_len(), 8 * 2);
  EXPECT_EQ(l.num_pages(), 4);
  EXPECT_THAT(*l.DataLens(), ElementsAre(640, 640, 640, 640));
  EXPECT_THAT(*l.ItemLens(), ElementsAre(128, 128, 128, 128));
  EXPECT_THAT(*l.UnitLens(), ElementsAre(16, 16, 16, 16));
  const auto offsets = l.LayerwiseBufInfoOffsets();
  ASSERT_EQ(offsets.size(), 2u);
  EXPECT_EQ(offsets[0], (std::array<int64_t, 2>{0, 2}));
  EXPECT_EQ(offsets[1], (std::array<int64_t, 2>{1, 3}));
  // A draft model's entries follow the target's: start_idx = 2 * L_target.
  const auto draft = l.LayerwiseBufInfoOffsets(4);
  EXPECT_EQ(draft[0], (std::array<int64_t, 2>{4, 6}));
  EXPECT_EQ(draft[1], (std::array<int64_t, 2>{5, 7}));
  EXPECT_EQ(l.KvSizeBytes(), std::make_pair(int64_t{1280}, int64_t{1280}));
  EXPECT_FALSE(l.hybrid_slab_active());
  EXPECT_FALSE(l.state_active());
  EXPECT_TRUE(l.supports_hierarchical_kv_cache());
  EXPECT_THAT(KvBuffers(l), ElementsAre(0, 1));
}

TEST(PoolLayoutTest, Fp8IsStoredAsUint8) {
  PoolOptions o = SmallOptions(1);
  o.dtype = DType::kFP8E4M3;
  const PoolLayout l = MustCompute(o);
  EXPECT_EQ(l.store_dtype(), DType::kUInt8);
  EXPECT_EQ(l.row_bytes(), 16);
  EXPECT_EQ(l.unit_len(), 8);
  o.dtype = DType::kFP32;
  EXPECT_EQ(MustCompute(o).row_bytes(), 64);
}

TEST(PoolLayoutTest, HybridSlabPairsFullAndSlidingByOccurrence) {
  PoolOptions o = SmallOptions(4);
  o.layer_types = {kFull, kSliding, kFull, kSliding};
  o.enable_hybrid_slab = true;
  o.sliding_window_tokens = 128;
  const PoolLayout l = MustCompute(o);
  EXPECT_TRUE(l.hybrid_slab_active());
  EXPECT_EQ(l.slab_count(), 2);
  EXPECT_THAT(SlabIndices(l), ElementsAre(0, 0, 1, 1));
  EXPECT_EQ(l.num_kv_buffers(), 2);
  // Aliased slabs are counted once: 2 slabs x 640 bytes a side.
  EXPECT_EQ(l.KvSizeBytes(), std::make_pair(int64_t{1280}, int64_t{1280}));
  // Buffer infos keep one entry per layer (aliases included).
  EXPECT_EQ(l.DataLens()->size(), 8u);
  EXPECT_FALSE(l.supports_hierarchical_kv_cache());

  o.layer_types = {kFull, kFull, kSliding, kSliding};
  EXPECT_THAT(SlabIndices(MustCompute(o)), ElementsAre(0, 1, 0, 1));
}

TEST(PoolLayoutTest, HybridSlabPredicateFalseKeepsPerLayerQuietly) {
  PoolOptions o = SmallOptions(4);
  o.enable_hybrid_slab = true;
  // No layer types.
  EXPECT_FALSE(MustCompute(o).hybrid_slab_active());
  // One label only.
  o.layer_types = {kFull, kFull, kFull, kFull};
  EXPECT_FALSE(MustCompute(o).hybrid_slab_active());
  // A state label (even uneven counts are fine then: the predicate is false).
  o.layer_types = {kFull, kSliding, kLinear, kFull};
  EXPECT_FALSE(MustCompute(o).hybrid_slab_active());
  // Several distinct sliding windows.
  o.layer_types = {kFull, kSliding, kFull, kSliding};
  o.sliding_window_tokens_per_layer = {std::nullopt, 128, std::nullopt, 256};
  EXPECT_FALSE(MustCompute(o).hybrid_slab_active());
  // One distinct window per layer list is fine.
  o.sliding_window_tokens_per_layer = {std::nullopt, 128, std::nullopt, 128};
  EXPECT_TRUE(MustCompute(o).hybrid_slab_active());
  // Not asked for.
  o.enable_hybrid_slab = false;
  const PoolLayout off = MustCompute(o);
  EXPECT_FALSE(off.hybrid_slab_active());
  EXPECT_THAT(SlabIndices(off), ElementsAre(-1, -1, -1, -1));
  EXPECT_EQ(off.num_kv_buffers(), 4);
}

TEST(PoolLayoutTest, UnevenSlabGroupsAreInvalid) {
  PoolOptions o = SmallOptions(3);
  o.layer_types = {kFull, kSliding, kFull};
  o.enable_hybrid_slab = true;
  ExpectError(o, StatusCode::kInvalidArgument,
              "uneven groups {'full_attention': 2, 'sliding_attention': 1}");
}

TEST(PoolLayoutTest, SlabWithPdIsRefusedAtConstruction) {
  PoolOptions o = SmallOptions(4);
  o.layer_types = {kFull, kSliding, kFull, kSliding};
  o.enable_hybrid_slab = true;
  o.pd_disaggregation_enabled = true;
  ExpectError(o, StatusCode::kFailedPrecondition, "incompatible with PD disaggregation");
  ExpectError(o, StatusCode::kFailedPrecondition, "send the same bytes twice");
  ExpectError(o, StatusCode::kFailedPrecondition, "clobber the peer's pairing");
  // As in the reference, the PD guard runs before the uneven-groups check.
  o.layer_types = {kFull, kSliding, kFull, kFull};
  ExpectError(o, StatusCode::kFailedPrecondition, "incompatible with PD disaggregation");
  // PD with the per-layer layout is fine.
  o.enable_hybrid_slab = false;
  EXPECT_TRUE(PoolLayout::Compute(o).ok());
}

PoolOptions StateOptions() {
  PoolOptions o = SmallOptions(4);
  o.layer_types = {kFull, kLinear, kFull, kLinear};
  o.conv_state_shape = {4, 8};    // 32 bf16 = 64 bytes
  o.ssm_state_shape = {2, 4, 8};  // 64 fp32 = 256 bytes
  o.ssm_dtype = DType::kFP32;
  return o;
}

TEST(PoolLayoutTest, StateLayersHaveSlabsInsteadOfKv) {
  const PoolLayout l = MustCompute(StateOptions());
  EXPECT_TRUE(l.state_active());
  EXPECT_THAT(l.state_layer_ids(), ElementsAre(1, 3));
  EXPECT_THAT(KvBuffers(l), ElementsAre(0, -1, 1, -1));
  EXPECT_EQ(l.layers()[1].state_pair, 0);
  EXPECT_EQ(l.layers()[3].state_pair, 1);
  EXPECT_EQ(l.num_state_slab_pairs(), 2);
  EXPECT_EQ(l.state_rows(), 16 / 4 + 1);
  EXPECT_EQ(l.conv_row_bytes(), 64);
  EXPECT_EQ(l.ssm_row_bytes(), 256);
  EXPECT_THAT(l.conv_slab_shape(), ElementsAre(5, 4, 8));
  // The ssm slab is allocated with its last two dims swapped ([Hv, K, V] -> [Hv, V, K]).
  EXPECT_THAT(l.ssm_slab_shape(), ElementsAre(5, 2, 8, 4));
  // Only the two KV layers carry buffers.
  EXPECT_EQ(l.KvSizeBytes(), std::make_pair(int64_t{1280}, int64_t{1280}));
  EXPECT_FALSE(l.supports_hierarchical_kv_cache());
}

TEST(PoolLayoutTest, StateGuards) {
  const PoolLayout l = MustCompute(StateOptions());
  Status infos = l.CheckContiguousBufInfos();
  EXPECT_EQ(infos.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(infos.message(), HasSubstr("state layers [1, 3]"));
  EXPECT_THAT(infos.message(), HasSubstr("PD disaggregation is unsupported"));
  EXPECT_FALSE(l.DataLens().ok());
  EXPECT_FALSE(l.ItemLens().ok());
  StatusOr<std::vector<int64_t>> units = l.UnitLens();
  ASSERT_FALSE(units.ok());
  EXPECT_THAT(units.status().message(), HasSubstr("layer 1 is a state layer"));
  // Layerwise offsets never fail.
  EXPECT_EQ(l.LayerwiseBufInfoOffsets().size(), 4u);

  Status kv = l.CheckKvLayer(3);
  EXPECT_EQ(kv.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(kv.message(), HasSubstr("layer 3 is a state layer"));
  EXPECT_THAT(kv.message(), HasSubstr("no KV buffer"));
  EXPECT_TRUE(l.CheckKvLayer(2).ok());
  EXPECT_EQ(l.CheckKvLayer(4).code(), StatusCode::kOutOfRange);

  Status state = l.CheckStateLayer(0);
  EXPECT_EQ(state.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(state.message(), HasSubstr("layer 0 is not a state layer"));
  EXPECT_THAT(state.message(), HasSubstr("full_attention"));
  EXPECT_TRUE(l.CheckStateLayer(1).ok());
  EXPECT_EQ(l.CheckStateLayer(-1).code(), StatusCode::kOutOfRange);
}

TEST(PoolLayoutTest, StateLayersWithoutBothShapesKeepKv) {
  PoolOptions o = StateOptions();
  o.ssm_state_shape.clear();
  const PoolLayout l = MustCompute(o);
  EXPECT_FALSE(l.state_active());
  EXPECT_THAT(KvBuffers(l), ElementsAre(0, 1, 2, 3));
  EXPECT_TRUE(l.CheckContiguousBufInfos().ok());
  EXPECT_TRUE(l.CheckKvLayer(1).ok());
  Status state = l.CheckStateLayer(1);
  EXPECT_EQ(state.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(state.message(), HasSubstr("no state slabs were allocated"));
  // No whole-page requirement without state slabs.
  o.size = 17;
  EXPECT_TRUE(PoolLayout::Compute(o).ok());
}

TEST(PoolLayoutTest, PageSizePreCheckNamesTheSmallestFittingMultiple) {
  PoolOptions o = StateOptions();
  // One KV slot is 2 * 2 * 8 * 2 = 64 bytes; a 512-byte ssm row needs 8 tokens.
  o.ssm_state_shape = {2, 4, 16};
  ExpectError(o, StatusCode::kInvalidArgument, "use page_size >= 8 (the smallest multiple of 4");
  ExpectError(o, StatusCode::kInvalidArgument, "the widest state row is 512 bytes");
  o.page_size = 3;
  o.size = 15;
  ExpectError(o, StatusCode::kInvalidArgument, "use page_size >= 9 (the smallest multiple of 3");
  o.page_size = 8;
  o.size = 16;
  EXPECT_TRUE(PoolLayout::Compute(o).ok());
  // The conv row is measured too.
  o = StateOptions();
  o.conv_state_shape = {4, 64};  // 512 bytes
  ExpectError(o, StatusCode::kInvalidArgument, "use page_size >= 8");
}

TEST(PoolLayoutTest, PageSizePreCheckOnlyWithStateLayers) {
  PoolOptions o = SmallOptions(2);
  o.layer_types = {kFull, kSliding};
  o.conv_state_shape = {1024, 1024};
  o.ssm_state_shape = {1024, 1024};
  EXPECT_TRUE(PoolLayout::Compute(o).ok());
}

TEST(PoolLayoutTest, StatePoolsNeedWholePagesAndAKvLayer) {
  PoolOptions o = StateOptions();
  o.size = 18;
  ExpectError(o, StatusCode::kInvalidArgument, "size 18 is not a whole number of pages");
  ExpectError(o, StatusCode::kInvalidArgument, "use size 16 or 20");
  o = StateOptions();
  o.layer_types = {kLinear, kLinear, kLinear, kLinear};
  ExpectError(o, StatusCode::kInvalidArgument, "at least one KV layer");
}

TEST(PoolLayoutTest, BadSizesAreInvalid) {
  struct Case {
    const char* name;
    void (*set)(PoolOptions&);
    const char* message;
  };
  const Case cases[] = {
      {"size", [](PoolOptions& o) { o.size = 0; }, "size must be > 0 (got 0)"},
      {"page_size", [](PoolOptions& o) { o.page_size = -4; }, "page_size must be > 0 (got -4)"},
      {"head_num", [](PoolOptions& o) { o.head_num = 0; }, "head_num must be > 0"},
      {"head_dim", [](PoolOptions& o) { o.head_dim = -1; }, "head_dim must be > 0 (got -1)"},
      {"layer_num", [](PoolOptions& o) { o.layer_num = 0; }, "layer_num must be > 0"},
      {"max_batch", [](PoolOptions& o) { o.max_batch_size = -1; }, "max_batch_size must be >= 0"},
      {"max_ctx", [](PoolOptions& o) { o.max_context_len = -2; }, "max_context_len must be >= 0"},
      {"chunk", [](PoolOptions& o) { o.offload_chunk_page_num = 0; }, "offload_chunk_page_num"},
      {"dtype", [](PoolOptions& o) { o.dtype = DType::kUInt8; }, "dtype uint8 is not a pool"},
      {"device", [](PoolOptions& o) { o.device = -1; }, "device must be >= 0"},
      {"huge", [](PoolOptions& o) { o.size = int64_t{1} << 33; }, "int32 row index range"},
      {"overflow",
       [](PoolOptions& o) {
         o.head_num = int64_t{1} << 40;
         o.head_dim = int64_t{1} << 30;
       },
       "overflows 64-bit"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    PoolOptions o = SmallOptions();
    c.set(o);
    ExpectError(o, StatusCode::kInvalidArgument, c.message);
  }
}

TEST(PoolLayoutTest, BadLayerTypesAndWindowsAreInvalid) {
  PoolOptions o = SmallOptions(3);
  o.layer_types = {kFull, kSliding};
  ExpectError(o, StatusCode::kInvalidArgument, "layer_types has 2 entries but layer_num=3");

  o.layer_types = {kFull, static_cast<LayerType>(7), kFull};
  ExpectError(o, StatusCode::kInvalidArgument,
              "layer_types[1] is not a known layer type (value 7)");

  o.layer_types = {};
  o.sliding_window_tokens_per_layer = {128, 128};
  ExpectError(o, StatusCode::kInvalidArgument,
              "sliding_window_tokens_per_layer has 2 entries but layer_num=3");
  o.sliding_window_tokens_per_layer = {128, -5, std::nullopt};
  ExpectError(o, StatusCode::kInvalidArgument,
              "sliding_window_tokens_per_layer[1] must be > 0 (got -5)");
  o.sliding_window_tokens_per_layer = {128, 128, 128};
  o.sliding_window_tokens = 128;
  ExpectError(o, StatusCode::kInvalidArgument, "not both");
  o.sliding_window_tokens_per_layer.clear();
  o.sliding_window_tokens = 0;
  ExpectError(o, StatusCode::kInvalidArgument, "sliding_window_tokens must be > 0 (got 0)");
}

TEST(PoolLayoutTest, BadStateShapesAreInvalid) {
  PoolOptions o = StateOptions();
  o.conv_state_shape = {4, 0};
  ExpectError(o, StatusCode::kInvalidArgument, "conv_state_shape[1] must be > 0 (got 0 in [4, 0])");
  o = StateOptions();
  o.ssm_state_shape = {-2, 4};
  ExpectError(o, StatusCode::kInvalidArgument, "ssm_state_shape[0] must be > 0");
}

TEST(PoolLayoutTest, CheckRowsNamesValueAndPosition) {
  const PoolLayout l = MustCompute(SmallOptions());
  const int32_t rows[] = {0, 19, 20};
  Status st = l.CheckRows(rows, 3, "loc");
  EXPECT_EQ(st.code(), StatusCode::kOutOfRange);
  EXPECT_THAT(st.message(), HasSubstr("loc[2] = 20"));
  EXPECT_THAT(st.message(), HasSubstr("[0, 20)"));
  const int32_t negative[] = {-1};
  EXPECT_THAT(l.CheckRows(negative, 1, "indices").message(), HasSubstr("indices[0] = -1"));
  EXPECT_TRUE(l.CheckRows(rows, 2, "loc").ok());
}

}  // namespace
}  // namespace kvt::pool

#include "kvt/transfer/plan.h"

#include <gtest/gtest.h>

#include <vector>

namespace kvt::transfer {
namespace {

PlanSpec Spec(const std::vector<int32_t>& src, const std::vector<int32_t>& dst) {
  PlanSpec spec;
  spec.src_pages = src;
  spec.dst_pages = dst;
  spec.num_layers = 2;
  spec.layer_begin = 0;
  spec.layer_end = 2;
  spec.src_item_len = spec.dst_item_len = 100;
  spec.src_buffer_len = spec.dst_buffer_len = 100 * 16;  // 16 pages per buffer
  return spec;
}

TEST(PlanTest, ReusesTheStorageItIsGiven) {
  std::vector<int32_t> src = {1, 2, 3, 7, 8};
  std::vector<int32_t> dst = {4, 5, 9, 10, 11};
  auto fresh = BuildPlan(Spec(src, dst));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  // Stale runs in the storage are cleared; its buffer (capacity) is what the plan writes into.
  std::vector<CopyRun> storage(64, CopyRun{7, 7, 7, 7});
  const CopyRun* buffer = storage.data();
  auto reused = BuildPlan(Spec(src, dst), std::move(storage));
  ASSERT_TRUE(reused.ok()) << reused.status();
  EXPECT_EQ(reused->runs, fresh->runs);
  EXPECT_EQ(reused->runs.data(), buffer);
  EXPECT_EQ(reused->total_bytes, fresh->total_bytes);
  EXPECT_EQ(reused->layer_begin_index, fresh->layer_begin_index);
}

TEST(PlanTest, CoalescesPagesConsecutiveOnBothSides) {
  std::vector<int32_t> src = {1, 2, 3, 7, 8};
  std::vector<int32_t> dst = {4, 5, 9, 10, 11};
  auto plan = BuildPlan(Spec(src, dst));
  ASSERT_TRUE(plan.ok()) << plan.status();
  // Segments: (1..2 -> 4..5), (3 -> 9), (7..8 -> 10..11): 3 per buffer, 4 buffers.
  ASSERT_EQ(plan->runs.size(), 12u);
  EXPECT_EQ(plan->runs[0], (CopyRun{0, 100, 400, 200}));
  EXPECT_EQ(plan->runs[1], (CopyRun{0, 300, 900, 100}));
  EXPECT_EQ(plan->runs[2], (CopyRun{0, 700, 1000, 200}));
  // Layer 0: K (buffer 0) then V (buffer L + 0 = 2); layer 1: buffers 1 and 3.
  EXPECT_EQ(plan->runs[3].buffer, 2u);
  EXPECT_EQ(plan->runs[6].buffer, 1u);
  EXPECT_EQ(plan->runs[9].buffer, 3u);
  EXPECT_EQ(plan->total_bytes, 4u * 500u);
  EXPECT_EQ(plan->Layers(0, 1).size(), 6u);
  EXPECT_EQ(plan->Layers(1, 2).front().buffer, 1u);
  EXPECT_EQ(plan->Layers(0, 2).size(), 12u);
}

TEST(PlanTest, LayerRangeSelectsBuffers) {
  std::vector<int32_t> src = {5};
  std::vector<int32_t> dst = {6};
  PlanSpec spec = Spec(src, dst);
  spec.num_layers = 4;
  spec.layer_begin = 2;
  spec.layer_end = 3;
  auto plan = BuildPlan(spec);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->runs.size(), 2u);
  EXPECT_EQ(plan->runs[0].buffer, 2u);
  EXPECT_EQ(plan->runs[1].buffer, 6u);
  EXPECT_EQ(plan->Layers(2, 3).size(), 2u);
}

TEST(PlanTest, PartialUnitsDoNotCoalesce) {
  std::vector<int32_t> src = {1, 2};
  std::vector<int32_t> dst = {3, 4};
  PlanSpec spec = Spec(src, dst);
  spec.num_layers = 1;
  spec.layer_end = 1;
  spec.dst_item_len = 50;
  spec.dst_buffer_len = 50 * 16;
  std::vector<PageUnit> units = {{50, 0, 30}, {90, 30, 10}};
  spec.units = units;
  auto plan = BuildPlan(spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->runs.size(), 8u);  // 2 pages x 2 units x (K, V)
  EXPECT_EQ(plan->runs[0], (CopyRun{0, 150, 150, 30}));
  EXPECT_EQ(plan->runs[1], (CopyRun{0, 190, 180, 10}));
  EXPECT_EQ(plan->runs[2], (CopyRun{0, 250, 200, 30}));
  EXPECT_EQ(plan->total_bytes, 2u * 2u * 40u);
}

TEST(PlanTest, RefusesBadInput) {
  std::vector<int32_t> two = {1, 2};
  std::vector<int32_t> one = {1};
  EXPECT_EQ(BuildPlan(Spec(two, one)).status().code(), StatusCode::kInvalidArgument);

  std::vector<int32_t> zero = {0};
  auto dummy = BuildPlan(Spec(zero, one));
  EXPECT_EQ(dummy.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(dummy.status().message().find("dummy page"), std::string::npos);

  std::vector<int32_t> past = {16};
  auto out = BuildPlan(Spec(one, past));
  EXPECT_EQ(out.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(out.status().message().find("destination page 16"), std::string::npos);

  PlanSpec layers = Spec(one, one);
  layers.layer_begin = 1;
  layers.layer_end = 1;
  EXPECT_EQ(BuildPlan(layers).status().code(), StatusCode::kInvalidArgument);
  layers.layer_begin = 0;
  layers.layer_end = 3;
  EXPECT_EQ(BuildPlan(layers).status().code(), StatusCode::kInvalidArgument);

  PlanSpec sizes = Spec(one, one);
  sizes.dst_item_len = 200;
  auto mismatch = BuildPlan(sizes);
  EXPECT_EQ(mismatch.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(mismatch.status().message().find("200"), std::string::npos);

  PlanSpec unit = Spec(one, one);
  std::vector<PageUnit> too_long = {{50, 0, 60}};
  unit.units = too_long;
  EXPECT_EQ(BuildPlan(unit).status().code(), StatusCode::kInvalidArgument);
  std::vector<PageUnit> empty_unit = {{0, 0, 0}};
  unit.units = empty_unit;
  EXPECT_EQ(BuildPlan(unit).status().code(), StatusCode::kInvalidArgument);
}

// Layouts of several groups: each buffer's own layer and page bytes; runs layer by layer, the
// buffers of one layer in index order.
TEST(PlanTest, BuffersOfMixedLayersAndPageBytes) {
  // Layers 0 1 0 1 (a K/V target of 2 layers, 100-byte pages), then a latent layer 2 (40 bytes)
  // and a K/V draft layer 3 (64 bytes).
  const std::vector<PlanBuffer> buffers = {
      {0, 100, 100, 1600, 1600}, {1, 100, 100, 1600, 1600}, {0, 100, 100, 1600, 1600},
      {1, 100, 100, 1600, 1600}, {2, 40, 40, 400, 800},     {3, 64, 64, 1024, 1024},
      {3, 64, 64, 1024, 1024}};
  std::vector<int32_t> src = {1, 2, 9};
  std::vector<int32_t> dst = {3, 4, 5};
  PlanSpec spec;
  spec.src_pages = src;
  spec.dst_pages = dst;
  spec.num_layers = 4;
  spec.layer_begin = 1;
  spec.layer_end = 4;
  spec.buffers = buffers;
  auto plan = BuildPlan(spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // Layer 1: buffers 1, 3; layer 2: buffer 4; layer 3: buffers 5, 6. Pages 1,2 -> 3,4 coalesce.
  std::vector<uint32_t> order;
  for (const CopyRun& r : plan->runs) order.push_back(r.buffer);
  EXPECT_EQ(order, (std::vector<uint32_t>{1, 1, 3, 3, 4, 4, 5, 5, 6, 6}));
  EXPECT_EQ(plan->Layers(2, 3).size(), 2u);
  EXPECT_EQ(plan->runs[4], (CopyRun{4, 40, 120, 80}));
  EXPECT_EQ(plan->runs[5], (CopyRun{4, 360, 200, 40}));
  const uint64_t bytes = 3 * (100 + 100 + 40 + 64 + 64);
  EXPECT_EQ(plan->total_bytes, bytes);
  EXPECT_EQ(PlanBytes(spec), bytes);
  // The latent buffer holds the fewest pages of the layers planned (400 / 40 = 10): page 9 fits,
  // page 10 does not.
  std::vector<int32_t> past = {1, 2, 10};
  spec.src_pages = past;
  auto refused = BuildPlan(spec);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(refused.status().message().find("source page 10 at position 2 is outside [1, 10)"),
            std::string::npos)
      << refused.status();
  // Whole pages of different sizes on the two sides are refused naming the buffer.
  std::vector<PlanBuffer> uneven = buffers;
  uneven[5].dst_item_len = 32;
  spec.src_pages = src;
  spec.buffers = uneven;
  auto mismatch = BuildPlan(spec);
  ASSERT_FALSE(mismatch.ok());
  EXPECT_NE(mismatch.status().message().find("buffer 5 has source items of 64 bytes"),
            std::string::npos)
      << mismatch.status();
}

TEST(PlanTest, EmptyRequestHasNoRuns) {
  std::vector<int32_t> none;
  auto plan = BuildPlan(Spec(none, none));
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->runs.empty());
  EXPECT_EQ(plan->total_bytes, 0u);
}

}  // namespace
}  // namespace kvt::transfer

// LayerTable: which registered buffers a page write of transfer layers [a, b) moves, and the
// checks every backend applies at Register (region layers) and at post (the layer range).
#include "backends/common/layer_table.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

namespace kvt::transfer {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<uint32_t> Buffers(const LayerTable& table, int32_t begin, int32_t end) {
  const std::span<const uint32_t> b = table.Buffers(begin, end);
  return {b.begin(), b.end()};
}

TEST(LayerTableTest, KeyValueLayoutMovesKAndVOfEachLayer) {
  // K of layers 0..2, then V: layers 0 1 2 0 1 2.
  const std::vector<int32_t> layers = {0, 1, 2, 0, 1, 2};
  auto table = LayerTable::FromLayers(layers);
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(table->num_layers(), 3);
  EXPECT_EQ(table->num_buffers(), 6u);
  EXPECT_THAT(Buffers(*table, 0, 3), ElementsAre(0, 3, 1, 4, 2, 5));
  EXPECT_THAT(Buffers(*table, 1, 2), ElementsAre(1, 4));
  EXPECT_TRUE(Buffers(*table, 2, 2).empty());
}

TEST(LayerTableTest, MixedLayoutOfTargetLatentAndDraftGroups) {
  // Target K/V of 2 layers, a latent group of 2 layers, a draft model's K/V of 1 layer.
  const std::vector<int32_t> layers = {0, 1, 0, 1, 2, 3, 4, 4};
  auto table = LayerTable::FromLayers(layers);
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(table->num_layers(), 5);
  EXPECT_THAT(Buffers(*table, 0, 5), ElementsAre(0, 2, 1, 3, 4, 5, 6, 7));
  EXPECT_THAT(Buffers(*table, 1, 3), ElementsAre(1, 3, 4));
  EXPECT_THAT(Buffers(*table, 4, 5), ElementsAre(6, 7));
}

TEST(LayerTableTest, CreateReadsTheRegionsLayers) {
  std::vector<LocalRegion> regions(4);
  for (int i = 0; i < 4; ++i) regions[i].layer = i % 2;
  auto table = LayerTable::Create(regions);
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_THAT(Buffers(*table, 0, 2), ElementsAre(0, 2, 1, 3));
  auto empty = LayerTable::Create({});
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->num_layers(), 0);
}

TEST(LayerTableTest, RefusesSkippedOutOfOrderAndNegativeLayersNamingTheBuffer) {
  auto expect = [](std::vector<int32_t> layers, const std::string& text) {
    auto table = LayerTable::FromLayers(layers);
    ASSERT_FALSE(table.ok()) << text;
    EXPECT_EQ(table.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(table.status().message(), HasSubstr(text));
  };
  expect({1, 0}, "buffer 0 has transfer layer 1; expected 0");
  expect({0, 1, 3, 2}, "buffer 2 has transfer layer 3; expected at most 2");
  expect({0, 0, 2}, "buffer 2 has transfer layer 2");
  expect({0, -1}, "buffer 1 has transfer layer -1");
}

TEST(LayerTableTest, CheckRangeNamesTheRangeAndTheRegisteredLayers) {
  const std::vector<int32_t> layers = {0, 1, 0, 1};
  auto table = LayerTable::FromLayers(layers);
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_TRUE(table->CheckRange(2, 0, 2).ok());
  EXPECT_TRUE(table->CheckRange(2, 1, 1).ok());
  auto expect = [&](int32_t n, int32_t begin, int32_t end, const std::string& text) {
    Status s = table->CheckRange(n, begin, end);
    ASSERT_FALSE(s.ok()) << text;
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr(text));
  };
  expect(2, 0, 3, "[0, 3) is not inside the registered layers [0, 2]");
  expect(2, -1, 1, "[-1, 1)");
  expect(2, 2, 1, "[2, 1)");
  expect(4, 0, 1, "num_layers = 4 but the registered buffers have 2 transfer layers");
}

}  // namespace
}  // namespace kvt::transfer

// The launch arithmetic of the page copy, checked without a device: how items split into units,
// which unroll auto picks, and how many blocks a grid gets under each grid policy.
#include <gtest/gtest.h>

#include <cstdint>

#include "kvt/kernels/tuning.h"
#include "page_copy_internal.h"

namespace kvt::kernels {
namespace {

using internal::GridBlocks;
using internal::SplitItems;

TEST(PageCopyLaunchTest, ItemsSplitIntoChunksOfTheTuning) {
  PageCopyTuning t;                                  // 16 KiB chunks
  EXPECT_EQ(SplitItems(t, 2048).chunk_bytes, 2048);  // shorter than a chunk: whole
  EXPECT_EQ(SplitItems(t, 2048).chunks_per_item, 1u);
  EXPECT_EQ(SplitItems(t, 16384).chunks_per_item, 1u);
  EXPECT_EQ(SplitItems(t, 131072).chunk_bytes, 16384);
  EXPECT_EQ(SplitItems(t, 131072).chunks_per_item, 8u);
  EXPECT_EQ(SplitItems(t, 16384 * 2 + 16).chunks_per_item, 3u);  // the last one shorter
  t.chunk_bytes = 0;
  EXPECT_EQ(SplitItems(t, 131072).chunks_per_item, 1u);
  t.chunk_bytes = 16;  // more than 2^31 - 1 chunks: whole items
  EXPECT_EQ(SplitItems(t, int64_t{1} << 40).chunks_per_item, 1u);
  EXPECT_EQ(SplitItems(t, int64_t{1} << 40).chunk_bytes, int64_t{1} << 40);
}

TEST(PageCopyLaunchTest, AutoUnrollFillsOneRoundOfTheGroup) {
  PageCopyTuning t;                        // unroll 0, one warp per unit, 16 KiB chunks
  EXPECT_EQ(EffectiveUnroll(t, 2048), 4);  // 1-token pages of the benchmark
  EXPECT_EQ(EffectiveUnroll(t, 4095), 4);
  EXPECT_EQ(EffectiveUnroll(t, 4096), 8);   // 32 lanes x 8 x 16 bytes
  EXPECT_EQ(EffectiveUnroll(t, 32768), 8);  // 16 KiB units
  EXPECT_EQ(EffectiveUnroll(t, 131072), 8);
  t.chunk_bytes = 2048;  // units of 2 KiB whatever the item
  EXPECT_EQ(EffectiveUnroll(t, 131072), 4);
  t.chunk_bytes = 16384;
  t.threads_per_item = 128;  // one round at unroll 8 is 16 KiB
  EXPECT_EQ(EffectiveUnroll(t, 8192), 4);
  EXPECT_EQ(EffectiveUnroll(t, 16384), 8);
  t.threads_per_item = 0;  // automatic group: counted as one warp
  EXPECT_EQ(EffectiveUnroll(t, 4096), 8);
  t.unroll = 4;  // explicit values are kept
  EXPECT_EQ(EffectiveUnroll(t, 131072), 4);
  t.unroll = 8;
  EXPECT_EQ(EffectiveUnroll(t, 16), 8);
}

TEST(PageCopyLaunchTest, OnePassGridHasABlockPerGroupOfUnits) {
  PageCopyTuning t;  // one-pass, no cap
  EXPECT_EQ(GridBlocks(t, 1, 16, 132, 0), 1u);
  EXPECT_EQ(GridBlocks(t, 16, 16, 132, 0), 1u);
  EXPECT_EQ(GridBlocks(t, 17, 16, 132, 0), 2u);
  EXPECT_EQ(GridBlocks(t, 131072, 16, 132, 0), 8192u);  // 1 GiB of 8 KiB units
  // More units than a grid can have blocks: capped at gridDim.x's limit (groups loop).
  EXPECT_EQ(GridBlocks(t, uint64_t{1} << 40, 16, 132, 0), 0x7FFFFFFFu);
  EXPECT_EQ(GridBlocks(t, (uint64_t{1} << 32) + 5, 1, 132, 0), 0x7FFFFFFFu);
  // Nothing to do still launches one block (callers skip empty copies before).
  EXPECT_EQ(GridBlocks(t, 0, 16, 132, 0), 1u);
}

TEST(PageCopyLaunchTest, PersistentAndCappedGrids) {
  PageCopyTuning t;
  t.persistent = true;  // the blocks that fit at once
  EXPECT_EQ(GridBlocks(t, 131072, 8, 132, 2), 264u);
  EXPECT_EQ(GridBlocks(t, 100, 8, 132, 2), 13u);  // fewer units than that: what they need
  t.blocks_per_sm = 1;                            // the cap wins over the occupancy
  EXPECT_EQ(GridBlocks(t, 131072, 8, 132, 2), 132u);
  t.persistent = false;  // a cap applies to one-pass grids as well
  EXPECT_EQ(GridBlocks(t, 131072, 8, 132, 0), 132u);
  t.blocks_per_sm = 0;
  EXPECT_EQ(GridBlocks(t, 131072, 8, 132, 0), 16384u);
}

}  // namespace
}  // namespace kvt::kernels

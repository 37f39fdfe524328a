// The launch arithmetic of the page copy, checked without a device: how items split into units,
// which unroll auto picks, and how many blocks a grid gets under each grid policy.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

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
  // Items near 2^63 bytes count their chunks without overflowing (and, being more than 2^31 - 1
  // chunks of any chunk size, stay whole).
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  t.chunk_bytes = std::numeric_limits<int32_t>::max() - 15;
  EXPECT_EQ(SplitItems(t, kMax).chunks_per_item, 1u);
  EXPECT_EQ(SplitItems(t, kMax).chunk_bytes, kMax);
  EXPECT_EQ(SplitItems(t, kMax - 1).chunks_per_item, 1u);
}

// A launch too small to give every multiprocessor kSmallLaunchUnitsPerSm units splits finer:
// one page of a 64-buffer pool (32 layers) on a 132-multiprocessor card.
TEST(PageCopyLaunchTest, SmallLaunchesSplitIntoSmallerChunks) {
  using internal::LaunchChunkBytes;
  PageCopyTuning t;  // 16 KiB chunks, 2 KiB at the least
  const int sms = 132;
  // 16 tokens (32 KiB items): 128 units of 16 KiB would leave most multiprocessors idle;
  // 2 MiB over 2112 wanted units is 993 bytes a unit, so the floor holds: 1024 units of 2 KiB.
  EXPECT_EQ(LaunchChunkBytes(t, 32768, 64, sms), 2048);
  // 64 tokens (128 KiB items): 8 MiB / 2112 = 3972 bytes, rounded up to a power of two.
  EXPECT_EQ(LaunchChunkBytes(t, 131072, 64, sms), 4096);
  // 1 token (2 KiB items): the items are no larger than the floor; they stay whole.
  EXPECT_EQ(SplitItems(t, 2048).chunks_per_item, 1u);
  EXPECT_EQ(LaunchChunkBytes(t, 2048, 64, sms), 2048);
  // A 1 GiB request (65536 units of 16 KiB), and a launch with as many items as wanted units,
  // keep the tuning's chunks.
  EXPECT_EQ(LaunchChunkBytes(t, 32768, 32768, sms), 16384);
  EXPECT_EQ(LaunchChunkBytes(t, 512, 2112, sms), 16384);
  // Never smaller than the floor, never larger than the tuning's chunk, always a multiple of 16.
  EXPECT_EQ(LaunchChunkBytes(t, 16, 1, sms), 2048);
  EXPECT_EQ(LaunchChunkBytes(t, int64_t{1} << 30, 1, sms), 16384);
  // Items too large to split, whose bytes in all pass 64 bits: the tuning's chunk, whole items.
  constexpr int64_t kHuge = (int64_t{1} << 62) + 1;
  EXPECT_EQ(SplitItems(t, kHuge).chunks_per_item, 1u);
  EXPECT_EQ(LaunchChunkBytes(t, kHuge, 64, sms), 16384);
  EXPECT_EQ(LaunchChunkBytes(t, std::numeric_limits<int64_t>::max(), 2, 1), 16384);
  t.min_chunk_bytes = 48;
  EXPECT_EQ(LaunchChunkBytes(t, 32768, 64, sms), 1024);
  EXPECT_EQ(LaunchChunkBytes(t, 1000, 1, sms), 48);
  // Turned off: min_chunk_bytes 0, not below chunk_bytes, or whole items (chunk_bytes 0).
  t.min_chunk_bytes = 0;
  EXPECT_EQ(LaunchChunkBytes(t, 32768, 64, sms), 16384);
  t.min_chunk_bytes = 16384;
  EXPECT_EQ(LaunchChunkBytes(t, 32768, 64, sms), 16384);
  t.min_chunk_bytes = 2048;
  t.chunk_bytes = 0;
  EXPECT_EQ(LaunchChunkBytes(t, 32768, 64, sms), 0);
  EXPECT_EQ(SplitItems(t, 32768).chunks_per_item, 1u);
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

// TiledCopyCpu against a naive byte loop; the tile-size rule; validation.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvt/kernels/kernels.h"
#include "test_buffers.h"

namespace kvt::kernels {
namespace {

using testing::DistinctIndices;
using testing::HostBytes;
using testing::Uniform;

TEST(TiledCopyTest, TileBytesFollowTheReferenceRule) {
  EXPECT_EQ(TileBytesForStride(0), 128);
  EXPECT_EQ(TileBytesForStride(4095), 128);
  EXPECT_EQ(TileBytesForStride(4096), 256);
  EXPECT_EQ(TileBytesForStride(8191), 256);
  EXPECT_EQ(TileBytesForStride(8192), 512);
  EXPECT_EQ(TileBytesForStride(1 << 20), 512);
}

TEST(TiledCopyTest, RandomRowsMatchNaiveLoop) {
  std::mt19937 rng(42);
  for (int iter = 0; iter < 200; ++iter) {
    const int32_t num_buffers = static_cast<int32_t>(Uniform(rng, 1, 6));
    const int64_t num_locs = Uniform(rng, 1, 15);
    const int64_t rows = 2 * num_locs + Uniform(rng, 0, 10);
    std::vector<int64_t> row_bytes;
    std::vector<std::unique_ptr<HostBytes>> bufs;
    std::vector<uint64_t> bases;
    int64_t max_row = 0;
    for (int32_t b = 0; b < num_buffers; ++b) {
      row_bytes.push_back(Uniform(rng, 0, 1) ? 16 * Uniform(rng, 1, 40) : Uniform(rng, 1, 700));
      max_row = std::max(max_row, row_bytes.back());
      bufs.push_back(
          std::make_unique<HostBytes>(rows * row_bytes.back(), Uniform(rng, 0, 15), rng));
      bases.push_back(bufs.back()->addr());
    }
    // Sources and targets disjoint: split one set of distinct rows.
    const std::vector<int32_t> picked = DistinctIndices(2 * num_locs, rows, rng);
    std::vector<int32_t> src(picked.begin(), picked.begin() + num_locs);
    std::vector<int32_t> tgt(picked.begin() + num_locs, picked.end());
    std::vector<std::vector<uint8_t>> want;
    for (int32_t b = 0; b < num_buffers; ++b) {
      std::vector<uint8_t> w = bufs[b]->Bytes();
      for (int64_t i = 0; i < num_locs; ++i) {
        for (int64_t k = 0; k < row_bytes[b]; ++k) {
          w[tgt[i] * row_bytes[b] + k] = w[src[i] * row_bytes[b] + k];
        }
      }
      want.push_back(std::move(w));
    }
    TiledCopyArgs a;
    a.bases = bases.data();
    a.row_bytes = row_bytes.data();
    a.num_buffers = num_buffers;
    a.tgt_loc = tgt.data();
    a.src_loc = src.data();
    a.num_locs = num_locs;
    a.max_row_bytes = max_row;
    a.bytes_per_tile = TileBytesForStride(max_row);
    ASSERT_TRUE(TiledCopyCpu(a).ok());
    for (int32_t b = 0; b < num_buffers; ++b) ASSERT_EQ(bufs[b]->Bytes(), want[b]) << iter;
  }
}

TEST(TiledCopyTest, RejectsBadArguments) {
  uint64_t bases[1] = {0x1000};
  int64_t row_bytes[1] = {256};
  int32_t loc[1] = {0};
  TiledCopyArgs a;
  a.bases = bases;
  a.row_bytes = row_bytes;
  a.num_buffers = 1;
  a.tgt_loc = loc;
  a.src_loc = loc;
  a.num_locs = 1;
  a.max_row_bytes = 256;

  TiledCopyArgs b = a;
  b.num_locs = -1;
  Status s = TiledCopyCpu(b);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("num_locs is -1"), std::string::npos) << s;

  b = a;
  b.bytes_per_tile = 0;
  s = TiledCopyCpu(b);
  EXPECT_NE(s.message().find("bytes_per_tile is 0"), std::string::npos) << s;

  b = a;
  b.src_loc = nullptr;
  s = TiledCopyCpu(b);
  EXPECT_NE(s.message().find("src_loc is null"), std::string::npos) << s;

  b = a;
  b.max_row_bytes = 128;  // smaller than row_bytes[0]
  s = TiledCopyCpu(b);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("row_bytes[0] is 256"), std::string::npos) << s;

  b = TiledCopyArgs{};
  b.num_buffers = 4;
  EXPECT_TRUE(TiledCopyCpu(b).ok());  // no locs: a no-op
}

}  // namespace
}  // namespace kvt::kernels

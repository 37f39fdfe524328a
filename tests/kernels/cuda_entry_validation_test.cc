// The CUDA entry points validate before touching the device, so these run on any machine:
// invalid arguments give InvalidArgument naming the value, empty inputs are no-ops.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kvt/kernels/kernels.h"
#include "kvt/kernels/tuning.h"

namespace kvt::kernels {
namespace {

TEST(CudaEntryValidationTest, InvalidArgumentsNeverReachTheDevice) {
  PageCopyArgs p;
  p.num_buffers = -4;
  Status s = PageCopyCuda(p, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("PageCopyCuda: num_buffers is -4"), std::string::npos) << s;

  PackArgs k;
  k.num_pages = -1;
  s = PackCuda(k, nullptr);
  EXPECT_NE(s.message().find("PackCuda: num_pages is -1"), std::string::npos) << s;
  s = UnpackCuda(k, nullptr);
  EXPECT_NE(s.message().find("UnpackCuda: num_pages is -1"), std::string::npos) << s;

  StoreArgs st;
  st.row_elems = -3;
  s = StoreCuda(st, nullptr);
  EXPECT_NE(s.message().find("StoreCuda: row_elems is -3"), std::string::npos) << s;

  TiledCopyArgs t;
  t.max_row_bytes = -9;
  s = TiledCopyCuda(t, nullptr);
  EXPECT_NE(s.message().find("TiledCopyCuda: max_row_bytes is -9"), std::string::npos) << s;

  PatternArgs pa;
  pa.num_layers = -1;
  s = FillPatternCuda(pa, nullptr);
  EXPECT_NE(s.message().find("FillPatternCuda: num_layers is -1"), std::string::npos) << s;
  s = VerifyPatternCuda(pa, nullptr).status();
  EXPECT_NE(s.message().find("VerifyPatternCuda: num_layers is -1"), std::string::npos) << s;

  PageCopyTuning tuning;
  tuning.unroll = 3;
  s = PageCopyCudaTuned(PageCopyArgs{}, tuning, nullptr);
  EXPECT_NE(s.message().find("unroll is 3"), std::string::npos) << s;
  EXPECT_NE(s.message().find("it must be 0 (auto), 4 or 8"), std::string::npos) << s;
  tuning.unroll = 4;
  tuning.threads_per_item = 48;
  s = PageCopyCudaTuned(PageCopyArgs{}, tuning, nullptr);
  EXPECT_NE(s.message().find("threads_per_item is 48"), std::string::npos) << s;
  tuning.threads_per_item = 32;
  tuning.chunk_bytes = 1000;
  s = PageCopyCudaTuned(PageCopyArgs{}, tuning, nullptr);
  EXPECT_NE(s.message().find("chunk_bytes is 1000"), std::string::npos) << s;
  tuning.chunk_bytes = -16;
  s = PageCopyCudaTuned(PageCopyArgs{}, tuning, nullptr);
  EXPECT_NE(s.message().find("chunk_bytes is -16"), std::string::npos) << s;
}

// Inline tables: the block must fit in a launch's parameters and hold every table the arguments
// name, aligned; each refusal names the value before anything reaches the device.
TEST(CudaEntryValidationTest, InlineTablesMustFitAndHoldEveryTable) {
  std::vector<uint64_t> tables(8, 0);
  PageCopyArgs a;
  a.num_buffers = 2;
  a.num_pages = 1;
  a.bytes = 64;
  a.src_page_stride = a.dst_page_stride = 64;
  a.src_bases = tables.data();
  a.dst_bases = tables.data() + 2;
  a.src_pages = reinterpret_cast<const int32_t*>(tables.data() + 4);
  a.dst_pages = a.src_pages + 1;

  std::vector<uint64_t> big(kPageCopyInlineTableWords + 1, 0);
  Status s = PageCopyCudaInline(a, big.data(), big.size(), nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("tables of " + std::to_string(big.size()) + " words; at most " +
                             std::to_string(kPageCopyInlineTableWords)),
            std::string::npos)
      << s;

  PageCopyArgs outside = a;
  outside.dst_bases = tables.data() + 7;  // two entries from the last word: one past the end
  s = PageCopyCudaInline(outside, tables.data(), tables.size(), nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("dst_bases (2 entries of 8 bytes) is not an aligned range inside "
                             "`tables` (64 bytes)"),
            std::string::npos)
      << s;

  const std::vector<uint64_t> elsewhere(2, 0);
  outside = a;
  outside.src_bases = elsewhere.data();
  s = PageCopyCudaInline(outside, tables.data(), tables.size(), nullptr);
  EXPECT_NE(s.message().find("src_bases (2 entries"), std::string::npos) << s;

  PageCopyArgs misaligned = a;
  misaligned.src_bases =
      reinterpret_cast<const uint64_t*>(reinterpret_cast<const char*>(tables.data()) + 4);
  s = PageCopyCudaInline(misaligned, tables.data(), tables.size(), nullptr);
  EXPECT_NE(s.message().find("src_bases (2 entries"), std::string::npos) << s;

  PageCopyArgs pages = a;
  pages.num_pages = 9;  // 36 bytes of page list from byte 32: past the 64-byte block
  s = PageCopyCudaInline(pages, tables.data(), tables.size(), nullptr);
  EXPECT_NE(s.message().find("src_pages (9 entries of 4 bytes)"), std::string::npos) << s;

  PageCopyArgs negative = a;
  negative.num_pages = -1;
  s = PageCopyCudaInline(negative, tables.data(), tables.size(), nullptr);
  EXPECT_NE(s.message().find("PageCopyCudaInline: num_pages is -1"), std::string::npos) << s;

  PageCopyArgs empty = a;
  empty.num_pages = 0;  // nothing to copy: no tables needed, nothing launched
  EXPECT_TRUE(PageCopyCudaInline(empty, nullptr, 0, nullptr).ok());
}

// The default tuning: a one-pass grid of 512-thread blocks, 16 KiB units, unroll chosen per
// unit, no streaming hints; it validates without a device.
TEST(CudaEntryValidationTest, DefaultTuningIsTheOnePassGrid) {
  const PageCopyTuning t = DefaultPageCopyTuning();
  EXPECT_FALSE(t.persistent);
  EXPECT_EQ(t.unroll, 0);
  EXPECT_EQ(t.threads_per_block, 512);
  EXPECT_EQ(t.chunk_bytes, 16384);
  EXPECT_EQ(t.blocks_per_sm, 0);
  EXPECT_FALSE(t.streaming);
  EXPECT_TRUE(PageCopyCudaTuned(PageCopyArgs{}, t, nullptr).ok());
  PageCopyTuning p = t;
  p.persistent = true;
  EXPECT_TRUE(PageCopyCudaTuned(PageCopyArgs{}, p, nullptr).ok());
  p.blocks_per_sm = -1;
  const Status s = PageCopyCudaTuned(PageCopyArgs{}, p, nullptr);
  EXPECT_NE(s.message().find("blocks_per_sm is -1; it must be >= 0"), std::string::npos) << s;
}

// The pack / unpack entry points validate their tuning like PageCopyCudaTuned, before the device
// is touched; empty inputs stay no-ops.
TEST(CudaEntryValidationTest, PackTuningIsValidated) {
  PageCopyTuning t;
  t.unroll = 8;
  t.threads_per_block = 256;
  EXPECT_TRUE(PackCudaTuned(PackArgs{}, t, nullptr).ok());
  EXPECT_TRUE(UnpackCudaTuned(PackArgs{}, t, nullptr).ok());
  t.unroll = 3;
  Status s = PackCudaTuned(PackArgs{}, t, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("unroll is 3; it must be 0 (auto), 4 or 8"), std::string::npos) << s;
  s = UnpackCudaTuned(PackArgs{}, t, nullptr);
  EXPECT_NE(s.message().find("unroll is 3"), std::string::npos) << s;
  t.unroll = 4;
  t.chunk_bytes = 24;
  s = PackCudaTuned(PackArgs{}, t, nullptr);
  EXPECT_NE(s.message().find("chunk_bytes is 24"), std::string::npos) << s;
  t.chunk_bytes = 0;
  PackArgs k;
  k.num_pages = -1;
  s = PackCudaTuned(k, t, nullptr);
  EXPECT_NE(s.message().find("PackCuda: num_pages is -1"), std::string::npos) << s;
  s = UnpackCudaTuned(k, t, nullptr);
  EXPECT_NE(s.message().find("UnpackCuda: num_pages is -1"), std::string::npos) << s;
}

TEST(CudaEntryValidationTest, EmptyInputsAreNoOpsEvenWithoutDevice) {
  EXPECT_TRUE(PageCopyCuda(PageCopyArgs{}, nullptr).ok());
  EXPECT_TRUE(PackCuda(PackArgs{}, nullptr).ok());
  EXPECT_TRUE(UnpackCuda(PackArgs{}, nullptr).ok());
  EXPECT_TRUE(StoreCuda(StoreArgs{}, nullptr).ok());
  EXPECT_TRUE(TiledCopyCuda(TiledCopyArgs{}, nullptr).ok());
  EXPECT_TRUE(FillPatternCuda(PatternArgs{}, nullptr).ok());
  auto r = VerifyPatternCuda(PatternArgs{}, nullptr);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->mismatches, 0u);
}

}  // namespace
}  // namespace kvt::kernels

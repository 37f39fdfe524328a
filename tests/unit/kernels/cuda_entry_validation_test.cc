// The CUDA entry points validate before touching the device, so these run on any machine:
// invalid arguments give InvalidArgument naming the value, empty inputs are no-ops.
#include <gtest/gtest.h>

#include <string>

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

// The default tuning is the one docs/kernels.md measured best (session 6): a one-pass grid of
// 512-thread blocks, 16 KiB units, unroll chosen per unit, no streaming hints; it validates
// without a device.
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

// The session 3 knobs (pipeline, async_smem, async_stages) are checked before the device is
// touched, through every tuned entry point.
TEST(CudaEntryValidationTest, Session3TuningKnobsAreValidated) {
  auto message = [](const PageCopyTuning& t) {
    return PageCopyCudaTuned(PageCopyArgs{}, t, nullptr).message();
  };
  PageCopyTuning t;
  EXPECT_EQ(t.pipeline, false);
  EXPECT_EQ(t.async_smem, false);
  t.async_stages = 1;
  EXPECT_NE(message(t).find("async_stages is 1; it must be in [2, 8]"), std::string::npos)
      << message(t);
  t.async_stages = 9;
  EXPECT_NE(message(t).find("async_stages is 9"), std::string::npos) << message(t);
  t.async_stages = 4;

  t.pipeline = true;
  t.async_smem = true;
  EXPECT_NE(message(t).find("pipeline and async_smem are both set"), std::string::npos)
      << message(t);

  t.async_smem = false;
  t.threads_per_item = 0;
  EXPECT_NE(message(t).find("threads_per_item is 0; pipeline copies one unit per warp and needs "
                            "32"),
            std::string::npos)
      << message(t);
  t.pipeline = false;
  t.async_smem = true;
  t.threads_per_item = 64;
  EXPECT_NE(message(t).find("threads_per_item is 64; async_smem copies one unit per warp"),
            std::string::npos)
      << message(t);
  t.threads_per_item = 32;

  // Shared memory: 16 warps x 7 stages x unroll 4 x 512 B = 224 KiB fits; 8 stages do not.
  t.threads_per_block = 512;
  t.unroll = 4;
  t.async_stages = 7;
  EXPECT_TRUE(PageCopyCudaTuned(PageCopyArgs{}, t, nullptr).ok()) << message(t);
  t.async_stages = 8;
  EXPECT_NE(message(t).find("async_smem needs 262144 bytes of shared memory per block"),
            std::string::npos)
      << message(t);
  EXPECT_NE(message(t).find("at most 232448 fit"), std::string::npos) << message(t);
  t.threads_per_block = 256;
  t.unroll = 8;
  EXPECT_NE(message(t).find("async_smem needs 262144 bytes"), std::string::npos) << message(t);
  t.async_stages = 6;  // 8 warps x 6 x 8 x 512 B = 192 KiB
  EXPECT_TRUE(PageCopyCudaTuned(PageCopyArgs{}, t, nullptr).ok()) << message(t);

  // The pack / unpack entry points validate the same way; empty inputs stay no-ops.
  EXPECT_TRUE(PackCudaTuned(PackArgs{}, t, nullptr).ok());
  EXPECT_TRUE(UnpackCudaTuned(PackArgs{}, t, nullptr).ok());
  t.async_stages = 0;
  Status s = PackCudaTuned(PackArgs{}, t, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("async_stages is 0"), std::string::npos) << s;
  s = UnpackCudaTuned(PackArgs{}, t, nullptr);
  EXPECT_NE(s.message().find("async_stages is 0"), std::string::npos) << s;
  t.async_stages = 4;
  PackArgs k;
  k.num_pages = -1;
  s = PackCudaTuned(k, t, nullptr);
  EXPECT_NE(s.message().find("PackCuda: num_pages is -1"), std::string::npos) << s;
  s = UnpackCudaTuned(k, t, nullptr);
  EXPECT_NE(s.message().find("UnpackCuda: num_pages is -1"), std::string::npos) << s;

  // The variants copy with the unroll they are given: 0 (auto) is refused for them.
  PageCopyTuning autounroll;
  autounroll.pipeline = true;
  EXPECT_NE(message(autounroll).find("pipeline needs an explicit unroll (4 or 8), not 0 (auto)"),
            std::string::npos)
      << message(autounroll);
  autounroll.pipeline = false;
  autounroll.async_smem = true;
  EXPECT_NE(message(autounroll).find("async_smem needs an explicit unroll"), std::string::npos)
      << message(autounroll);

  // The pipeline variant with both unrolls and block sizes validates.
  for (int unroll : {4, 8}) {
    for (int threads : {256, 512}) {
      PageCopyTuning p;
      p.pipeline = true;
      p.unroll = unroll;
      p.threads_per_block = threads;
      EXPECT_TRUE(PageCopyCudaTuned(PageCopyArgs{}, p, nullptr).ok()) << message(p);
    }
  }
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

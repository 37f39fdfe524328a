// PageCopyCpu / PackCpu / UnpackCpu against a naive byte loop on random layouts, and argument
// validation.
#include <gtest/gtest.h>

#include <cstring>
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

struct RandomCopy {
  int32_t num_buffers;
  int64_t num_pages;
  int64_t bytes, src_stride, dst_stride, src_offset, dst_offset;
  int64_t src_pool_pages, dst_pool_pages;
  std::vector<std::unique_ptr<HostBytes>> src, dst;
  std::vector<uint64_t> src_bases, dst_bases;
  std::vector<int32_t> src_pages, dst_pages;
  bool src_indexed, dst_indexed;

  explicit RandomCopy(std::mt19937& rng) {
    num_buffers = static_cast<int32_t>(Uniform(rng, 1, 6));
    num_pages = Uniform(rng, 1, 24);
    bytes = Uniform(rng, 1, 3) == 1 ? 16 * Uniform(rng, 1, 20) : Uniform(rng, 1, 301);
    src_offset = Uniform(rng, 0, 2) == 0 ? 0 : Uniform(rng, 0, 19);
    dst_offset = Uniform(rng, 0, 2) == 0 ? 0 : Uniform(rng, 0, 19);
    src_stride = src_offset + bytes + Uniform(rng, 0, 33);
    dst_stride = dst_offset + bytes + Uniform(rng, 0, 33);
    src_indexed = Uniform(rng, 0, 3) != 0;
    dst_indexed = Uniform(rng, 0, 3) != 0;
    src_pool_pages = src_indexed ? num_pages + Uniform(rng, 0, 20) : num_pages;
    dst_pool_pages = dst_indexed ? num_pages + Uniform(rng, 0, 20) : num_pages;
    for (int32_t b = 0; b < num_buffers; ++b) {
      src.push_back(
          std::make_unique<HostBytes>(src_pool_pages * src_stride, Uniform(rng, 0, 17), rng));
      dst.push_back(
          std::make_unique<HostBytes>(dst_pool_pages * dst_stride, Uniform(rng, 0, 17), rng));
      dst.back()->Fill(0xA5);
      src_bases.push_back(src.back()->addr());
      dst_bases.push_back(dst.back()->addr());
    }
    if (src_indexed) src_pages = DistinctIndices(num_pages, src_pool_pages, rng);
    if (dst_indexed) dst_pages = DistinctIndices(num_pages, dst_pool_pages, rng);
  }

  PageCopyArgs Args() const {
    PageCopyArgs a;
    a.src_bases = src_bases.data();
    a.dst_bases = dst_bases.data();
    a.num_buffers = num_buffers;
    a.src_pages = src_indexed ? src_pages.data() : nullptr;
    a.dst_pages = dst_indexed ? dst_pages.data() : nullptr;
    a.num_pages = num_pages;
    a.src_page_stride = src_stride;
    a.dst_page_stride = dst_stride;
    a.src_offset = src_offset;
    a.dst_offset = dst_offset;
    a.bytes = bytes;
    return a;
  }

  // The expected destination buffers, computed byte by byte.
  std::vector<std::vector<uint8_t>> Naive() const {
    std::vector<std::vector<uint8_t>> out;
    for (int32_t b = 0; b < num_buffers; ++b) {
      std::vector<uint8_t> d = dst[b]->Bytes();
      for (int64_t i = 0; i < num_pages; ++i) {
        const int64_t sp = src_indexed ? src_pages[i] : i;
        const int64_t dp = dst_indexed ? dst_pages[i] : i;
        for (int64_t k = 0; k < bytes; ++k) {
          d[dp * dst_stride + dst_offset + k] = src[b]->data()[sp * src_stride + src_offset + k];
        }
      }
      out.push_back(std::move(d));
    }
    return out;
  }
};

TEST(PageCopyCpuTest, RandomLayoutsMatchNaiveLoop) {
  std::mt19937 rng(20240601);
  for (int iter = 0; iter < 300; ++iter) {
    RandomCopy c(rng);
    const auto expected = c.Naive();
    ASSERT_TRUE(PageCopyCpu(c.Args()).ok());
    for (int32_t b = 0; b < c.num_buffers; ++b) {
      ASSERT_EQ(c.dst[b]->Bytes(), expected[b]) << "iteration " << iter << " buffer " << b;
    }
  }
}

TEST(PageCopyCpuTest, PackMatchesNaiveAndUnpackRestores) {
  std::mt19937 rng(7);
  for (int iter = 0; iter < 200; ++iter) {
    const int32_t num_buffers = static_cast<int32_t>(Uniform(rng, 1, 5));
    const int64_t num_pages = Uniform(rng, 1, 17);
    const int64_t bytes = Uniform(rng, 1, 200);
    const int64_t offset = Uniform(rng, 0, 9);
    const int64_t stride = offset + bytes + Uniform(rng, 0, 20);
    const int64_t pool_pages = num_pages + Uniform(rng, 0, 10);
    std::vector<std::unique_ptr<HostBytes>> pool;
    std::vector<uint64_t> bases;
    for (int32_t b = 0; b < num_buffers; ++b) {
      pool.push_back(std::make_unique<HostBytes>(pool_pages * stride, Uniform(rng, 0, 15), rng));
      bases.push_back(pool.back()->addr());
    }
    const std::vector<int32_t> pages = DistinctIndices(num_pages, pool_pages, rng);
    HostBytes staging(num_buffers * num_pages * bytes, Uniform(rng, 0, 15), rng);
    staging.Fill(0xA5);

    PackArgs a;
    a.bases = bases.data();
    a.num_buffers = num_buffers;
    a.pages = pages.data();
    a.num_pages = num_pages;
    a.page_stride = stride;
    a.offset = offset;
    a.bytes = bytes;
    a.staging = staging.data();
    ASSERT_TRUE(PackCpu(a).ok());
    for (int32_t b = 0; b < num_buffers; ++b) {
      for (int64_t i = 0; i < num_pages; ++i) {
        for (int64_t k = 0; k < bytes; ++k) {
          ASSERT_EQ(staging.data()[(b * num_pages + i) * bytes + k],
                    pool[b]->data()[pages[i] * stride + offset + k]);
        }
      }
    }
    // Unpack into a poisoned copy of the pool: exactly the packed ranges come back.
    std::vector<std::vector<uint8_t>> original;
    for (auto& p : pool) {
      original.push_back(p->Bytes());
      for (int64_t i = 0; i < num_pages; ++i) {
        std::memset(p->data() + pages[i] * stride + offset, 0xA5, bytes);
      }
    }
    ASSERT_TRUE(UnpackCpu(a).ok());
    for (int32_t b = 0; b < num_buffers; ++b) ASSERT_EQ(pool[b]->Bytes(), original[b]);
  }
}

TEST(PageCopyCpuTest, EmptyInputsAreNoOps) {
  PageCopyArgs a;  // all zero / null
  EXPECT_TRUE(PageCopyCpu(a).ok());
  a.num_buffers = 3;  // no pages
  EXPECT_TRUE(PageCopyCpu(a).ok());
  a.num_pages = 5;  // no bytes
  EXPECT_TRUE(PageCopyCpu(a).ok());
  PackArgs p;
  p.num_buffers = 2;
  EXPECT_TRUE(PackCpu(p).ok());
  EXPECT_TRUE(UnpackCpu(p).ok());
}

struct BadCopy {
  const char* name;
  void (*mutate)(PageCopyArgs&);
  const char* needle;
};

class PageCopyInvalidTest : public ::testing::TestWithParam<BadCopy> {};

TEST_P(PageCopyInvalidTest, IsInvalidArgumentNamingTheValue) {
  static const uint64_t bases[2] = {0x1000, 0x2000};
  PageCopyArgs a;
  a.src_bases = bases;
  a.dst_bases = bases;
  a.num_buffers = 2;
  a.num_pages = 4;
  a.src_page_stride = 64;
  a.dst_page_stride = 64;
  a.bytes = 32;
  GetParam().mutate(a);
  Status s = PageCopyCpu(a);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(GetParam().needle), std::string::npos) << s;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, PageCopyInvalidTest,
    ::testing::Values(
        BadCopy{"negative_buffers", [](PageCopyArgs& a) { a.num_buffers = -1; },
                "num_buffers is -1"},
        BadCopy{"negative_pages", [](PageCopyArgs& a) { a.num_pages = -3; }, "num_pages is -3"},
        BadCopy{"negative_bytes", [](PageCopyArgs& a) { a.bytes = -8; }, "bytes is -8"},
        BadCopy{"negative_offset", [](PageCopyArgs& a) { a.dst_offset = -2; }, "dst_offset is -2"},
        BadCopy{"negative_stride", [](PageCopyArgs& a) { a.src_page_stride = -64; },
                "src_page_stride is -64"},
        BadCopy{"null_src", [](PageCopyArgs& a) { a.src_bases = nullptr; }, "src_bases is null"},
        BadCopy{"null_dst", [](PageCopyArgs& a) { a.dst_bases = nullptr; }, "dst_bases is null"},
        BadCopy{"range_past_stride", [](PageCopyArgs& a) { a.src_offset = 40; },
                "src_offset (40) + bytes (32) exceeds src_page_stride (64)"}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(PageCopyCpuTest, PackRejectsNullStagingAndNegativeValues) {
  static const uint64_t bases[1] = {0x1000};
  static const int32_t pages[1] = {0};
  PackArgs a;
  a.bases = bases;
  a.num_buffers = 1;
  a.pages = pages;
  a.num_pages = 1;
  a.page_stride = 64;
  a.bytes = 64;
  Status s = PackCpu(a);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("staging is null"), std::string::npos) << s;
  a.offset = -1;
  s = UnpackCpu(a);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("offset is -1"), std::string::npos) << s;
}

}  // namespace
}  // namespace kvt::kernels

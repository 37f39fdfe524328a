// PageCopyCuda / PackCuda / UnpackCuda (and the tuned variants) against the CPU reference on
// random data, destinations poisoned with 0xA5 first, every byte compared.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/kernels/kernels.h"
#include "kvt/kernels/tuning.h"

namespace kvt::kernels {
namespace {

using testing::DeviceBytes;
using testing::DistinctIndices;
using testing::ToDevice;

struct CopyCase {
  const char* name;
  int32_t num_buffers;
  int64_t num_pages;
  int64_t bytes;
  int64_t src_offset, dst_offset;
  int64_t src_stride_extra, dst_stride_extra;
  size_t src_misalign, dst_misalign;
  bool src_indexed, dst_indexed;
};

void PrintTo(const CopyCase& c, std::ostream* os) { *os << c.name; }

// Builds the case on host and device, runs `run` on the device arguments, runs PageCopyCpu on
// the host mirrors, and compares every destination byte.
template <typename Run>
void CheckCopy(const CopyCase& c, uint32_t seed, Run run) {
  std::mt19937 rng(seed);
  const int64_t src_stride = c.src_offset + c.bytes + c.src_stride_extra;
  const int64_t dst_stride = c.dst_offset + c.bytes + c.dst_stride_extra;
  const int64_t src_pool = c.src_indexed ? c.num_pages * 3 / 2 + 3 : c.num_pages;
  const int64_t dst_pool = c.dst_indexed ? c.num_pages * 3 / 2 + 3 : c.num_pages;
  std::vector<std::unique_ptr<DeviceBytes>> src, dst;
  std::vector<uint64_t> src_dev, dst_dev, src_host, dst_host;
  for (int32_t b = 0; b < c.num_buffers; ++b) {
    src.push_back(std::make_unique<DeviceBytes>());
    dst.push_back(std::make_unique<DeviceBytes>());
    KVT_ASSERT_OK(src.back()->Init(src_pool * src_stride, c.src_misalign));
    KVT_ASSERT_OK(dst.back()->Init(dst_pool * dst_stride, c.dst_misalign));
    src.back()->Randomize(rng);
    std::fill(dst.back()->host.begin(), dst.back()->host.end(), 0xA5);
    KVT_ASSERT_OK(src.back()->Upload());
    KVT_ASSERT_OK(dst.back()->Upload());
    src_dev.push_back(src.back()->addr());
    dst_dev.push_back(dst.back()->addr());
    src_host.push_back(src.back()->host_addr());
    dst_host.push_back(dst.back()->host_addr());
  }
  std::vector<int32_t> src_pages = DistinctIndices(c.num_pages, src_pool, rng);
  std::vector<int32_t> dst_pages = DistinctIndices(c.num_pages, dst_pool, rng);
  auto d_src_bases = ToDevice(src_dev);
  auto d_dst_bases = ToDevice(dst_dev);
  auto d_src_pages = ToDevice(src_pages);
  auto d_dst_pages = ToDevice(dst_pages);
  ASSERT_TRUE(d_src_bases.ok() && d_dst_bases.ok() && d_src_pages.ok() && d_dst_pages.ok());

  PageCopyArgs a;
  a.num_buffers = c.num_buffers;
  a.num_pages = c.num_pages;
  a.src_page_stride = src_stride;
  a.dst_page_stride = dst_stride;
  a.src_offset = c.src_offset;
  a.dst_offset = c.dst_offset;
  a.bytes = c.bytes;
  PageCopyArgs dev = a, host = a;
  dev.src_bases = d_src_bases->as<uint64_t>();
  dev.dst_bases = d_dst_bases->as<uint64_t>();
  dev.src_pages = c.src_indexed ? d_src_pages->as<int32_t>() : nullptr;
  dev.dst_pages = c.dst_indexed ? d_dst_pages->as<int32_t>() : nullptr;
  host.src_bases = src_host.data();
  host.dst_bases = dst_host.data();
  host.src_pages = c.src_indexed ? src_pages.data() : nullptr;
  host.dst_pages = c.dst_indexed ? dst_pages.data() : nullptr;

  auto stream = cuda::Stream::Create();
  ASSERT_TRUE(stream.ok()) << stream.status();
  KVT_ASSERT_OK(run(dev, stream->get()));
  KVT_ASSERT_OK(stream->Synchronize());
  KVT_ASSERT_OK(PageCopyCpu(host));
  for (int32_t b = 0; b < c.num_buffers; ++b) {
    auto got = dst[b]->Download();
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(*got, dst[b]->host) << c.name << ": buffer " << b << " differs";
  }
}

const CopyCase kCases[] = {
    {"aligned_2KiB_items", 8, 300, 2048, 0, 0, 0, 0, 0, 0, true, true},
    {"aligned_32KiB_items", 4, 40, 32768, 0, 0, 0, 0, 0, 0, true, true},
    {"aligned_128KiB_items", 2, 9, 131072, 0, 0, 0, 0, 0, 0, true, true},
    {"many_items_grid_stride", 64, 700, 256, 0, 0, 0, 0, 0, 0, true, true},
    {"single_item", 1, 1, 2048, 0, 0, 0, 0, 0, 0, true, true},
    {"vector_body_odd_tail", 3, 50, 16 * 37 + 5, 0, 0, 11, 11, 0, 0, true, true},
    {"eight_aligned", 3, 50, 1000, 8, 24, 8, 0, 0, 0, true, true},
    {"four_aligned", 3, 50, 998, 4, 0, 0, 4, 4, 0, true, true},
    {"two_aligned", 3, 50, 998, 2, 6, 0, 2, 2, 2, true, true},
    {"odd_everything", 5, 33, 333, 1, 3, 7, 5, 1, 3, true, true},
    {"src_aligned_dst_not", 4, 60, 4096, 0, 3, 0, 0, 0, 0, true, true},
    {"tiny_items", 6, 100, 3, 1, 2, 0, 1, 0, 0, true, true},
    {"identity_source", 4, 64, 2048, 0, 0, 0, 0, 0, 0, false, true},
    {"identity_destination", 4, 64, 2048, 0, 0, 0, 0, 0, 0, true, false},
    {"offset_inside_page", 4, 64, 512, 256, 1024, 1024, 512, 0, 0, true, true},
};

class PageCopyGpuTest : public ::testing::TestWithParam<CopyCase> {};

TEST_P(PageCopyGpuTest, MatchesCpuReference) {
  KVT_SKIP_WITHOUT_GPU();
  CheckCopy(GetParam(), 1234,
            [](const PageCopyArgs& a, cudaStream_t s) { return PageCopyCuda(a, s); });
}

TEST_P(PageCopyGpuTest, EveryTuningMatchesCpuReference) {
  KVT_SKIP_WITHOUT_GPU();
  for (int unroll : {0, 4, 8}) {
    for (bool streaming : {false, true}) {
      for (int threads : {32, 256, 512}) {
        for (int per_item : {0, 32, 128, threads}) {
          if (per_item > threads || (per_item == threads && per_item <= 128)) continue;
          for (bool page_major : {false, true}) {
            PageCopyTuning t;
            t.unroll = unroll;
            t.streaming = streaming;
            t.threads_per_block = threads;
            t.threads_per_item = per_item;
            t.page_major = page_major;
            t.chunk_bytes = 0;  // whole items here; chunks in ChunkedTuningsMatchCpuReference
            // Grids: one-pass (unroll 0), persistent (4), and smaller than the work (8).
            t.persistent = unroll == 4;
            t.blocks_per_sm = unroll == 8 ? 1 : 0;
            SCOPED_TRACE(::testing::Message()
                         << "unroll " << unroll << " streaming " << streaming << " threads "
                         << threads << " per_item " << per_item << " page_major " << page_major);
            CheckCopy(GetParam(), 99, [&](const PageCopyArgs& a, cudaStream_t s) {
              return PageCopyCudaTuned(a, t, s);
            });
            if (HasFatalFailure()) return;
          }
        }
      }
    }
  }
}

// Items split into chunks (the last one shorter, tails and narrow accesses per chunk), with and
// without the L2 bulk prefetch, on every layout.
TEST_P(PageCopyGpuTest, ChunkedTuningsMatchCpuReference) {
  KVT_SKIP_WITHOUT_GPU();
  for (int unroll : {0, 4, 8}) {
    for (int chunk : {16, 48, 512, 4096, 8192, 16384}) {
      for (bool prefetch : {false, true}) {
        for (int threads : {256, 512}) {
          PageCopyTuning t = DefaultPageCopyTuning();
          t.unroll = unroll;
          t.chunk_bytes = chunk;
          t.prefetch_l2 = prefetch;
          t.threads_per_block = threads;
          t.persistent = prefetch;                // both grid policies
          t.blocks_per_sm = chunk == 48 ? 1 : 0;  // also a grid smaller than the work
          SCOPED_TRACE(::testing::Message()
                       << "unroll " << unroll << " chunk " << chunk << " prefetch " << prefetch
                       << " threads " << threads << " persistent " << t.persistent);
          CheckCopy(GetParam(), 17, [&](const PageCopyArgs& a, cudaStream_t s) {
            return PageCopyCudaTuned(a, t, s);
          });
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, PageCopyGpuTest, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// ---- Edge layouts under several tunings --------------------------------------------------
//
// One lane round of unroll 4 is 128 16-byte vectors (2 KiB), of unroll 8 256 (4 KiB). These
// layouts add, to kCases, units shorter than one lane round, exact multiples of a round, many
// rounds plus a partial round plus a tail under 16 bytes, aligned and narrow units mixed in one
// launch, and a partial last chunk at 8 KiB chunks.
const CopyCase kEdgeCases[] = {
    {"one_vector", 4, 50, 16, 0, 0, 0, 0, 0, 0, true, true},
    {"part_lane_round_tail", 3, 40, 16 * 20 + 3, 0, 0, 13, 13, 0, 0, true, true},
    {"exact_rounds", 2, 20, 4096 * 5, 0, 0, 0, 0, 0, 0, true, true},
    // 21 rounds of 2 KiB + 45 vectors + 7 bytes; stride a multiple of 16: all items aligned.
    {"many_rounds_tail", 2, 12, 2048 * 21 + 16 * 45 + 7, 0, 0, 9, 9, 0, 0, true, true},
    // The same length with strides that are not: odd pages' items take the narrow path.
    {"many_rounds_mixed_alignment", 2, 12, 2048 * 21 + 16 * 45 + 7, 0, 0, 0, 0, 0, 0, true, true},
    {"partial_last_chunk", 3, 10, 8192 * 3 + 16 * 70 + 8, 0, 0, 8, 8, 0, 0, true, true},
    {"eight_aligned_large", 2, 20, 32768, 4, 4, 0, 0, 4, 4, true, true},
    {"dst_odd_large", 2, 10, 32768 + 5, 0, 1, 11, 0, 0, 0, true, true},
    {"offset_48_large", 3, 16, 16384 + 16 * 9, 48, 16, 0, 0, 0, 0, true, true},
};

std::vector<CopyCase> EdgeCases() {
  std::vector<CopyCase> out(std::begin(kCases), std::end(kCases));
  out.insert(out.end(), std::begin(kEdgeCases), std::end(kEdgeCases));
  return out;
}

std::string TuningName(const PageCopyTuning& t) {
  std::ostringstream n;
  n << "u" << t.unroll << " t" << t.threads_per_block << " c" << t.chunk_bytes << " b"
    << t.blocks_per_sm << " s" << (t.streaming ? 1 : 0);
  if (t.persistent) n << " persistent";
  if (t.prefetch_l2) n << " pf";
  return n.str();
}

// Tunings the edge layouts run under: every unroll, 64..512 threads per block, whole items,
// 8 KiB and tiny 48-byte chunks, both grid policies, grids smaller than the work
// (blocks_per_sm 1), both cache hints.
std::vector<PageCopyTuning> EdgeTunings() {
  std::vector<PageCopyTuning> out;
  for (int unroll : {0, 4, 8}) {
    for (int threads : {64, 256, 512}) {
      for (int chunk : {0, 8192}) {
        PageCopyTuning t = DefaultPageCopyTuning();
        t.unroll = unroll;
        t.threads_per_block = threads;
        t.chunk_bytes = chunk;
        t.blocks_per_sm = chunk == 0 ? 1 : 0;
        t.persistent = threads == 256;  // both grid policies
        t.streaming = threads == 64;    // both cache hints
        out.push_back(t);
      }
    }
    PageCopyTuning t = DefaultPageCopyTuning();
    t.unroll = unroll;
    t.chunk_bytes = 48;
    t.blocks_per_sm = 1;
    out.push_back(t);
  }
  return out;
}

class PageCopyEdgeGpuTest : public ::testing::TestWithParam<CopyCase> {};

TEST_P(PageCopyEdgeGpuTest, MatchesCpuReference) {
  KVT_SKIP_WITHOUT_GPU();
  uint32_t seed = 300;
  for (const PageCopyTuning& t : EdgeTunings()) {
    SCOPED_TRACE(TuningName(t));
    CheckCopy(GetParam(), seed++,
              [&](const PageCopyArgs& a, cudaStream_t s) { return PageCopyCudaTuned(a, t, s); });
    if (HasFatalFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, PageCopyEdgeGpuTest, ::testing::ValuesIn(EdgeCases()),
                         [](const auto& info) { return std::string(info.param.name); });

// Random layouts (lengths, offsets, strides, misalignments), each with a random tuning.
TEST(PageCopyEdgeGpuRandomTest, RandomLayoutsAndTunings) {
  KVT_SKIP_WITHOUT_GPU();
  const std::vector<PageCopyTuning> tunings = EdgeTunings();
  std::mt19937 rng(3003);
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int iter = 0; iter < 60; ++iter) {
    CopyCase c{"random",
               static_cast<int32_t>(pick(1, 6)),
               pick(1, 40),
               pick(0, 1) ? 16 * pick(1, 3000) : pick(1, 50000),
               pick(0, 1) ? 0 : 16 * pick(0, 4),
               pick(0, 1) ? 0 : pick(0, 40),
               pick(0, 1) ? 0 : 16 * pick(0, 4),
               pick(0, 1) ? 0 : pick(0, 64),
               static_cast<size_t>(pick(0, 2) ? 0 : pick(0, 15)),
               static_cast<size_t>(pick(0, 2) ? 0 : pick(0, 15)),
               pick(0, 3) != 0,
               pick(0, 3) != 0};
    const PageCopyTuning& t = tunings[static_cast<size_t>(pick(0, tunings.size() - 1))];
    SCOPED_TRACE(::testing::Message()
                 << "iter " << iter << ": " << TuningName(t) << ", bytes " << c.bytes);
    CheckCopy(c, static_cast<uint32_t>(iter),
              [&](const PageCopyArgs& a, cudaStream_t s) { return PageCopyCudaTuned(a, t, s); });
    if (HasFatalFailure()) return;
  }
}

TEST(PageCopyGpuRandomTest, RandomLayouts) {
  KVT_SKIP_WITHOUT_GPU();
  std::mt19937 rng(77);
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int iter = 0; iter < 40; ++iter) {
    CopyCase c{"random",
               static_cast<int32_t>(pick(1, 9)),
               pick(1, 80),
               pick(0, 1) ? 16 * pick(1, 300) : pick(1, 5000),
               pick(0, 1) ? 0 : pick(0, 40),
               pick(0, 1) ? 0 : pick(0, 40),
               pick(0, 1) ? 0 : pick(0, 64),
               pick(0, 1) ? 0 : pick(0, 64),
               static_cast<size_t>(pick(0, 1) ? 0 : pick(0, 15)),
               static_cast<size_t>(pick(0, 1) ? 0 : pick(0, 15)),
               pick(0, 3) != 0,
               pick(0, 3) != 0};
    SCOPED_TRACE(iter);
    CheckCopy(c, static_cast<uint32_t>(iter),
              [](const PageCopyArgs& a, cudaStream_t s) { return PageCopyCuda(a, s); });
    if (HasFatalFailure()) return;
  }
}

struct PackCase {
  int32_t buffers;
  int64_t pages, bytes, offset, stride_extra;
  size_t misalign;
};

const PackCase kPackCases[] = {
    {64, 100, 2048, 0, 0, 0}, {3, 17, 777, 5, 9, 3}, {8, 64, 32768, 0, 0, 0}, {2, 5, 1, 0, 0, 1}};

// Packs random pools into poisoned staging with `pack`, then unpacks fresh random staging into
// poisoned pools with `unpack`, each against PackCpu / UnpackCpu, every byte compared.
template <typename Pack, typename Unpack>
void CheckPackUnpack(const std::vector<PackCase>& cases, uint32_t seed, Pack pack, Unpack unpack) {
  std::mt19937 rng(seed);
  for (const PackCase& p : cases) {
    SCOPED_TRACE(::testing::Message()
                 << p.buffers << " buffers x " << p.pages << " pages of " << p.bytes
                 << " bytes, offset " << p.offset << ", misalign " << p.misalign);
    const int64_t stride = p.offset + p.bytes + p.stride_extra;
    const int64_t pool_pages = p.pages * 2;
    std::vector<std::unique_ptr<DeviceBytes>> pool;
    std::vector<uint64_t> dev_bases, host_bases;
    for (int32_t b = 0; b < p.buffers; ++b) {
      pool.push_back(std::make_unique<DeviceBytes>());
      KVT_ASSERT_OK(pool.back()->Init(pool_pages * stride, p.misalign));
      pool.back()->Randomize(rng);
      KVT_ASSERT_OK(pool.back()->Upload());
      dev_bases.push_back(pool.back()->addr());
      host_bases.push_back(pool.back()->host_addr());
    }
    const std::vector<int32_t> pages = DistinctIndices(p.pages, pool_pages, rng);
    auto d_bases = ToDevice(dev_bases);
    auto d_pages = ToDevice(pages);
    ASSERT_TRUE(d_bases.ok() && d_pages.ok());
    DeviceBytes staging;
    KVT_ASSERT_OK(staging.Init(p.buffers * p.pages * p.bytes, p.misalign));
    std::fill(staging.host.begin(), staging.host.end(), 0xA5);
    KVT_ASSERT_OK(staging.Upload());

    PackArgs a;
    a.num_buffers = p.buffers;
    a.num_pages = p.pages;
    a.page_stride = stride;
    a.offset = p.offset;
    a.bytes = p.bytes;
    PackArgs dev = a, host = a;
    dev.bases = d_bases->as<uint64_t>();
    dev.pages = d_pages->as<int32_t>();
    dev.staging = staging.dev();
    host.bases = host_bases.data();
    host.pages = pages.data();
    host.staging = staging.host.data();
    auto stream = cuda::Stream::Create();
    ASSERT_TRUE(stream.ok());
    KVT_ASSERT_OK(pack(dev, stream->get()));
    KVT_ASSERT_OK(stream->Synchronize());
    KVT_ASSERT_OK(PackCpu(host));
    auto packed = staging.Download();
    ASSERT_TRUE(packed.ok());
    ASSERT_EQ(*packed, staging.host) << "pack of " << p.bytes << "-byte items";

    // Unpack fresh random staging into poisoned pools.
    staging.Randomize(rng);
    KVT_ASSERT_OK(staging.Upload());
    for (auto& buf : pool) {
      std::fill(buf->host.begin(), buf->host.end(), 0xA5);
      KVT_ASSERT_OK(buf->Upload());
    }
    KVT_ASSERT_OK(unpack(dev, stream->get()));
    KVT_ASSERT_OK(stream->Synchronize());
    KVT_ASSERT_OK(UnpackCpu(host));
    for (auto& buf : pool) {
      auto got = buf->Download();
      ASSERT_TRUE(got.ok());
      ASSERT_EQ(*got, buf->host) << "unpack of " << p.bytes << "-byte items";
    }
  }
}

TEST(PackGpuTest, PackAndUnpackMatchCpuReference) {
  KVT_SKIP_WITHOUT_GPU();
  CheckPackUnpack(
      std::vector<PackCase>(std::begin(kPackCases), std::end(kPackCases)), 5,
      [](const PackArgs& a, cudaStream_t s) { return PackCuda(a, s); },
      [](const PackArgs& a, cudaStream_t s) { return UnpackCuda(a, s); });
}

// Pack and unpack descriptions (staging side: one base plus a buffer stride, no tables) through
// the tuned entry points.
TEST(PackGpuTest, TunedPackAndUnpack) {
  KVT_SKIP_WITHOUT_GPU();
  std::vector<PackCase> cases(std::begin(kPackCases), std::end(kPackCases));
  cases.push_back({4, 9, 2048 * 5 + 16 * 33 + 4, 0, 12, 0});  // rounds + partial + tail
  cases.push_back({2, 7, 8192 * 2 + 96, 16, 0, 0});           // partial last chunk
  cases.push_back({3, 5, 4096 * 4, 0, 0, 8});                 // 8-aligned: narrow path
  uint32_t seed = 50;
  for (const PageCopyTuning& t : EdgeTunings()) {
    if (t.chunk_bytes == 48) continue;  // fewer, all layouts
    SCOPED_TRACE(TuningName(t));
    CheckPackUnpack(
        cases, seed++, [&](const PackArgs& a, cudaStream_t s) { return PackCudaTuned(a, t, s); },
        [&](const PackArgs& a, cudaStream_t s) { return UnpackCudaTuned(a, t, s); });
    if (HasFatalFailure()) return;
  }
}

// The device tables of `dev` copied into one host block, and the same arguments pointing into
// it: what PageCopyCudaInline takes. Empty `block` when they would not fit in a launch.
struct InlineCopy {
  std::vector<uint64_t> block;
  PageCopyArgs args;
};

StatusOr<InlineCopy> ToInline(const PageCopyArgs& dev) {
  const size_t base_words = static_cast<size_t>(dev.num_buffers);
  const size_t page_words = (static_cast<size_t>(dev.num_pages) + 1) / 2;
  InlineCopy c;
  c.args = dev;
  c.block.assign(2 * base_words + 2 * page_words, 0);
  if (c.block.size() > kPageCopyInlineTableWords) return c;
  const auto fetch = [](void* to, const void* from, size_t bytes) {
    return cuda::ToStatus(cudaMemcpy(to, from, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
  };
  uint64_t* words = c.block.data();
  KVT_RETURN_IF_ERROR(fetch(words, dev.src_bases, base_words * 8));
  KVT_RETURN_IF_ERROR(fetch(words + base_words, dev.dst_bases, base_words * 8));
  c.args.src_bases = words;
  c.args.dst_bases = words + base_words;
  auto* src_pages = reinterpret_cast<int32_t*>(words + 2 * base_words);
  auto* dst_pages = reinterpret_cast<int32_t*>(words + 2 * base_words + page_words);
  const size_t page_bytes = static_cast<size_t>(dev.num_pages) * 4;
  if (dev.src_pages != nullptr) KVT_RETURN_IF_ERROR(fetch(src_pages, dev.src_pages, page_bytes));
  if (dev.dst_pages != nullptr) KVT_RETURN_IF_ERROR(fetch(dst_pages, dev.dst_pages, page_bytes));
  c.args.src_pages = dev.src_pages != nullptr ? src_pages : nullptr;
  c.args.dst_pages = dev.dst_pages != nullptr ? dst_pages : nullptr;
  return c;
}

// Tables in the launch's parameters copy exactly what the same tables in device memory copy:
// every case whose tables fit (vector and narrow paths, identity sides, offsets, tails), then
// random layouts. The host block is overwritten right after the launch, before the stream runs:
// the launch took its own copy.
TEST(PageCopyInlineGpuTest, MatchesCpuReference) {
  KVT_SKIP_WITHOUT_GPU();
  std::vector<CopyCase> cases;
  for (const CopyCase& c : kCases) cases.push_back(c);
  std::mt19937 rng(91);
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int iter = 0; iter < 30; ++iter) {
    cases.push_back(CopyCase{
        "random_inline", static_cast<int32_t>(pick(1, 32)), pick(1, 40),
        pick(0, 1) ? 16 * pick(1, 2500) : pick(1, 40000), pick(0, 1) ? 0 : pick(0, 40),
        pick(0, 1) ? 0 : pick(0, 40), 0, 0, static_cast<size_t>(pick(0, 3) ? 0 : pick(0, 15)),
        static_cast<size_t>(pick(0, 3) ? 0 : pick(0, 15)), pick(0, 3) != 0, pick(0, 3) != 0});
  }
  // Many buffers and few pages: blocks of 150-420 words, the larger of the two parameter sizes
  // the launch picks from (a one-page write of a pool of 80 layers).
  for (int iter = 0; iter < 12; ++iter) {
    cases.push_back(CopyCase{"random_inline_many_buffers", static_cast<int32_t>(pick(74, 200)),
                             pick(1, 8), 16 * pick(1, 64), 0, 0, 0, 0, 0, 0, pick(0, 3) != 0,
                             pick(0, 3) != 0});
  }
  int ran = 0;
  int small_blocks = 0;  // <= 130 words (a one-page write of 64 buffers)
  int large_blocks = 0;  // >= 150 words
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << i << ": " << cases[i].name);
    bool fits = true;
    CheckCopy(cases[i], static_cast<uint32_t>(i), [&](const PageCopyArgs& dev, cudaStream_t s) {
      StatusOr<InlineCopy> c = ToInline(dev);
      if (!c.ok()) return c.status();
      if (c->block.size() > kPageCopyInlineTableWords) {
        fits = false;
        return PageCopyCuda(dev, s);
      }
      small_blocks += c->block.size() <= 130 ? 1 : 0;
      large_blocks += c->block.size() >= 150 ? 1 : 0;
      const Status launched = PageCopyCudaInline(c->args, c->block.data(), c->block.size(), s);
      std::fill(c->block.begin(), c->block.end(), ~uint64_t{0});
      return launched;
    });
    if (HasFatalFailure()) return;
    ran += fits ? 1 : 0;
  }
  EXPECT_GE(ran, 30) << "too few cases had tables small enough for the launch's parameters";
  EXPECT_GE(small_blocks, 10) << "too few cases launched the small parameter block";
  EXPECT_GE(large_blocks, 8) << "too few cases launched the large parameter block";
}

// One page of a 32-layer pool at 16 and 64 tokens (and items of an odd length): launches small
// enough to be split below the tuning's chunks (PageCopyTuning::min_chunk_bytes), with tables in
// device memory and in the launch's parameters, and the same launches unsplit, all byte-exact.
TEST(PageCopyGpuTest, SmallLaunchesSplitFinerMatchCpuReference) {
  KVT_SKIP_WITHOUT_GPU();
  const CopyCase cases[] = {
      {"one_page_16_tokens", 64, 1, 32768, 0, 0, 0, 0, 0, 0, true, true},
      {"one_page_64_tokens", 64, 1, 131072, 0, 0, 0, 0, 0, 0, true, true},
      {"one_page_odd_items", 64, 1, 32768 + 48 + 5, 0, 0, 0, 0, 0, 0, true, true},
      {"few_pages_misaligned", 6, 3, 20000, 3, 5, 0, 0, 1, 2, true, true},
  };
  PageCopyTuning unsplit = DefaultPageCopyTuning();
  unsplit.min_chunk_bytes = 0;
  uint32_t seed = 500;
  for (const CopyCase& c : cases) {
    SCOPED_TRACE(c.name);
    CheckCopy(c, seed++,
              [](const PageCopyArgs& dev, cudaStream_t s) { return PageCopyCuda(dev, s); });
    CheckCopy(c, seed++, [&](const PageCopyArgs& dev, cudaStream_t s) {
      return PageCopyCudaTuned(dev, unsplit, s);
    });
    CheckCopy(c, seed++, [](const PageCopyArgs& dev, cudaStream_t s) {
      StatusOr<InlineCopy> inl = ToInline(dev);
      if (!inl.ok()) return inl.status();
      if (inl->block.size() > kPageCopyInlineTableWords) return PageCopyCuda(dev, s);
      return PageCopyCudaInline(inl->args, inl->block.data(), inl->block.size(), s);
    });
    if (HasFatalFailure()) return;
  }
}

TEST(PageCopyGpuTest, EmptyInputsLaunchNothing) {
  KVT_SKIP_WITHOUT_GPU();
  auto stream = cuda::Stream::Create();
  ASSERT_TRUE(stream.ok());
  PageCopyArgs a;
  a.num_buffers = 4;  // no pages, null tables: nothing to do
  KVT_ASSERT_OK(PageCopyCuda(a, stream->get()));
  PackArgs p;
  p.num_pages = 3;  // no buffers
  KVT_ASSERT_OK(PackCuda(p, stream->get()));
  KVT_ASSERT_OK(UnpackCuda(p, stream->get()));
  KVT_ASSERT_OK(stream->Synchronize());
  KVT_ASSERT_OK(cuda::LastLaunchStatus("nothing"));
}

}  // namespace
}  // namespace kvt::kernels

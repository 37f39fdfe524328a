// The ucx backend's staged path on buffers that are sub-ranges of large allocations, as serving
// engines' caching allocators hand them out (label gpu; skips without a CUDA device). The staged
// path gathers and scatters through the buffers' device addresses, never an IPC handle, so
// buffers at 256-byte-aligned offsets of one or several allocations must move byte-exact, and
// the gaps between them stay untouched. Two ucx backends in one process.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend_test_util.h"
#include "carved_pool.h"
#include "kvt/testing/gpu.h"
#include "kvt/testing/status.h"
#include "kvt/transfer/backend.h"
#include "kvt/transfer/backends.h"

namespace kvt::transfer {
namespace {

using testing::CarvedPool;
using testing::DistinctPages;
using testing::RandomBytes;
using testing::WaitFor;

constexpr int kLayers = 3;  // 6 buffers
constexpr int32_t kPages = 64;
constexpr uint64_t kItem = 2304;

class UcxStagedSubAllocations : public ::testing::TestWithParam<std::string> {};

TEST_P(UcxStagedSubAllocations, PageWritesBetweenCarvedBuffersAreByteExact) {
  KVT_SKIP_WITHOUT_GPU();
  CarvedPool src, dst;
  KVT_ASSERT_OK(src.Init(kLayers, kPages, kItem, /*allocations=*/1));
  KVT_ASSERT_OK(dst.Init(kLayers, kPages, kItem, /*allocations=*/2));
  const std::vector<uint8_t> src_image = RandomBytes(src.bytes(), 3);
  std::vector<uint8_t> expected = RandomBytes(dst.bytes(), 4);
  KVT_ASSERT_OK(src.Upload(src_image));
  KVT_ASSERT_OK(dst.Upload(expected));

  UcxOptions options;
  options.transports = GetParam();
  options.cuda_mode = UcxCudaMode::kStaged;
  options.staging_slot_bytes = 64 << 10;  // small: every write is many chunks
  options.staging_slots = 3;
  auto sender = CreateBackend(options);
  ASSERT_TRUE(sender.ok()) << sender.status();
  auto receiver = CreateBackend(options);
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  auto sd = (*sender)->Register(src.Regions());
  ASSERT_TRUE(sd.ok()) << sd.status();
  auto rd = (*receiver)->Register(dst.Regions());
  ASSERT_TRUE(rd.ok()) << rd.status();
  ASSERT_TRUE((*sender)->Capabilities().page_writes);
  auto peer = (*sender)->Connect(*rd);
  ASSERT_TRUE(peer.ok()) << peer.status();

  std::mt19937 rng(13);
  std::vector<std::vector<int32_t>> pages;  // alive until posted
  std::vector<PageWrite> writes;
  for (auto [begin, end] : {std::pair{0, 1}, std::pair{1, 3}, std::pair{0, kLayers}}) {
    const int64_t n = end - begin == kLayers ? kPages - 1 : 17;
    pages.push_back(DistinctPages(n, kPages, rng));
    pages.push_back(DistinctPages(n, kPages, rng));
    PageWrite w;
    w.src_pages = pages[pages.size() - 2];
    w.dst_pages = pages.back();
    w.num_layers = kLayers;
    w.layer_begin = begin;
    w.layer_end = end;
    writes.push_back(w);
  }
  const std::vector<PageUnit> units = {{0, 512, 1024}, {2000, 7, 300}};
  pages.push_back(DistinctPages(9, kPages, rng));
  pages.push_back(DistinctPages(9, kPages, rng));
  PageWrite parts;
  parts.src_pages = pages[pages.size() - 2];
  parts.dst_pages = pages.back();
  parts.num_layers = kLayers;
  parts.layer_begin = 1;
  parts.layer_end = kLayers;
  parts.units = units;
  writes.push_back(parts);

  for (const PageWrite& w : writes) {
    auto id = (*sender)->PostPages(*peer, w);
    ASSERT_TRUE(id.ok()) << id.status();
    KVT_ASSERT_OK(WaitFor(**sender, *id, std::chrono::seconds(30)));  // in order: pages overlap
    (*sender)->Release(*id);
    testing::ApplyCarvedPageWrite(w, src, src_image, dst, expected);
  }
  auto actual = dst.Download();
  ASSERT_TRUE(actual.ok()) << actual.status();
  EXPECT_EQ(testing::DescribeCarvedMismatch(dst, expected, *actual), "");
  auto untouched = src.Download();
  ASSERT_TRUE(untouched.ok()) << untouched.status();
  EXPECT_EQ(testing::DescribeCarvedMismatch(src, src_image, *untouched), "")
      << "the source allocation changed";
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxStagedSubAllocations,
                         ::testing::Values(std::string(""), std::string("tcp")),
                         testing::TransportsTestName);

}  // namespace
}  // namespace kvt::transfer

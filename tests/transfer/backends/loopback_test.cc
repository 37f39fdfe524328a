// The loopback backend's page writes over a layout of mixed structure (target K/V, a latent
// group, a draft model's K/V with other page sizes) and its checks of region layers.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "backend_test_util.h"
#include "kvt/transfer/backend.h"
#include "kvt/transfer/backends.h"

namespace kvt::transfer {
namespace {

using testing::DistinctPages;
using ::testing::HasSubstr;
using testing::MixedLayout;

std::unique_ptr<Backend> PageWriting() {
  LoopbackOptions options;
  options.page_writes = true;
  auto backend = CreateBackend(options);
  EXPECT_TRUE(backend.ok()) << backend.status();
  return std::move(backend).value();
}

TEST(LoopbackBackendTest, MixedLayoutMovesEveryBufferOfTheLayersByteExact) {
  const MixedLayout layout;
  std::mt19937 rng(41);
  std::vector<uint8_t> src(layout.ImageBytes());
  std::vector<uint8_t> dst(layout.ImageBytes());
  testing::FillRandom(src, rng);
  testing::FillRandom(dst, rng);
  std::vector<uint8_t> expected = dst;
  auto sender = PageWriting();
  auto receiver = PageWriting();
  ASSERT_TRUE(sender->Register(layout.Regions(reinterpret_cast<uint64_t>(src.data()))).ok());
  auto descriptor = receiver->Register(layout.Regions(reinterpret_cast<uint64_t>(dst.data())));
  ASSERT_TRUE(descriptor.ok()) << descriptor.status();
  auto peer = sender->Connect(*descriptor);
  ASSERT_TRUE(peer.ok()) << peer.status();

  const std::vector<int32_t> src_pages = DistinctPages(9, layout.pages, rng);
  const std::vector<int32_t> dst_pages = DistinctPages(9, layout.pages, rng);
  // Two batches: [0, 3) ends inside the latent group, [3, 5) holds its rest and the draft.
  for (auto [begin, end] : {std::pair{0, 3}, std::pair{3, 5}}) {
    PageWrite w;
    w.src_pages = src_pages;
    w.dst_pages = dst_pages;
    w.num_layers = layout.num_layers;
    w.layer_begin = begin;
    w.layer_end = end;
    auto id = sender->PostPages(*peer, w);
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_TRUE(testing::WaitFor(*sender, *id).ok());
    sender->Release(*id);
    layout.Apply(w, src, expected);
    EXPECT_EQ(layout.Mismatch(expected, dst), "")
        << "after layers [" << begin << ", " << end << ")";
  }
  // Every buffer's chosen pages now hold the source's; nothing else changed (checked above).
  for (size_t b = 0; b < layout.buffers(); ++b) {
    const uint64_t item = layout.items[b];
    for (size_t i = 0; i < src_pages.size(); ++i) {
      ASSERT_EQ(0, std::memcmp(dst.data() + layout.Offset(b) + dst_pages[i] * item,
                               src.data() + layout.Offset(b) + src_pages[i] * item, item))
          << "buffer " << b << " page " << dst_pages[i];
    }
  }
}

TEST(LoopbackBackendTest, RefusesRegionLayersOutOfOrderAndRangesOutsideThem) {
  const MixedLayout layout;
  std::vector<uint8_t> src(layout.ImageBytes()), dst(layout.ImageBytes());
  auto backend = PageWriting();
  std::vector<LocalRegion> regions = layout.Regions(reinterpret_cast<uint64_t>(src.data()));
  regions[4].layer = 3;  // skips layer 2
  auto refused = backend->Register(regions);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("buffer 4 has transfer layer 3"));

  auto receiver = PageWriting();
  ASSERT_TRUE(backend->Register(layout.Regions(reinterpret_cast<uint64_t>(src.data()))).ok());
  auto descriptor = receiver->Register(layout.Regions(reinterpret_cast<uint64_t>(dst.data())));
  ASSERT_TRUE(descriptor.ok()) << descriptor.status();
  auto peer = backend->Connect(*descriptor);
  ASSERT_TRUE(peer.ok()) << peer.status();
  const std::vector<int32_t> pages = {1, 2};
  PageWrite w;
  w.src_pages = pages;
  w.dst_pages = pages;
  w.num_layers = layout.num_layers;
  w.layer_begin = 3;
  w.layer_end = 6;
  auto past = backend->PostPages(*peer, w);
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(past.status().message(),
              HasSubstr("[3, 6) is not inside the registered layers [0, 5]"));
  w.num_layers = 4;
  w.layer_end = 4;
  auto count = backend->PostPages(*peer, w);
  ASSERT_FALSE(count.ok());
  EXPECT_THAT(count.status().message(), HasSubstr("num_layers = 4"));
}

}  // namespace
}  // namespace kvt::transfer

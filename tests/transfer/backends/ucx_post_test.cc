// The ucx backend's network path (UCX puts, here over tcp on loopback): writes above
// ucx_direct_inline_bytes are posted by the backend's poster thread in batches, so PostWrite
// returns at once. Byte exactness, completion notification, that Release / Disconnect /
// destruction stop a write before any byte of it is posted, and that a write's bytes are all
// visible once Check says so.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "backend_test_util.h"
#include "backends/ucx/ucx_backend.h"
#include "kvt/transfer/backend.h"
#include "kvt/transfer/backends.h"

namespace kvt::transfer {
namespace {

using testing::WaitFor;

constexpr int kBuffers = 4;
constexpr uint64_t kItem = 16384;
constexpr uint64_t kPages = 64;
constexpr uint64_t kBufferBytes = kItem * kPages;  // 4 MiB over all buffers
constexpr uint8_t kPoison = 0xEE;

class UcxPostTest : public ::testing::Test {
 protected:
  // delay_us: the poster's start delay per write; pause_us: its pause after each batch (test
  // hooks).
  void Start(int delay_us, int pause_us = 0, int batch_bytes = 0) {
    UcxOptions options;
    options.transports = "tcp";
    options.host_path = UcxHostPath::kPut;  // the put path's poster (tcp would take messages)
    options.direct_inline_bytes = 64 << 10;
    UcxTestHooks hooks;
    hooks.post_delay_us = delay_us;
    hooks.post_batch_pause_us = pause_us;
    hooks.post_batch_bytes = batch_bytes;
    auto a = CreateUcxBackendForTest(options, hooks);
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = CreateUcxBackendForTest(options, hooks);
    ASSERT_TRUE(b.ok()) << b.status();
    sender_ = std::move(a).value();
    receiver_ = std::move(b).value();
    notified_ = std::make_shared<std::atomic<int>>(0);
    sender_->SetCompletionNotifier([n = notified_] { n->fetch_add(1); });

    src_.clear();
    for (int b = 0; b < kBuffers; ++b) src_.push_back(testing::RandomBytes(kBufferBytes, 20 + b));
    dst_.assign(kBuffers * kBufferBytes, kPoison);
    std::vector<const uint8_t*> src;
    for (const auto& buffer : src_) src.push_back(buffer.data());
    auto peer =
        testing::RegisterAndConnect(*sender_, *receiver_, src, dst_.data(), kBufferBytes, kItem);
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
  }

  void TearDown() override {
    sender_.reset();
    receiver_.reset();
  }

  // Every page of the buffers in `buffers`, shuffled destinations: 1 MiB a buffer in 64 runs.
  std::vector<CopyRun> Pages(std::vector<uint32_t> buffers, uint32_t seed) const {
    std::vector<uint64_t> dst_pages(kPages);
    for (uint64_t i = 0; i < kPages; ++i) dst_pages[i] = i;
    std::mt19937 rng(seed);
    std::shuffle(dst_pages.begin(), dst_pages.end(), rng);
    std::vector<CopyRun> runs;
    for (uint32_t b : buffers) {
      for (uint64_t p = 0; p < kPages; ++p) {
        runs.push_back({b, p * kItem, dst_pages[p] * kItem, kItem});
      }
    }
    return runs;
  }

  void ExpectLanded(const std::vector<CopyRun>& runs) const {
    for (const CopyRun& r : runs) {
      ASSERT_EQ(std::memcmp(dst_.data() + r.buffer * kBufferBytes + r.dst_offset,
                            src_[r.buffer].data() + r.src_offset, r.bytes),
                0)
          << "buffer " << r.buffer << " offset " << r.dst_offset;
    }
  }

  bool AllPoison() const {
    return std::all_of(dst_.begin(), dst_.end(), [](uint8_t b) { return b == kPoison; });
  }

  std::unique_ptr<Backend> sender_, receiver_;
  std::vector<std::vector<uint8_t>> src_;
  std::vector<uint8_t> dst_;
  PeerId peer_ = 0;
  std::shared_ptr<std::atomic<int>> notified_;
};

TEST_F(UcxPostTest, LargeWritesArePostedByThePosterByteExactAndNotified) {
  Start(/*delay_us=*/0);
  const std::vector<CopyRun> runs = Pages({0, 1, 2, 3}, 1);
  auto write = sender_->PostWrite(peer_, runs);
  ASSERT_TRUE(write.ok()) << write.status();
  ASSERT_TRUE(WaitFor(*sender_, *write).ok());
  sender_->Release(*write);
  ExpectLanded(runs);
  for (int i = 0; i < 1000 && notified_->load() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_GE(notified_->load(), 1);
}

// Many large writes queued at once, from two threads, with small ones (posted by the caller)
// in between: every one lands.
TEST_F(UcxPostTest, QueuedWritesFromTwoThreadsAllLand) {
  Start(/*delay_us=*/0);
  std::vector<std::vector<CopyRun>> writes;
  for (uint32_t b = 0; b < kBuffers; ++b) writes.push_back(Pages({b}, 10 + b));
  std::vector<WriteId> ids(writes.size());
  auto post = [&](size_t first) {
    for (size_t i = first; i < writes.size(); i += 2) {
      auto w = sender_->PostWrite(peer_, writes[i]);
      ASSERT_TRUE(w.ok()) << w.status();
      ids[i] = *w;
    }
  };
  std::thread other(post, 1);
  post(0);
  other.join();
  for (WriteId id : ids) {
    ASSERT_TRUE(WaitFor(*sender_, id).ok());
    sender_->Release(id);
  }
  for (const auto& runs : writes) ExpectLanded(runs);
}

TEST_F(UcxPostTest, PostWriteReturnsBeforeTheWriteIsPosted) {
  Start(/*delay_us=*/2000000);
  const std::vector<CopyRun> runs = Pages({2}, 3);
  const auto t0 = std::chrono::steady_clock::now();
  auto write = sender_->PostWrite(peer_, runs);
  ASSERT_TRUE(write.ok()) << write.status();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  EXPECT_EQ(sender_->Check(*write).code(), StatusCode::kInProgress);
  ASSERT_TRUE(WaitFor(*sender_, *write).ok());
  sender_->Release(*write);
  ExpectLanded(runs);
}

TEST_F(UcxPostTest, ReleaseBeforePostingLandsNothing) {
  Start(/*delay_us=*/5000000);
  auto write = sender_->PostWrite(peer_, Pages({0, 1}, 4));
  ASSERT_TRUE(write.ok()) << write.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the poster holds it
  EXPECT_EQ(sender_->Check(*write).code(), StatusCode::kInProgress);
  const auto t0 = std::chrono::steady_clock::now();
  sender_->Release(*write);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));  // not the delay
  EXPECT_EQ(sender_->Check(*write).code(), StatusCode::kNotFound);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_TRUE(AllPoison());
  // The poster serves the next write.
  auto next = sender_->PostWrite(peer_, Pages({3}, 5));
  ASSERT_TRUE(next.ok());
  EXPECT_TRUE(WaitFor(*sender_, *next, std::chrono::seconds(30)).ok());
}

// Cancelled part-way: the batch already posted lands (Release waits for it), nothing after it.
TEST_F(UcxPostTest, ReleasePartWayLandsExactlyThePostedBatches) {
  Start(/*delay_us=*/0, /*pause_us=*/10000000);
  const std::vector<CopyRun> runs = Pages({0, 1, 2, 3}, 11);  // a 1 MiB batch per buffer
  const std::vector<CopyRun> first(runs.begin(), runs.begin() + kPages);  // buffer 0
  auto write = sender_->PostWrite(peer_, runs);
  ASSERT_TRUE(write.ok()) << write.status();
  // Batch 1 lands, then the poster pauses (the cancel below ends the pause).
  auto landed = [&] {
    for (const CopyRun& r : first) {
      if (std::memcmp(dst_.data() + r.dst_offset, src_[0].data() + r.src_offset, r.bytes) != 0) {
        return false;
      }
    }
    return true;
  };
  for (int i = 0; i < 10000 && !landed(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(landed()) << "the first batch did not land in 10 s";
  EXPECT_EQ(sender_->Check(*write).code(), StatusCode::kInProgress);
  const auto t0 = std::chrono::steady_clock::now();
  sender_->Release(*write);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));  // not the pause
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_TRUE(
      std::all_of(dst_.begin() + kBufferBytes, dst_.end(), [](uint8_t b) { return b == kPoison; }));
}

// A run longer than a batch goes in pieces: cancelled after the first piece, exactly that
// piece lands.
TEST_F(UcxPostTest, LongRunsArePostedInPiecesAndCancelBetweenThem) {
  constexpr uint64_t kPiece = 256 << 10;
  Start(/*delay_us=*/0, /*pause_us=*/10000000, /*batch_bytes=*/kPiece);
  const CopyRun run{1, 0, 0, kBufferBytes};  // buffer 1 whole: four pieces
  auto write = sender_->PostWrite(peer_, {&run, 1});
  ASSERT_TRUE(write.ok()) << write.status();
  uint8_t* one = dst_.data() + kBufferBytes;
  auto landed = [&] { return std::memcmp(one, src_[1].data(), kPiece) == 0; };
  for (int i = 0; i < 10000 && !landed(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(landed()) << "the first piece did not land in 10 s";
  const Status st = sender_->Check(*write);
  EXPECT_EQ(st.code(), StatusCode::kInProgress) << st;
  sender_->Release(*write);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_TRUE(
      std::all_of(one + kPiece, one + kBufferBytes, [](uint8_t b) { return b == kPoison; }));
  EXPECT_TRUE(std::all_of(dst_.begin(), dst_.begin() + kBufferBytes,
                          [](uint8_t b) { return b == kPoison; }));
}

// Without pauses a long run still arrives whole, in pieces.
TEST_F(UcxPostTest, LongRunsInPiecesArriveWhole) {
  Start(/*delay_us=*/0, /*pause_us=*/0, /*batch_bytes=*/100000);  // pieces not page-aligned
  const std::vector<CopyRun> runs{{0, 0, 0, kBufferBytes}, {3, 4096, 8192, kBufferBytes - 8192}};
  auto write = sender_->PostWrite(peer_, runs);
  ASSERT_TRUE(write.ok()) << write.status();
  ASSERT_TRUE(WaitFor(*sender_, *write).ok());
  sender_->Release(*write);
  ExpectLanded(runs);
}

TEST_F(UcxPostTest, DisconnectAbortsWritesNotYetPosted) {
  Start(/*delay_us=*/5000000);
  auto first = sender_->PostWrite(peer_, Pages({0}, 6));
  auto second = sender_->PostWrite(peer_, Pages({1}, 7));  // queued behind the first
  ASSERT_TRUE(first.ok() && second.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(sender_->Disconnect(peer_).ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  for (WriteId w : {*first, *second}) {
    const Status st = sender_->Check(w);
    EXPECT_EQ(st.code(), StatusCode::kAborted) << st;
    sender_->Release(w);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_TRUE(AllPoison());
  EXPECT_EQ(sender_->PostWrite(peer_, Pages({2}, 8)).status().code(), StatusCode::kNotFound);
}

TEST_F(UcxPostTest, DestroyingTheBackendStopsWritesNotYetPosted) {
  Start(/*delay_us=*/5000000);
  auto write = sender_->PostWrite(peer_, Pages({0, 1, 2, 3}, 9));
  ASSERT_TRUE(write.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const auto t0 = std::chrono::steady_clock::now();
  sender_.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_TRUE(AllPoison());
}

// A Release waiting for the flush of a write to a peer that does not answer (its worker held)
// lets other calls take the backend: a write to a second peer lands meanwhile, and Register,
// which would remap buffers the puts may still read, is refused naming the wait.
TEST(UcxReleaseTest, AReleaseWaitingForAFlushLetsOtherPeersWritesThrough) {
  UcxOptions options;
  options.transports = "tcp";
  options.host_path = UcxHostPath::kPut;
  auto hold = std::make_shared<std::atomic<bool>>(false);
  UcxTestHooks held;
  held.hold_progress = hold;
  auto sender = CreateUcxBackendForTest(options, {});
  ASSERT_TRUE(sender.ok()) << sender.status();
  auto slow = CreateUcxBackendForTest(options, held);
  ASSERT_TRUE(slow.ok()) << slow.status();
  auto fast = CreateUcxBackendForTest(options, {});
  ASSERT_TRUE(fast.ok()) << fast.status();
  std::vector<std::vector<uint8_t>> src;
  for (int b = 0; b < kBuffers; ++b) src.push_back(testing::RandomBytes(kBufferBytes, 60 + b));
  std::vector<const uint8_t*> src_ptrs;
  for (const auto& buffer : src) src_ptrs.push_back(buffer.data());
  std::vector<uint8_t> slow_dst(kBuffers * kBufferBytes, kPoison);
  std::vector<uint8_t> fast_dst(kBuffers * kBufferBytes, kPoison);
  auto slow_peer =
      testing::RegisterAndConnect(**sender, **slow, src_ptrs, slow_dst.data(), kBufferBytes, kItem);
  ASSERT_TRUE(slow_peer.ok()) << slow_peer.status();
  std::vector<LocalRegion> fast_regions;
  for (int b = 0; b < kBuffers; ++b) {
    fast_regions.push_back(
        LocalRegion{reinterpret_cast<uint64_t>(fast_dst.data() + b * kBufferBytes), kBufferBytes,
                    kItem, MemoryKind::kHost, -1});
  }
  auto fast_descriptor = (*fast)->Register(fast_regions);
  ASSERT_TRUE(fast_descriptor.ok()) << fast_descriptor.status();
  auto fast_peer = (*sender)->Connect(*fast_descriptor);
  ASSERT_TRUE(fast_peer.ok()) << fast_peer.status();

  // One page of each buffer to the held peer: posted, its flush waits for that peer.
  std::vector<CopyRun> runs;
  for (uint32_t b = 0; b < kBuffers; ++b) runs.push_back({b, 0, kItem, kItem});
  hold->store(true);
  auto stuck = (*sender)->PostWrite(*slow_peer, runs);
  ASSERT_TRUE(stuck.ok()) << stuck.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_EQ((*sender)->Check(*stuck).code(), StatusCode::kInProgress)
      << "the held peer completed the flush: the test cannot hold a write";
  std::atomic<bool> released{false};
  std::thread release([&] {
    (*sender)->Release(*stuck);
    released.store(true);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // Release is waiting now
  EXPECT_FALSE(released.load());
  const auto t0 = std::chrono::steady_clock::now();
  auto other = (*sender)->PostWrite(*fast_peer, runs);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_TRUE(WaitFor(**sender, *other, std::chrono::seconds(10)).ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  EXPECT_FALSE(released.load()) << "the held peer's flush finished: nothing was tested";
  for (const CopyRun& r : runs) {
    EXPECT_EQ(std::memcmp(fast_dst.data() + r.buffer * kBufferBytes + r.dst_offset,
                          src[r.buffer].data() + r.src_offset, r.bytes),
              0);
  }
  std::vector<LocalRegion> again;
  for (int b = 0; b < kBuffers; ++b) {
    again.push_back(LocalRegion{reinterpret_cast<uint64_t>(src[b].data()), kBufferBytes, kItem,
                                MemoryKind::kHost, -1});
  }
  const Status reregistered = (*sender)->Register(again).status();
  EXPECT_EQ(reregistered.code(), StatusCode::kFailedPrecondition) << reregistered;
  EXPECT_NE(reregistered.message().find("still flush"), std::string::npos) << reregistered;
  hold->store(false);  // the peer answers again: the flush, and the Release, finish
  release.join();
  EXPECT_TRUE(released.load());
}

}  // namespace
}  // namespace kvt::transfer

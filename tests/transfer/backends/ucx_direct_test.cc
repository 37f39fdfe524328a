// The ucx backend's direct path: when UCX maps the peer's buffers into this process (shared
// memory from the peer's AllocateHost, ucp_rkey_ptr), writes are plain copies; those above
// ucx_direct_inline_bytes run on the backend's copy threads (each a slice of the write). Byte
// exactness with 1, 2 and 4 copy threads, completion notification, and that Release /
// Disconnect / destruction leave no copy landing afterwards.
#include <gtest/gtest.h>

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
constexpr uint64_t kItem = 16384;  // 4 MiB in all: a slice for each of 4 copy threads
constexpr uint64_t kPages = 64;
constexpr uint64_t kBufferBytes = kItem * kPages;
constexpr uint8_t kPoison = 0xEE;

class UcxDirectTest : public ::testing::TestWithParam<int> {
 protected:
  // inline_bytes: UcxOptions::direct_inline_bytes; delay_us: the copy thread's start delay (test
  // hook).
  void Start(size_t inline_bytes, int delay_us) {
    UcxOptions options;
    options.direct_inline_bytes = inline_bytes;
    options.copy_threads = GetParam();
    UcxTestHooks hooks;
    hooks.direct_copy_delay_us = delay_us;
    auto a = CreateUcxBackendForTest(options, hooks);
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = CreateUcxBackendForTest(options, hooks);
    ASSERT_TRUE(b.ok()) << b.status();
    sender_ = std::move(a).value();
    receiver_ = std::move(b).value();
    notified_ = std::make_shared<std::atomic<int>>(0);
    ASSERT_TRUE(sender_->Capabilities().notifies_completion);
    sender_->SetCompletionNotifier([n = notified_] { n->fetch_add(1); });

    std::mt19937 rng(3);
    src_.assign(kBuffers, std::vector<uint8_t>(kBufferBytes));
    for (auto& buffer : src_) {
      for (auto& byte : buffer) byte = static_cast<uint8_t>(rng());
    }
    // The receiver's buffers in memory its UCX shares with peers on this host.
    auto block = receiver_->AllocateHost(kBuffers * kBufferBytes);
    ASSERT_TRUE(block.ok()) << block.status();
    dst_ = static_cast<uint8_t*>(*block);
    std::memset(dst_, kPoison, kBuffers * kBufferBytes);

    std::vector<const uint8_t*> src;
    for (const auto& buffer : src_) src.push_back(buffer.data());
    auto peer = testing::RegisterAndConnect(*sender_, *receiver_, src, dst_, kBufferBytes, kItem);
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
  }

  void TearDown() override {
    sender_.reset();
    if (receiver_ && dst_ != nullptr) receiver_->FreeHost(dst_);
    receiver_.reset();
  }

  // Every page of every buffer, shuffled destinations: 4 MiB in 256 runs.
  std::vector<CopyRun> AllPages() const {
    std::vector<uint64_t> dst_pages(kPages);
    for (uint64_t i = 0; i < kPages; ++i) dst_pages[i] = i;
    std::mt19937 rng(9);
    std::shuffle(dst_pages.begin(), dst_pages.end(), rng);
    std::vector<CopyRun> runs;
    for (uint32_t b = 0; b < kBuffers; ++b) {
      for (uint64_t p = 0; p < kPages; ++p)
        runs.push_back({b, p * kItem, dst_pages[p] * kItem, kItem});
    }
    return runs;
  }

  bool AllPoison() const {
    for (uint64_t i = 0; i < kBuffers * kBufferBytes; ++i) {
      if (dst_[i] != kPoison) return false;
    }
    return true;
  }

  std::unique_ptr<Backend> sender_, receiver_;
  std::vector<std::vector<uint8_t>> src_;
  uint8_t* dst_ = nullptr;
  PeerId peer_ = 0;
  std::shared_ptr<std::atomic<int>> notified_;
};

TEST_P(UcxDirectTest, LargeWritesAreCopiedOnTheCopyThreadByteExactAndNotified) {
  Start(/*inline_bytes=*/0, /*delay_us=*/0);
  const std::vector<CopyRun> runs = AllPages();
  auto write = sender_->PostWrite(peer_, runs);
  ASSERT_TRUE(write.ok()) << write.status();
  ASSERT_TRUE(WaitFor(*sender_, *write).ok());
  sender_->Release(*write);
  for (const CopyRun& r : runs) {
    ASSERT_EQ(std::memcmp(dst_ + r.buffer * kBufferBytes + r.dst_offset,
                          src_[r.buffer].data() + r.src_offset, r.bytes),
              0)
        << "buffer " << r.buffer << " offset " << r.dst_offset;
  }
  // The copy thread notifies right after marking the copy done, so Check may see it done first.
  for (int i = 0; i < 1000 && notified_->load() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_GE(notified_->load(), 1);
}

// Long runs (the copy threads cut runs inside): one run into buffer 2, and buffers 0, 1 and 3
// whole as one run each, posted back to back (their slices may run at the same time): both
// land byte exact.
TEST_P(UcxDirectTest, LongRunsAreCutBetweenCopyThreadsByteExact) {
  Start(/*inline_bytes=*/0, /*delay_us=*/0);
  const CopyRun one{2, kItem, 3 * kItem, kBufferBytes - 7 * kItem + 100};
  std::vector<CopyRun> whole;
  for (uint32_t b : {0u, 1u, 3u}) whole.push_back({b, 0, 0, kBufferBytes});
  auto first = sender_->PostWrite(peer_, {&one, 1});
  auto second = sender_->PostWrite(peer_, whole);
  ASSERT_TRUE(first.ok() && second.ok());
  ASSERT_TRUE(WaitFor(*sender_, *first).ok());
  ASSERT_TRUE(WaitFor(*sender_, *second).ok());
  sender_->Release(*first);
  sender_->Release(*second);
  for (uint32_t b : {0u, 1u, 3u}) {
    EXPECT_EQ(std::memcmp(dst_ + b * kBufferBytes, src_[b].data(), kBufferBytes), 0)
        << "buffer " << b;
  }
  uint8_t* two = dst_ + 2 * kBufferBytes;
  EXPECT_EQ(std::memcmp(two + one.dst_offset, src_[2].data() + one.src_offset, one.bytes), 0);
  for (uint64_t i = 0; i < kBufferBytes; ++i) {
    if (i >= one.dst_offset && i < one.dst_offset + one.bytes) continue;
    ASSERT_EQ(two[i], kPoison) << "buffer 2 byte " << i << " outside the run";
  }
}

TEST_P(UcxDirectTest, WritesUpToTheInlineLimitCompleteWhenPosted) {
  Start(/*inline_bytes=*/kItem, /*delay_us=*/1000000);
  CopyRun run{1, 3 * kItem, 5 * kItem, kItem};
  auto write = sender_->PostWrite(peer_, {&run, 1});
  ASSERT_TRUE(write.ok()) << write.status();
  EXPECT_TRUE(sender_->Check(*write).ok());  // no copy thread (its delay would show)
  EXPECT_EQ(std::memcmp(dst_ + kBufferBytes + 5 * kItem, src_[1].data() + 3 * kItem, kItem), 0);
  sender_->Release(*write);
}

TEST_P(UcxDirectTest, ReleaseCancelsACopyInFlightAndNothingLandsLater) {
  Start(/*inline_bytes=*/0, /*delay_us=*/2000000);
  auto write = sender_->PostWrite(peer_, AllPages());
  ASSERT_TRUE(write.ok()) << write.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(sender_->Check(*write).code(), StatusCode::kInProgress);
  const auto t0 = std::chrono::steady_clock::now();
  sender_->Release(*write);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));  // not the 2 s delay
  EXPECT_EQ(sender_->Check(*write).code(), StatusCode::kNotFound);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_TRUE(AllPoison());
  // The copy thread still serves the next write.
  Start(/*inline_bytes=*/0, /*delay_us=*/0);
  auto next = sender_->PostWrite(peer_, AllPages());
  ASSERT_TRUE(next.ok());
  EXPECT_TRUE(WaitFor(*sender_, *next).ok());
}

TEST_P(UcxDirectTest, DisconnectAbortsCopiesInFlight) {
  Start(/*inline_bytes=*/0, /*delay_us=*/2000000);
  auto first = sender_->PostWrite(peer_, AllPages());
  auto second = sender_->PostWrite(peer_, AllPages());  // queued behind the first
  ASSERT_TRUE(first.ok() && second.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_TRUE(sender_->Disconnect(peer_).ok());
  for (WriteId w : {*first, *second}) {
    const Status st = sender_->Check(w);
    EXPECT_EQ(st.code(), StatusCode::kAborted) << st;
    sender_->Release(w);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_TRUE(AllPoison());
}

TEST_P(UcxDirectTest, DestroyingTheBackendStopsCopiesInFlight) {
  Start(/*inline_bytes=*/0, /*delay_us=*/2000000);
  auto write = sender_->PostWrite(peer_, AllPages());
  ASSERT_TRUE(write.ok());
  const auto t0 = std::chrono::steady_clock::now();
  sender_.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_TRUE(AllPoison());
}

INSTANTIATE_TEST_SUITE_P(CopyThreads, UcxDirectTest, ::testing::Values(1, 2, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "Threads";
                         });

TEST(UcxDirectOptionsTest, CopyThreadsOutOfRangeAreRefused) {
  for (int threads : {-1, 65}) {
    UcxOptions options;
    options.copy_threads = threads;
    auto backend = CreateUcxBackendForTest(options, UcxTestHooks{});
    ASSERT_FALSE(backend.ok()) << threads;
    EXPECT_EQ(backend.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(backend.status().message().find("ucx copy_threads is " + std::to_string(threads)),
              std::string::npos)
        << backend.status();
  }
}

TEST(UcxDirectOptionsTest, ZeroCopyThreadsPicksThemFromTheCores) {
  UcxOptions options;
  options.copy_threads = 0;
  auto backend = CreateUcxBackendForTest(options, UcxTestHooks{});
  EXPECT_TRUE(backend.ok()) << backend.status();
}

}  // namespace
}  // namespace kvt::transfer

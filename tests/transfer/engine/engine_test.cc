// The transfer engine end to end inside one process: a prefill and a decode engine, each with
// its own host pool, talking over the real control plane on loopback, parameterized over the
// host backends.
#include "kvt/transfer/engine.h"

#include <gtest/gtest.h>

#include <limits>
#include <numeric>
#include <random>
#include <thread>

#include "engine_test_util.h"
#include "kvt/pool/page_allocator.h"

namespace kvt::transfer {
namespace {

using namespace std::chrono_literals;
using testing::Fill;
using testing::MakePool;
using testing::Mismatches;
using testing::SmallPoolOptions;

// The backend of a test parameter: "loopback", "loopback_pages" (the loopback backend taking
// page lists, the device backends' path), "ucx" (UCX's transports: kvt's pools are mapped
// between the processes, copies) or "ucx_tcp" (tcp only: copy runs as active messages).
BackendConfig BackendFor(const std::string& param, std::chrono::microseconds delay = {}) {
  if (param == "ucx") return UcxOptions{};
  if (param == "ucx_tcp") return UcxOptions{.transports = "tcp"};
  LoopbackOptions loopback;
  loopback.delay = delay;
  loopback.page_writes = param == "loopback_pages";
  return loopback;
}

class EngineTest : public ::testing::TestWithParam<std::string> {
 protected:
  void Start(const pool::PoolOptions& prefill_pool, const pool::PoolOptions& decode_pool,
             int loopback_delay_us = 0) {
    src_pool_ = MakePool(prefill_pool);
    dst_pool_ = MakePool(decode_pool);
    ASSERT_TRUE(src_pool_ && dst_pool_);
    EngineOptions p;
    p.name = "prefill-0";
    p.prefill = true;
    p.backend = BackendFor(GetParam(), std::chrono::microseconds(loopback_delay_us));
    p.default_deadline = 5s;
    p.control_busy_poll = busy_poll_;
    auto prefill = TransferEngine::Create(p, src_pool_.get());
    ASSERT_TRUE(prefill.ok()) << prefill.status();
    prefill_ = std::move(prefill).value();
    EngineOptions d = p;
    d.name = "decode-0";
    d.prefill = false;
    auto decode = TransferEngine::Create(d, dst_pool_.get());
    ASSERT_TRUE(decode.ok()) << decode.status();
    decode_ = std::move(decode).value();
  }

  void Start() { Start(SmallPoolOptions(), SmallPoolOptions()); }

  PeerHandle Connect() {
    auto peer = decode_->ConnectPeer("127.0.0.1", prefill_->port());
    EXPECT_TRUE(peer.ok()) << peer.status();
    return peer.ok() ? *peer : 0;
  }

  void TearDown() override {
    decode_.reset();
    prefill_.reset();
  }

  std::chrono::microseconds busy_poll_{0};  // EngineOptions::control_busy_poll of both engines
  std::unique_ptr<pool::KvPool> src_pool_, dst_pool_;
  std::unique_ptr<TransferEngine> prefill_, decode_;
};

TEST_P(EngineTest, WholeRequestArrivesByteExact) {
  Start();
  const PeerHandle peer = Connect();
  std::vector<int32_t> src = {3, 4, 5, 9}, dst = {10, 2, 3, 40};
  Fill(*src_pool_, 77, src);
  ASSERT_TRUE(decode_->Receive("room-1", peer, dst).ok());
  ASSERT_TRUE(prefill_->Send("room-1", src).ok());
  ASSERT_TRUE(prefill_->LayersReady("room-1", 4).ok());
  auto info = decode_->WaitRequest("room-1", 5s);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state, RequestState::kSuccess) << info->status;
  EXPECT_TRUE(info->pages_reusable);
  const uint64_t item = 16 * 2 * 64 * 2;
  EXPECT_EQ(info->bytes, 4 * 2 * 4 * item);
  EXPECT_EQ(Mismatches(*dst_pool_, 77, dst), 0u);
  auto sent = prefill_->WaitRequest("room-1", 1s);
  ASSERT_TRUE(sent.ok());
  EXPECT_EQ(sent->state, RequestState::kSuccess);
  EXPECT_EQ(prefill_->stats().requests_succeeded, 1u);
  EXPECT_EQ(decode_->stats().bytes, info->bytes);
}

// The control threads polling instead of sleeping (EngineOptions::control_busy_poll): requests
// whole and layer by layer, back to back, arrive byte-exact, and the engines shut down while
// their io threads poll (a request still in flight keeps them polling).
TEST_P(EngineTest, BusyPollingControlThreadsMoveRequests) {
  busy_poll_ = 500us;
  Start();
  const PeerHandle peer = Connect();
  for (int r = 0; r < 12; ++r) {
    const std::string room = "busy-" + std::to_string(r);
    std::vector<int32_t> src = {1 + r % 3, 7, 20 + r}, dst = {30 + r, 2 + r % 5, 60};
    Fill(*src_pool_, 100 + r, src);
    ASSERT_TRUE(decode_->Receive(room, peer, dst).ok());
    ASSERT_TRUE(prefill_->Send(room, src).ok());
    if (r % 2 == 0) {
      ASSERT_TRUE(prefill_->LayersReady(room, 4).ok());
    } else {
      for (int32_t layer = 1; layer <= 4; ++layer) {
        ASSERT_TRUE(prefill_->LayersReady(room, layer).ok());
      }
    }
    auto info = decode_->WaitRequest(room, 5s);
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_EQ(info->state, RequestState::kSuccess) << info->status;
    EXPECT_EQ(Mismatches(*dst_pool_, 100 + r, dst), 0u) << room;
  }
  // Both engines poll on one host: their connection moved to a shared-memory lane.
  EXPECT_EQ(decode_->stats().control_lanes, 1u);
  EXPECT_EQ(prefill_->stats().control_lanes, 1u);
  std::vector<int32_t> dst = {3};
  ASSERT_TRUE(decode_->Receive("left-in-flight", peer, dst).ok());
  EXPECT_EQ(decode_->stats().requests_succeeded, 12u);
}

// With busy-polling engines WaitRequest polls for the busy-poll window before it sleeps: it
// sees its own room end while other rooms end around it, sees a room that ends after the window
// (asleep by then), and its timeout and unknown-room errors are those of the sleeping wait.
TEST_P(EngineTest, WaitRequestPollsWhileTheEnginesBusyPoll) {
  busy_poll_ = 2ms;
  Start();
  const PeerHandle peer = Connect();
  auto finish_later = [this](std::string room, std::vector<int32_t> src,
                             std::chrono::microseconds after) {
    return std::thread([this, room = std::move(room), src = std::move(src), after] {
      std::this_thread::sleep_for(after);
      EXPECT_TRUE(prefill_->Send(room, src).ok()) << room;
      EXPECT_TRUE(prefill_->LayersReady(room, 4).ok()) << room;
    });
  };
  // Another room ends first (the waiter looks, and goes on polling), then the waited one.
  std::vector<int32_t> src_a = {1, 2}, dst_a = {10, 11}, src_b = {3, 4}, dst_b = {12, 13};
  Fill(*src_pool_, 5, src_a);
  Fill(*src_pool_, 6, src_b);
  ASSERT_TRUE(decode_->Receive("waited", peer, dst_a).ok());
  ASSERT_TRUE(decode_->Receive("other", peer, dst_b).ok());
  std::thread other = finish_later("other", src_b, 100us);
  other.join();
  std::thread waited = finish_later("waited", src_a, 300us);
  auto info = decode_->WaitRequest("waited", 5s);
  waited.join();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state, RequestState::kSuccess) << info->status;
  EXPECT_EQ(Mismatches(*dst_pool_, 5, dst_a), 0u);
  auto other_info = decode_->WaitRequest("other", 5s);
  ASSERT_TRUE(other_info.ok()) << other_info.status();
  EXPECT_EQ(other_info->state, RequestState::kSuccess) << other_info->status;
  EXPECT_EQ(Mismatches(*dst_pool_, 6, dst_b), 0u);

  // A room that ends well after the window: the waiter has gone to sleep and is woken.
  std::vector<int32_t> src_c = {7}, dst_c = {20};
  Fill(*src_pool_, 7, src_c);
  ASSERT_TRUE(decode_->Receive("late", peer, dst_c).ok());
  std::thread late = finish_later("late", src_c, 30ms);
  info = decode_->WaitRequest("late", 5s);
  late.join();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state, RequestState::kSuccess) << info->status;
  EXPECT_EQ(Mismatches(*dst_pool_, 7, dst_c), 0u);

  // A timeout shorter than the window, and none at all: DeadlineExceeded naming it.
  std::vector<int32_t> dst_d = {21};
  ASSERT_TRUE(decode_->Receive("never-sent", peer, dst_d).ok());
  for (const std::chrono::milliseconds timeout : {1ms, 0ms}) {
    auto waited_out = decode_->WaitRequest("never-sent", timeout);
    ASSERT_FALSE(waited_out.ok());
    EXPECT_EQ(waited_out.status().code(), StatusCode::kDeadlineExceeded);
    EXPECT_NE(waited_out.status().message().find("room 'never-sent' is still "), std::string::npos)
        << waited_out.status();
    EXPECT_NE(
        waited_out.status().message().find("after " + std::to_string(timeout.count()) + " ms"),
        std::string::npos)
        << waited_out.status();
  }
  auto unknown = decode_->WaitRequest("no-such-room", 5s);
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), StatusCode::kNotFound);
  EXPECT_NE(unknown.status().message().find("no room 'no-such-room'"), std::string::npos)
      << unknown.status();
}

// Busy polling per connection: a decode engine connected to two prefill engines (each
// connection polls while its own peer has requests in flight) moves requests from both,
// interleaved, byte-exact, while the other connection idles.
TEST_P(EngineTest, BusyPollingPerConnectionMovesRequestsFromTwoPeers) {
  busy_poll_ = 300us;
  Start();
  auto second_pool = MakePool(SmallPoolOptions());
  ASSERT_TRUE(second_pool);
  EngineOptions o;
  o.name = "prefill-1";
  o.prefill = true;
  o.backend = BackendFor(GetParam());
  o.default_deadline = 5s;
  o.control_busy_poll = busy_poll_;
  auto second = TransferEngine::Create(o, second_pool.get());
  ASSERT_TRUE(second.ok()) << second.status();
  const PeerHandle a = Connect();
  auto b = decode_->ConnectPeer("127.0.0.1", (*second)->port());
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_NE(a, *b);
  for (int r = 0; r < 8; ++r) {
    const bool from_second = r % 3 == 0;
    TransferEngine& prefill = from_second ? **second : *prefill_;
    pool::KvPool& src_pool = from_second ? *second_pool : *src_pool_;
    const std::string room = "two-" + std::to_string(r);
    std::vector<int32_t> src = {2 + r, 30}, dst = {40 + r, 5};
    Fill(src_pool, 200 + r, src);
    ASSERT_TRUE(decode_->Receive(room, from_second ? *b : a, dst).ok());
    ASSERT_TRUE(prefill.Send(room, src).ok());
    ASSERT_TRUE(prefill.LayersReady(room, 4).ok());
    auto info = decode_->WaitRequest(room, 5s);
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_EQ(info->state, RequestState::kSuccess) << info->status;
    EXPECT_EQ(Mismatches(*dst_pool_, 200 + r, dst), 0u) << room;
  }
  EXPECT_EQ(decode_->stats().requests_succeeded, 8u);
  decode_.reset();  // before the second prefill engine and its pool
}

TEST_P(EngineTest, LayersGoOutAsTheyBecomeReady) {
  Start();
  const PeerHandle peer = Connect();
  std::vector<int32_t> src = {1, 2}, dst = {5, 6};
  ASSERT_TRUE(prefill_->Send("layerwise", src).ok());  // prefill first this time
  ASSERT_TRUE(decode_->Receive("layerwise", peer, dst).ok());
  for (int32_t layer = 0; layer < 4; ++layer) {
    Fill(*src_pool_, 5, src, layer, 1);  // the "forward" writes one layer
    ASSERT_TRUE(prefill_->LayersReady("layerwise", layer + 1).ok());
    if (layer < 3) {
      auto info = decode_->GetRequest("layerwise");
      ASSERT_TRUE(info.ok());
      EXPECT_FALSE(IsFinal(info->state)) << "done before the last layer was ready";
    }
  }
  auto info = decode_->WaitRequest("layerwise", 5s);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state, RequestState::kSuccess) << info->status;
  EXPECT_EQ(Mismatches(*dst_pool_, 5, dst), 0u);
  auto sent = prefill_->GetRequest("layerwise");
  EXPECT_EQ(sent->layers_posted, 4);
}

TEST_P(EngineTest, TimelineStampsEveryStepInOrder) {
  Start();
  const PeerHandle peer = Connect();
  std::vector<int32_t> src = {1, 2, 3}, dst = {7, 8, 9};
  const auto before = std::chrono::steady_clock::now();
  ASSERT_TRUE(decode_->Receive("timed", peer, dst).ok());
  ASSERT_TRUE(prefill_->Send("timed", src).ok());
  ASSERT_TRUE(prefill_->LayersReady("timed", 2).ok());  // two layer batches: two posts
  ASSERT_TRUE(prefill_->LayersReady("timed", 4).ok());
  auto got = decode_->WaitRequest("timed", 5s);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->state, RequestState::kSuccess) << got->status;
  auto sent = prefill_->WaitRequest("timed", 5s);
  ASSERT_TRUE(sent.ok()) << sent.status();
  const std::chrono::steady_clock::time_point unset{};
  // Decode: Receive -> request handed to the connection -> TransferDone processed.
  EXPECT_LE(before, got->created);
  EXPECT_NE(got->request_sent, unset);
  EXPECT_LE(got->created, got->request_sent);
  EXPECT_LE(got->request_sent, got->finished);
  EXPECT_EQ(got->request_seen, unset);  // prefill-side stamps stay unset on the decode side
  // Prefill: request seen -> source ready -> first and last post -> every write visible.
  for (auto t : {sent->request_seen, sent->source_ready, sent->first_post, sent->last_post}) {
    EXPECT_NE(t, unset);
  }
  EXPECT_LE(sent->request_seen, sent->source_ready);
  EXPECT_LE(sent->first_post, sent->last_post);
  EXPECT_LE(sent->source_ready, sent->last_post);
  EXPECT_LE(sent->last_post, sent->finished);
  // Across the two engines (one steady clock): sent before seen, done here before done there.
  EXPECT_LE(got->request_sent, sent->request_seen);
  EXPECT_LE(sent->finished, got->finished);

  // A request aborted before its source came never posted: those stamps stay unset.
  ASSERT_TRUE(decode_->Receive("aborted", peer, {20, 21}).ok());
  for (int i = 0; i < 500; ++i) {
    auto seen = prefill_->GetRequest("aborted");
    if (seen.ok() && seen->request_seen != unset) break;
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_TRUE(decode_->Abort("aborted", "test").ok());
  for (int i = 0; i < 500; ++i) {
    auto a = prefill_->GetRequest("aborted");
    if (a.ok() && IsFinal(a->state)) break;
    std::this_thread::sleep_for(1ms);
  }
  auto aborted = prefill_->GetRequest("aborted");
  ASSERT_TRUE(aborted.ok()) << aborted.status();
  EXPECT_TRUE(IsFinal(aborted->state));
  EXPECT_NE(aborted->request_seen, unset);
  EXPECT_EQ(aborted->source_ready, unset);
  EXPECT_EQ(aborted->first_post, unset);
  EXPECT_EQ(aborted->last_post, unset);
}

TEST_P(EngineTest, LayerRangeMovesOnlyThoseLayers) {
  Start();
  const PeerHandle peer = Connect();
  std::vector<int32_t> src = {7}, dst = {8};
  Fill(*src_pool_, 9, src);
  ASSERT_TRUE(decode_->Receive("half", peer, dst, 0ms, 2, 4).ok());
  ASSERT_TRUE(prefill_->Send("half", src).ok());
  ASSERT_TRUE(prefill_->LayersReady("half", 4).ok());
  auto info = decode_->WaitRequest("half", 5s);
  ASSERT_EQ(info->state, RequestState::kSuccess) << info->status;
  auto t = testing::MakePattern(*dst_pool_, 9, dst, 16, 2, 2);
  EXPECT_EQ(kernels::VerifyPatternCpu(t.args)->mismatches, 0u);
  auto t0 = testing::MakePattern(*dst_pool_, 9, dst, 16, 0, 2);
  EXPECT_GT(kernels::VerifyPatternCpu(t0.args)->mismatches, 0u);  // layers 0, 1 untouched
}

TEST_P(EngineTest, RandomRequestsAllVerify) {
  Start(SmallPoolOptions(4, 4, 256), SmallPoolOptions(4, 4, 256));
  const PeerHandle peer = Connect();
  auto src_alloc = pool::PageAllocator::Create(256);
  auto dst_alloc = pool::PageAllocator::Create(256);
  std::mt19937 rng(3);
  struct Req {
    std::string room;
    std::vector<int32_t> src, dst;
  };
  for (int round = 0; round < 10; ++round) {
    std::vector<Req> reqs;
    for (int i = 0; i < 10; ++i) {
      const int64_t n = 1 + rng() % 24;
      // Appended, not "r" + to_string(...): GCC 12 warns falsely (-Wrestrict) on that form.
      std::string room = "r";
      room += std::to_string(round);
      room += '-';
      room += std::to_string(i);
      Req r{room, *(*src_alloc)->Allocate(n), *(*dst_alloc)->Allocate(n)};
      std::shuffle(r.src.begin(), r.src.end(), rng);
      Fill(*src_pool_, 1000 + round * 10 + i, r.src);
      ASSERT_TRUE(decode_->Receive(r.room, peer, r.dst).ok());
      ASSERT_TRUE(prefill_->Send(r.room, r.src).ok());
      ASSERT_TRUE(prefill_->LayersReady(r.room, 4).ok());
      reqs.push_back(std::move(r));
    }
    for (int i = 0; i < 10; ++i) {
      auto info = decode_->WaitRequest(reqs[i].room, 5s);
      ASSERT_TRUE(info.ok());
      ASSERT_EQ(info->state, RequestState::kSuccess) << info->status;
      EXPECT_EQ(Mismatches(*dst_pool_, 1000 + round * 10 + i, reqs[i].dst), 0u);
      ASSERT_TRUE((*src_alloc)->Free(reqs[i].src).ok());
      ASSERT_TRUE((*dst_alloc)->Free(reqs[i].dst).ok());
      ASSERT_TRUE(decode_->Forget(reqs[i].room).ok());
    }
  }
  EXPECT_EQ(decode_->stats().requests_succeeded, 100u);
}

TEST_P(EngineTest, LayoutMismatchIsRefusedWithBothValues) {
  Start(SmallPoolOptions(4, 16), SmallPoolOptions(4, 32));
  auto peer = decode_->ConnectPeer("127.0.0.1", prefill_->port());
  ASSERT_FALSE(peer.ok());
  EXPECT_EQ(peer.status().code(), StatusCode::kFailedPrecondition) << peer.status();
  EXPECT_NE(peer.status().message().find("page_size prefill=16 decode=32"), std::string::npos)
      << peer.status();
}

TEST_P(EngineTest, DecodeAbortFailsBothSidesAndIsAcknowledged) {
  Start(SmallPoolOptions(), SmallPoolOptions(), /*loopback_delay_us=*/300000);
  const PeerHandle peer = Connect();
  std::vector<int32_t> src = {1}, dst = {2};
  ASSERT_TRUE(decode_->Receive("abort-me", peer, dst).ok());
  ASSERT_TRUE(prefill_->Send("abort-me", src).ok());
  // Half the layers: the request is mid-transfer (with the loopback delay, writes in flight).
  ASSERT_TRUE(prefill_->LayersReady("abort-me", 2).ok());
  ASSERT_TRUE(decode_->Abort("abort-me", "user cancelled").ok());
  auto info = decode_->GetRequest("abort-me");
  EXPECT_EQ(info->state, RequestState::kFailed);
  EXPECT_EQ(info->status.code(), StatusCode::kAborted);
  auto sent = prefill_->WaitRequest("abort-me", 5s);
  ASSERT_TRUE(sent.ok());
  EXPECT_EQ(sent->state, RequestState::kFailed);
  EXPECT_NE(sent->status.message().find("user cancelled"), std::string::npos) << sent->status;
  // The ack makes the pages reusable.
  for (int i = 0; i < 500 && !decode_->GetRequest("abort-me")->pages_reusable; ++i) {
    std::this_thread::sleep_for(2ms);
  }
  EXPECT_TRUE(decode_->GetRequest("abort-me")->pages_reusable);
  EXPECT_TRUE(decode_->Abort("abort-me").ok());  // already final: no effect
}

TEST_P(EngineTest, DeadlineFailsARequestWhosePrefillNeverComes) {
  Start();
  const PeerHandle peer = Connect();
  std::vector<int32_t> dst = {2, 3};
  ASSERT_TRUE(decode_->Receive("late", peer, dst, 200ms).ok());
  auto info = decode_->WaitRequest("late", 5s);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state, RequestState::kFailed);
  EXPECT_EQ(info->status.code(), StatusCode::kDeadlineExceeded) << info->status;
  auto other = prefill_->WaitRequest("late", 5s);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(other->state, RequestState::kFailed);
}

TEST_P(EngineTest, BadRequestsAreRefusedAndOthersUnaffected) {
  Start();
  const PeerHandle peer = Connect();
  std::vector<int32_t> bad = {0};
  EXPECT_EQ(decode_->Receive("zero", peer, bad).code(), StatusCode::kOutOfRange);
  std::vector<int32_t> past = {65};
  EXPECT_EQ(decode_->Receive("past", peer, past).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(prefill_->Send("past", past).code(), StatusCode::kOutOfRange);
  std::vector<int32_t> none;
  EXPECT_EQ(decode_->Receive("none", peer, none).code(), StatusCode::kInvalidArgument);
  std::vector<int32_t> one = {1};
  EXPECT_EQ(decode_->Receive("nopeer", 999, one).code(), StatusCode::kUnavailable);
  EXPECT_EQ(decode_->Receive("layers", peer, one, 0ms, 3, 9).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(prefill_->LayersReady("unknown", 1).code(), StatusCode::kNotFound);
  EXPECT_EQ(decode_->GetRequest("unknown").status().code(), StatusCode::kNotFound);

  // Page-count mismatch between the sides (the prefill side's pages came first) fails that
  // room on both, not the next one. (A Send past a known request's count is refused instead:
  // EngineLayoutTest.ChunksAreCheckedAgainstTheDecodeRequest.)
  std::vector<int32_t> two = {1, 2}, three = {4, 5, 6};
  ASSERT_TRUE(prefill_->Send("mismatch", three).ok());
  ASSERT_TRUE(decode_->Receive("mismatch", peer, two).ok());
  auto info = decode_->WaitRequest("mismatch", 5s);
  EXPECT_EQ(info->state, RequestState::kFailed);
  EXPECT_EQ(info->status.code(), StatusCode::kInvalidArgument) << info->status;
  EXPECT_TRUE(info->pages_reusable);

  ASSERT_TRUE(decode_->Receive("fine", peer, one).ok());
  ASSERT_TRUE(prefill_->Send("fine", {9}).ok());
  ASSERT_TRUE(prefill_->LayersReady("fine", 4).ok());
  EXPECT_EQ(decode_->WaitRequest("fine", 5s)->state, RequestState::kSuccess);

  // Duplicate rooms.
  EXPECT_EQ(decode_->Receive("fine", peer, one).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(prefill_->Send("fine", one).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(decode_->Forget("fine").code(), StatusCode::kOk);
}

TEST_P(EngineTest, LosingThePrefillEngineFailsItsRequests) {
  Start();
  const PeerHandle peer = Connect();
  std::vector<int32_t> dst = {2};
  ASSERT_TRUE(decode_->Receive("orphan", peer, dst).ok());
  prefill_.reset();  // the prefill agent goes away
  auto info = decode_->WaitRequest("orphan", 5s);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state, RequestState::kFailed);
  EXPECT_EQ(info->status.code(), StatusCode::kUnavailable) << info->status;
  // Nothing listens any more, so no write can land: the pages become reusable.
  for (int i = 0; i < 500 && !decode_->GetRequest("orphan")->pages_reusable; ++i) {
    std::this_thread::sleep_for(2ms);
  }
  EXPECT_TRUE(decode_->GetRequest("orphan")->pages_reusable);
  EXPECT_EQ(decode_->Receive("after", peer, dst).code(), StatusCode::kUnavailable);
}

INSTANTIATE_TEST_SUITE_P(HostBackends, EngineTest,
                         ::testing::Values("loopback", "loopback_pages", "ucx", "ucx_tcp"),
                         [](const auto& info) { return std::string(info.param); });

TEST(EngineGuards, PoolsTheGuardsRefuseCannotBeRegistered) {
  pool::PoolOptions o = SmallPoolOptions();
  o.layer_types = {pool::LayerType::kFullAttention, pool::LayerType::kLinearAttention,
                   pool::LayerType::kFullAttention, pool::LayerType::kLinearAttention};
  o.conv_state_shape = {4, 8};
  o.ssm_state_shape = {2, 8, 8};
  auto pool = MakePool(o);
  ASSERT_TRUE(pool);
  EngineOptions e;
  e.backend = LoopbackOptions{};
  auto engine = TransferEngine::Create(e, pool.get());
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.status().message().find("state layers"), std::string::npos) << engine.status();
}

TEST(EngineGuards, ControlBusyPollOutsideASecondIsRefused) {
  auto pool = MakePool(SmallPoolOptions());
  for (const int64_t us : {int64_t{-1}, int64_t{1000001}, std::numeric_limits<int64_t>::max()}) {
    EngineOptions e;
    e.backend = LoopbackOptions{};
    e.control_busy_poll = std::chrono::microseconds(us);
    auto engine = TransferEngine::Create(e, pool.get());
    ASSERT_FALSE(engine.ok()) << us;
    EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(engine.status().message().find("control_busy_poll = " + std::to_string(us) +
                                             " us: must be in 0 .. 1000000 us"),
              std::string::npos)
        << engine.status();
  }
  EngineOptions e;
  e.backend = LoopbackOptions{};
  e.control_busy_poll = std::chrono::seconds(1);  // the longest window taken
  auto longest = TransferEngine::Create(e, pool.get());
  EXPECT_TRUE(longest.ok()) << longest.status();
}

TEST(EngineGuards, RolesAreEnforced) {
  auto pool = MakePool(SmallPoolOptions());
  EngineOptions e;
  e.backend = LoopbackOptions{};
  auto prefill = TransferEngine::Create(e, pool.get());
  ASSERT_TRUE(prefill.ok());
  EXPECT_EQ((*prefill)->ConnectPeer("127.0.0.1", 1).status().code(),
            StatusCode::kFailedPrecondition);
  std::vector<int32_t> one = {1};
  EXPECT_EQ((*prefill)->Receive("x", 1, one).code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace kvt::transfer

// A decode engine that shuts down with rooms still open, inside one process over the loopback
// backend. Every room that is not final ends with a status that says so; waiters return at once;
// a room's pages are reported reusable only once no write into them can land any more (the
// prefill side confirmed it stopped, or this side's end of a two-sided connection is gone); and
// once the engine is destroyed, no write lands in its pool any more when the prefill side
// answers. The decode side is built here as TransferEngine builds it, so that its rooms can be
// looked at after Shutdown (a TransferEngine is gone by then).
#include "engine/decode_side.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/layout_codec.h"
#include "engine/request_table.h"
#include "engine_test_util.h"
#include "kvt/testing/status.h"
#include "kvt/testing/tcp_relay.h"
#include "kvt/transfer/backends.h"
#include "kvt/transfer/engine.h"

namespace kvt::transfer {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::Fill;
using ::testing::HasSubstr;
using testing::Loopback;
using testing::MakePool;
using testing::Mismatches;
using testing::SmallPoolOptions;
using testing::Snapshot;

EngineOptions Options(const std::string& name, bool prefill) {
  return testing::NamedEngine(name, prefill, 30s);
}

// A decode side over `pool`, set up as TransferEngine::Create sets one up (engine.cc), without
// the poller: deadlines do not run, nothing else changes the rooms behind the test's back.
class DecodeHarness {
 public:
  DecodeHarness(pool::KvPool& pool, std::shared_ptr<Backend> backend)
      : ctx_(Options("decode-0", false)) {
    auto layout = TransferLayout::FromPool(pool, 0, 1);
    EXPECT_TRUE(layout.ok()) << layout.status();
    if (!layout.ok()) return;
    ctx_.layout = std::move(layout).value();
    ctx_.backend = std::move(backend);
    auto wire = LayoutToProto(ctx_.layout);
    EXPECT_TRUE(wire.ok()) << wire.status();
    if (!wire.ok()) return;
    ctx_.local_layout = std::move(wire).value();
    ctx_.buffers = ctx_.layout.Flatten();
    std::vector<LocalRegion> regions;
    for (const TransferLayout::FlatBuffer& b : ctx_.buffers) {
      regions.push_back(
          LocalRegion{b.info.ptr, b.info.length, b.info.item_len, MemoryKind::kHost, -1, b.layer});
    }
    auto descriptor = ctx_.backend->Register(regions);
    EXPECT_TRUE(descriptor.ok()) << descriptor.status();
    if (!descriptor.ok()) return;
    ctx_.local_info =
        MakePeerInfo(ctx_.options.name, false, ctx_.local_layout, *descriptor, regions);
    ctx_.worker = std::make_unique<engine::Worker>(*ctx_.backend);
    side_ = std::make_unique<engine::DecodeSide>(ctx_);
    EXPECT_TRUE(side_->Start().ok());
  }
  ~DecodeHarness() { Shutdown(); }

  bool ready() const { return side_ != nullptr; }
  engine::DecodeSide& side() { return *side_; }

  // What TransferEngine's destructor does once its poller has stopped.
  void Shutdown() {
    if (side_ == nullptr || shut_down_.exchange(true)) return;
    {
      MutexLock lock(ctx_.mu);
      ctx_.stop = true;
    }
    side_->Shutdown();
    ctx_.worker->Stop();
  }

  Status Receive(const std::string& room, PeerHandle peer, std::vector<int32_t> dst) {
    return side_->Receive(room, peer, std::move(dst), 0ms, 0, ctx_.num_layers(), -1);
  }

 private:
  engine::EngineContext ctx_;  // declared first: the side uses it until it is destroyed
  std::unique_ptr<engine::DecodeSide> side_;
  std::atomic<bool> shut_down_{false};
};

// Loopback on the decode side, but two-sided: the decode side joins each prefill connection
// (Accept) and disconnects its end at shutdown. `disconnect` answers that Disconnect;
// `on_disconnect` runs at its start.
class TwoSidedDecodeBackend final : public Backend {
 public:
  static constexpr PeerId kAccepted = 1'000'000;

  TwoSidedDecodeBackend(std::shared_ptr<Backend> inner, Status disconnect,
                        std::function<void()> on_disconnect)
      : inner_(std::move(inner)),
        disconnect_(std::move(disconnect)),
        on_disconnect_(std::move(on_disconnect)) {}
  std::string_view Name() const override { return inner_->Name(); }
  BackendCapabilities Capabilities() const override {
    BackendCapabilities caps = inner_->Capabilities();
    caps.two_sided = true;
    return caps;
  }
  StatusOr<PeerDescriptor> Register(std::span<const LocalRegion> regions) override {
    return inner_->Register(regions);
  }
  StatusOr<PeerId> Connect(const PeerDescriptor& peer) override { return inner_->Connect(peer); }
  StatusOr<PeerId> Accept(const PeerDescriptor&, const std::string&) override { return kAccepted; }
  Status Disconnect(PeerId peer, DisconnectMode mode) override {
    if (peer != kAccepted) return inner_->Disconnect(peer, mode);
    disconnects_.fetch_add(1);
    if (on_disconnect_) on_disconnect_();
    return disconnect_;
  }
  StatusOr<WriteId> PostWrite(PeerId peer, std::span<const CopyRun> runs) override {
    return inner_->PostWrite(peer, runs);
  }
  Status Check(WriteId write) override { return inner_->Check(write); }
  void Release(WriteId write) override { inner_->Release(write); }

  int disconnects() const { return disconnects_.load(); }

 private:
  std::shared_ptr<Backend> inner_;
  const Status disconnect_;
  const std::function<void()> on_disconnect_;
  std::atomic<int> disconnects_{0};
};

// The prefill engine answers: a room in flight ends Aborted naming the shutdown and the state it
// was in, a WaitRequest on it returns at once, and its pages are reusable after the shutdown (the
// prefill side acknowledged the abort). Rooms that had ended keep their outcome. The prefill side
// hears why its room ended.
TEST(DecodeSideShutdownTest, RoomsInFlightEndAbortedAndFinalRoomsKeepTheirOutcome) {
  auto src_pool = MakePool(SmallPoolOptions());
  auto dst_pool = MakePool(SmallPoolOptions());
  auto prefill = TransferEngine::Create(Options("prefill-0", true), src_pool.get(), Loopback());
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  DecodeHarness decode(*dst_pool, Loopback());
  ASSERT_TRUE(decode.ready());
  auto peer = decode.side().ConnectPeer("127.0.0.1", (*prefill)->port());
  ASSERT_TRUE(peer.ok()) << peer.status();

  Fill(*src_pool, 21, {1, 2});
  KVT_ASSERT_OK(decode.Receive("done", *peer, {20, 21}));
  KVT_ASSERT_OK((*prefill)->Send("done", {1, 2}));
  KVT_ASSERT_OK((*prefill)->LayersReady("done", 4));
  auto done = decode.side().WaitRequest("done", 5s);
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_EQ(done->state, RequestState::kSuccess) << done->status;

  KVT_ASSERT_OK(decode.Receive("aborted", *peer, {30}));
  KVT_ASSERT_OK(decode.side().Abort("aborted", "the caller gave up"));
  KVT_ASSERT_OK(decode.Receive("pending", *peer, {40, 41}));  // the prefill never sends
  for (auto until = Clock::now() + 2s; Clock::now() < until;) {
    auto seen = (*prefill)->GetRequest("pending");
    if (seen.ok()) break;
    std::this_thread::sleep_for(1ms);
  }
  KVT_ASSERT_OK((*prefill)->GetRequest("pending").status());

  auto waiting =
      std::async(std::launch::async, [&] { return decode.side().WaitRequest("pending", 10s); });
  std::this_thread::sleep_for(100ms);
  ASSERT_EQ(waiting.wait_for(0s), std::future_status::timeout);
  const auto start = Clock::now();
  decode.Shutdown();
  ASSERT_EQ(waiting.wait_for(2s), std::future_status::ready)
      << "the wait on a room in flight outlived the shutdown";
  EXPECT_LT(Clock::now() - start, 2s);
  auto woken = waiting.get();
  ASSERT_TRUE(woken.ok()) << woken.status();
  EXPECT_EQ(woken->state, RequestState::kFailed);

  auto pending = decode.side().GetRequest("pending");
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_EQ(pending->state, RequestState::kFailed);
  EXPECT_EQ(pending->status.code(), StatusCode::kAborted) << pending->status;
  EXPECT_THAT(pending->status.message(),
              HasSubstr("the transfer engine 'decode-0' shut down while room 'pending' was "
                        "WaitingForInput"));
  EXPECT_TRUE(pending->pages_reusable) << "the prefill side acknowledged the abort";

  auto kept = decode.side().GetRequest("done");
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(kept->state, RequestState::kSuccess);
  KVT_EXPECT_OK(kept->status);
  EXPECT_TRUE(kept->pages_reusable);
  EXPECT_EQ(Mismatches(*dst_pool, 21, {20, 21}), 0u);
  auto aborted = decode.side().GetRequest("aborted");
  ASSERT_TRUE(aborted.ok());
  EXPECT_EQ(aborted->state, RequestState::kFailed);
  EXPECT_EQ(aborted->status.message(), "the caller gave up") << aborted->status;
  EXPECT_TRUE(aborted->pages_reusable);

  // The prefill side was told why, rather than finding the connection gone.
  auto there = (*prefill)->WaitRequest("pending", 5s);
  ASSERT_TRUE(there.ok()) << there.status();
  EXPECT_EQ(there->state, RequestState::kFailed);
  EXPECT_EQ(there->status.code(), StatusCode::kAborted) << there->status;
  EXPECT_THAT(there->status.message(), HasSubstr("decode engine 'decode-0' is shutting down"));
}

// The prefill engine has gone silent (a frozen connection): the shutdown cannot learn that its
// writes stopped. The room still ends at once, but its pages stay quarantined, and its status
// says for how long to keep them.
TEST(DecodeSideShutdownTest, PagesStayQuarantinedWhenThePrefillSideCannotConfirm) {
  auto src_pool = MakePool(SmallPoolOptions());
  auto dst_pool = MakePool(SmallPoolOptions());
  auto prefill = TransferEngine::Create(Options("prefill-0", true), src_pool.get(), Loopback());
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  kvt::testing::TcpRelay relay((*prefill)->port());
  ASSERT_NE(relay.port(), 0);
  DecodeHarness decode(*dst_pool, Loopback());
  ASSERT_TRUE(decode.ready());
  auto peer = decode.side().ConnectPeer("127.0.0.1", relay.port());
  ASSERT_TRUE(peer.ok()) << peer.status();
  KVT_ASSERT_OK(decode.Receive("frozen", *peer, {7, 8}));
  relay.Pause();

  auto waiting =
      std::async(std::launch::async, [&] { return decode.side().WaitRequest("frozen", 10s); });
  std::this_thread::sleep_for(100ms);
  const auto start = Clock::now();
  auto shutdown = std::async(std::launch::async, [&] { decode.Shutdown(); });
  ASSERT_EQ(waiting.wait_for(1s), std::future_status::ready)
      << "the wait waited for the prefill side's answer";
  EXPECT_LT(Clock::now() - start, 1s);
  auto woken = waiting.get();
  ASSERT_TRUE(woken.ok()) << woken.status();
  EXPECT_EQ(woken->state, RequestState::kFailed);
  EXPECT_FALSE(woken->pages_reusable);
  shutdown.get();
  EXPECT_LT(Clock::now() - start, 5s) << "the shutdown waited past its bound for the answer";

  auto info = decode.side().GetRequest("frozen");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state, RequestState::kFailed);
  EXPECT_EQ(info->status.code(), StatusCode::kAborted) << info->status;
  EXPECT_FALSE(info->pages_reusable) << "pages reusable although a write may still land";
  EXPECT_THAT(info->status.message(), HasSubstr("while room 'frozen' was WaitingForInput"));
  EXPECT_THAT(info->status.message(), HasSubstr("did not confirm"));
  EXPECT_THAT(info->status.message(), HasSubstr("12000 ms"));  // its fencing bound
}

// Two-sided backends: without the prefill side's answer, the pages become reusable once this
// side's end of the connection is disconnected, never before; a failed disconnect keeps them
// quarantined and says so in the status.
TEST(DecodeSideShutdownTest, TwoSidedPagesAreReusableOnlyOnceTheirConnectionIsDisconnected) {
  for (const bool disconnect_fails : {false, true}) {
    SCOPED_TRACE(disconnect_fails ? "the disconnect fails" : "the disconnect succeeds");
    auto src_pool = MakePool(SmallPoolOptions());
    auto dst_pool = MakePool(SmallPoolOptions());
    auto prefill = TransferEngine::Create(Options("prefill-0", true), src_pool.get(), Loopback());
    ASSERT_TRUE(prefill.ok()) << prefill.status();
    kvt::testing::TcpRelay relay((*prefill)->port());
    ASSERT_NE(relay.port(), 0);
    DecodeHarness* self = nullptr;
    std::optional<bool> reusable_at_disconnect;
    auto backend = std::make_shared<TwoSidedDecodeBackend>(
        Loopback(), disconnect_fails ? Internal("injected teardown failure") : OkStatus(), [&] {
          auto info = self->side().GetRequest("frozen");
          reusable_at_disconnect = info.ok() && info->pages_reusable;
        });
    DecodeHarness decode(*dst_pool, backend);
    ASSERT_TRUE(decode.ready());
    self = &decode;
    auto peer = decode.side().ConnectPeer("127.0.0.1", relay.port());
    ASSERT_TRUE(peer.ok()) << peer.status();
    KVT_ASSERT_OK(decode.Receive("frozen", *peer, {7, 8}));
    relay.Pause();
    decode.Shutdown();

    EXPECT_EQ(backend->disconnects(), 1);
    ASSERT_TRUE(reusable_at_disconnect.has_value()) << "the connection was never disconnected";
    EXPECT_FALSE(*reusable_at_disconnect) << "pages reusable before the disconnect";
    auto info = decode.side().GetRequest("frozen");
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->state, RequestState::kFailed);
    EXPECT_EQ(info->status.code(), StatusCode::kAborted) << info->status;
    EXPECT_THAT(info->status.message(), HasSubstr("while room 'frozen' was WaitingForInput"));
    if (disconnect_fails) {
      EXPECT_FALSE(info->pages_reusable);
      EXPECT_THAT(info->status.message(), HasSubstr("injected teardown failure"));
      EXPECT_THAT(info->status.message(), HasSubstr("may still land"));
    } else {
      EXPECT_TRUE(info->pages_reusable);
    }
  }
}

// A decode engine destroyed while a write into its pages is in flight (it lands 400 ms after it
// was posted, even once released, as a network card that took the data would). Its owner keeps
// the backend (as one that allocated the pool through it does) and may free or reuse the pool
// once the engine is gone: no byte may land after the destructor returned.
TEST(DecodeSideShutdownTest, NoWriteLandsInThePoolOnceTheEngineIsDestroyed) {
  auto src_pool = MakePool(SmallPoolOptions());
  auto dst_pool = MakePool(SmallPoolOptions());
  LoopbackOptions slow;
  slow.delay = 400ms;
  slow.release_completes_in_flight = true;
  auto prefill = TransferEngine::Create(Options("prefill-0", true), src_pool.get(), Loopback(slow));
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  std::shared_ptr<Backend> kept = Loopback();
  auto decode = TransferEngine::Create(Options("decode-0", false), dst_pool.get(), kept);
  ASSERT_TRUE(decode.ok()) << decode.status();
  auto peer = (*decode)->ConnectPeer("127.0.0.1", (*prefill)->port());
  ASSERT_TRUE(peer.ok()) << peer.status();

  const std::vector<int32_t> src = {3, 4, 5}, dst = {10, 11, 40};
  Fill(*src_pool, 55, src);
  KVT_ASSERT_OK((*decode)->Receive("slow", *peer, dst));
  KVT_ASSERT_OK((*prefill)->Send("slow", src));
  KVT_ASSERT_OK((*prefill)->LayersReady("slow", 4));
  bool posted = false;
  for (auto until = Clock::now() + 2s; Clock::now() < until && !posted;) {
    auto info = (*prefill)->GetRequest("slow");
    posted = info.ok() && info->state == RequestState::kTransferring;
    if (!posted) std::this_thread::sleep_for(1ms);
  }
  ASSERT_TRUE(posted) << "the prefill engine never posted the write";

  decode->reset();
  const std::vector<uint8_t> at_destruction = Snapshot(*dst_pool, dst);
  std::this_thread::sleep_for(600ms);  // past the write's delay
  EXPECT_EQ(Snapshot(*dst_pool, dst), at_destruction)
      << "bytes landed in the pool after the decode engine was destroyed";
  auto there = (*prefill)->WaitRequest("slow", 5s);
  ASSERT_TRUE(there.ok()) << there.status();
  EXPECT_EQ(there->state, RequestState::kFailed);
  EXPECT_EQ(there->status.code(), StatusCode::kAborted) << there->status;
  EXPECT_THAT(there->status.message(), HasSubstr("decode engine 'decode-0' is shutting down"));
}

}  // namespace
}  // namespace kvt::transfer

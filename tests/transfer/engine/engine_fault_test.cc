// The engine under faults and concurrency, inside one process over the loopback backend: a
// prefill engine shutting down mid-transfer, a slow peer teardown, concurrent connects, failed
// sends, orphaned rooms and lost peers. Each case guards a defect that lost or corrupted data,
// or stalled unrelated requests.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <optional>
#include <thread>
#include <vector>

#include "control/control_server.h"
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
using testing::Loopback;
using testing::MakePool;
using testing::Mismatches;
using testing::SmallPoolOptions;
using testing::Snapshot;

EngineOptions Options(const std::string& name, bool prefill) {
  return testing::NamedEngine(name, prefill, 10s);
}

size_t EntryCount(const char* folder) {
  size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(folder)) ++n;
  return n;
}
size_t ThreadCount() { return EntryCount("/proc/self/task"); }
size_t FdCount() { return EntryCount("/proc/self/fd"); }

// Short liveness settings for the fencing tests.
EngineOptions Quick(const std::string& name, bool prefill) {
  EngineOptions o = Options(name, prefill);
  o.peer_timeout = 600ms;
  o.heartbeat_interval = 150ms;
  return o;
}

double MsSince(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

// A prefill engine whose writes land `delay` after they are posted, even once released (as a
// network card that already took the data would), and a decode engine connected to it.
struct SlowWrites {
  explicit SlowWrites(std::chrono::milliseconds delay) {
    LoopbackOptions slow;
    slow.delay = delay;
    slow.release_completes_in_flight = true;
    auto p = TransferEngine::Create(Options("prefill-0", true), src_pool.get(), Loopback(slow));
    auto d = TransferEngine::Create(Options("decode-0", false), dst_pool.get(), Loopback({}));
    EXPECT_TRUE(p.ok()) << p.status();
    EXPECT_TRUE(d.ok()) << d.status();
    if (!p.ok() || !d.ok()) return;
    prefill = std::move(p).value();
    decode = std::move(d).value();
    auto handle = decode->ConnectPeer("127.0.0.1", prefill->port());
    EXPECT_TRUE(handle.ok()) << handle.status();
    if (handle.ok()) peer = *handle;
  }
  bool ready() const { return peer != 0; }

  // Room `room` from `src` (filled with `seed`) to `dst`, every layer ready; true once its
  // write is in flight.
  bool Post(const std::string& room, const std::vector<int32_t>& src,
            const std::vector<int32_t>& dst, uint64_t seed) {
    Fill(*src_pool, seed, src);
    if (!decode->Receive(room, peer, dst).ok() || !prefill->Send(room, src).ok() ||
        !prefill->LayersReady(room, 4).ok()) {
      return false;
    }
    for (auto until = Clock::now() + 2s; Clock::now() < until;) {
      auto info = prefill->GetRequest(room);
      if (info.ok() && info->state == RequestState::kTransferring) return true;
      std::this_thread::sleep_for(1ms);
    }
    return false;
  }

  // The bytes of the decode room's pages at the moment it said they are reusable (the room is
  // then final); nothing when that did not happen within 5 s.
  std::optional<std::vector<uint8_t>> BytesOnceReusable(const std::string& room,
                                                        const std::vector<int32_t>& dst) {
    for (auto until = Clock::now() + 5s; Clock::now() < until;) {
      auto info = decode->GetRequest(room);
      if (!info.ok()) return std::nullopt;
      if (info->pages_reusable) {
        EXPECT_TRUE(IsFinal(info->state));
        return Snapshot(*dst_pool, dst);
      }
    }
    return std::nullopt;
  }

  std::unique_ptr<pool::KvPool> src_pool = MakePool(SmallPoolOptions());
  std::unique_ptr<pool::KvPool> dst_pool = MakePool(SmallPoolOptions());
  std::unique_ptr<TransferEngine> prefill;
  std::unique_ptr<TransferEngine> decode;
  PeerHandle peer = 0;
};

// A prefill engine destroyed while its writes are in flight: the decode side may reuse the pages
// only once no byte of them can land any more. The loopback backend here models a network card
// that already took the data: a released write still lands (after its delay). The decode side
// must not hear "reusable" (nor see the port close) before that.
TEST(EngineFaultTest, PrefillShutdownQuiescesWritesBeforePagesAreReusable) {
  SlowWrites w(400ms);
  ASSERT_TRUE(w.ready());
  const std::vector<int32_t> dst = {10, 11, 12, 40};
  ASSERT_TRUE(w.Post("room-1", {3, 4, 5, 9}, dst, 77));  // lands 400 ms after the post
  std::thread shutdown([&] { w.prefill.reset(); });
  // Watch the decode room: once it says the pages are reusable, they must not change any more.
  const auto at_reusable = w.BytesOnceReusable("room-1", dst);
  shutdown.join();
  ASSERT_TRUE(at_reusable) << "the decode room never became reusable after the prefill shut down";
  std::this_thread::sleep_for(600ms);  // past the write's delay
  EXPECT_EQ(Snapshot(*w.dst_pool, dst), *at_reusable)
      << "bytes landed in the decode pages after they were reported reusable";
  auto info = w.decode->GetRequest("room-1");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state, RequestState::kFailed);
  EXPECT_EQ(info->status.code(), StatusCode::kUnavailable) << info->status;
  // The reason names the room's state and what to do.
  EXPECT_THAT(info->status.message(), ::testing::HasSubstr("is shutting down (room 'room-1' was "))
      << info->status;
  EXPECT_THAT(info->status.message(), ::testing::HasSubstr("send the room to a running prefill"))
      << info->status;
}

// Both sides abort one room at once: the prefill side's abort is still releasing the room's
// write (it lands after 400 ms, as a network card that took the data would) when the decode
// side's Abort arrives for the room that is already over there. Its AbortAck says the writes
// are quiesced, so it must wait for that release: the decode pages may not change once they
// are reported reusable.
TEST(EngineFaultTest, AnAbortAckWaitsForTheReleaseOfAnEarlierAbort) {
  SlowWrites w(400ms);
  ASSERT_TRUE(w.ready());
  const std::vector<int32_t> dst = {10, 11, 12, 40};
  ASSERT_TRUE(w.Post("both", {3, 4, 5, 9}, dst, 91));
  ASSERT_TRUE(w.prefill->Abort("both", "prefill gives up").ok());
  ASSERT_TRUE(w.decode->Abort("both", "decode gives up").ok());
  // Not forgotten while a late answer may still come: a new room of the id would take it.
  const Status early = w.decode->Forget("both");
  EXPECT_EQ(early.code(), StatusCode::kFailedPrecondition) << early;
  EXPECT_THAT(early.message(), ::testing::HasSubstr("pages_reusable is false")) << early;
  const auto at_reusable = w.BytesOnceReusable("both", dst);
  ASSERT_TRUE(at_reusable) << "the decode room never became reusable after both aborts";
  std::this_thread::sleep_for(600ms);  // past the write's delay
  EXPECT_EQ(Snapshot(*w.dst_pool, dst), *at_reusable)
      << "bytes landed in the decode pages after they were reported reusable";
  EXPECT_TRUE(w.decode->Forget("both").ok());
}

// The decode side aborts a room while the prefill engine's shutdown is releasing that room's
// write (which lands 400 ms after its post, as a network card that took the data would). The
// shutdown already failed the room, so the abort finds it over; its AbortAck says the writes are
// quiesced, so it must not go out before the shutdown's release returned: the decode pages may
// not change once they are reported reusable.
TEST(EngineFaultTest, AnAbortAckDuringPrefillShutdownWaitsForTheShutdownsRelease) {
  SlowWrites w(400ms);
  ASSERT_TRUE(w.ready());
  const std::vector<int32_t> dst = {10, 11, 12, 40};
  ASSERT_TRUE(w.Post("closing", {3, 4, 5, 9}, dst, 93));
  std::thread shutdown([&] { w.prefill.reset(); });
  std::this_thread::sleep_for(50ms);  // the shutdown has failed the room and is releasing
  const Status aborted = w.decode->Abort("closing", "decode gives up");
  const auto at_reusable = w.BytesOnceReusable("closing", dst);
  shutdown.join();
  ASSERT_TRUE(at_reusable) << "the decode room never became reusable (abort: " << aborted << ")";
  std::this_thread::sleep_for(600ms);  // past the write's delay
  EXPECT_EQ(Snapshot(*w.dst_pool, dst), *at_reusable)
      << "bytes landed in the decode pages after they were reported reusable (abort: " << aborted
      << ")";
}

// A prefill engine whose connection ends right after its hello-ack (it went away while the
// decode side was still setting the peer up): ConnectPeer never hands out that dead connection
// for good. Either it fails naming what happened, or the loss is noticed and the next
// ConnectPeer to the address connects afresh.
TEST(EngineFaultTest, AConnectionThatEndsRightAfterTheHelloAckIsNotKept) {
  auto src_pool = MakePool(SmallPoolOptions());
  auto dst_pool = MakePool(SmallPoolOptions());
  auto prefill = TransferEngine::Create(Options("prefill-0", true), src_pool.get(), Loopback({}));
  auto decode = TransferEngine::Create(Options("decode-0", false), dst_pool.get(), Loopback({}));
  ASSERT_TRUE(prefill.ok() && decode.ok());
  kvt::testing::TcpRelay relay((*prefill)->port());
  ASSERT_NE(relay.port(), 0);
  relay.CloseAfterReplies(2);  // the handshake's answer, then the hello-ack
  int refused = 0;
  for (int attempt = 0; attempt < 10; ++attempt) {
    auto first = (*decode)->ConnectPeer("127.0.0.1", relay.port());
    if (!first.ok()) {
      EXPECT_EQ(first.status().code(), StatusCode::kUnavailable) << first.status();
      EXPECT_THAT(first.status().message(),
                  ::testing::HasSubstr("closed the connection right after answering hello"))
          << first.status();
      ++refused;
      continue;
    }
    // Handed out before the close was seen: the close makes it lost, so it is not handed out
    // again, and requests on it fail.
    std::this_thread::sleep_for(100ms);
    auto again = (*decode)->ConnectPeer("127.0.0.1", relay.port());
    EXPECT_TRUE(!again.ok() || *again != *first) << "attempt " << attempt << ": peer " << *first
                                                 << " handed out again after its connection ended";
    EXPECT_FALSE((*decode)->Receive("r" + std::to_string(attempt), *first, {7}).ok());
  }
  std::printf("%d of 10 connects failed at once, the others were noticed lost\n", refused);
  // The engine still connects to the prefill engine itself, and moves a request.
  auto peer = (*decode)->ConnectPeer("127.0.0.1", (*prefill)->port());
  ASSERT_TRUE(peer.ok()) << peer.status();
  ASSERT_TRUE((*decode)->Receive("fine", *peer, {7}).ok());
  ASSERT_TRUE((*prefill)->Send("fine", {3}).ok());
  ASSERT_TRUE((*prefill)->LayersReady("fine", 4).ok());
  auto info = (*decode)->WaitRequest("fine", 5s);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state, RequestState::kSuccess) << info->status;
}

// One decode peer's backend teardown blocks for 2 s: another peer's requests still complete and
// the engine answers queries at once meanwhile.
TEST(EngineFaultTest, SlowPeerTeardownDoesNotStallOtherPeers) {
  auto src_pool = MakePool(SmallPoolOptions());
  auto dst_a = MakePool(SmallPoolOptions());
  auto dst_b = MakePool(SmallPoolOptions());
  std::atomic<bool> in_teardown{false};
  LoopbackOptions hooked;
  hooked.before_disconnect = [&](uint64_t) {
    in_teardown = true;
    std::this_thread::sleep_for(2s);
  };
  auto prefill =
      TransferEngine::Create(Options("prefill-0", true), src_pool.get(), Loopback(hooked));
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  auto decode_a = TransferEngine::Create(Options("decode-a", false), dst_a.get(), Loopback({}));
  auto decode_b = TransferEngine::Create(Options("decode-b", false), dst_b.get(), Loopback({}));
  ASSERT_TRUE(decode_a.ok() && decode_b.ok());
  ASSERT_TRUE((*decode_a)->ConnectPeer("127.0.0.1", (*prefill)->port()).ok());
  auto peer_b = (*decode_b)->ConnectPeer("127.0.0.1", (*prefill)->port());
  ASSERT_TRUE(peer_b.ok()) << peer_b.status();

  decode_a->reset();  // the prefill side tears its peer down (2 s)
  for (auto until = Clock::now() + 3s; Clock::now() < until && !in_teardown;) {
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_TRUE(in_teardown) << "the prefill engine never tore down the lost peer";

  const auto start = Clock::now();
  const std::vector<int32_t> src = {1, 2}, dst = {5, 6};
  Fill(*src_pool, 5, src);
  ASSERT_TRUE((*decode_b)->Receive("room-b", *peer_b, dst).ok());
  ASSERT_TRUE((*prefill)->Send("room-b", src).ok());
  ASSERT_TRUE((*prefill)->LayersReady("room-b", 4).ok());
  auto query_start = Clock::now();
  ASSERT_TRUE((*prefill)->GetRequest("room-b").ok());
  EXPECT_LT(Clock::now() - query_start, 100ms) << "GetRequest waited for the other peer";
  auto info = (*decode_b)->WaitRequest("room-b", 5s);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state, RequestState::kSuccess) << info->status;
  EXPECT_LT(Clock::now() - start, 1500ms) << "the request waited for the other peer's teardown";
  EXPECT_EQ(Mismatches(*dst_b, 5, dst), 0u);
}

// A write in flight whose release blocks (the loopback card waits out its delay) does not hold
// up the engine: an abort of one room does not stall queries of another.
TEST(EngineFaultTest, ReleasingWritesOfAnAbortedRoomDoesNotStallQueries) {
  SlowWrites w(1500ms);
  ASSERT_TRUE(w.ready());
  ASSERT_TRUE(w.prefill->Send("other", {4}).ok());
  ASSERT_TRUE(w.Post("slow", {3}, {7}, 5));
  std::thread abort([&] { ASSERT_TRUE(w.prefill->Abort("slow", "test").ok()); });
  std::this_thread::sleep_for(50ms);  // the abort is releasing the write (1.5 s)
  const auto start = Clock::now();
  auto other = w.prefill->GetRequest("other");
  EXPECT_LT(Clock::now() - start, 100ms) << "GetRequest waited for another room's release";
  ASSERT_TRUE(other.ok());
  abort.join();
  // The decode side hears of the abort only after the write was released.
  auto info = w.decode->WaitRequest("slow", 5s);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state, RequestState::kFailed);
  for (auto until = Clock::now() + 2s; Clock::now() < until;) {
    if (w.decode->GetRequest("slow")->pages_reusable) break;
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_TRUE(w.decode->GetRequest("slow")->pages_reusable);
}

// Two threads connecting to one prefill engine at once share one connection.
TEST(EngineFaultTest, ConcurrentConnectsShareOneConnection) {
  auto src_pool = MakePool(SmallPoolOptions());
  auto dst_pool = MakePool(SmallPoolOptions());
  auto prefill = TransferEngine::Create(Options("prefill-0", true), src_pool.get(), Loopback({}));
  auto decode = TransferEngine::Create(Options("decode-0", false), dst_pool.get(), Loopback({}));
  ASSERT_TRUE(prefill.ok() && decode.ok());
  for (int round = 0; round < 5; ++round) {
    // A new prefill engine each round, so no connection exists yet.
    auto target = TransferEngine::Create(Options("prefill-" + std::to_string(round + 1), true),
                                         src_pool.get(), Loopback({}));
    ASSERT_TRUE(target.ok()) << target.status();
    std::promise<void> go;
    std::shared_future<void> start = go.get_future().share();
    std::vector<std::future<StatusOr<PeerHandle>>> connects;
    for (int i = 0; i < 4; ++i) {
      connects.push_back(std::async(std::launch::async, [&] {
        start.wait();
        return (*decode)->ConnectPeer("127.0.0.1", (*target)->port());
      }));
    }
    go.set_value();
    std::vector<PeerHandle> handles;
    for (auto& c : connects) {
      auto handle = c.get();
      ASSERT_TRUE(handle.ok()) << handle.status();
      handles.push_back(*handle);
    }
    for (PeerHandle h : handles) EXPECT_EQ(h, handles.front()) << "round " << round;
  }
}

TEST(EngineFaultTest, HelloTimeoutIsAnOption) {
  auto dst_pool = MakePool(SmallPoolOptions());
  EngineOptions o = Options("decode-0", false);
  o.hello_timeout = 0ms;
  auto refused = TransferEngine::Create(o, dst_pool.get(), Loopback({}));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("hello_timeout = 0 ms"), std::string::npos)
      << refused.status();

  // A short timeout is enough for an engine that answers.
  auto src_pool = MakePool(SmallPoolOptions());
  auto prefill = TransferEngine::Create(Options("prefill-0", true), src_pool.get(), Loopback({}));
  ASSERT_TRUE(prefill.ok());
  o.hello_timeout = 2s;
  auto decode = TransferEngine::Create(o, dst_pool.get(), Loopback({}));
  ASSERT_TRUE(decode.ok()) << decode.status();
  auto connected = (*decode)->ConnectPeer("127.0.0.1", (*prefill)->port());
  EXPECT_TRUE(connected.ok()) << connected.status();
}

// A Receive whose request could not be sent leaves nothing behind: the same room id can be
// retried at once.
TEST(EngineFaultTest, FailedReceiveLeavesNoRoomBehind) {
  auto src_pool = MakePool(SmallPoolOptions());
  auto dst_pool = MakePool(SmallPoolOptions());
  auto prefill = TransferEngine::Create(Options("prefill-0", true), src_pool.get(), Loopback({}));
  auto decode = TransferEngine::Create(Options("decode-0", false), dst_pool.get(), Loopback({}));
  ASSERT_TRUE(prefill.ok() && decode.ok());
  auto peer = (*decode)->ConnectPeer("127.0.0.1", (*prefill)->port());
  ASSERT_TRUE(peer.ok()) << peer.status();
  // 5 M page ids (20 MB) do not fit in one control frame: the request cannot be sent.
  std::vector<int32_t> huge(5'000'000, 1);
  Status sent = (*decode)->Receive("retry-me", *peer, huge);
  ASSERT_FALSE(sent.ok());
  EXPECT_EQ((*decode)->GetRequest("retry-me").status().code(), StatusCode::kNotFound)
      << "a request that was never sent left a room behind";
  EXPECT_EQ((*decode)->stats().requests_failed, 0u);
  const std::vector<int32_t> src = {2, 3}, dst = {8, 9};
  Fill(*src_pool, 9, src);
  ASSERT_TRUE((*decode)->Receive("retry-me", *peer, dst).ok());
  ASSERT_TRUE((*prefill)->Send("retry-me", src).ok());
  ASSERT_TRUE((*prefill)->LayersReady("retry-me", 4).ok());
  auto info = (*decode)->WaitRequest("retry-me", 5s);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state, RequestState::kSuccess) << info->status;
  EXPECT_EQ(Mismatches(*dst_pool, 9, dst), 0u);
}

// A prefill room whose decode request never comes ends at the deadline Send gave it.
TEST(EngineFaultTest, OrphanedPrefillRoomEndsAtItsSendDeadline) {
  auto src_pool = MakePool(SmallPoolOptions());
  EngineOptions o = Options("prefill-0", true);
  o.default_deadline = 60s;
  auto prefill = TransferEngine::Create(o, src_pool.get(), Loopback({}));
  ASSERT_TRUE(prefill.ok());
  const auto start = Clock::now();
  ASSERT_TRUE((*prefill)->Send("orphan", {1, 2, 3}, 300ms).ok());
  auto info = (*prefill)->WaitRequest("orphan", 5s);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state, RequestState::kFailed);
  EXPECT_EQ(info->status.code(), StatusCode::kDeadlineExceeded) << info->status;
  EXPECT_NE(info->status.message().find("never asked"), std::string::npos) << info->status;
  EXPECT_LT(Clock::now() - start, 2s);
  EXPECT_EQ((*prefill)->Send("negative", {1}, -5ms).code(), StatusCode::kInvalidArgument);
}

// Lost prefill peers leave no thread and no file descriptor (connection) behind on the decode
// engine.
TEST(EngineFaultTest, LostPeersLeaveNoThreadsBehind) {
  auto dst_pool = MakePool(SmallPoolOptions());
  auto src_pool = MakePool(SmallPoolOptions());
  auto decode = TransferEngine::Create(Options("decode-0", false), dst_pool.get(), Loopback({}));
  ASSERT_TRUE(decode.ok());
  size_t baseline = 0, baseline_fds = 0;
  for (int i = 0; i < 12; ++i) {
    auto prefill = TransferEngine::Create(Options("prefill-" + std::to_string(i), true),
                                          src_pool.get(), Loopback({}));
    ASSERT_TRUE(prefill.ok());
    auto peer = (*decode)->ConnectPeer("127.0.0.1", (*prefill)->port());
    ASSERT_TRUE(peer.ok()) << peer.status();
    // A request in flight when the peer goes: its pages wait for the proof that it is gone.
    ASSERT_TRUE((*decode)->Receive("lost-" + std::to_string(i), *peer, {5}).ok());
    prefill->reset();
    auto info = (*decode)->WaitRequest("lost-" + std::to_string(i), 5s);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->state, RequestState::kFailed);
    if (i == 1) {
      std::this_thread::sleep_for(300ms);
      baseline = ThreadCount();
      baseline_fds = FdCount();
    }
  }
  size_t now = ThreadCount(), fds = FdCount();
  for (auto until = Clock::now() + 3s;
       Clock::now() < until && (now > baseline || fds > baseline_fds);) {
    std::this_thread::sleep_for(20ms);
    now = ThreadCount();
    fds = FdCount();
  }
  EXPECT_LE(now, baseline) << "threads grew with the number of lost peers";
  EXPECT_LE(fds, baseline_fds) << "file descriptors grew with the number of lost peers";
}

// The control connection goes silent (a paused peer, a pulled cable: nothing is closed). Both
// sides fail the request within the peer timeout; the prefill side fences the session (it posts
// nothing more, even for layers that become ready afterwards); the decode side frees the pages
// once the prefill side's fencing bound has passed, not before; and once the connection is back,
// a new request succeeds.
TEST(EngineFaultTest, SilentPeerIsFencedAndItsPagesComeBackAfterTheBound) {
  auto src_pool = MakePool(SmallPoolOptions());
  auto dst_pool = MakePool(SmallPoolOptions());
  auto prefill = TransferEngine::Create(Quick("prefill-0", true), src_pool.get(), Loopback({}));
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  auto decode = TransferEngine::Create(Quick("decode-0", false), dst_pool.get(), Loopback({}));
  ASSERT_TRUE(decode.ok()) << decode.status();
  kvt::testing::TcpRelay relay((*prefill)->port());
  ASSERT_NE(relay.port(), 0);
  auto peer = (*decode)->ConnectPeer("127.0.0.1", relay.port());
  ASSERT_TRUE(peer.ok()) << peer.status();

  const std::vector<int32_t> src = {3, 4, 5, 9}, dst = {10, 11, 12, 40};
  Fill(*src_pool, 77, src);
  const std::vector<uint8_t> before = Snapshot(*dst_pool, dst);
  ASSERT_TRUE((*decode)->Receive("room-1", *peer, dst).ok());
  ASSERT_TRUE((*prefill)->Send("room-1", src).ok());
  for (auto until = Clock::now() + 2s; Clock::now() < until;) {
    auto info = (*prefill)->GetRequest("room-1");
    if (info.ok() && info->state == RequestState::kWaitingForInput) break;
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_EQ((*prefill)->GetRequest("room-1")->state, RequestState::kWaitingForInput);

  relay.Pause();
  const auto paused = Clock::now();
  auto failed = (*decode)->WaitRequest("room-1", 5s);
  ASSERT_TRUE(failed.ok()) << failed.status();
  const double failed_ms = MsSince(paused);
  EXPECT_EQ(failed->state, RequestState::kFailed);
  EXPECT_EQ(failed->status.code(), StatusCode::kUnavailable) << failed->status;
  EXPECT_LT(failed_ms, 600 + 3000) << "the silent peer's request failed late";
  EXPECT_FALSE(failed->pages_reusable) << "pages reusable before the prefill side is fenced";

  // The prefill side fenced the session too; layers that become ready now are never posted.
  auto fenced = (*prefill)->WaitRequest("room-1", 5s);
  ASSERT_TRUE(fenced.ok()) << fenced.status();
  EXPECT_EQ(fenced->state, RequestState::kFailed);
  EXPECT_EQ(fenced->layers_posted, 0);
  ASSERT_TRUE((*prefill)->LayersReady("room-1", 4).ok());

  // The bound: the prefill side's peer timeout plus its teardown time, from the close.
  bool reusable = false;
  for (auto until = Clock::now() + 6s; Clock::now() < until && !reusable;) {
    auto info = (*decode)->GetRequest("room-1");
    ASSERT_TRUE(info.ok()) << info.status();
    reusable = info->pages_reusable;
    if (!reusable) std::this_thread::sleep_for(10ms);
  }
  const double reusable_ms = MsSince(paused);
  ASSERT_TRUE(reusable) << "the pages of the silent peer's request never came back";
  EXPECT_GE(reusable_ms, 600 + 2000 - 50) << "pages came back before the fencing bound";
  EXPECT_EQ(Snapshot(*dst_pool, dst), before) << "a write landed after the session was fenced";

  // The connection comes back: the old session is gone on both sides, a new one works.
  relay.Resume();
  auto again = (*decode)->ConnectPeer("127.0.0.1", relay.port());
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE((*decode)->Receive("room-2", *again, dst).ok());
  ASSERT_TRUE((*prefill)->Send("room-2", src).ok());
  ASSERT_TRUE((*prefill)->LayersReady("room-2", 4).ok());
  auto done = (*decode)->WaitRequest("room-2", 5s);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->state, RequestState::kSuccess) << done->status;
  EXPECT_EQ(Mismatches(*dst_pool, 77, dst), 0u);
}

TEST(EngineFaultTest, LivenessSettingsAreValidated) {
  auto pool = MakePool(SmallPoolOptions());
  EngineOptions slow_heartbeat = Options("prefill-0", true);
  slow_heartbeat.peer_timeout = 500ms;
  slow_heartbeat.heartbeat_interval = 500ms;
  auto refused = TransferEngine::Create(slow_heartbeat, pool.get(), Loopback({}));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("heartbeat_interval = 500"), std::string::npos)
      << refused.status();
  EngineOptions no_timeout = Options("prefill-0", true);
  no_timeout.peer_timeout = 0ms;
  refused = TransferEngine::Create(no_timeout, pool.get(), Loopback({}));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("peer_timeout = 0"), std::string::npos)
      << refused.status();
}

// A backend that forwards to another and adds completion hints (Backend::CompletedHint), as
// cuda_ipc's completion word does: truthful ones (the write's Check is OK), or hints that never
// come (the engine must still see completion through Check).
class HintingBackend final : public Backend {
 public:
  HintingBackend(std::shared_ptr<Backend> inner, bool truthful)
      : inner_(std::move(inner)), truthful_(truthful) {}
  std::string_view Name() const override { return inner_->Name(); }
  BackendCapabilities Capabilities() const override {
    BackendCapabilities caps = inner_->Capabilities();
    caps.completion_hints = true;
    return caps;
  }
  StatusOr<PeerDescriptor> Register(std::span<const LocalRegion> regions) override {
    return inner_->Register(regions);
  }
  StatusOr<PeerId> Connect(const PeerDescriptor& peer) override { return inner_->Connect(peer); }
  Status Disconnect(PeerId peer, DisconnectMode mode) override {
    return inner_->Disconnect(peer, mode);
  }
  StatusOr<WriteId> PostWrite(PeerId peer, std::span<const CopyRun> runs) override {
    return inner_->PostWrite(peer, runs);
  }
  StatusOr<WriteId> PostPages(PeerId peer, const PageWrite& write) override {
    return inner_->PostPages(peer, write);
  }
  Status Check(WriteId write) override {
    checks_.fetch_add(1);
    return inner_->Check(write);
  }
  bool CompletedHint(WriteId write) const override {
    hints_.fetch_add(1);
    return truthful_ && inner_->Check(write).ok();
  }
  void SetCompletionNotifier(std::function<void()> notify) override {
    inner_->SetCompletionNotifier(std::move(notify));
  }
  void Release(WriteId write) override { inner_->Release(write); }

  uint64_t hints() const { return hints_.load(); }

 private:
  std::shared_ptr<Backend> inner_;
  const bool truthful_;
  std::atomic<uint64_t> checks_{0};
  mutable std::atomic<uint64_t> hints_{0};
};

// Two engines over loopback page writes that each run 300 us (the prefill engine's poller
// watches them), the prefill side's backend giving completion hints (truthful ones, or hints
// that never come); the prefill engine busy-polls for `busy_poll` (0: it does not).
struct HintedPair {
  std::unique_ptr<pool::KvPool> src_pool = MakePool(SmallPoolOptions());
  std::unique_ptr<pool::KvPool> dst_pool = MakePool(SmallPoolOptions());
  std::shared_ptr<HintingBackend> hinting;
  std::unique_ptr<TransferEngine> prefill, decode;
  PeerHandle peer = 0;

  void Start(bool truthful, std::chrono::microseconds busy_poll) {
    LoopbackOptions paged;
    paged.page_writes = true;
    paged.delay = 300us;
    hinting = std::make_shared<HintingBackend>(Loopback(paged), truthful);
    EngineOptions po = Options("prefill-0", true);
    po.control_busy_poll = busy_poll;
    auto p = TransferEngine::Create(po, src_pool.get(), hinting);
    LoopbackOptions plain;
    plain.page_writes = true;
    auto d = TransferEngine::Create(Options("decode-0", false), dst_pool.get(), Loopback(plain));
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(d.ok()) << d.status();
    prefill = std::move(p).value();
    decode = std::move(d).value();
    auto handle = decode->ConnectPeer("127.0.0.1", prefill->port());
    ASSERT_TRUE(handle.ok()) << handle.status();
    peer = *handle;
  }

  // Moves `n` two-page rooms one after another, each filled with the pattern of request
  // seed + i and checked byte for byte once done.
  void MoveRoomsOneAtATime(int n, int seed) {
    for (int i = 0; i < n; ++i) {
      std::string room = "r";  // appended: GCC 12 warns falsely (-Wrestrict) on "r" + ...
      room += std::to_string(i);
      const std::vector<int32_t> src = {1 + i, 30 + i}, dst = {40 + i, 5 + i};
      Fill(*src_pool, seed + i, src);
      KVT_ASSERT_OK(decode->Receive(room, peer, dst));
      KVT_ASSERT_OK(prefill->Send(room, src));
      KVT_ASSERT_OK(prefill->LayersReady(room, 4));
      auto info = decode->WaitRequest(room, 5s);
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->state, RequestState::kSuccess) << room << ": " << info->status;
      EXPECT_EQ(Mismatches(*dst_pool, seed + i, dst), 0u) << room;
    }
  }

  ~HintedPair() {
    decode.reset();
    prefill.reset();
  }
};

// The poller watches a running write through the backend's completion hints: with truthful
// hints and with hints that never come (then Check, every 50 us, sees it), every room arrives
// byte-exact within its deadline.
TEST(EngineHintTest, TheWatchedWriteCompletesWithHintsAndWithoutThem) {
  for (const bool truthful : {true, false}) {
    SCOPED_TRACE(truthful ? "truthful hints" : "hints that never come");
    HintedPair pair;
    pair.Start(truthful, 0us);
    if (HasFatalFailure()) return;
    pair.MoveRoomsOneAtATime(20, 100);
    if (HasFatalFailure()) return;
    EXPECT_GT(pair.hinting->hints(), 0u) << "the poller never asked for a hint";
  }
}

// Wakeup::SpinUntil, the hot poller's wait: it ends at a kick (also one that came before it)
// and at its deadline without one, consuming the kick either way; meanwhile, as for a sleeping
// poller, KickBefore kicks only for a time before the spin's end. Bounded: every spin ends by
// its own deadline (2 s), and a wait that times out kicks its spin and waits for it, so no
// Wakeup goes while a spin still uses it.
TEST(WakeupTest, ASpinEndsAtAKickOrAtItsDeadline) {
  using engine::Wakeup;
  Wakeup kicked, early, later, idle;  // declared before the spins, which use them
  std::future<void> spin;
  const auto start = [&spin](Wakeup& wakeup, Clock::time_point deadline) {
    spin = std::async(std::launch::async, [&wakeup, deadline] { wakeup.SpinUntil(deadline); });
  };
  const auto ended = [&spin](Wakeup& wakeup) {
    if (spin.wait_for(5s) == std::future_status::ready) return true;
    wakeup.Kick();
    spin.wait();
    return false;
  };

  auto t0 = Clock::now();
  start(kicked, t0 + 2s);
  std::this_thread::sleep_for(20ms);
  kicked.Kick();
  ASSERT_TRUE(ended(kicked));
  EXPECT_LT(Clock::now() - t0, 1s) << "a kick did not end the spin";
  EXPECT_FALSE(kicked.pending()) << "the spin left its kick pending";

  early.Kick();  // before the spin: not lost
  t0 = Clock::now();
  start(early, t0 + 2s);
  ASSERT_TRUE(ended(early));
  EXPECT_LT(Clock::now() - t0, 1s) << "an earlier kick was lost";
  EXPECT_FALSE(early.pending());

  t0 = Clock::now();
  start(later, t0 + 2s);
  for (int i = 0; i < 500 && !later.waiting(); ++i) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(later.waiting()) << "the spin did not start within 0.5 s";
  later.KickBefore(t0 + 1h);  // after the spin's end: not needed, not taken
  EXPECT_FALSE(later.pending());
  EXPECT_EQ(spin.wait_for(50ms), std::future_status::timeout) << "a later kick ended the spin";
  later.KickBefore(t0 + 100ms);  // before it: ends the spin
  ASSERT_TRUE(ended(later));
  EXPECT_LT(Clock::now() - t0, 1s) << "a kick for before the spin's end did not end it";
  EXPECT_FALSE(later.pending());

  t0 = Clock::now();
  start(idle, t0 + 30ms);
  ASSERT_TRUE(ended(idle));
  EXPECT_GE(Clock::now() - t0, 30ms) << "the spin ended before its deadline without a kick";
  idle.KickBefore(Clock::now() + 1h);  // not spinning or sleeping now: the kick is kept
  EXPECT_TRUE(idle.pending());
  EXPECT_TRUE(idle.Consume());
  EXPECT_FALSE(idle.pending());
}

// A busy-polling prefill engine keeps its poller spinning (not sleeping) for its polling window
// after it watched a device write (Wakeup::SpinUntil; counted in poller_hot_spins). Meanwhile
// every write is still seen complete and verified, and a room that comes during the spin still
// ends at its deadline.
TEST(EngineHintTest, AHotPollerSeesEveryWriteAndEveryEarlierDeadline) {
  HintedPair pair;
  pair.Start(/*truthful=*/true, 1s);  // the longest window: hot through the rest of the test
  if (HasFatalFailure()) return;
  EXPECT_EQ(pair.prefill->stats().poller_hot_spins, 0u) << "hot before it watched a write";
  pair.MoveRoomsOneAtATime(10, 200);
  if (HasFatalFailure()) return;
  EXPECT_GT(pair.prefill->stats().poller_hot_spins, 0u) << "the poller never stayed hot";
  // The poller spins now (its window runs 1 s from the last write it watched).
  const auto start = Clock::now();
  KVT_ASSERT_OK(pair.prefill->Send("orphan", {3, 4}, 300ms));
  auto info = pair.prefill->WaitRequest("orphan", 5s);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state, RequestState::kFailed);
  EXPECT_EQ(info->status.code(), StatusCode::kDeadlineExceeded) << info->status;
  EXPECT_LT(Clock::now() - start, 3s) << "the spinning poller missed the room's deadline";
  // A prefill engine that does not busy-poll never spins.
  HintedPair cold;
  cold.Start(/*truthful=*/true, 0us);
  if (HasFatalFailure()) return;
  cold.MoveRoomsOneAtATime(3, 300);
  if (HasFatalFailure()) return;
  EXPECT_EQ(cold.prefill->stats().poller_hot_spins, 0u);
}

// A control server that completes the handshake and then never answers: a prefill engine
// that hangs before its hello-ack.
class SilentHandler final : public control::ControlHandler {
 public:
  void OnMessage(control::ConnectionId, const v1::Envelope&) override {}
  void OnDisconnect(control::ConnectionId, const Status&) override {}
};

// Interrupt makes calls that wait on a peer return now: a ConnectPeer waiting for a hello-ack
// that never comes, and a WaitRequest on a room that is not final; later ones fail at once. The
// owner can then destroy the engine without waiting out hello_timeout.
TEST(EngineFaultTest, InterruptEndsConnectsAndWaitsInFlight) {
  SilentHandler silent;
  control::ControlServerOptions so;
  so.bind_address = "127.0.0.1";
  auto server = control::ControlServer::Create(so, &silent);
  ASSERT_TRUE(server.ok()) << server.status();
  auto src_pool = MakePool(SmallPoolOptions());
  auto dst_pool = MakePool(SmallPoolOptions());
  auto prefill = TransferEngine::Create(Options("prefill-0", true), src_pool.get(), Loopback({}));
  EngineOptions o = Options("decode-0", false);
  o.hello_timeout = 20s;
  o.default_deadline = 30s;
  auto decode = TransferEngine::Create(o, dst_pool.get(), Loopback({}));
  ASSERT_TRUE(prefill.ok() && decode.ok());
  auto peer = (*decode)->ConnectPeer("127.0.0.1", (*prefill)->port());
  ASSERT_TRUE(peer.ok()) << peer.status();
  ASSERT_TRUE((*decode)->Receive("pending", *peer, {4, 5}).ok());  // the prefill never sends

  const auto start = Clock::now();
  auto hanging = std::async(std::launch::async, [&] {
    return (*decode)->ConnectPeer("127.0.0.1", (*server)->port()).status();
  });
  auto waiting = std::async(std::launch::async,
                            [&] { return (*decode)->WaitRequest("pending", 20s).status(); });
  std::this_thread::sleep_for(300ms);
  (*decode)->Interrupt();
  ASSERT_EQ(hanging.wait_for(5s), std::future_status::ready) << "the connect was not interrupted";
  ASSERT_EQ(waiting.wait_for(5s), std::future_status::ready) << "the wait was not interrupted";
  EXPECT_LT(Clock::now() - start, 3s);
  const Status connect = hanging.get(), wait = waiting.get();
  EXPECT_EQ(connect.code(), StatusCode::kAborted) << connect;
  EXPECT_THAT(connect.message(), ::testing::HasSubstr("interrupted")) << connect;
  EXPECT_EQ(wait.code(), StatusCode::kAborted) << wait;
  EXPECT_THAT(wait.message(), ::testing::HasSubstr("room 'pending' was interrupted")) << wait;
  // Later calls fail at once; the room itself is untouched.
  EXPECT_EQ((*decode)->ConnectPeer("127.0.0.1", (*prefill)->port()).status().code(),
            StatusCode::kAborted);
  EXPECT_EQ((*decode)->WaitRequest("pending", 10s).status().code(), StatusCode::kAborted);
  auto info = (*decode)->GetRequest("pending");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_FALSE(IsFinal(info->state));
  decode->reset();
  EXPECT_LT(Clock::now() - start, 4s) << "destroying the interrupted engine waited";
  (*server)->Stop();
}

}  // namespace
}  // namespace kvt::transfer

// The ucx backend's copy runs as active messages (host memory where UCX has no native RMA, as
// over tcp): the automatic choice of path, byte exactness with many writes in flight, a
// disconnect part-way, refusals of a peer that cannot take messages, a hostile sender whose
// malformed or out-of-range run messages are refused with an ack naming the value while the
// receiver keeps serving its real peers, a third party without a link's token that can neither
// ack, close nor write that link, senders past the window or credits a receiver granted, a
// fenced sender that is alive (told at once, by acks naming the fence), and waits for one slow
// peer's acks that leave other peers' writes running.
#include <gtest/gtest.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "backend_test_util.h"
#include "backends/ucx/ucx_backend.h"
#include "backends/ucx/ucx_staged_protocol.h"
#include "kvt/testing/status.h"
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

UcxOptions Tcp(UcxHostPath path = UcxHostPath::kAuto) {
  UcxOptions options;
  options.transports = "tcp";
  options.host_path = path;
  return options;
}

// The kBuffers buffers of `pool` (kBuffers * kBufferBytes bytes), as host regions.
std::vector<LocalRegion> HostRegions(std::vector<uint8_t>& pool, uint64_t item) {
  std::vector<LocalRegion> regions;
  for (int b = 0; b < kBuffers; ++b) {
    regions.push_back(LocalRegion{reinterpret_cast<uint64_t>(pool.data() + b * kBufferBytes),
                                  kBufferBytes, item, MemoryKind::kHost, -1});
  }
  return regions;
}

class UcxAmTest : public ::testing::Test {
 protected:
  void Start(UcxOptions sender_options, UcxOptions receiver_options) {
    auto a = CreateBackend(sender_options);
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = CreateBackend(receiver_options);
    ASSERT_TRUE(b.ok()) << b.status();
    sender_ = std::move(a).value();
    receiver_ = std::move(b).value();
    src_.clear();
    for (int b = 0; b < kBuffers; ++b) src_.push_back(testing::RandomBytes(kBufferBytes, 40 + b));
    dst_.assign(kBuffers * kBufferBytes, kPoison);
    std::vector<const uint8_t*> src;
    for (const auto& buffer : src_) src.push_back(buffer.data());
    peer_ =
        testing::RegisterAndConnect(*sender_, *receiver_, src, dst_.data(), kBufferBytes, kItem);
  }
  void Start(const UcxOptions& options) { Start(options, options); }

  // The receiver's buffers, as RegisterAndConnect registered them.
  std::vector<LocalRegion> DstRegions() { return HostRegions(dst_, kItem); }

  // Three backends over tcp: sender_ (src_ registered, random from `seed`), receiver_ (dst_) and
  // a third one made with `hooks`, the peer whose trouble a test makes (its pool `third_dst_`,
  // registered: `third_descriptor_`). The sender is connected to the receiver only (`fast_`).
  void StartWithThird(const UcxTestHooks& hooks, uint32_t seed) {
    auto s = CreateBackend(Tcp());
    auto a = CreateBackend(Tcp());
    auto b = CreateUcxBackendForTest(Tcp(), hooks);
    ASSERT_TRUE(s.ok() && a.ok() && b.ok());
    sender_ = std::move(s).value();
    receiver_ = std::move(a).value();
    third_ = std::move(b).value();
    for (int i = 0; i < kBuffers; ++i) src_.push_back(testing::RandomBytes(kBufferBytes, seed + i));
    dst_.assign(kBuffers * kBufferBytes, kPoison);
    third_dst_.assign(kBuffers * kBufferBytes, kPoison);
    std::vector<LocalRegion> src;
    for (auto& buffer : src_) {
      src.push_back(LocalRegion{reinterpret_cast<uint64_t>(buffer.data()), buffer.size(), kItem,
                                MemoryKind::kHost, -1});
    }
    auto sender_descriptor = sender_->Register(src);
    ASSERT_TRUE(sender_descriptor.ok()) << sender_descriptor.status();
    sender_descriptor_ = *sender_descriptor;
    auto fast_descriptor = receiver_->Register(DstRegions());
    ASSERT_TRUE(fast_descriptor.ok()) << fast_descriptor.status();
    auto third_descriptor = third_->Register(HostRegions(third_dst_, kItem));
    ASSERT_TRUE(third_descriptor.ok()) << third_descriptor.status();
    third_descriptor_ = *third_descriptor;
    auto fast = sender_->Connect(*fast_descriptor);
    ASSERT_TRUE(fast.ok()) << fast.status();
    fast_ = *fast;
  }

  // A staged receiver over tcp (host memory staged as a CUDA pool would be: 2 slots of 1 MiB)
  // with dst_ registered, and the worker address its raw senders reach.
  void StartStagedReceiver(std::unique_ptr<Backend>& receiver, std::string& worker_address) {
    UcxOptions staged = Tcp();
    staged.cuda_mode = UcxCudaMode::kStaged;
    staged.staging_slots = 2;
    staged.staging_slot_bytes = 1 << 20;
    UcxTestHooks hooks;
    hooks.stage_host_memory = true;
    auto created = CreateUcxBackendForTest(staged, hooks);
    ASSERT_TRUE(created.ok()) << created.status();
    receiver = std::move(created).value();
    dst_.assign(kBuffers * kBufferBytes, kPoison);
    auto descriptor = receiver->Register(DstRegions());
    ASSERT_TRUE(descriptor.ok()) << descriptor.status();
    worker_address = std::string(ucx_staging::SplitPeerAddress(descriptor->address).worker_address);
  }

  void TearDown() override {
    sender_.reset();
    receiver_.reset();
    third_.reset();
  }

  std::vector<CopyRun> Pages(uint32_t buffer, uint64_t bytes_per_run) const {
    std::vector<CopyRun> runs;
    for (uint64_t off = 0; off < kBufferBytes; off += bytes_per_run) {
      // Reversed destinations: every run lands somewhere else than it came from.
      runs.push_back({buffer, off, kBufferBytes - off - bytes_per_run, bytes_per_run});
    }
    return runs;
  }

  void ExpectLanded(const std::vector<CopyRun>& runs) const {
    for (const CopyRun& r : runs) {
      ASSERT_EQ(std::memcmp(dst_.data() + r.DstBuffer() * kBufferBytes + r.dst_offset,
                            src_[r.buffer].data() + r.src_offset, r.bytes),
                0)
          << "buffer " << r.buffer << " offset " << r.dst_offset;
    }
  }

  std::unique_ptr<Backend> sender_, receiver_;
  std::vector<std::vector<uint8_t>> src_;
  std::vector<uint8_t> dst_;
  StatusOr<PeerId> peer_ = NotFound("not started");
  // StartWithThird.
  std::unique_ptr<Backend> third_;
  std::vector<uint8_t> third_dst_;
  PeerDescriptor third_descriptor_;
  PeerDescriptor sender_descriptor_;
  PeerId fast_ = 0;
};

// The path writes to the peer take, or the error's text.
std::string PathOf(Backend& backend, PeerId peer) {
  StatusOr<std::string> path = UcxPeerPath(backend, peer);
  return path.ok() ? *path : path.status().ToString();
}

TEST_F(UcxAmTest, TcpPeersGetActiveMessagesAutomaticallyAndPutsOnRequest) {
  Start(Tcp());
  ASSERT_TRUE(peer_.ok()) << peer_.status();
  EXPECT_EQ(PathOf(*sender_, *peer_), "am");
  sender_.reset();
  receiver_.reset();

  Start(Tcp(UcxHostPath::kPut), Tcp());
  ASSERT_TRUE(peer_.ok()) << peer_.status();
  EXPECT_EQ(PathOf(*sender_, *peer_), "put");
  EXPECT_EQ(UcxPeerPath(*sender_, *peer_ + 7).status().code(), StatusCode::kNotFound);
}

TEST_F(UcxAmTest, SharedMemoryPeersMappedHereAreStillCopiedDirectly) {
  UcxOptions shm;
  shm.transports = "shm,self";
  shm.host_path = UcxHostPath::kActiveMessages;
  auto a = CreateBackend(shm);
  auto b = CreateBackend(shm);
  ASSERT_TRUE(a.ok() && b.ok());
  // Pools from UCX's own allocator are mapped into the peer: plain copies beat any message.
  auto src = (*a)->AllocateHost(kBufferBytes);
  auto dst = (*b)->AllocateHost(kBufferBytes);
  ASSERT_TRUE(src.ok() && dst.ok());
  auto peer = testing::RegisterAndConnect(**a, **b, {static_cast<const uint8_t*>(*src)},
                                          static_cast<uint8_t*>(*dst), kBufferBytes, kItem);
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_EQ(PathOf(**a, *peer), "copy");
  ASSERT_TRUE((*a)->Disconnect(*peer).ok());
  (*a)->FreeHost(*src);
  (*b)->FreeHost(*dst);
}

TEST_F(UcxAmTest, ManyWritesInFlightFromTwoThreadsLandByteExactAndNotify) {
  Start(Tcp());
  ASSERT_TRUE(peer_.ok()) << peer_.status();
  auto notified = std::make_shared<std::atomic<int>>(0);
  sender_->SetCompletionNotifier([notified] { notified->fetch_add(1); });
  // Two threads, each with four writes in flight at a time: 2 KiB runs (many per message) and
  // 1 MiB runs (many messages per run).
  auto writer = [&](uint32_t buffer, uint64_t run_bytes) {
    const std::vector<CopyRun> runs = Pages(buffer, run_bytes);
    std::vector<WriteId> writes;
    for (int i = 0; i < 4; ++i) {
      auto w = sender_->PostWrite(*peer_, runs);
      ASSERT_TRUE(w.ok()) << w.status();
      writes.push_back(*w);
    }
    for (WriteId w : writes) {
      EXPECT_TRUE(WaitFor(*sender_, w).ok());
      sender_->Release(w);
    }
  };
  std::thread t1(writer, 0u, 2048), t2(writer, 3u, uint64_t{1} << 20);
  t1.join();
  t2.join();
  ExpectLanded(Pages(0, 2048));
  ExpectLanded(Pages(3, uint64_t{1} << 20));
  EXPECT_GE(notified->load(), 1);
  // Buffers no run named are untouched.
  EXPECT_TRUE(std::all_of(dst_.begin() + kBufferBytes, dst_.begin() + 3 * kBufferBytes,
                          [](uint8_t b) { return b == kPoison; }));
}

TEST_F(UcxAmTest, DisconnectPartWayAbortsTheWriteAndAReconnectWritesWhole) {
  Start(Tcp());
  ASSERT_TRUE(peer_.ok()) << peer_.status();
  std::vector<CopyRun> runs;
  for (uint32_t b = 0; b < kBuffers; ++b) runs.push_back({b, 0, 0, kBufferBytes});
  auto w = sender_->PostWrite(*peer_, runs);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(sender_->Disconnect(*peer_).ok());
  const Status after = sender_->Check(*w);
  // Either it finished before the disconnect or it was aborted; never still running.
  EXPECT_TRUE(after.ok() || after.code() == StatusCode::kAborted) << after;
  sender_->Release(*w);
  EXPECT_EQ(sender_->PostWrite(*peer_, runs).status().code(), StatusCode::kNotFound);

  auto descriptor = receiver_->Register(DstRegions());
  ASSERT_TRUE(descriptor.ok()) << descriptor.status();
  auto again = sender_->Connect(*descriptor);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(PathOf(*sender_, *again), "am");
  w = sender_->PostWrite(*again, runs);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(WaitFor(*sender_, *w).ok());
  sender_->Release(*w);
  ExpectLanded(runs);
}

// A run message UCX refuses to send fails its write, naming the call; the writes queued behind
// it still go out and land whole, and the peer stays usable.
TEST_F(UcxAmTest, ARunMessageUcxRefusesFailsItsWriteAndTheWritesBehindItLand) {
  UcxTestHooks hooks;
  hooks.fail_run_send_at = 2;  // the first write's second message
  auto a = CreateUcxBackendForTest(Tcp(), hooks);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = CreateBackend(Tcp());
  ASSERT_TRUE(b.ok()) << b.status();
  sender_ = std::move(a).value();
  receiver_ = std::move(b).value();
  for (int i = 0; i < kBuffers; ++i) src_.push_back(testing::RandomBytes(kBufferBytes, 60 + i));
  dst_.assign(kBuffers * kBufferBytes, kPoison);
  std::vector<const uint8_t*> src;
  for (const auto& buffer : src_) src.push_back(buffer.data());
  peer_ = testing::RegisterAndConnect(*sender_, *receiver_, src, dst_.data(), kBufferBytes, kItem);
  ASSERT_TRUE(peer_.ok()) << peer_.status();
  ASSERT_EQ(PathOf(*sender_, *peer_), "am");

  // The first write is two messages (two buffers of 2 KiB runs, 1 MiB a message), the second
  // one; posted back to back, the second waits in the queue behind the first when the first's
  // second message fails (or is posted after it failed, if the progress thread sent it first).
  std::vector<CopyRun> first = Pages(0, 2048);
  const std::vector<CopyRun> first_rest = Pages(1, 2048), second = Pages(2, 2048);
  first.insert(first.end(), first_rest.begin(), first_rest.end());
  auto failing = sender_->PostWrite(*peer_, first);
  ASSERT_TRUE(failing.ok()) << failing.status();
  auto behind = sender_->PostWrite(*peer_, second);
  ASSERT_TRUE(behind.ok()) << behind.status();
  const Status failed = WaitFor(*sender_, *failing);
  EXPECT_FALSE(failed.ok());
  EXPECT_NE(failed.message().find("ucp_am_send_nbx"), std::string::npos) << failed;
  KVT_EXPECT_OK(WaitFor(*sender_, *behind));
  sender_->Release(*failing);
  sender_->Release(*behind);
  ExpectLanded(second);

  auto again = sender_->PostWrite(*peer_, Pages(3, 4096));
  ASSERT_TRUE(again.ok()) << again.status();
  KVT_EXPECT_OK(WaitFor(*sender_, *again));
  sender_->Release(*again);
  ExpectLanded(Pages(3, 4096));
}

TEST_F(UcxAmTest, ForcedActiveMessagesToAPutOnlyPeerAreRefusedNamingTheOption) {
  Start(Tcp(UcxHostPath::kActiveMessages), Tcp(UcxHostPath::kPut));
  ASSERT_FALSE(peer_.ok());
  EXPECT_EQ(peer_.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(peer_.status().message().find("host_path is 'am'"), std::string::npos)
      << peer_.status();
  EXPECT_NE(peer_.status().message().find("'put'"), std::string::npos) << peer_.status();
}

TEST(UcxAmOptionsTest, OutOfRangeOptionsAndNamesAreRefused) {
  UcxOptions options;
  options.am_message_bytes = 100;
  auto b = CreateBackend(options);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("am_message_bytes is 100"), std::string::npos);
  options.am_message_bytes = size_t{128} << 10;
  options.host_path = static_cast<UcxHostPath>(9);
  b = CreateBackend(options);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("host_path is 9"), std::string::npos);
  auto am = ParseUcxHostPath("am");
  ASSERT_TRUE(am.ok());
  EXPECT_EQ(*am, UcxHostPath::kActiveMessages);
  auto bad = ParseUcxHostPath("rdma");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'rdma'"), std::string::npos);
  EXPECT_NE(bad.status().message().find("'auto', 'put' or 'am'"), std::string::npos);
}

// ---- a fenced sender that is alive, and waits that let other peers through ----------------------

// The descriptor a backend publishes for its host buffers, for a receiver's FenceSender.
StatusOr<PeerDescriptor> RegisterHost(Backend& backend,
                                      const std::vector<std::vector<uint8_t>>& src, uint64_t item) {
  std::vector<LocalRegion> regions;
  for (const auto& buffer : src) {
    regions.push_back(LocalRegion{reinterpret_cast<uint64_t>(buffer.data()), buffer.size(), item,
                                  MemoryKind::kHost, -1});
  }
  return backend.Register(regions);
}

bool NamesTheFence(const Status& status) {
  return status.code() == StatusCode::kAborted &&
         status.message().find("was fenced here") != std::string::npos &&
         status.message().find("reconnect") != std::string::npos;
}

// A decode engine fences a prefill peer it declared dead, but the prefill side is alive (a
// partition that healed, or one only the decode side saw). The receiver still lands none of its
// bytes, and answers every message it refuses: the sender's writes fail at once naming the fence
// (not at the room's deadline), its releases do not wait for acks that never come, another
// sender's writes land meanwhile, and the fenced sender lands again once it reconnects.
TEST_F(UcxAmTest, AnAliveFencedSenderFailsItsWritesAtOnceAndOtherSendersLand) {
  auto r = CreateBackend(Tcp());
  auto s1 = CreateBackend(Tcp());
  auto s2 = CreateBackend(Tcp());
  ASSERT_TRUE(r.ok() && s1.ok() && s2.ok());
  receiver_ = std::move(r).value();
  sender_ = std::move(s1).value();
  std::unique_ptr<Backend> other = std::move(s2).value();
  for (int b = 0; b < kBuffers; ++b) src_.push_back(testing::RandomBytes(kBufferBytes, 70 + b));
  std::vector<std::vector<uint8_t>> other_src;
  for (int b = 0; b < kBuffers; ++b) {
    other_src.push_back(testing::RandomBytes(kBufferBytes, 80 + b));
  }
  dst_.assign(kBuffers * kBufferBytes, kPoison);
  auto fenced_descriptor = RegisterHost(*sender_, src_, kItem);
  ASSERT_TRUE(fenced_descriptor.ok()) << fenced_descriptor.status();
  ASSERT_TRUE(RegisterHost(*other, other_src, kItem).ok());
  auto receiver_descriptor = receiver_->Register(DstRegions());
  ASSERT_TRUE(receiver_descriptor.ok()) << receiver_descriptor.status();
  auto fenced = sender_->Connect(*receiver_descriptor);
  ASSERT_TRUE(fenced.ok()) << fenced.status();
  auto healthy = other->Connect(*receiver_descriptor);
  ASSERT_TRUE(healthy.ok()) << healthy.status();
  ASSERT_EQ(PathOf(*sender_, *fenced), "am");
  ASSERT_EQ(PathOf(*other, *healthy), "am");

  // The link is open (its hello answered) before the fence: a write lands.
  const std::vector<CopyRun> before = {{0, 0, 0, 65536}};
  auto landed = sender_->PostWrite(*fenced, before);
  ASSERT_TRUE(landed.ok()) << landed.status();
  KVT_ASSERT_OK(WaitFor(*sender_, *landed));
  sender_->Release(*landed);
  ExpectLanded(before);

  // A write in flight when the fence comes: whatever of it arrived before the fence is
  // acknowledged, the rest refused; it ends either way, long before any deadline.
  const std::vector<CopyRun> in_flight = Pages(0, 4096);
  auto w0 = sender_->PostWrite(*fenced, in_flight);
  ASSERT_TRUE(w0.ok()) << w0.status();
  receiver_->FenceSender(*fenced_descriptor);
  const Status first = WaitFor(*sender_, *w0, std::chrono::seconds(5));
  EXPECT_TRUE(first.ok() || NamesTheFence(first)) << first;

  // Writes after the fence: refused whole, each failing at once with the reason; none lands.
  const auto t0 = std::chrono::steady_clock::now();
  auto w1 = sender_->PostWrite(*fenced, Pages(1, 4096));  // 4 messages of 1 MiB
  ASSERT_TRUE(w1.ok()) << w1.status();
  const std::vector<CopyRun> small = {{2, 0, 0, 4096}};
  auto w2 = sender_->PostWrite(*fenced, small);  // sent by the caller
  ASSERT_TRUE(w2.ok()) << w2.status();
  const Status refused = WaitFor(*sender_, *w1, std::chrono::seconds(5));
  EXPECT_TRUE(NamesTheFence(refused)) << refused;
  EXPECT_NE(refused.message().find("run message"), std::string::npos) << refused;
  const Status refused_small = WaitFor(*sender_, *w2, std::chrono::seconds(5));
  EXPECT_TRUE(NamesTheFence(refused_small)) << refused_small;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  // Nothing is left unacknowledged: the releases do not wait out their bound.
  const auto t1 = std::chrono::steady_clock::now();
  sender_->Release(*w0);
  sender_->Release(*w1);
  sender_->Release(*w2);
  EXPECT_LT(std::chrono::steady_clock::now() - t1, std::chrono::seconds(2));
  EXPECT_TRUE(std::all_of(dst_.begin() + kBufferBytes, dst_.begin() + 3 * kBufferBytes,
                          [](uint8_t b) { return b == kPoison; }))
      << "bytes of a fenced sender landed";

  // The other sender is undisturbed.
  const std::vector<CopyRun> others = Pages(3, 16384);
  auto w3 = other->PostWrite(*healthy, others);
  ASSERT_TRUE(w3.ok()) << w3.status();
  KVT_EXPECT_OK(WaitFor(*other, *w3));
  other->Release(*w3);
  for (const CopyRun& run : others) {
    ASSERT_EQ(std::memcmp(dst_.data() + 3 * kBufferBytes + run.dst_offset,
                          other_src[3].data() + run.src_offset, run.bytes),
              0)
        << "offset " << run.dst_offset;
  }

  // The fenced sender, told to reconnect, does: the new session's writes land.
  auto again = sender_->Connect(*receiver_descriptor);
  ASSERT_TRUE(again.ok()) << again.status();
  const std::vector<CopyRun> after = Pages(1, 8192);
  auto w4 = sender_->PostWrite(*again, after);
  ASSERT_TRUE(w4.ok()) << w4.status();
  KVT_EXPECT_OK(WaitFor(*sender_, *w4));
  sender_->Release(*w4);
  ExpectLanded(after);
  other.reset();
}

// A peer that takes its time to acknowledge (here: 1.5 s, as one behind a slow or cut link)
// keeps a Release or a graceful Disconnect of its writes waiting; writes to other peers go on
// meanwhile instead of queueing behind the backend's lock.
TEST_F(UcxAmTest, AReleaseOrDisconnectWaitingForAcksLetsOtherPeersWritesThrough) {
  UcxTestHooks slow;
  slow.ack_delay_us = 1'500'000;
  ASSERT_NO_FATAL_FAILURE(StartWithThird(slow, 90));
  auto slow_peer = sender_->Connect(third_descriptor_);
  ASSERT_TRUE(slow_peer.ok()) << slow_peer.status();
  ASSERT_EQ(PathOf(*sender_, *slow_peer), "am");

  // While `wait` (on another thread) waits for the slow peer's acks, a write to the fast peer is
  // posted and completes.
  auto write_to_fast_peer_during = [&](const std::function<void()>& wait, uint32_t buffer) {
    std::atomic<bool> waiting{true};
    std::thread waiter([&] {
      wait();
      waiting.store(false);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the wait is under way
    const std::vector<CopyRun> runs = Pages(buffer, 4096);
    auto w = sender_->PostWrite(fast_, runs);
    const Status done = w.ok() ? WaitFor(*sender_, *w, std::chrono::seconds(10)) : w.status();
    const bool overtaken = waiting.load();
    waiter.join();
    KVT_EXPECT_OK(done);
    EXPECT_TRUE(overtaken) << "the write to the fast peer waited for the slow peer's acks";
    if (w.ok()) sender_->Release(*w);
    ExpectLanded(runs);
  };
  // Small writes go out at once, on the posting thread, once the link's hello is answered (a
  // first write waits for that): the acks are what is waited for.
  const std::vector<CopyRun> small = {{0, 0, 0, 16384}};
  auto held = sender_->PostWrite(*slow_peer, small);
  ASSERT_TRUE(held.ok()) << held.status();
  KVT_ASSERT_OK(WaitFor(*sender_, *held));
  sender_->Release(*held);
  held = sender_->PostWrite(*slow_peer, small);
  ASSERT_TRUE(held.ok()) << held.status();
  write_to_fast_peer_during([&] { sender_->Release(*held); }, 1);
  held = sender_->PostWrite(*slow_peer, small);
  ASSERT_TRUE(held.ok()) << held.status();
  write_to_fast_peer_during([&] { KVT_EXPECT_OK(sender_->Disconnect(*slow_peer)); }, 2);
  // What reached the slow peer landed; only its acks were late.
  EXPECT_EQ(std::memcmp(third_dst_.data(), src_[0].data(), 16384), 0);
  sender_.reset();
  third_.reset();
}

// ---- a hostile sender ---------------------------------------------------------------------------

// A bare UCX worker that speaks the staging protocol by hand.
class RawSender {
 public:
  ~RawSender() {
    if (ep_ != nullptr) {
      // Sends still posted complete (cancelled) as the endpoint closes.
      ucp_request_param_t param = {};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = UCP_EP_CLOSE_FLAG_FORCE;
      ucs_status_ptr_t req = ucp_ep_close_nbx(ep_, &param);
      if (req != nullptr && !UCS_PTR_IS_ERR(req)) {
        Progress([&] { return ucp_request_check_status(req) != UCS_INPROGRESS; });
        ucp_request_free(req);
      }
    }
    for (void* req : posted_) {
      Progress([&] { return ucp_request_check_status(req) != UCS_INPROGRESS; });
      ucp_request_free(req);
    }
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
  }

  bool Start(std::string_view address) {
    ucp_config_t* config = nullptr;
    if (ucp_config_read(nullptr, nullptr, &config) != UCS_OK) return false;
    ucp_config_modify(config, "TLS", "tcp");
    ucp_params_t params = {};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM;
    const ucs_status_t st = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (st != UCS_OK) return false;
    ucp_worker_params_t wparams = {};
    if (ucp_worker_create(context_, &wparams, &worker_) != UCS_OK) return false;
    ucp_am_handler_param_t handler = {};
    handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                         UCP_AM_HANDLER_PARAM_FIELD_ARG;
    handler.id = ucx_staging::kAmChunkAck;
    handler.cb = &RawSender::OnAck;
    handler.arg = this;
    if (ucp_worker_set_am_recv_handler(worker_, &handler) != UCS_OK) return false;
    handler.id = ucx_staging::kAmHelloAck;
    handler.cb = &RawSender::OnHelloAck;
    if (ucp_worker_set_am_recv_handler(worker_, &handler) != UCS_OK) return false;
    ucp_address_t* own = nullptr;
    size_t own_len = 0;
    if (ucp_worker_get_address(worker_, &own, &own_len) != UCS_OK) return false;
    own_address_.assign(reinterpret_cast<const char*>(own), own_len);
    ucp_worker_release_address(worker_, own);
    ucp_ep_params_t ep = {};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
    return ucp_ep_create(worker_, &ep, &ep_) == UCS_OK;
  }

  // Sends one active message and progresses until it is out.
  bool Send(unsigned id, const std::vector<uint8_t>& header, const std::string& data) {
    ucp_request_param_t param = {};
    ucs_status_ptr_t req =
        ucp_am_send_nbx(ep_, id, header.data(), header.size(), data.empty() ? nullptr : data.data(),
                        data.size(), &param);
    if (UCS_PTR_IS_ERR(req)) return false;
    if (req == nullptr) return true;
    const bool done = Progress([&] { return ucp_request_check_status(req) != UCS_INPROGRESS; });
    ucp_request_free(req);
    return done;
  }

  // Posts one active message by rendezvous (its data moves once the receiver takes it) and
  // returns without progressing: the message is out, its data waits for the receiver.
  bool PostRendezvous(unsigned id, std::vector<uint8_t> header, std::string data) {
    ucp_request_param_t param = {};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_RNDV;
    // UCX reads both until the send completes.
    const auto& [h, d] = kept_.emplace_back(std::move(header), std::move(data));
    ucs_status_ptr_t req = ucp_am_send_nbx(ep_, id, h.data(), h.size(), d.data(), d.size(), &param);
    if (UCS_PTR_IS_ERR(req)) return false;
    if (req != nullptr) posted_.push_back(req);
    return true;
  }

  // The token this sender opens `link` with (a real sender draws it at random).
  static uint64_t token(uint64_t link) { return 0x70c3'0000'0000'0000ull ^ (link + 1); }
  // A hello that opens `link` as the sender backend `instance`, with the link's token.
  static ucx_staging::Hello HelloFor(uint64_t instance, uint64_t link, ucx_staging::LinkMode mode) {
    ucx_staging::Hello hello{instance, link, mode};
    hello.token = token(link);
    return hello;
  }
  // Opens copy-run link `link` as the sender backend `instance`: its hello, until acknowledged.
  bool OpenRunLink(uint64_t instance, uint64_t link) {
    hello_acked = false;
    return Send(ucx_staging::kAmHello,
                ucx_staging::Encode(HelloFor(instance, link, ucx_staging::LinkMode::kRuns)),
                own_address()) &&
           Progress([&] { return hello_acked; });
  }
  // A run message on `link`: message `index` of write `write`, 64 bytes of `fill` for offset
  // `offset` of buffer 0.
  bool SendRun(uint64_t instance, uint64_t link, uint64_t write, uint32_t index, uint64_t offset,
               char fill = 'A') {
    auto header = ucx_staging::EncodeRuns({instance, link, write, index, 1, token(link)},
                                          std::vector<ucx_staging::RunSegment>{{0, offset, 64}});
    return header.ok() && Send(ucx_staging::kAmRuns, *header, std::string(64, fill));
  }

  template <typename Done>
  bool Progress(Done&& done, std::chrono::milliseconds bound = std::chrono::seconds(10)) {
    const auto give_up = std::chrono::steady_clock::now() + bound;
    while (!done()) {
      if (std::chrono::steady_clock::now() > give_up) return false;
      ucp_worker_progress(worker_);
    }
    return true;
  }

  const std::string& own_address() const { return own_address_; }
  // The acks so far by message (chunk) index: code and text.
  std::map<uint32_t, std::pair<StatusCode, std::string>> AcksByMessage() const {
    std::map<uint32_t, std::pair<StatusCode, std::string>> by_message;
    for (const auto& [ack, text] : acks) by_message[ack.chunk] = {ack.code, text};
    return by_message;
  }
  std::vector<std::pair<ucx_staging::ChunkAck, std::string>> acks;
  bool hello_acked = false;
  bool in_place = false;  // the hello ack said the receiver reads our slots in place
  uint32_t granted = 0;   // the credits (slots, or the window of run messages) it granted

 private:
  static ucs_status_t OnAck(void* arg, const void* header, size_t header_length, void* data,
                            size_t length, const ucp_am_recv_param_t*) {
    auto ack = ucx_staging::DecodeChunkAck({static_cast<const uint8_t*>(header), header_length});
    if (ack.ok()) {
      static_cast<RawSender*>(arg)->acks.emplace_back(
          *ack, std::string(static_cast<const char*>(data), length));
    }
    return UCS_OK;
  }
  static ucs_status_t OnHelloAck(void* arg, const void* header, size_t header_length, void*, size_t,
                                 const ucp_am_recv_param_t*) {
    auto ack = ucx_staging::DecodeHelloAck({static_cast<const uint8_t*>(header), header_length});
    static_cast<RawSender*>(arg)->hello_acked = ack.ok() && ack->code == StatusCode::kOk;
    static_cast<RawSender*>(arg)->in_place = ack.ok() && ack->in_place;
    static_cast<RawSender*>(arg)->granted = ack.ok() ? ack->slots : 0;
    return UCS_OK;
  }

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  std::string own_address_;
  std::vector<void*> posted_;                                      // PostRendezvous requests
  std::deque<std::pair<std::vector<uint8_t>, std::string>> kept_;  // and their header and data
};

// Tests with a raw copy-run sender: receiver_ (connected to sender_) is registered again for its
// descriptor, and raw_ is the sender backend `instance` with its link 1 open at the receiver.
class UcxAmRawTest : public UcxAmTest {
 protected:
  void StartRaw(uint64_t instance) {
    Start(Tcp());
    ASSERT_TRUE(peer_.ok()) << peer_.status();
    auto descriptor = receiver_->Register(DstRegions());
    ASSERT_TRUE(descriptor.ok()) << descriptor.status();
    raw_ = std::make_unique<RawSender>();
    ASSERT_TRUE(raw_->Start(ucx_staging::SplitPeerAddress(descriptor->address).runs_address));
    ASSERT_TRUE(raw_->OpenRunLink(instance, 1));
  }
  void TearDown() override {
    raw_.reset();
    UcxAmTest::TearDown();
  }
  std::unique_ptr<RawSender> raw_;
};

TEST_F(UcxAmTest, MalformedAndOutOfRangeRunMessagesAreRefusedAndTheRealPeerIsUndisturbed) {
  Start(Tcp());
  ASSERT_TRUE(peer_.ok()) << peer_.status();
  auto descriptor = receiver_->Register(DstRegions());
  ASSERT_TRUE(descriptor.ok()) << descriptor.status();
  const ucx_staging::SplitAddress split = ucx_staging::SplitPeerAddress(descriptor->address);
  ASSERT_FALSE(split.runs_address.empty());
  // The receiver re-registered: connect the real sender again.
  auto real = sender_->Connect(*descriptor);
  ASSERT_TRUE(real.ok()) << real.status();

  RawSender raw;
  ASSERT_TRUE(raw.Start(split.runs_address));
  const uint64_t instance = 0x5eed;
  // Before any hello: dropped (nobody to tell), no byte moves.
  auto header = ucx_staging::EncodeRuns({instance, 1, 1, 0, 1, RawSender::token(1)},
                                        std::vector<ucx_staging::RunSegment>{{0, 0, 16}});
  ASSERT_TRUE(header.ok());
  ASSERT_TRUE(raw.Send(ucx_staging::kAmRuns, *header, std::string(16, 'x')));
  // Garbage as a header.
  ASSERT_TRUE(raw.Send(ucx_staging::kAmRuns, std::vector<uint8_t>(40, 0xab), std::string(8, 'x')));

  ASSERT_TRUE(raw.OpenRunLink(instance, 1));
  // A segment past the end of buffer 2, one naming a buffer that does not exist, and one whose
  // bytes disagree with the data: each answered with an error naming the value.
  header = ucx_staging::EncodeRuns({instance, 1, 7, 0, 1, RawSender::token(1)},
                                   std::vector<ucx_staging::RunSegment>{{2, kBufferBytes - 8, 16}});
  ASSERT_TRUE(raw.Send(ucx_staging::kAmRuns, *header, std::string(16, 'x')));
  header = ucx_staging::EncodeRuns({instance, 1, 7, 1, 1, RawSender::token(1)},
                                   std::vector<ucx_staging::RunSegment>{{9, 0, 16}});
  ASSERT_TRUE(raw.Send(ucx_staging::kAmRuns, *header, std::string(16, 'x')));
  header = ucx_staging::EncodeRuns({instance, 1, 7, 2, 1, RawSender::token(1)},
                                   std::vector<ucx_staging::RunSegment>{{0, 0, 16}});
  ASSERT_TRUE(raw.Send(ucx_staging::kAmRuns, *header, std::string(15, 'x')));
  ASSERT_TRUE(raw.Progress([&] { return raw.acks.size() >= 3; }));
  ASSERT_EQ(raw.acks.size(), 3u);
  EXPECT_EQ(raw.acks[0].first.code, StatusCode::kOutOfRange);
  EXPECT_NE(raw.acks[0].second.find("at offset " + std::to_string(kBufferBytes - 8)),
            std::string::npos)
      << raw.acks[0].second;
  EXPECT_EQ(raw.acks[1].first.code, StatusCode::kOutOfRange);
  EXPECT_NE(raw.acks[1].second.find("names buffer 9"), std::string::npos) << raw.acks[1].second;
  EXPECT_EQ(raw.acks[2].first.code, StatusCode::kDataLoss);
  EXPECT_NE(raw.acks[2].second.find("16 bytes but 15 arrived"), std::string::npos)
      << raw.acks[2].second;
  // Nothing of it landed.
  EXPECT_TRUE(std::all_of(dst_.begin(), dst_.end(), [](uint8_t b) { return b == kPoison; }));

  // The real peer's write lands whole.
  std::vector<CopyRun> runs = Pages(1, 4096);
  auto w = sender_->PostWrite(*real, runs);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(WaitFor(*sender_, *w).ok());
  sender_->Release(*w);
  ExpectLanded(runs);
}

// A third party that can reach both staging workers, and knows the sender's instance, the link
// and the write (small numbers), but not the link's token, can do nothing to another sender's
// link: its acks neither complete nor fail the write, its bye does not close the link, its run
// message on the link lands nothing, and its hello for the link does not take it over. The
// real write lands once its own (delayed) acks come.
TEST_F(UcxAmTest, AThirdPartyWithoutTheLinksTokenCanNeitherAckCloseNorWriteTheLink) {
  UcxTestHooks slow;
  slow.ack_delay_us = 1'500'000;
  ASSERT_NO_FATAL_FAILURE(StartWithThird(slow, 70));
  auto link = sender_->Connect(third_descriptor_);
  ASSERT_TRUE(link.ok()) << link.status();
  ASSERT_EQ(PathOf(*sender_, *link), "am");
  const ucx_staging::SplitAddress sender_address =
      ucx_staging::SplitPeerAddress(sender_descriptor_.address);
  const ucx_staging::SplitAddress receiver_address =
      ucx_staging::SplitPeerAddress(third_descriptor_.address);
  ASSERT_TRUE(sender_address.trailer.has_value());
  ASSERT_FALSE(sender_address.runs_address.empty());
  ASSERT_FALSE(receiver_address.runs_address.empty());
  const uint64_t instance = sender_address.trailer->instance;

  const std::vector<CopyRun> first = {{0, 0, 0, 16384}};
  auto write = sender_->PostWrite(*link, first);
  ASSERT_TRUE(write.ok()) << write.status();
  // Its one message is out (its ack is held back 1.5 s): forged acks reach the sender meanwhile.
  RawSender to_sender;
  ASSERT_TRUE(to_sender.Start(sender_address.runs_address));
  for (uint64_t token : {uint64_t{0}, uint64_t{1}, RawSender::token(*link)}) {
    for (StatusCode code : {StatusCode::kOk, StatusCode::kDataLoss}) {
      ASSERT_TRUE(to_sender.Send(
          ucx_staging::kAmChunkAck,
          ucx_staging::Encode(ucx_staging::ChunkAck{*link, *write, 0, code, token}), "forged"));
    }
  }
  // Against the receiver: a bye closing the link, a run message on it, a hello taking it over.
  RawSender to_receiver;
  ASSERT_TRUE(to_receiver.Start(receiver_address.runs_address));
  ASSERT_TRUE(to_receiver.Send(ucx_staging::kAmBye,
                               ucx_staging::Encode(ucx_staging::Bye{instance, *link, 1}), ""));
  auto forged_run = ucx_staging::EncodeRuns({instance, *link, 99, 0, 1, 1},
                                            std::vector<ucx_staging::RunSegment>{{1, 0, 64}});
  ASSERT_TRUE(forged_run.ok());
  ASSERT_TRUE(to_receiver.Send(ucx_staging::kAmRuns, *forged_run, std::string(64, 'F')));
  ASSERT_TRUE(to_receiver.Send(
      ucx_staging::kAmHello,
      ucx_staging::Encode(RawSender::HelloFor(instance, *link, ucx_staging::LinkMode::kRuns)),
      to_receiver.own_address()));
  // Nor can it open a link of its own in the sender's name (from another worker) and write on it.
  const uint64_t own_link = 77;
  ASSERT_TRUE(to_receiver.Send(
      ucx_staging::kAmHello,
      ucx_staging::Encode(RawSender::HelloFor(instance, own_link, ucx_staging::LinkMode::kRuns)),
      to_receiver.own_address()));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the hello has been handled
  auto own_run = ucx_staging::EncodeRuns({instance, own_link, 98, 0, 1, RawSender::token(own_link)},
                                         std::vector<ucx_staging::RunSegment>{{1, 64, 64}});
  ASSERT_TRUE(own_run.ok());
  ASSERT_TRUE(to_receiver.Send(ucx_staging::kAmRuns, *own_run, std::string(64, 'O')));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // all of it has been handled
  EXPECT_EQ(sender_->Check(*write).code(), StatusCode::kInProgress)
      << "an ack without the link's token completed or failed the write: "
      << sender_->Check(*write);
  EXPECT_TRUE(std::all_of(third_dst_.begin() + kBufferBytes, third_dst_.begin() + kBufferBytes + 64,
                          [](uint8_t b) { return b == kPoison; }))
      << "a run message without the link's token landed";
  EXPECT_TRUE(std::all_of(third_dst_.begin() + kBufferBytes + 64,
                          third_dst_.begin() + kBufferBytes + 128,
                          [](uint8_t b) { return b == kPoison; }))
      << "a link opened in another sender's name from another worker took a message";
  EXPECT_FALSE(to_receiver.hello_acked) << "a second hello for an open link was answered";

  // The real acks complete the write, and the link still carries the next one whole.
  KVT_ASSERT_OK(WaitFor(*sender_, *write, std::chrono::seconds(10)));
  sender_->Release(*write);
  const std::vector<CopyRun> second = {{2, 0, 0, 16384}};
  auto next = sender_->PostWrite(*link, second);
  ASSERT_TRUE(next.ok()) << next.status();
  KVT_ASSERT_OK(WaitFor(*sender_, *next, std::chrono::seconds(10)));
  sender_->Release(*next);
  EXPECT_EQ(std::memcmp(third_dst_.data(), src_[0].data(), 16384), 0);
  EXPECT_EQ(std::memcmp(third_dst_.data() + 2 * kBufferBytes, src_[2].data(), 16384), 0);
  EXPECT_EQ(third_dst_[kBufferBytes], kPoison);
}

// A receiver holds at most the window its hello ack granted of one link's rendezvous run
// messages waiting to be received (each holds UCX's descriptor and an IOV of up to 4096
// pieces): a sender past it has the extra messages refused at once, naming the window, and the
// ones within it land.
TEST_F(UcxAmTest, RunMessagesPastTheGrantedWindowAreRefusedAndTheOnesWithinLand) {
  UcxOptions options = Tcp();
  options.am_message_bytes = 4 << 20;  // a window of 2 messages
  UcxTestHooks hooks;
  hooks.receive_delay_us = 1'000'000;  // the messages wait here to be received
  auto receiver = CreateUcxBackendForTest(options, hooks);
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  dst_.assign(kBuffers * kBufferBytes, kPoison);
  auto descriptor = (*receiver)->Register(DstRegions());
  ASSERT_TRUE(descriptor.ok()) << descriptor.status();
  RawSender raw;
  ASSERT_TRUE(raw.Start(ucx_staging::SplitPeerAddress(descriptor->address).runs_address));
  const uint64_t instance = 0x3a11;
  ASSERT_TRUE(raw.OpenRunLink(instance, 1));
  ASSERT_EQ(raw.granted, 2u);

  for (uint32_t i = 0; i < 4; ++i) {
    auto header = ucx_staging::EncodeRuns({instance, 1, 5, i, 1, RawSender::token(1)},
                                          std::vector<ucx_staging::RunSegment>{{0, 64ull * i, 64}});
    ASSERT_TRUE(header.ok());
    ASSERT_TRUE(raw.PostRendezvous(ucx_staging::kAmRuns, *header, std::string(64, 'W')));
  }
  ASSERT_TRUE(raw.Progress([&] { return raw.acks.size() >= 4; })) << raw.acks.size() << " acks";
  auto by_message = raw.AcksByMessage();
  ASSERT_EQ(by_message.size(), 4u);
  EXPECT_EQ(by_message[0].first, StatusCode::kOk) << by_message[0].second;
  EXPECT_EQ(by_message[1].first, StatusCode::kOk) << by_message[1].second;
  for (uint32_t i : {2u, 3u}) {
    EXPECT_EQ(by_message[i].first, StatusCode::kResourceExhausted) << by_message[i].second;
    EXPECT_NE(by_message[i].second.find("has 2 run messages landing here, its window"),
              std::string::npos)
        << by_message[i].second;
  }
  EXPECT_TRUE(std::all_of(dst_.begin(), dst_.begin() + 128, [](uint8_t b) { return b == 'W'; }));
  EXPECT_TRUE(
      std::all_of(dst_.begin() + 128, dst_.begin() + 256, [](uint8_t b) { return b == kPoison; }));
}

// The same for staged chunks: a receiver queues no more of one link's chunks than the credits
// (its slots) its hello ack granted; the ones past them are refused at once, naming the credits.
TEST_F(UcxAmTest, StagedChunksPastTheGrantedCreditsAreRefusedNamingThem) {
  UcxOptions staged = Tcp();
  staged.cuda_mode = UcxCudaMode::kStaged;
  staged.staging_slots = 2;
  staged.staging_slot_bytes = 1 << 20;
  UcxTestHooks hooks;
  hooks.stage_host_memory = true;
  hooks.receive_delay_us = 1'000'000;  // the chunks wait here to be taken
  auto receiver = CreateUcxBackendForTest(staged, hooks);
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  dst_.assign(kBuffers * kBufferBytes, kPoison);
  auto descriptor = (*receiver)->Register(DstRegions());
  ASSERT_TRUE(descriptor.ok()) << descriptor.status();
  RawSender raw;
  ASSERT_TRUE(raw.Start(ucx_staging::SplitPeerAddress(descriptor->address).worker_address));
  const uint64_t instance = 0xc4ed;
  ASSERT_TRUE(raw.Send(
      ucx_staging::kAmHello,
      ucx_staging::Encode(RawSender::HelloFor(instance, 1, ucx_staging::LinkMode::kStaged)),
      raw.own_address()));
  ASSERT_TRUE(raw.Progress([&] { return raw.hello_acked; }));
  ASSERT_EQ(raw.granted, 2u);

  using ucx_staging::ChunkNotice;
  for (uint32_t i = 0; i < 4; ++i) {
    ASSERT_TRUE(raw.Send(ucx_staging::kAmChunk,
                         ucx_staging::Encode(ChunkNotice{instance, 1, 8, i, RawSender::token(1)}),
                         std::string(4096, 'C')));
  }
  // The two past the credits are answered at once; the two queued ones once taken (they are no
  // chunks, and are refused as malformed then).
  ASSERT_TRUE(raw.Progress([&] { return raw.acks.size() >= 4; })) << raw.acks.size() << " acks";
  auto by_chunk = raw.AcksByMessage();
  ASSERT_EQ(by_chunk.size(), 4u);
  EXPECT_EQ(by_chunk[0].first, StatusCode::kDataLoss) << by_chunk[0].second;
  EXPECT_EQ(by_chunk[1].first, StatusCode::kDataLoss) << by_chunk[1].second;
  for (uint32_t i : {2u, 3u}) {
    EXPECT_EQ(by_chunk[i].first, StatusCode::kResourceExhausted) << by_chunk[i].second;
    EXPECT_NE(by_chunk[i].second.find("has 2 chunks queued here, the 2 credits its hello ack "
                                      "granted"),
              std::string::npos)
        << by_chunk[i].second;
  }
  EXPECT_TRUE(std::all_of(dst_.begin(), dst_.end(), [](uint8_t b) { return b == kPoison; }));
}

// A Release that gives up waiting for its write's acks keeps the write's credits taken: the
// receiver still holds those messages, and a next write sent on returned credits would pass the
// window the receiver granted (and be refused). The next write waits for the late acks instead,
// and lands whole.
TEST_F(UcxAmTest, AReleaseThatGaveUpKeepsTheCreditsTheReceiverStillHolds) {
  UcxOptions options = Tcp();
  options.am_message_bytes = 4096;  // a window of 64 messages of 4 KiB
  UcxOptions rendezvous = options;
  rendezvous.am_rendezvous = true;  // the receiver holds each message until it is received
  UcxTestHooks impatient;
  impatient.release_bound_ms = 300;
  UcxTestHooks slow;
  slow.receive_delay_us = 1'500'000;
  auto sender = CreateUcxBackendForTest(rendezvous, impatient);
  ASSERT_TRUE(sender.ok()) << sender.status();
  auto receiver = CreateUcxBackendForTest(options, slow);
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  sender_ = std::move(sender).value();
  receiver_ = std::move(receiver).value();
  for (int b = 0; b < kBuffers; ++b) src_.push_back(testing::RandomBytes(kBufferBytes, 60 + b));
  dst_.assign(kBuffers * kBufferBytes, kPoison);
  std::vector<const uint8_t*> src;
  for (const auto& buffer : src_) src.push_back(buffer.data());
  auto link =
      testing::RegisterAndConnect(*sender_, *receiver_, src, dst_.data(), kBufferBytes, kItem);
  ASSERT_TRUE(link.ok()) << link.status();
  ASSERT_EQ(PathOf(*sender_, *link), "am");

  // 64 messages: the whole window, held at the receiver for 1.5 s; the release gives up first.
  const std::vector<CopyRun> first = {{0, 0, 0, 64 * 4096}};
  auto held = sender_->PostWrite(*link, first);
  ASSERT_TRUE(held.ok()) << held.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // all 64 are out
  sender_->Release(*held);

  const std::vector<CopyRun> second = {{1, 0, 0, 4096}};
  auto next = sender_->PostWrite(*link, second);
  ASSERT_TRUE(next.ok()) << next.status();
  KVT_ASSERT_OK(WaitFor(*sender_, *next, std::chrono::seconds(10)));
  sender_->Release(*next);
  ExpectLanded(second);
}

// A staged receiver reads a sender's slots in place only where it mapped them for it: an offer
// whose key is no key is answered "not in place", and slot notices it did not accept, or on a
// link no hello opened, are refused with an ack naming the slot or the link; nothing lands.
TEST_F(UcxAmTest, SlotNoticesTheReceiverDidNotAcceptAreRefusedNamingTheSlot) {
  std::unique_ptr<Backend> receiver;
  std::string worker_address;
  ASSERT_NO_FATAL_FAILURE(StartStagedReceiver(receiver, worker_address));

  RawSender raw;
  ASSERT_TRUE(raw.Start(worker_address));
  const uint64_t instance = 0x51a7;
  ucx_staging::Hello hello = RawSender::HelloFor(instance, 1, ucx_staging::LinkMode::kStaged);
  hello.slots_base = uint64_t{1} << 40;
  hello.slot_bytes = 65536;
  hello.slots = 4;
  hello.key_bytes = 16;
  ASSERT_TRUE(raw.Send(ucx_staging::kAmHello, ucx_staging::Encode(hello),
                       raw.own_address() + std::string(16, '\x7f')));
  ASSERT_TRUE(raw.Progress([&] { return raw.hello_acked; }));
  EXPECT_FALSE(raw.in_place);

  using ucx_staging::SlotNotice;
  ASSERT_TRUE(raw.Send(ucx_staging::kAmSlotChunk,
                       ucx_staging::Encode(SlotNotice{{instance, 1, 5, 0, raw.token(1)}, 2, 4096}),
                       ""));
  ASSERT_TRUE(raw.Send(ucx_staging::kAmSlotChunk,
                       ucx_staging::Encode(SlotNotice{{instance, 9, 5, 1, raw.token(9)}, 0, 4096}),
                       ""));
  ASSERT_TRUE(raw.Progress([&] { return raw.acks.size() >= 2; }));
  ASSERT_EQ(raw.acks.size(), 2u);
  EXPECT_EQ(raw.acks[0].first.code, StatusCode::kFailedPrecondition);
  EXPECT_EQ(raw.acks[0].first.chunk, 0u);
  EXPECT_NE(raw.acks[0].second.find("names slot 2"), std::string::npos) << raw.acks[0].second;
  EXPECT_NE(raw.acks[0].second.find("in place"), std::string::npos) << raw.acks[0].second;
  EXPECT_EQ(raw.acks[1].first.code, StatusCode::kAborted);
  EXPECT_NE(raw.acks[1].second.find("link 9 is not open"), std::string::npos) << raw.acks[1].second;
  EXPECT_TRUE(std::all_of(dst_.begin(), dst_.end(), [](uint8_t b) { return b == kPoison; }));
}

// A staged receiver that fences a sender answers what still arrives on the fenced link, a chunk
// sent eagerly or a slot notice, with an ack naming the fence; nothing of it lands.
TEST_F(UcxAmTest, StagedChunksOnAFencedLinkAreAnsweredNamingTheFence) {
  std::unique_ptr<Backend> receiver;
  std::string worker_address;
  ASSERT_NO_FATAL_FAILURE(StartStagedReceiver(receiver, worker_address));

  RawSender raw;
  ASSERT_TRUE(raw.Start(worker_address));
  const uint64_t instance = 0xfe9c5;
  ASSERT_TRUE(raw.Send(
      ucx_staging::kAmHello,
      ucx_staging::Encode(RawSender::HelloFor(instance, 3, ucx_staging::LinkMode::kStaged)),
      raw.own_address()));
  ASSERT_TRUE(raw.Progress([&] { return raw.hello_acked; }));
  PeerDescriptor sender;
  sender.backend = "ucx";
  sender.address = ucx_staging::AppendTrailer(raw.own_address(), {.instance = instance});
  receiver->FenceSender(sender);

  using ucx_staging::ChunkNotice;
  using ucx_staging::SlotNotice;
  ASSERT_TRUE(raw.Send(ucx_staging::kAmChunk,
                       ucx_staging::Encode(ChunkNotice{instance, 3, 8, 0, raw.token(3)}),
                       std::string(4096, 'C')));
  ASSERT_TRUE(raw.Send(ucx_staging::kAmSlotChunk,
                       ucx_staging::Encode(SlotNotice{{instance, 3, 8, 1, raw.token(3)}, 0, 4096}),
                       std::string(ucx_staging::kChunkHeaderBytes, '\0')));
  ASSERT_TRUE(raw.Progress([&] { return raw.acks.size() >= 2; }))
      << "chunks on a fenced link were not answered";
  ASSERT_EQ(raw.acks.size(), 2u);
  for (const auto& [ack, text] : raw.acks) {
    EXPECT_EQ(ack.link, 3u);
    EXPECT_EQ(ack.write, 8u);
    EXPECT_EQ(ack.code, StatusCode::kAborted) << text;
    EXPECT_NE(text.find("sender 0xfe9c5 was fenced here"), std::string::npos) << text;
    EXPECT_NE(text.find("link 3"), std::string::npos) << text;
  }
  EXPECT_TRUE(std::all_of(dst_.begin(), dst_.end(), [](uint8_t b) { return b == kPoison; }));
}

TEST_F(UcxAmTest, FencedSendersLinksLandNothingMoreAndANewLinkDoes) {
  // A decode engine that lost its prefill peer fences it: bytes the network delivers late on
  // the old links must not land in pages the engine hands out again.
  Start(Tcp());
  ASSERT_TRUE(peer_.ok()) << peer_.status();
  auto descriptor = receiver_->Register(DstRegions());
  ASSERT_TRUE(descriptor.ok()) << descriptor.status();
  const ucx_staging::SplitAddress split = ucx_staging::SplitPeerAddress(descriptor->address);
  RawSender raw;
  ASSERT_TRUE(raw.Start(split.runs_address));
  const uint64_t instance = 0xfe9ce;
  auto hello = [&](uint64_t link) { return raw.OpenRunLink(instance, link); };
  auto message = [&](uint64_t link, uint32_t index, uint64_t offset) {
    return raw.SendRun(instance, link, 5, index, offset);
  };
  ASSERT_TRUE(hello(1));
  ASSERT_TRUE(message(1, 0, 0));
  ASSERT_TRUE(raw.Progress([&] { return raw.acks.size() == 1; }));
  EXPECT_EQ(raw.acks[0].first.code, StatusCode::kOk);
  EXPECT_EQ(dst_[0], 'A');

  // The receiver's engine lost this sender: what it sent on link 1 before is refused now, and
  // the sender (alive behind what looked like a dead connection) is told so at once.
  PeerDescriptor sender;
  sender.backend = "ucx";
  sender.address = ucx_staging::AppendTrailer(raw.own_address(), {.instance = instance});
  receiver_->FenceSender(sender);
  ASSERT_TRUE(message(1, 1, 4096));
  ASSERT_TRUE(raw.Progress([&] { return raw.acks.size() == 2; }))
      << "a message of a fenced link was not answered";
  EXPECT_EQ(dst_[4096], kPoison) << "a message of a fenced link landed";
  auto told_fenced = [](const ucx_staging::ChunkAck& ack, const std::string& text) {
    return ack.code == StatusCode::kAborted &&
           text.find("sender 0xfe9ce was fenced here") != std::string::npos &&
           text.find("link 1") != std::string::npos && text.find("reconnect") != std::string::npos;
  };
  EXPECT_EQ(raw.acks[1].first.link, 1u);
  EXPECT_EQ(raw.acks[1].first.chunk, 1u);
  EXPECT_TRUE(told_fenced(raw.acks[1].first, raw.acks[1].second)) << raw.acks[1].second;

  // A new session's link is accepted; the old link stays closed, and says so.
  ASSERT_TRUE(hello(2));
  ASSERT_TRUE(message(2, 0, 8192));
  ASSERT_TRUE(message(1, 2, 12288));
  ASSERT_TRUE(raw.Progress([&] { return raw.acks.size() >= 4; }));
  EXPECT_EQ(dst_[8192], 'A');
  EXPECT_EQ(dst_[12288], kPoison);
  bool landed = false, told = false;
  for (const auto& [ack, text] : raw.acks) {
    if (ack.link == 2 && ack.chunk == 0) landed = ack.code == StatusCode::kOk;
    if (ack.link == 1 && ack.chunk == 2) told = told_fenced(ack, text);
  }
  EXPECT_TRUE(landed) << "the new link's message was not acknowledged";
  EXPECT_TRUE(told) << "the refusal of the fenced link's message names the fence";
}

// A sender that stopped part-way through a rendezvous run message (its data has not come: it is
// behind a partition, or stopped) and is fenced: the fence returns at once, the buffers can be
// registered again at once, and when the sender comes back and its data arrives, none of it
// lands (the engine may have handed those pages out again); the message is refused instead.
TEST_F(UcxAmRawTest, AFencedSendersRendezvousDataThatComesLaterLandsNothing) {
  const uint64_t instance = 0x57a11;
  ASSERT_NO_FATAL_FAILURE(StartRaw(instance));
  RawSender& raw = *raw_;

  // The message's header goes out; the raw sender then stops progressing, so its data does not
  // move while the receiver waits for it.
  auto header = ucx_staging::EncodeRuns({instance, 1, 5, 0, 1, RawSender::token(1)},
                                        std::vector<ucx_staging::RunSegment>{{0, 0, 65536}});
  ASSERT_TRUE(header.ok());
  ASSERT_TRUE(raw.PostRendezvous(ucx_staging::kAmRuns, *header, std::string(65536, 'L')));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the receive is under way

  PeerDescriptor sender;
  sender.backend = "ucx";
  sender.address = ucx_staging::AppendTrailer(raw.own_address(), {.instance = instance});
  const auto fence_start = std::chrono::steady_clock::now();
  receiver_->FenceSender(sender);
  EXPECT_LT(std::chrono::steady_clock::now() - fence_start, std::chrono::seconds(2))
      << "the fence waited for data that had not come";
  auto again = receiver_->Register(DstRegions());
  KVT_EXPECT_OK(again.status());

  // The sender comes back: its data arrives, is refused naming the fence, and lands nothing.
  ASSERT_TRUE(raw.Progress([&] { return !raw.acks.empty(); }));
  EXPECT_EQ(raw.acks[0].first.code, StatusCode::kAborted) << raw.acks[0].second;
  EXPECT_NE(raw.acks[0].second.find("fenced here"), std::string::npos) << raw.acks[0].second;
  EXPECT_TRUE(std::all_of(dst_.begin(), dst_.begin() + 65536, [](uint8_t b) {
    return b == kPoison;
  })) << "the message landed after the fence";
}

// A second hello for a link that is open, from the link's own sender worker, neither answers
// nor replaces the link's token: messages with the first token still land, ones with the
// second are refused as not the link's.
TEST_F(UcxAmRawTest, ASecondHelloForAnOpenLinkKeepsItsToken) {
  const uint64_t instance = 0x2e11;
  ASSERT_NO_FATAL_FAILURE(StartRaw(instance));
  RawSender& raw = *raw_;
  ucx_staging::Hello again = RawSender::HelloFor(instance, 1, ucx_staging::LinkMode::kRuns);
  again.token = 0x5ec0d;
  raw.hello_acked = false;
  ASSERT_TRUE(raw.Send(ucx_staging::kAmHello, ucx_staging::Encode(again), raw.own_address()));
  auto second = ucx_staging::EncodeRuns({instance, 1, 6, 0, 1, again.token},
                                        std::vector<ucx_staging::RunSegment>{{0, 0, 64}});
  ASSERT_TRUE(second.ok());
  ASSERT_TRUE(raw.Send(ucx_staging::kAmRuns, *second, std::string(64, 'S')));
  ASSERT_TRUE(raw.SendRun(instance, 1, 7, 0, 64, 'F'));
  ASSERT_TRUE(raw.Progress([&] { return raw.acks.size() >= 2; }));
  EXPECT_FALSE(raw.hello_acked) << "a second hello for an open link was answered";
  for (const auto& [ack, text] : raw.acks) {
    if (ack.write == 6) {
      EXPECT_EQ(ack.code, StatusCode::kFailedPrecondition) << text;
      EXPECT_NE(text.find("not the token that link was opened with"), std::string::npos) << text;
    } else {
      EXPECT_EQ(ack.code, StatusCode::kOk) << text;
    }
  }
  EXPECT_EQ(dst_[0], kPoison);
  EXPECT_EQ(dst_[64], 'F');
}

// A rendezvous run message longer than any message a sender cuts (64 MiB) is refused, naming the
// limit, before the receiver allocates anything to take it into.
TEST_F(UcxAmRawTest, ARendezvousRunMessageLongerThanAnyMessageIsRefusedNamingTheLimit) {
  const uint64_t instance = 0x61b;
  ASSERT_NO_FATAL_FAILURE(StartRaw(instance));
  RawSender& raw = *raw_;
  // 65 pieces of all of buffer 0: each inside the buffer, 65 MiB together.
  const std::vector<ucx_staging::RunSegment> segments(65, {0, 0, kBufferBytes});
  auto header = ucx_staging::EncodeRuns({instance, 1, 3, 0, 65, RawSender::token(1)}, segments);
  ASSERT_TRUE(header.ok());
  ASSERT_TRUE(
      raw.PostRendezvous(ucx_staging::kAmRuns, *header, std::string(65 * kBufferBytes, 'B')));
  ASSERT_TRUE(raw.Progress([&] { return !raw.acks.empty(); }));
  EXPECT_EQ(raw.acks[0].first.code, StatusCode::kOutOfRange) << raw.acks[0].second;
  EXPECT_NE(raw.acks[0].second.find("of 68157440 data bytes; at most 67108864"), std::string::npos)
      << raw.acks[0].second;
  EXPECT_EQ(dst_[0], kPoison);
}

// A sender that keeps writing on a fenced link has every message answered, but the receiver's
// warnings about them are bounded (10 a second), so that the sender cannot flood its log.
TEST_F(UcxAmRawTest, RefusalsOfAFloodOfMessagesAreAllAnsweredButLoggedAtABoundedRate) {
  const uint64_t instance = 0xf100d;
  ASSERT_NO_FATAL_FAILURE(StartRaw(instance));
  RawSender& raw = *raw_;
  PeerDescriptor sender;
  sender.backend = "ucx";
  sender.address = ucx_staging::AppendTrailer(raw.own_address(), {.instance = instance});
  receiver_->FenceSender(sender);

  constexpr uint32_t kMessages = 200;
  auto send = [&](uint32_t i) { return raw.SendRun(instance, 1, 9, i, 64ull * i, 'F'); };
  ::testing::internal::CaptureStderr();
  bool sent = true;
  for (uint32_t i = 0; i < kMessages && sent; ++i) sent = send(i);
  const bool answered = raw.Progress([&] { return raw.acks.size() == kMessages; });
  // Past the limiter's period, one more: its line says how many were held back.
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  const bool last_sent = send(kMessages);
  const bool last_answered = raw.Progress([&] { return raw.acks.size() == kMessages + 1; });
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(sent && last_sent);
  ASSERT_TRUE(answered && last_answered)
      << raw.acks.size() << " of " << kMessages + 1 << " messages were answered";
  for (const auto& [ack, text] : raw.acks) {
    ASSERT_EQ(ack.code, StatusCode::kAborted) << text;
    ASSERT_NE(text.find("was fenced here"), std::string::npos) << text;
  }
  for (uint32_t i = 0; i <= kMessages; ++i) ASSERT_EQ(dst_[64 * i], kPoison) << "message " << i;
  // Every refusal is either a line or counted in a later line's "(N more like it held back)".
  size_t lines = 0;
  uint64_t held_back = 0;
  std::istringstream in(log);
  for (std::string line; std::getline(in, line);) {
    if (line.find("refusing a run message") == std::string::npos) continue;
    ++lines;
    const size_t at = line.find(" more like it held back)");
    if (at == std::string::npos) continue;
    const size_t open = line.rfind('(', at);
    ASSERT_NE(open, std::string::npos) << line;
    held_back += std::stoull(line.substr(open + 1, at - open - 1));
  }
  EXPECT_LE(lines, 21u) << "at most 10 lines a second: " << log;
  EXPECT_GT(held_back, 0u) << "nothing was held back: " << log;
  EXPECT_EQ(lines + held_back, kMessages + 1) << log;
}

// ---- connects that wait, and links that outlive one another -----------------------------------

// Connect sets up the UCX endpoint to a copy-run peer and waits (at most 5 s) for the peer to
// answer. A peer whose worker does not progress stalls only that Connect: writes to other peers
// go on meanwhile, re-registering is refused saying why, and the Connect completes once the peer
// answers.
TEST_F(UcxAmTest, AConnectWaitingForAnUnresponsivePeerLetsOtherPeersWritesThrough) {
  auto hold = std::make_shared<std::atomic<bool>>(false);
  UcxTestHooks held;
  held.hold_progress = hold;
  ASSERT_NO_FATAL_FAILURE(StartWithThird(held, 70));
  ASSERT_EQ(PathOf(*sender_, fast_), "am");

  hold->store(true);
  std::atomic<bool> connecting{true};
  StatusOr<PeerId> held_peer = NotFound("not connected yet");
  std::thread connect([&] {
    held_peer = sender_->Connect(third_descriptor_);
    connecting.store(false);
  });
  // The Connect is under way once re-registering (the same buffers: harmless if it goes
  // through before the Connect starts) is refused, saying why.
  Status reregistered;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  do {
    reregistered = RegisterHost(*sender_, src_, kItem).status();
  } while (reregistered.ok() && std::chrono::steady_clock::now() < give_up);
  const bool held_connect = connecting.load();
  const std::vector<CopyRun> runs = Pages(1, 4096);
  auto w = sender_->PostWrite(fast_, runs);
  // Polled as seldom as the engine polls (the backend's own progress must carry the write).
  const Status done =
      w.ok() ? WaitFor(*sender_, *w, std::chrono::seconds(10), std::chrono::milliseconds(5))
             : w.status();
  const bool overtaken = connecting.load();
  hold->store(false);
  connect.join();
  ASSERT_TRUE(held_connect) << "the held peer answered at once: the test cannot hold a Connect";
  EXPECT_EQ(reregistered.code(), StatusCode::kFailedPrecondition) << reregistered;
  EXPECT_NE(reregistered.message().find("Connect"), std::string::npos) << reregistered;
  EXPECT_NE(reregistered.message().find("retry"), std::string::npos) << reregistered;
  KVT_EXPECT_OK(done);
  EXPECT_TRUE(overtaken) << "the write to the fast peer waited for the unresponsive peer";
  if (w.ok()) sender_->Release(*w);
  ExpectLanded(runs);

  // The peer answered: the Connect succeeded, and writes to that peer land.
  ASSERT_TRUE(held_peer.ok()) << held_peer.status();
  const std::vector<CopyRun> small = {{2, 0, 8192, 16384}};
  auto late = sender_->PostWrite(*held_peer, small);
  ASSERT_TRUE(late.ok()) << late.status();
  KVT_EXPECT_OK(WaitFor(*sender_, *late));
  sender_->Release(*late);
  EXPECT_EQ(std::memcmp(third_dst_.data() + 2 * kBufferBytes + 8192, src_[2].data(), 16384), 0);
}

// A backend that links to the same peer backend twice (a reconnect before the older link is let
// go) keeps taking that backend's messages when it disconnects the older link (as dead, too);
// the disconnect of its last link to that backend refuses them, saying why. The peer backend's
// messages come from a raw sender; the links go to sender_'s workers, published under the raw
// sender's instance.
TEST_F(UcxAmRawTest, DisconnectingAnOlderLinkKeepsThePeerBackendsMessagesAdmitted) {
  const uint64_t instance = 0xfe9cf;
  ASSERT_NO_FATAL_FAILURE(StartRaw(instance));
  RawSender& raw = *raw_;
  auto message = [&](uint32_t index, uint64_t offset) {
    return raw.SendRun(instance, 1, 5, index, offset);
  };

  auto published = RegisterHost(*sender_, src_, kItem);
  ASSERT_TRUE(published.ok()) << published.status();
  const ucx_staging::SplitAddress split = ucx_staging::SplitPeerAddress(published->address);
  ASSERT_TRUE(split.trailer.has_value());
  ucx_staging::AddressTrailer trailer = *split.trailer;
  trailer.instance = instance;
  PeerDescriptor as_raw = *published;
  as_raw.address = ucx_staging::AppendTrailer(split.worker_address, trailer, split.runs_address);
  auto older = receiver_->Connect(as_raw);
  ASSERT_TRUE(older.ok()) << older.status();
  auto newer = receiver_->Connect(as_raw);
  ASSERT_TRUE(newer.ok()) << newer.status();

  // Let go as dead, as a lost control connection's link is: that would also close the
  // endpoint its messages are answered on.
  KVT_ASSERT_OK(receiver_->Disconnect(*older, Backend::DisconnectMode::kPeerDead));
  ASSERT_TRUE(message(0, 0));
  ASSERT_TRUE(raw.Progress([&] { return raw.acks.size() == 1; }));
  EXPECT_EQ(raw.acks[0].first.code, StatusCode::kOk) << raw.acks[0].second;
  EXPECT_EQ(dst_[0], 'A') << "disconnecting the older link stopped the messages of a backend "
                             "the newer link still reaches";

  KVT_ASSERT_OK(receiver_->Disconnect(*newer));
  ASSERT_TRUE(message(1, 4096));
  ASSERT_TRUE(raw.Progress([&] { return raw.acks.size() == 2; }))
      << "a message of a disconnected backend was not answered";
  EXPECT_EQ(raw.acks[1].first.code, StatusCode::kAborted) << raw.acks[1].second;
  EXPECT_NE(raw.acks[1].second.find("disconnected"), std::string::npos) << raw.acks[1].second;
  EXPECT_EQ(dst_[4096], kPoison) << "a message of a disconnected backend landed";
}

// A Connect that waits for its peer does not keep that peer backend's messages admitted: the
// disconnect of the backend's last connected link meanwhile drops them (so that a Connect that
// then fails leaves nothing admitted), and the Connect takes them back once it succeeds. The
// backend's messages come from a raw sender that claims the instance of the backend the links
// go to (whose progress the test holds).
TEST_F(UcxAmRawTest, AConnectUnderWayDoesNotKeepADisconnectedBackendsMessagesAdmitted) {
  auto hold = std::make_shared<std::atomic<bool>>(false);
  UcxTestHooks held;
  held.hold_progress = hold;
  auto created = CreateUcxBackendForTest(Tcp(), held);
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<Backend> target = std::move(created).value();
  std::vector<uint8_t> target_pool(kBuffers * kBufferBytes, 0);
  auto target_descriptor = target->Register(HostRegions(target_pool, kItem));
  ASSERT_TRUE(target_descriptor.ok()) << target_descriptor.status();
  const auto trailer = ucx_staging::SplitPeerAddress(target_descriptor->address).trailer;
  ASSERT_TRUE(trailer.has_value());
  const uint64_t instance = trailer->instance;
  ASSERT_NO_FATAL_FAILURE(StartRaw(instance));
  RawSender& raw = *raw_;
  auto message = [&](uint32_t index, uint64_t offset) {
    return raw.SendRun(instance, 1, 5, index, offset);
  };

  auto first = receiver_->Connect(*target_descriptor);
  ASSERT_TRUE(first.ok()) << first.status();
  // A write over the first link: its hello is answered, so that its disconnect below does not
  // wait for that answer from the held backend.
  auto w = receiver_->PostWrite(*first, std::vector<CopyRun>{{0, 0, 0, 4096}});
  ASSERT_TRUE(w.ok()) << w.status();
  KVT_ASSERT_OK(WaitFor(*receiver_, *w));
  receiver_->Release(*w);
  hold->store(true);
  std::atomic<bool> connecting{true};
  StatusOr<PeerId> second = NotFound("not connected yet");
  std::thread connect([&] {
    second = receiver_->Connect(*target_descriptor);
    connecting.store(false);
  });
  // Under way once re-registering (the same buffers) is refused.
  Status reregistered;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  do {
    reregistered = receiver_->Register(DstRegions()).status();
  } while (reregistered.ok() && std::chrono::steady_clock::now() < give_up);
  const Status disconnected = receiver_->Disconnect(*first);
  const bool during = connecting.load();
  const bool refused_sent = message(0, 0);
  const bool refused_answered = raw.Progress([&] { return raw.acks.size() == 1; });
  hold->store(false);
  connect.join();
  ASSERT_EQ(reregistered.code(), StatusCode::kFailedPrecondition) << reregistered;
  ASSERT_TRUE(during) << "the Connect returned before the disconnect: nothing was tested";
  KVT_ASSERT_OK(disconnected);
  ASSERT_TRUE(refused_sent && refused_answered);
  EXPECT_EQ(raw.acks[0].first.code, StatusCode::kAborted) << raw.acks[0].second;
  EXPECT_NE(raw.acks[0].second.find("disconnected"), std::string::npos) << raw.acks[0].second;
  EXPECT_EQ(dst_[0], kPoison) << "a message of a backend with no connected link landed";

  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_TRUE(message(1, 4096));
  ASSERT_TRUE(raw.Progress([&] { return raw.acks.size() == 2; }));
  EXPECT_EQ(raw.acks[1].first.code, StatusCode::kOk) << raw.acks[1].second;
  EXPECT_EQ(dst_[4096], 'A') << "the Connect that succeeded did not take the backend back";
}

}  // namespace
}  // namespace kvt::transfer

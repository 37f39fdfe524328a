// GPU tests of the nccl backend (label gpu).
//
// Two processes, one GPU each (NCCL refuses two ranks on one GPU), so these need 2 CUDA devices
// and skip with "needs 2 CUDA devices, found N" otherwise. The test binary re-executes itself
// (posix_spawn of /proc/self/exe, never a bare fork after CUDA is initialised) as the decode
// side on device 1; the prefill side (this process, device 0) pairs with it exactly as the
// engines do: the child's descriptor comes over a pipe (its hello), this side Connects and sends
// its own descriptor and ConnectToken back (the hello-ack), the child Accepts. Writes then go
// out with PostPages; the child compares its whole pool with the image this side expects, byte
// for byte (pages outside the writes must keep their poison).
//
// With one GPU only the single-process checks run: refusals of Register and Connect (same GPU)
// and a communicator that never comes up (the queued write fails after connect_timeout, the
// in-progress init is aborted). Every wait is bounded.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kvt/kernels/cuda_util.h"
#include "kvt/testing/gpu.h"
#include "kvt/testing/status.h"
#include "kvt/transfer/backend.h"
#include "kvt/transfer/backends.h"
// Private headers of kvt::transfer (this target has no transfer/src include path).
#include "backend_test_util.h"
#include "backends/nccl/nccl_backend.h"
#include "backends/nccl/nccl_protocol.h"
#include "child_process.h"
#include "gpu_pool.h"

namespace kvt::transfer {
namespace {

using Clock = std::chrono::steady_clock;
using testing::ApplyPageWrite;
using testing::DescribeMismatch;
using testing::DistinctPages;
using ::testing::HasSubstr;
using testing::RandomBytes;

constexpr int kLayers = 4;
constexpr int32_t kPages = 257;  // page 0 is the dummy page
constexpr uint64_t kItem = 4096;
constexpr uint8_t kPoison = 0xA5;
constexpr int kParentDevice = 0;
constexpr int kChildDevice = 1;

// Small slots so that every write spans many chunks and wraps the slot ring many times.
nccl::NcclTuning TestTuning() {
  nccl::NcclTuning tuning;
  tuning.slot_bytes = nccl::kHeaderBytes + 48 * 1024;
  tuning.connect_timeout = std::chrono::seconds(60);
  tuning.stall_timeout = std::chrono::seconds(3);
  tuning.drain_timeout = std::chrono::seconds(20);
  tuning.idle_tick = std::chrono::milliseconds(2);
  tuning.receiver_silence_timeout = std::chrono::seconds(30);
  return tuning;
}

// A backend or the reason there is none (no NCCL on a GPU machine skips rather than fails).
StatusOr<std::unique_ptr<Backend>> NewBackend(const nccl::NcclTuning& tuning = TestTuning()) {
  return CreateNcclBackendWithTuning(tuning);
}

// ---- Pools and expectations -----------------------------------------------------------------

// The pools of these tests: kLayers x kPages x kItem on one device, after a 4 KiB gap.
class GpuPool : public testing::GpuPool {
 public:
  Status Init(int device) {
    return testing::GpuPool::Init(kLayers, kPages, kItem, device, /*gap=*/4096);
  }
  static uint64_t buffer_bytes() { return static_cast<uint64_t>(kPages) * kItem; }
  static uint64_t bytes() { return 2 * kLayers * buffer_bytes(); }
};

// Polls until no write is InProgress or `limit` passed; the final statuses.
std::vector<Status> WaitAll(Backend& backend, const std::vector<WriteId>& writes,
                            std::chrono::milliseconds limit) {
  const auto deadline = Clock::now() + limit;
  std::vector<Status> statuses(writes.size(), InProgress());
  while (true) {
    bool busy = false;
    for (size_t i = 0; i < writes.size(); ++i) {
      if (statuses[i].code() == StatusCode::kInProgress) statuses[i] = backend.Check(writes[i]);
      busy = busy || statuses[i].code() == StatusCode::kInProgress;
    }
    if (!busy || Clock::now() > deadline) return statuses;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// ---- Two processes --------------------------------------------------------------------------

constexpr char kChildEnv[] = "KVT_NCCL_TEST_CHILD";  // "<in fd>,<out fd>,<device>"
using testing::Channel;

// The decode process: owns the destination pool on device 1, joins with Accept, and answers
// commands ("verify" + image, "disconnect", "exit").
class Child : public testing::ChildProcess {
 public:
  // `test`: the hidden child test whose pool the child registers.
  Status Start(const char* test = "NcclChild.DISABLED_Decode") {
    return ChildProcess::Start(kChildEnv, test, "," + std::to_string(kChildDevice));
  }

  StatusOr<PeerDescriptor> Hello() {
    auto message = channel().Receive(std::chrono::seconds(120));
    if (!message.ok()) return message.status().WithContext("waiting for the child's hello");
    auto hello = testing::DecodeDescriptor(*message);
    if (!hello.ok()) return hello.status();
    return hello->descriptor;
  }

  // Sends this side's descriptor and token; the child Accepts (which returns at once).
  Status HelloAck(const PeerDescriptor& descriptor, const std::string& token) {
    KVT_RETURN_IF_ERROR(channel().Send(testing::EncodeDescriptor(descriptor, token)));
    auto reply = channel().Receive(std::chrono::seconds(60));
    if (!reply.ok()) return reply.status();
    if (*reply != "accepted") return Internal("the child's Accept: " + *reply);
    return OkStatus();
  }

  // The child's graceful Disconnect: "<status> <milliseconds>".
  StatusOr<std::string> Disconnect() {
    KVT_RETURN_IF_ERROR(channel().Send("disconnect"));
    return channel().Receive(std::chrono::seconds(60));
  }

  StatusOr<int> Stop() { return ChildProcess::Stop(std::chrono::seconds(60)); }
};

// The mixed layout of backend_test_util.h (a K/V group of 256-byte pages, a latent group of
// 96-byte pages, a draft model's K/V of 512-byte pages; transfer layers 0..4) as one device
// allocation per side, the buffers back to back.
class MixedGpuPool {
 public:
  Status Init(int device) {
    KVT_ASSIGN_OR_RETURN(memory_, cuda::DeviceBuffer::Allocate(layout_.ImageBytes(), device));
    device_ = device;
    return OkStatus();
  }
  std::vector<LocalRegion> Regions() const {
    return layout_.Regions(reinterpret_cast<uint64_t>(memory_.data()), MemoryKind::kCuda, device_);
  }
  Status Upload(const std::vector<uint8_t>& image) {
    return cuda::Copy(memory_.data(), image.data(), image.size());
  }
  StatusOr<std::vector<uint8_t>> Download() const {
    std::vector<uint8_t> image(layout_.ImageBytes());
    KVT_RETURN_IF_ERROR(cuda::Copy(image.data(), memory_.data(), image.size()));
    return image;
  }
  const testing::MixedLayout& layout() const { return layout_; }

 private:
  testing::MixedLayout layout_;
  cuda::DeviceBuffer memory_;
  int device_ = 0;
};

// The decode side once its pool holds the poison: publishes its descriptor (the hello), Accepts
// the parent's token, then answers commands ("verify" + image, "disconnect", "exit"). `mismatch`
// describes how the pool differs from an image ("" when equal).
void ServeAsChild(Channel& channel, std::span<const LocalRegion> regions,
                  const std::function<StatusOr<std::vector<uint8_t>>()>& download,
                  const std::function<std::string(const std::vector<uint8_t>&,
                                                  const std::vector<uint8_t>&)>& mismatch) {
  auto backend = NewBackend();
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto descriptor = (*backend)->Register(regions);
  ASSERT_TRUE(descriptor.ok()) << descriptor.status();
  KVT_ASSERT_OK(channel.Send(testing::EncodeDescriptor(*descriptor)));
  auto ack = channel.Receive(std::chrono::seconds(120));
  ASSERT_TRUE(ack.ok()) << ack.status();
  auto hello = testing::DecodeDescriptor(*ack);
  ASSERT_TRUE(hello.ok()) << hello.status();
  auto peer = (*backend)->Accept(hello->descriptor, hello->token);
  KVT_ASSERT_OK(channel.Send(peer.ok() ? std::string("accepted") : peer.status().ToString()));
  ASSERT_TRUE(peer.ok()) << peer.status();
  while (true) {
    auto command = channel.Receive(std::chrono::seconds(300));
    if (!command.ok()) break;  // the parent is gone
    if (*command == "verify") {
      auto expected = channel.Receive(std::chrono::seconds(60));
      ASSERT_TRUE(expected.ok()) << expected.status();
      auto actual = download();
      ASSERT_TRUE(actual.ok()) << actual.status();
      KVT_ASSERT_OK(channel.Send(
          mismatch(std::vector<uint8_t>(expected->begin(), expected->end()), *actual)));
    } else if (*command == "disconnect") {
      const auto start = Clock::now();
      Status status = (*backend)->Disconnect(*peer, Backend::DisconnectMode::kGraceful);
      const auto ms =
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
      KVT_ASSERT_OK(channel.Send(status.ToString() + " " + std::to_string(ms)));
    } else if (*command == "exit") {
      KVT_ASSERT_OK(channel.Send("bye"));
      break;
    }
  }
}

// The hidden children: run only when started by Child::Start, with the pool of their name.
TEST(NcclChild, DISABLED_Decode) {
  const char* spec = std::getenv(kChildEnv);
  if (spec == nullptr) GTEST_SKIP() << "runs only as the child of the two-process tests";
  int in = -1, out = -1, device = -1;
  ASSERT_EQ(std::sscanf(spec, "%d,%d,%d", &in, &out, &device), 3);
  Channel channel(in, out);
  KVT_ASSERT_OK(cuda::ToStatus(cudaSetDevice(device), "cudaSetDevice"));
  GpuPool pool;
  KVT_ASSERT_OK(pool.Init(device));
  KVT_ASSERT_OK(pool.Upload(std::vector<uint8_t>(GpuPool::bytes(), kPoison)));
  ServeAsChild(
      channel, pool.Regions(), [&] { return pool.Download(); },
      [](const std::vector<uint8_t>& want, const std::vector<uint8_t>& got) {
        return DescribeMismatch(want, got, GpuPool::buffer_bytes(), kItem);
      });
}

TEST(NcclChild, DISABLED_DecodeMixed) {
  const char* spec = std::getenv(kChildEnv);
  if (spec == nullptr) GTEST_SKIP() << "runs only as the child of the two-process tests";
  int in = -1, out = -1, device = -1;
  ASSERT_EQ(std::sscanf(spec, "%d,%d,%d", &in, &out, &device), 3);
  Channel channel(in, out);
  KVT_ASSERT_OK(cuda::ToStatus(cudaSetDevice(device), "cudaSetDevice"));
  MixedGpuPool pool;
  KVT_ASSERT_OK(pool.Init(device));
  KVT_ASSERT_OK(pool.Upload(std::vector<uint8_t>(pool.layout().ImageBytes(), kPoison)));
  ServeAsChild(
      channel, pool.Regions(), [&] { return pool.Download(); },
      [&](const std::vector<uint8_t>& want, const std::vector<uint8_t>& got) {
        return pool.layout().Mismatch(want, got);
      });
}

class NcclTwoProcesses : public ::testing::Test {
 protected:
  void SetUp() override {
    KVT_SKIP_WITHOUT_GPUS(2, "NCCL cannot put two ranks on one GPU");
    signal(SIGPIPE, SIG_IGN);  // a dead child must fail a write, not kill the test
    KVT_ASSERT_OK(cuda::ToStatus(cudaSetDevice(kParentDevice), "cudaSetDevice"));
    auto backend = NewBackend();
    if (!backend.ok() && backend.status().code() == StatusCode::kUnavailable) {
      GTEST_SKIP() << backend.status();
    }
    ASSERT_TRUE(backend.ok()) << backend.status();
    sender_ = std::move(backend).value();
    KVT_ASSERT_OK(src_.Init(kParentDevice));
    src_image_ = RandomBytes(GpuPool::bytes(), 42);
    KVT_ASSERT_OK(src_.Upload(src_image_));
    expected_.assign(GpuPool::bytes(), kPoison);
    auto descriptor = sender_->Register(src_.Regions());
    ASSERT_TRUE(descriptor.ok()) << descriptor.status();
    KVT_ASSERT_OK(child_.Start());
    child_started_ = true;
    auto child = child_.Hello();
    ASSERT_TRUE(child.ok()) << child.status();
    ASSERT_EQ(child->backend, "nccl");
    // The engine's order: Connect on the hello, ConnectToken into the hello-ack.
    auto peer = sender_->Connect(*child);
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
    auto token = sender_->ConnectToken(peer_);
    ASSERT_TRUE(token.ok()) << token.status();
    KVT_ASSERT_OK(child_.HelloAck(*descriptor, *token));
  }

  void TearDown() override {
    if (!child_started_ || child_killed_) return;
    // Close the pair first so that the child's receiver sees the close and its backend goes
    // away at once (else it would wait out its drain timeout for a close that never comes).
    if (sender_ != nullptr) {
      Status closed = sender_->Disconnect(peer_, Backend::DisconnectMode::kGraceful);
      EXPECT_TRUE(closed.ok() || closed.code() == StatusCode::kNotFound) << closed;
    }
    auto status = child_.Stop();
    EXPECT_TRUE(status.ok()) << status.status();
    if (status.ok()) {
      EXPECT_EQ(*status, 0) << "the child's own checks failed";
    }
  }

  void ExpectChildHasExpected() {
    auto verdict = child_.Verify(expected_);
    ASSERT_TRUE(verdict.ok()) << verdict.status();
    EXPECT_EQ(*verdict, "") << "the child's pool differs";
  }

  // Posts a write and records what it must do to the child's pool.
  StatusOr<WriteId> Post(std::span<const int32_t> src_pages, std::span<const int32_t> dst_pages,
                         int32_t begin, int32_t end, std::span<const PageUnit> units = {},
                         cudaEvent_t ready = nullptr) {
    PageWrite write;
    write.src_pages = src_pages;
    write.dst_pages = dst_pages;
    write.num_layers = kLayers;
    write.layer_begin = begin;
    write.layer_end = end;
    write.units = units;
    write.ready = ready;
    auto id = sender_->PostPages(peer_, write);
    if (id.ok()) ApplyPageWrite(write, src_image_, expected_, GpuPool::buffer_bytes(), kItem);
    return id;
  }

  GpuPool src_;
  std::vector<uint8_t> src_image_, expected_;
  std::unique_ptr<Backend> sender_;
  Child child_;
  PeerId peer_ = 0;
  bool child_started_ = false;
  bool child_killed_ = false;
};

TEST_F(NcclTwoProcesses, RandomPagesAcrossLayerBatchesLandByteExact) {
  std::mt19937 rng(7);
  std::vector<WriteId> writes;
  // Destination pages are disjoint across writes so that the expected image does not depend
  // on the order of writes (which the pair keeps anyway).
  std::vector<int32_t> dst_all = DistinctPages(kPages - 1, kPages, rng);
  size_t next_dst = 0;
  auto take = [&](size_t n) {
    std::vector<int32_t> pages(dst_all.begin() + next_dst, dst_all.begin() + next_dst + n);
    next_dst += n;
    return pages;
  };
  // Layer batches as a prefill engine posts them: [0, 1), [1, 3), [3, 4).
  std::vector<std::vector<int32_t>> keep;  // page lists stay alive until posted (copied anyway)
  for (auto [begin, end] : {std::pair{0, 1}, std::pair{1, 3}, std::pair{3, 4}}) {
    const size_t n = 20 + rng() % 40;
    keep.push_back(DistinctPages(n, kPages, rng));
    keep.push_back(take(n));
    auto id = Post(keep[keep.size() - 2], keep.back(), begin, end);
    ASSERT_TRUE(id.ok()) << id.status();
    writes.push_back(*id);
  }
  // Partial pages (a head range of each token, as between pools of different TP sizes).
  const std::vector<PageUnit> units = {{0, 512, 1024}, {3072, 0, 512}, {2048, 2048, 8}};
  keep.push_back(DistinctPages(33, kPages, rng));
  keep.push_back(take(33));
  auto partial = Post(keep[keep.size() - 2], keep.back(), 0, kLayers, units);
  ASSERT_TRUE(partial.ok()) << partial.status();
  writes.push_back(*partial);
  // An empty write completes at once.
  auto empty = Post({}, {}, 0, 1);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(sender_->Check(*empty).ok());

  const std::vector<Status> statuses = WaitAll(*sender_, writes, std::chrono::seconds(60));
  for (size_t i = 0; i < writes.size(); ++i)
    EXPECT_TRUE(statuses[i].ok()) << i << ": " << statuses[i];
  ExpectChildHasExpected();
  for (WriteId id : writes) sender_->Release(id);
  sender_->Release(*empty);
  EXPECT_EQ(sender_->Check(writes[0]).code(), StatusCode::kNotFound);
}

TEST_F(NcclTwoProcesses, AWriteLargerThanAllStagingSlotsStreamsThroughThem) {
  std::mt19937 rng(11);
  const std::vector<int32_t> src_pages = DistinctPages(kPages - 1, kPages, rng);
  const std::vector<int32_t> dst_pages = DistinctPages(kPages - 1, kPages, rng);
  const uint64_t bytes = 2ULL * kLayers * (kPages - 1) * kItem;  // 8 MiB
  const nccl::NcclTuning tuning = TestTuning();
  ASSERT_GT(bytes, nccl::kRing * tuning.slot_bytes * 10) << "the write must wrap the ring often";
  auto id = Post(src_pages, dst_pages, 0, kLayers);
  ASSERT_TRUE(id.ok()) << id.status();
  const std::vector<Status> statuses = WaitAll(*sender_, {*id}, std::chrono::seconds(120));
  EXPECT_TRUE(statuses[0].ok()) << statuses[0];
  ExpectChildHasExpected();
  sender_->Release(*id);
}

// A host callback blocks the producer's stream for a while; the new source bytes are copied in
// after it and `ready` recorded after that. Without the GPU-side wait the pack would read the
// old bytes long before.
TEST_F(NcclTwoProcesses, TheReadyEventGatesThePackOnTheGpuNotOnTheCaller) {
  std::mt19937 rng(13);
  const std::vector<int32_t> src_pages = DistinctPages(40, kPages, rng);
  const std::vector<int32_t> dst_pages = DistinctPages(40, kPages, rng);
  auto stream = cuda::Stream::Create(kParentDevice);
  ASSERT_TRUE(stream.ok()) << stream.status();
  auto ready = cuda::Event::Create(/*timing=*/false);
  ASSERT_TRUE(ready.ok()) << ready.status();
  auto staged = cuda::PinnedBuffer::Allocate(GpuPool::bytes());
  ASSERT_TRUE(staged.ok()) << staged.status();
  std::vector<uint8_t> fresh = RandomBytes(GpuPool::bytes(), 99);
  std::memcpy(staged->data(), fresh.data(), fresh.size());
  KVT_ASSERT_OK(cuda::ToStatus(
      cudaLaunchHostFunc(
          stream->get(), [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(400)); },
          nullptr),
      "cudaLaunchHostFunc"));
  KVT_ASSERT_OK(cuda::ToStatus(cudaMemcpyAsync(src_.data(), staged->data(), GpuPool::bytes(),
                                               cudaMemcpyHostToDevice, stream->get()),
                               "cudaMemcpyAsync"));
  KVT_ASSERT_OK(ready->Record(stream->get()));
  src_image_ = fresh;  // what the write must carry
  const auto start = Clock::now();
  auto id = Post(src_pages, dst_pages, 0, kLayers, {}, ready->get());
  const auto post_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_LT(post_ms, 300) << "PostPages waited for the ready event on the calling thread";
  const std::vector<Status> statuses = WaitAll(*sender_, {*id}, std::chrono::seconds(60));
  EXPECT_TRUE(statuses[0].ok()) << statuses[0];
  EXPECT_GE(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count(),
            350)
      << "the write completed before its ready event fired";
  ExpectChildHasExpected();
  sender_->Release(*id);
  KVT_ASSERT_OK(stream->Synchronize());
}

TEST_F(NcclTwoProcesses, GracefulDisconnectClosesBothSidesWithoutWaitingOut) {
  std::mt19937 rng(17);
  const std::vector<int32_t> pages = DistinctPages(64, kPages, rng);
  auto id = Post(pages, pages, 0, kLayers);
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_TRUE(WaitAll(*sender_, {*id}, std::chrono::seconds(60))[0].ok());
  const auto start = Clock::now();
  KVT_ASSERT_OK(sender_->Disconnect(peer_, Backend::DisconnectMode::kGraceful));
  const auto sender_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
  EXPECT_LT(sender_ms, 5000) << "the close handshake should take milliseconds";
  // The receiver saw the close: its graceful disconnect finds every posted step matched and
  // destroys the communicator at once instead of waiting out its 20 s drain timeout.
  auto reply = child_.Disconnect();
  ASSERT_TRUE(reply.ok()) << reply.status();
  ASSERT_EQ(reply->rfind("OK ", 0), 0u) << *reply;
  EXPECT_LT(std::stoll(reply->substr(3)), 5000) << *reply;
  EXPECT_EQ(sender_->Check(*id).code(), StatusCode::kOk);  // completed writes stay OK
  sender_->Release(*id);
  PageWrite write;
  write.src_pages = pages;
  write.dst_pages = pages;
  write.num_layers = kLayers;
  write.layer_begin = 0;
  write.layer_end = 1;
  EXPECT_EQ(sender_->PostPages(peer_, write).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(sender_->Disconnect(peer_).code(), StatusCode::kNotFound);
  ExpectChildHasExpected();
}

TEST_F(NcclTwoProcesses, APeerKilledMidTransferFailsWritesAndNothingHangs) {
  std::mt19937 rng(19);
  const std::vector<int32_t> src_pages = DistinctPages(kPages - 1, kPages, rng);
  const std::vector<int32_t> dst_pages = DistinctPages(kPages - 1, kPages, rng);
  std::vector<WriteId> writes;
  const auto start = Clock::now();
  // Keep the pair busy; the child dies while writes stream and more are posted after.
  while (Clock::now() - start < std::chrono::milliseconds(1500)) {
    auto id = Post(src_pages, dst_pages, 0, kLayers);
    if (!id.ok() && child_killed_) break;  // the pair already noticed
    ASSERT_TRUE(id.ok()) << id.status();
    writes.push_back(*id);
    if (writes.size() == 8) {
      child_.Kill();
      child_killed_ = true;
    }
    if (writes.size() >= 8) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(child_killed_);
  // No Disconnect yet: the pair notices on its own (stall timeout 3 s) and fails the writes.
  const std::vector<Status> statuses = WaitAll(*sender_, writes, std::chrono::seconds(30));
  size_t failed = 0;
  for (const Status& s : statuses) {
    EXPECT_NE(s.code(), StatusCode::kInProgress) << "a write still runs 30 s after the kill";
    if (!s.ok()) {
      ++failed;
      // The stall detector says Unavailable; NCCL itself may report the loss first.
      EXPECT_NE(s.code(), StatusCode::kAborted) << s;
      EXPECT_THAT(s.message(), HasSubstr("nccl peer"));
    }
  }
  EXPECT_GT(failed, 0u) << "writes posted after the kill cannot have completed";
  // Posting more fails at once with the pair's failure.
  PageWrite write;
  write.src_pages = src_pages;
  write.dst_pages = dst_pages;
  write.num_layers = kLayers;
  write.layer_begin = 0;
  write.layer_end = 1;
  auto late = sender_->PostPages(peer_, write);
  ASSERT_FALSE(late.ok());
  EXPECT_THAT(late.status().message(), HasSubstr("nccl peer")) << late.status();
  // The engine's control plane declares the peer dead: abort is immediate.
  const auto disconnect_start = Clock::now();
  KVT_ASSERT_OK(sender_->Disconnect(peer_, Backend::DisconnectMode::kPeerDead));
  EXPECT_LT(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - disconnect_start)
                .count(),
            10000);
  for (WriteId id : writes) sender_->Release(id);  // returns at once: the pair is gone
  EXPECT_LT(std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - start).count(), 60);
}

TEST_F(NcclTwoProcesses, DisconnectAsPeerDeadAbortsWritesInFlight) {
  std::mt19937 rng(23);
  const std::vector<int32_t> src_pages = DistinctPages(kPages - 1, kPages, rng);
  const std::vector<int32_t> dst_pages = DistinctPages(kPages - 1, kPages, rng);
  std::vector<WriteId> writes;
  for (int i = 0; i < 16; ++i) {
    auto id = Post(src_pages, dst_pages, 0, kLayers);
    ASSERT_TRUE(id.ok()) << id.status();
    writes.push_back(*id);
  }
  KVT_ASSERT_OK(sender_->Disconnect(peer_, Backend::DisconnectMode::kPeerDead));
  size_t aborted = 0;
  for (WriteId id : writes) {
    const Status s = sender_->Check(id);
    EXPECT_NE(s.code(), StatusCode::kInProgress);
    if (s.code() == StatusCode::kAborted) ++aborted;
    sender_->Release(id);
  }
  EXPECT_GT(aborted, 0u) << "16 x 8 MiB cannot all have landed before the disconnect";
  // The child's receiver still has its steps posted; the engine would Disconnect it as well.
  child_.Kill();
  child_killed_ = true;
}

// ---- One process (one GPU suffices) ---------------------------------------------------------

// The mixed layout over two GPUs: every buffer of each layer batch moves with its own page
// bytes (K/V, latent and draft groups), whole pages and units, through slots that hold a few
// pages of the heaviest layer; the child's whole pool matches byte for byte, poison elsewhere.
TEST(NcclTwoProcessesMixed, MixedLayoutMovesEveryBufferOfTheLayersByteExact) {
  KVT_SKIP_WITHOUT_GPUS(2, "NCCL cannot put two ranks on one GPU");
  signal(SIGPIPE, SIG_IGN);
  KVT_ASSERT_OK(cuda::ToStatus(cudaSetDevice(kParentDevice), "cudaSetDevice"));
  nccl::NcclTuning tuning = TestTuning();
  tuning.slot_bytes = nccl::kMinSlotBytes;  // 4 KiB of payload: 4 pages of the draft layer
  auto backend = NewBackend(tuning);
  if (!backend.ok() && backend.status().code() == StatusCode::kUnavailable) {
    GTEST_SKIP() << backend.status();
  }
  ASSERT_TRUE(backend.ok()) << backend.status();
  std::unique_ptr<Backend> sender = std::move(backend).value();
  MixedGpuPool src;
  KVT_ASSERT_OK(src.Init(kParentDevice));
  const testing::MixedLayout& mixed = src.layout();
  const std::vector<uint8_t> src_image = RandomBytes(mixed.ImageBytes(), 99);
  KVT_ASSERT_OK(src.Upload(src_image));
  std::vector<uint8_t> expected(mixed.ImageBytes(), kPoison);
  auto descriptor = sender->Register(src.Regions());
  ASSERT_TRUE(descriptor.ok()) << descriptor.status();

  Child child;
  KVT_ASSERT_OK(child.Start("NcclChild.DISABLED_DecodeMixed"));
  auto hello = child.Hello();
  ASSERT_TRUE(hello.ok()) << hello.status();
  auto peer = sender->Connect(*hello);
  ASSERT_TRUE(peer.ok()) << peer.status();
  auto token = sender->ConnectToken(*peer);
  ASSERT_TRUE(token.ok()) << token.status();
  KVT_ASSERT_OK(child.HelloAck(*descriptor, *token));

  std::mt19937 rng(5);
  // Disjoint destination pages across writes: the expected image does not depend on their order.
  const std::vector<int32_t> dst_all = DistinctPages(mixed.pages - 1, mixed.pages, rng);
  size_t next_dst = 0;
  std::vector<std::vector<int32_t>> keep;
  std::vector<WriteId> writes;
  auto post = [&](size_t n, int32_t begin, int32_t end, std::span<const PageUnit> units) {
    keep.push_back(DistinctPages(static_cast<int64_t>(n), mixed.pages, rng));
    keep.emplace_back(dst_all.begin() + next_dst, dst_all.begin() + next_dst + n);
    next_dst += n;
    PageWrite write;
    write.src_pages = keep[keep.size() - 2];
    write.dst_pages = keep.back();
    write.num_layers = mixed.num_layers;
    write.layer_begin = begin;
    write.layer_end = end;
    write.units = units;
    auto id = sender->PostPages(*peer, write);
    ASSERT_TRUE(id.ok()) << id.status();
    writes.push_back(*id);
    // What the write must leave, from the definition: every buffer whose layer is in the range.
    for (size_t b = 0; b < mixed.buffers(); ++b) {
      if (mixed.layers[b] < begin || mixed.layers[b] >= end) continue;
      const PageUnit whole{0, 0, mixed.items[b]};
      for (const PageUnit& u : units.empty() ? std::span<const PageUnit>(&whole, 1) : units) {
        for (size_t i = 0; i < n; ++i) {
          std::memcpy(expected.data() + mixed.Offset(b) + write.dst_pages[i] * mixed.items[b] +
                          u.dst_offset,
                      src_image.data() + mixed.Offset(b) + write.src_pages[i] * mixed.items[b] +
                          u.src_offset,
                      u.bytes);
        }
      }
    }
  };
  // Layer batches as a prefill engine posts them: the target's K/V, its latent layers, the draft.
  post(6, 0, 2, {});
  post(5, 2, 4, {});
  post(7, 4, 5, {});
  // Parts of every page (inside the 96-byte latent pages too), over every layer at once.
  const std::vector<PageUnit> units = {{8, 40, 24}, {64, 0, 32}};
  post(4, 0, mixed.num_layers, units);
  const std::vector<Status> statuses = WaitAll(*sender, writes, std::chrono::seconds(60));
  for (size_t i = 0; i < statuses.size(); ++i)
    EXPECT_TRUE(statuses[i].ok()) << i << ": " << statuses[i];
  auto verdict = child.Verify(expected);
  ASSERT_TRUE(verdict.ok()) << verdict.status();
  EXPECT_EQ(*verdict, "") << "the child's pool differs";
  for (WriteId id : writes) sender->Release(id);

  // A page beyond the peer's shortest buffer of the range is refused before anything moves.
  std::vector<int32_t> far = {static_cast<int32_t>(mixed.pages)};
  PageWrite refused;
  refused.src_pages = far;
  refused.dst_pages = far;
  refused.num_layers = mixed.num_layers;
  refused.layer_begin = 2;
  refused.layer_end = 4;
  EXPECT_EQ(sender->PostPages(*peer, refused).status().code(), StatusCode::kOutOfRange);

  KVT_ASSERT_OK(sender->Disconnect(*peer, Backend::DisconnectMode::kGraceful));
  auto stopped = child.Stop();
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  EXPECT_EQ(*stopped, 0) << "the child's own checks failed";
}

class NcclOneProcess : public ::testing::Test {
 protected:
  void SetUp() override {
    KVT_SKIP_WITHOUT_GPU();
    KVT_ASSERT_OK(cuda::ToStatus(cudaSetDevice(0), "cudaSetDevice"));
    nccl::NcclTuning tuning = TestTuning();
    tuning.connect_timeout = std::chrono::seconds(2);
    auto backend = NewBackend(tuning);
    if (!backend.ok() && backend.status().code() == StatusCode::kUnavailable) {
      GTEST_SKIP() << backend.status();
    }
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = std::move(backend).value();
    KVT_ASSERT_OK(pool_.Init(0));
    auto descriptor = backend_->Register(pool_.Regions());
    ASSERT_TRUE(descriptor.ok()) << descriptor.status();
    descriptor_ = *descriptor;
  }

  GpuPool pool_;
  std::unique_ptr<Backend> backend_;
  PeerDescriptor descriptor_;
};

TEST_F(NcclOneProcess, RegisterTakesAnyLayerTableButRefusesHostMemoryAndEmptyPages) {
  std::vector<uint8_t> host(GpuPool::bytes());
  std::vector<LocalRegion> regions = pool_.Regions();
  regions[3].kind = MemoryKind::kHost;
  regions[3].base = reinterpret_cast<uint64_t>(host.data());
  auto refused = backend_->Register(regions);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("use ucx for host pools"));
  // Layouts of any layer table and page sizes register; broken tables and empty pages do not.
  regions = pool_.Regions();
  regions[1].layer = 5;
  auto skipped = backend_->Register(regions);
  EXPECT_EQ(skipped.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(skipped.status().message(), HasSubstr("buffer 1 has transfer layer 5"));
  regions = pool_.Regions();
  regions[1].item_len = 0;
  EXPECT_THAT(backend_->Register(regions).status().message(),
              HasSubstr("buffer 1 has 0-byte pages"));
  regions = pool_.Regions();
  regions.pop_back();          // V of the last layer gone
  regions[1].item_len = 2048;  // another page size
  EXPECT_TRUE(backend_->Register(regions).ok());
  KVT_ASSERT_OK(backend_->Register(pool_.Regions()).status());
  EXPECT_EQ(descriptor_.backend, "nccl");
  auto address = nccl::DecodeAddress(descriptor_.address);
  ASSERT_TRUE(address.ok()) << address.status();
  EXPECT_EQ(address->pid, static_cast<uint64_t>(getpid()));
  EXPECT_EQ(address->device, 0);
  // Copy runs are not this backend's business.
  const CopyRun run{0, 0, 0, 16};
  EXPECT_EQ(backend_->PostWrite(1, std::span<const CopyRun>(&run, 1)).status().code(),
            StatusCode::kUnimplemented);
}

TEST_F(NcclOneProcess, APeerOnTheSameGpuIsRefused) {
  auto other = NewBackend();
  ASSERT_TRUE(other.ok()) << other.status();
  GpuPool pool;
  KVT_ASSERT_OK(pool.Init(0));
  auto descriptor = (*other)->Register(pool.Regions());
  ASSERT_TRUE(descriptor.ok()) << descriptor.status();
  auto peer = backend_->Connect(*descriptor);
  ASSERT_FALSE(peer.ok());
  EXPECT_EQ(peer.status().code(), StatusCode::kFailedPrecondition) << peer.status();
  EXPECT_THAT(peer.status().message(),
              HasSubstr("nccl needs one GPU per rank; use cuda_ipc on one GPU"));
  auto token = nccl::EncodeToken(nccl::PairToken{{}, TestTuning().slot_bytes, 2, 1});
  EXPECT_EQ((*other)->Accept(descriptor_, token).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*other)->Accept(descriptor_, "garbage").status().code(), StatusCode::kInvalidArgument);
}

// A peer "on another host" that never joins: the queued write fails after connect_timeout with
// a message saying what to check, and the in-progress communicator is aborted.
TEST_F(NcclOneProcess, ACommunicatorThatNeverComesUpFailsQueuedWrites) {
  PeerDescriptor ghost = descriptor_;
  auto address = nccl::DecodeAddress(ghost.address);
  ASSERT_TRUE(address.ok());
  address->boot_id = "another-host";
  ghost.address = nccl::EncodeAddress(*address);
  auto peer = backend_->Connect(ghost);
  ASSERT_TRUE(peer.ok()) << peer.status();
  auto token = backend_->ConnectToken(*peer);
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_TRUE(nccl::DecodeToken(*token).ok());
  std::vector<int32_t> pages = {1, 2, 3};
  PageWrite write;
  write.src_pages = pages;
  write.dst_pages = pages;
  write.num_layers = kLayers;
  write.layer_begin = 0;
  write.layer_end = 2;
  auto id = backend_->PostPages(*peer, write);
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(backend_->Check(*id).code(), StatusCode::kInProgress);  // queued, not refused
  const std::vector<Status> statuses = WaitAll(*backend_, {*id}, std::chrono::seconds(30));
  EXPECT_EQ(statuses[0].code(), StatusCode::kDeadlineExceeded) << statuses[0];
  EXPECT_THAT(statuses[0].message(), HasSubstr("must Accept this side's token"));
  const auto start = Clock::now();
  KVT_ASSERT_OK(backend_->Disconnect(*peer, Backend::DisconnectMode::kGraceful));
  EXPECT_LT(std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - start).count(), 15);
  backend_->Release(*id);
  // A write naming pages outside the peer's buffers is refused before anything moves.
  auto second = backend_->Connect(ghost);
  ASSERT_TRUE(second.ok()) << second.status();
  std::vector<int32_t> far = {kPages};
  write.src_pages = far;
  write.dst_pages = far;
  EXPECT_EQ(backend_->PostPages(*second, write).status().code(), StatusCode::kOutOfRange);
  KVT_ASSERT_OK(backend_->Disconnect(*second, Backend::DisconnectMode::kPeerDead));
}

}  // namespace
}  // namespace kvt::transfer

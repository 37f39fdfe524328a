// GPU tests of the cuda_ipc backend (label gpu; every test skips itself without a CUDA device).
//
// Same process: two backends, two pools laid out as kvt's pool lays them out (one cudaMalloc
// sliced into 2L buffers, here after a gap so the buffers sit at non-zero offsets), page writes
// (whole pages, units), copy runs, the `ready` event, disconnects and releases of writes in
// flight, and the refusals of Register and Connect.
//
// Two processes: the test binary re-executes itself (posix_spawn of /proc/self/exe, never a bare
// fork after CUDA is initialised) as the owner of the destination pool; descriptors, commands and
// the expected bytes travel over pipes, and the child compares its pool with what the parent
// expects, byte for byte. Also the mapping cache's lifetime and a peer killed with SIGKILL.
// Every wait is bounded.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kvt/kernels/cuda_util.h"
#include "kvt/kernels/kernels.h"
#include "kvt/testing/gpu.h"
#include "kvt/testing/status.h"
#include "kvt/transfer/backend.h"
#include "kvt/transfer/backends.h"
// Private headers of kvt::transfer (this target has no transfer/src include path).
#include "backend_test_util.h"
#include "backends/cuda_ipc/cuda_ipc_backend.h"
#include "backends/cuda_ipc/cuda_ipc_codec.h"
#include "child_process.h"
#include "gpu_pool.h"

namespace kvt::transfer {
namespace {

using Clock = std::chrono::steady_clock;
using testing::ApplyPageWrite;
using testing::DescribeMismatch;
using testing::DistinctPages;
using testing::GpuPool;
using ::testing::HasSubstr;
using testing::RandomBytes;
using testing::WaitFor;

constexpr int kLayers = 4;
constexpr int32_t kPages = 64;
constexpr uint64_t kItem = 2048;
constexpr uint8_t kPoison = 0xEE;

// ---- Pools and expectations ---------------------------------------------------------------

void ApplyRuns(std::span<const CopyRun> runs, const std::vector<uint8_t>& src,
               std::vector<uint8_t>& dst, uint64_t buffer_bytes) {
  for (const CopyRun& r : runs) {
    std::memcpy(dst.data() + r.buffer * buffer_bytes + r.dst_offset,
                src.data() + r.buffer * buffer_bytes + r.src_offset, r.bytes);
  }
}

// A write of one page (`src` to `dst`, which must outlive it) over layers [begin, end).
// Layers [begin, end) of the pages `src` into `dst` (the spans must outlive the write's post).
PageWrite Pages(std::span<const int32_t> src, std::span<const int32_t> dst, int32_t begin = 0,
                int32_t end = kLayers) {
  PageWrite w;
  w.src_pages = src;
  w.dst_pages = dst;
  w.num_layers = kLayers;
  w.layer_begin = begin;
  w.layer_end = end;
  return w;
}

PageWrite OnePage(const int32_t& src, const int32_t& dst, int32_t begin = 0,
                  int32_t end = kLayers) {
  return Pages({&src, 1}, {&dst, 1}, begin, end);
}

// Waits (at most 10 s) until `count` reaches `n`; its value then.
int WaitForCount(const std::atomic<int>& count, int n) {
  const auto give_up = Clock::now() + std::chrono::seconds(10);
  while (count.load() < n && Clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return count.load();
}

std::unique_ptr<Backend> NewBackend() {
  auto backend = CreateBackend("cuda_ipc");
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? std::move(backend).value() : nullptr;
}

// A stream blocked behind a host function until Open() (or 15 s, so nothing hangs): work queued
// after it on the stream — and every stream waiting for an event recorded after it — stalls.
class Gate {
 public:
  Status Close(cudaStream_t stream) {
    return cuda::ToStatus(cudaLaunchHostFunc(stream, &Gate::Wait, this), "cudaLaunchHostFunc");
  }
  void Open() { open_.store(true); }
  bool timed_out() const { return timed_out_.load(); }

 private:
  static void Wait(void* arg) {  // runs on a CUDA thread: no CUDA calls here
    auto* gate = static_cast<Gate*>(arg);
    const auto give_up = Clock::now() + std::chrono::seconds(15);
    while (!gate->open_.load()) {
      if (Clock::now() > give_up) {
        gate->timed_out_.store(true);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  std::atomic<bool> open_{false};
  std::atomic<bool> timed_out_{false};
};

// A producer whose `ready` event stays pending until gate.Open(): its stream is held behind the
// gate and the event recorded after it.
struct HeldProducer {
  Status Hold() {
    KVT_ASSIGN_OR_RETURN(stream, cuda::Stream::Create(0));
    KVT_ASSIGN_OR_RETURN(ready, cuda::Event::Create(/*timing=*/false));
    KVT_RETURN_IF_ERROR(gate.Close(stream.get()));
    return ready.Record(stream.get());
  }
  // Holds the producer and posts `w` waiting for it; the gate opens again when the post fails.
  StatusOr<WriteId> PostGated(Backend& backend, PeerId peer, PageWrite w) {
    KVT_RETURN_IF_ERROR(Hold());
    w.ready = ready.get();
    StatusOr<WriteId> id = backend.PostPages(peer, w);
    if (!id.ok()) gate.Open();
    return id;
  }
  cuda::Stream stream;
  cuda::Event ready;
  Gate gate;
};

// ---- Same process -------------------------------------------------------------------------

class CudaIpcSameProcess : public ::testing::Test {
 protected:
  void SetUp() override {
    KVT_SKIP_WITHOUT_GPU();
    KVT_ASSERT_OK(src_.Init(kLayers, kPages, kItem));
    KVT_ASSERT_OK(dst_.Init(kLayers, kPages, kItem));
    src_image_ = RandomBytes(src_.bytes(), 1);
    KVT_ASSERT_OK(src_.Upload(src_image_));
    KVT_ASSERT_OK(dst_.Fill(kPoison));
    expected_.assign(dst_.bytes(), kPoison);
    sender_ = NewBackend();
    receiver_ = NewBackend();
    ASSERT_TRUE(sender_ && receiver_);
    auto sd = sender_->Register(src_.Regions());
    ASSERT_TRUE(sd.ok()) << sd.status();
    auto rd = receiver_->Register(dst_.Regions());
    ASSERT_TRUE(rd.ok()) << rd.status();
    receiver_descriptor_ = *rd;
    EXPECT_EQ(rd->backend, "cuda_ipc");
    ASSERT_EQ(rd->regions.size(), 2u * kLayers);
    mappings_before_ = CudaIpcOpenMappingsForTest();
    auto peer = sender_->Connect(receiver_descriptor_);
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
  }

  void ExpectDestination() {
    auto actual = dst_.Download();
    ASSERT_TRUE(actual.ok()) << actual.status();
    const std::string diff = DescribeMismatch(expected_, *actual, dst_.buffer_bytes(), dst_.item());
    EXPECT_EQ(diff, "");
  }

  GpuPool src_, dst_;
  std::vector<uint8_t> src_image_, expected_;
  std::unique_ptr<Backend> sender_, receiver_;
  PeerDescriptor receiver_descriptor_;
  size_t mappings_before_ = 0;
  PeerId peer_ = 0;
};

TEST_F(CudaIpcSameProcess, WholePagesOfLayerBatchesAreByteExact) {
  // A peer in this process is written through its addresses: nothing is opened.
  EXPECT_EQ(CudaIpcOpenMappingsForTest(), mappings_before_);
  std::mt19937 rng(5);
  for (auto [begin, end] : {std::pair(1, 3), std::pair(0, 1), std::pair(3, 4)}) {
    const std::vector<int32_t> src_pages = DistinctPages(13, kPages, rng);
    const std::vector<int32_t> dst_pages = DistinctPages(13, kPages, rng);
    PageWrite w;
    w.src_pages = src_pages;
    w.dst_pages = dst_pages;
    w.num_layers = kLayers;
    w.layer_begin = begin;
    w.layer_end = end;
    auto id = sender_->PostPages(peer_, w);
    ASSERT_TRUE(id.ok()) << id.status();
    KVT_ASSERT_OK(WaitFor(*sender_, *id));
    EXPECT_TRUE(sender_->Check(*id).ok());  // stays OK
    sender_->Release(*id);
    ApplyPageWrite(w, src_image_, expected_, dst_.buffer_bytes(), kItem);
    ExpectDestination();
  }
}

TEST_F(CudaIpcSameProcess, UnitsAreByteExactIncludingUnalignedOnes) {
  std::mt19937 rng(6);
  const std::vector<int32_t> src_pages = DistinctPages(20, kPages, rng);
  const std::vector<int32_t> dst_pages = DistinctPages(20, kPages, rng);
  const std::vector<PageUnit> units = {{0, 1024, 512}, {1024, 0, 256}, {7, 1501, 333}};
  PageWrite w;
  w.src_pages = src_pages;
  w.dst_pages = dst_pages;
  w.num_layers = kLayers;
  w.layer_begin = 0;
  w.layer_end = kLayers;
  w.units = units;
  auto id = sender_->PostPages(peer_, w);
  ASSERT_TRUE(id.ok()) << id.status();
  KVT_ASSERT_OK(WaitFor(*sender_, *id));
  sender_->Release(*id);
  ApplyPageWrite(w, src_image_, expected_, dst_.buffer_bytes(), kItem);
  ExpectDestination();
}

TEST_F(CudaIpcSameProcess, CopyRunsAreByteExact) {
  std::mt19937 rng(7);
  std::vector<uint64_t> dst_pages(kPages);
  std::iota(dst_pages.begin(), dst_pages.end(), 0);
  std::shuffle(dst_pages.begin() + 1, dst_pages.end(), rng);
  std::vector<CopyRun> runs;
  for (uint32_t b = 0; b < 2 * kLayers; ++b) {
    for (uint64_t p = 1; p < 17; ++p) {
      const uint64_t bytes = p % 3 == 0 ? kItem : 1 + rng() % kItem;  // odd lengths too
      runs.push_back({b, p * kItem, dst_pages[p] * kItem, bytes});
    }
  }
  runs.push_back({0, 3 * kItem, 40 * kItem, 5 * kItem});  // a coalesced multi-page run
  auto id = sender_->PostWrite(peer_, runs);
  ASSERT_TRUE(id.ok()) << id.status();
  KVT_ASSERT_OK(WaitFor(*sender_, *id));
  sender_->Release(*id);
  ApplyRuns(runs, src_image_, expected_, dst_.buffer_bytes());
  ExpectDestination();
}

// Small writes pass their tables in the launch's parameters, large ones upload them: a write of
// 504 runs (over a thousand table words) and a one-page write posted right behind it, both in
// flight at once, land byte-exact and in order.
TEST_F(CudaIpcSameProcess, WritesWithUploadedAndInlineTablesAreByteExact) {
  std::mt19937 rng(8);
  std::vector<uint64_t> dst_pages(kPages);
  std::iota(dst_pages.begin(), dst_pages.end(), 0);
  std::shuffle(dst_pages.begin(), dst_pages.end(), rng);
  std::vector<CopyRun> runs;
  for (uint32_t b = 0; b < 2 * kLayers; ++b) {
    for (uint64_t p = 1; p < static_cast<uint64_t>(kPages); ++p) {
      runs.push_back({b, p * kItem, dst_pages[p] * kItem, kItem});
    }
  }
  ASSERT_GT(2 * runs.size(), kernels::kPageCopyInlineTableWords);
  auto large = sender_->PostWrite(peer_, runs);
  ASSERT_TRUE(large.ok()) << large.status();
  const int32_t src_page = 7, dst_page = static_cast<int32_t>(dst_pages[9]);  // also a run's
  PageWrite w = OnePage(src_page, dst_page);
  auto small = sender_->PostPages(peer_, w);
  ASSERT_TRUE(small.ok()) << small.status();
  KVT_ASSERT_OK(WaitFor(*sender_, *large));
  KVT_ASSERT_OK(WaitFor(*sender_, *small));
  sender_->Release(*large);
  sender_->Release(*small);
  ApplyRuns(runs, src_image_, expected_, dst_.buffer_bytes());
  ApplyPageWrite(w, src_image_, expected_, dst_.buffer_bytes(), kItem);
  ExpectDestination();
}

TEST_F(CudaIpcSameProcess, CopyWaitsOnTheGpuForTheReadyEvent) {
  // The producer overwrites the source (new data) on a stream held behind a gate, then records
  // `ready`; right after posting, `ready` is re-recorded on an idle stream. The write must wait
  // for the first recording: it stays in flight while the gate is shut and lands the new data.
  auto producer = cuda::Stream::Create(0);
  ASSERT_TRUE(producer.ok()) << producer.status();
  auto idle = cuda::Stream::Create(0);
  ASSERT_TRUE(idle.ok()) << idle.status();
  auto ready = cuda::Event::Create(/*timing=*/false);
  ASSERT_TRUE(ready.ok()) << ready.status();
  const std::vector<uint8_t> fresh = RandomBytes(src_.bytes(), 99);
  auto pinned = cuda::PinnedBuffer::Allocate(fresh.size());
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  std::memcpy(pinned->data(), fresh.data(), fresh.size());

  Gate gate;
  KVT_ASSERT_OK(gate.Close(producer->get()));
  KVT_ASSERT_OK(cuda::ToStatus(cudaMemcpyAsync(src_.data(), pinned->data(), fresh.size(),
                                               cudaMemcpyHostToDevice, producer->get()),
                               "cudaMemcpyAsync"));
  KVT_ASSERT_OK(ready->Record(producer->get()));

  std::mt19937 rng(8);
  const std::vector<int32_t> src_pages = DistinctPages(10, kPages, rng);
  const std::vector<int32_t> dst_pages = DistinctPages(10, kPages, rng);
  PageWrite w;
  w.src_pages = src_pages;
  w.dst_pages = dst_pages;
  w.num_layers = kLayers;
  w.layer_begin = 0;
  w.layer_end = 2;
  w.ready = ready->get();
  auto id = sender_->PostPages(peer_, w);
  if (!id.ok()) gate.Open();
  ASSERT_TRUE(id.ok()) << id.status();
  KVT_ASSERT_OK(ready->Record(idle->get()));  // the producer reuses its event at once

  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const Status held = sender_->Check(*id);
  gate.Open();
  EXPECT_EQ(held.code(), StatusCode::kInProgress) << "the copy ran before `ready`: " << held;
  KVT_ASSERT_OK(WaitFor(*sender_, *id));
  EXPECT_FALSE(gate.timed_out());
  sender_->Release(*id);
  ApplyPageWrite(w, fresh, expected_, dst_.buffer_bytes(), kItem);
  ExpectDestination();
  KVT_ASSERT_OK(producer->Synchronize());
}

// Every write sends a notice by default; with notices on demand none comes until the caller arms
// one, and then exactly one, once the oldest write in flight completes (a write gated on a
// producer here, so the notice provably waits for it).
TEST_F(CudaIpcSameProcess, NoticesComePerWriteOrOnlyWhenArmed) {
  auto notices = std::make_shared<std::atomic<int>>(0);
  sender_->SetCompletionNotifier([notices] { notices->fetch_add(1); });
  const auto settle = [] { std::this_thread::sleep_for(std::chrono::milliseconds(100)); };
  const int32_t src_page = 3, dst_page = 5;
  PageWrite w = OnePage(src_page, dst_page);

  auto id = sender_->PostPages(peer_, w);
  ASSERT_TRUE(id.ok()) << id.status();
  KVT_ASSERT_OK(WaitFor(*sender_, *id));
  sender_->Release(*id);
  settle();
  EXPECT_EQ(notices->load(), 1) << "a write without on-demand notices notifies once";

  sender_->SetNoticesOnDemand(true);
  id = sender_->PostPages(peer_, w);
  ASSERT_TRUE(id.ok()) << id.status();
  KVT_ASSERT_OK(WaitFor(*sender_, *id));
  sender_->Release(*id);
  sender_->ArmCompletionNotice();  // nothing in flight: nothing to notify
  settle();
  EXPECT_EQ(notices->load(), 1) << "an unarmed or finished write sent a notice";

  HeldProducer held;
  auto gated = held.PostGated(*sender_, peer_, w);
  ASSERT_TRUE(gated.ok()) << gated.status();
  auto behind = sender_->PostPages(peer_, w);  // queued behind the gated write
  if (!behind.ok()) held.gate.Open();
  ASSERT_TRUE(behind.ok()) << behind.status();
  sender_->ArmCompletionNotice();
  sender_->ArmCompletionNotice();  // armed already behind the same write: no second notice
  settle();
  const int while_gated = notices->load();
  const Status gated_status = sender_->Check(*gated);
  held.gate.Open();
  EXPECT_EQ(while_gated, 1) << "a notice came before the armed write completed";
  EXPECT_EQ(gated_status.code(), StatusCode::kInProgress) << gated_status;
  WaitForCount(*notices, 2);
  KVT_ASSERT_OK(WaitFor(*sender_, *gated));
  KVT_ASSERT_OK(WaitFor(*sender_, *behind));
  settle();
  EXPECT_EQ(notices->load(), 2) << "one armed notice, for the oldest write in flight";
  EXPECT_FALSE(held.gate.timed_out());
  sender_->Release(*gated);
  sender_->Release(*behind);
  sender_->SetCompletionNotifier(nullptr);
  KVT_ASSERT_OK(held.stream.Synchronize());
}

// A notice armed behind a write fires when that write completes; if nobody Checks the write
// afterwards (the engine hands a failed room's writes to its worker, which may not have got to
// them), the write still reads in progress inside the backend. Arming again for a later write
// must not take that fired notice for one behind the later write: the completed write gets a
// notice at once, and the next arming waits behind the later write, whose completion notifies.
TEST_F(CudaIpcSameProcess, AnArmedNoticeThatFiredDoesNotStandForTheWritesBehindIt) {
  auto notices = std::make_shared<std::atomic<int>>(0);
  sender_->SetCompletionNotifier([notices] { notices->fetch_add(1); });
  sender_->SetNoticesOnDemand(true);
  const auto wait_for_notices = [&](int n) { return WaitForCount(*notices, n); };
  PageWrite first_write = OnePage(3, 5);
  PageWrite second_write = OnePage(4, 6);

  HeldProducer first;
  auto a = first.PostGated(*sender_, peer_, first_write);
  ASSERT_TRUE(a.ok()) << a.status();
  sender_->ArmCompletionNotice();
  first.gate.Open();
  ASSERT_EQ(wait_for_notices(1), 1) << "the notice armed behind the first write";
  // The first write is not Checked: inside the backend it still reads in progress.

  HeldProducer second;
  auto b = second.PostGated(*sender_, peer_, second_write);
  ASSERT_TRUE(b.ok()) << b.status();
  sender_->ArmCompletionNotice();
  const int after_arming = wait_for_notices(2);
  sender_->ArmCompletionNotice();  // after looking, as the engine's poller does before it sleeps
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const int while_gated = notices->load();
  const Status gated_status = sender_->Check(*b);
  second.gate.Open();
  EXPECT_EQ(after_arming, 2) << "the first write completed unseen: a notice at once";
  EXPECT_EQ(while_gated, 2) << "a notice came before the second write completed";
  EXPECT_EQ(gated_status.code(), StatusCode::kInProgress) << gated_status;
  EXPECT_EQ(wait_for_notices(3), 3)
      << "the second write completed and no notice came: a caller that sleeps until the next "
         "notice would wait for its next poll";
  KVT_EXPECT_OK(WaitFor(*sender_, *a));
  KVT_EXPECT_OK(WaitFor(*sender_, *b));
  EXPECT_FALSE(first.gate.timed_out());
  EXPECT_FALSE(second.gate.timed_out());
  sender_->Release(*a);
  sender_->Release(*b);
  sender_->SetCompletionNotifier(nullptr);
  KVT_ASSERT_OK(first.stream.Synchronize());
  KVT_ASSERT_OK(second.stream.Synchronize());
}

// Completion hints (the completion word): false while a write waits for its producer, and for
// a write queued behind it; true for both once they ran, and their bytes are in place then;
// never true for ids not yet posted. A backend with the word off reports no hints and still
// completes its writes.
TEST_F(CudaIpcSameProcess, CompletionHintsFollowTheWritesAndNeverRunAhead) {
  // A sender of its own with the word on (the fixture's follows the default).
  CudaIpcOptions on;
  on.completion_word = true;
  auto made = CreateBackend(BackendConfig(on));
  ASSERT_TRUE(made.ok()) << made.status();
  std::unique_ptr<Backend> hinted = std::move(made).value();
  ASSERT_TRUE(hinted->Register(src_.Regions()).ok());
  ASSERT_TRUE(hinted->Capabilities().completion_hints)
      << "this device runs stream memory operations: the word should be there";
  auto hinted_peer = hinted->Connect(receiver_descriptor_);
  ASSERT_TRUE(hinted_peer.ok()) << hinted_peer.status();
  const int32_t src_page = 9, dst_page = 11;
  PageWrite w = OnePage(src_page, dst_page);
  HeldProducer held;
  auto gated = held.PostGated(*hinted, *hinted_peer, w);
  ASSERT_TRUE(gated.ok()) << gated.status();
  const int32_t src_next = 12, dst_next = 13;
  PageWrite next = OnePage(src_next, dst_next);
  auto behind = hinted->PostPages(*hinted_peer, next);
  if (!behind.ok()) held.gate.Open();
  ASSERT_TRUE(behind.ok()) << behind.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const bool gated_hint = hinted->CompletedHint(*gated);
  const bool behind_hint = hinted->CompletedHint(*behind);
  const Status gated_status = hinted->Check(*gated);
  held.gate.Open();
  EXPECT_FALSE(gated_hint) << "a write waiting for its producer was hinted complete";
  EXPECT_FALSE(behind_hint) << "a write queued behind it was hinted complete";
  EXPECT_EQ(gated_status.code(), StatusCode::kInProgress) << gated_status;
  const auto give_up = Clock::now() + std::chrono::seconds(10);
  while (!hinted->CompletedHint(*behind) && Clock::now() < give_up) {
  }
  EXPECT_TRUE(hinted->CompletedHint(*behind));
  EXPECT_TRUE(hinted->CompletedHint(*gated)) << "writes complete in the stream's order";
  EXPECT_FALSE(hinted->CompletedHint(*behind + 1000)) << "an id not posted yet";
  KVT_EXPECT_OK(hinted->Check(*gated));
  KVT_EXPECT_OK(hinted->Check(*behind));
  hinted->Release(*gated);
  hinted->Release(*behind);
  ApplyPageWrite(w, src_image_, expected_, dst_.buffer_bytes(), kItem);
  ApplyPageWrite(next, src_image_, expected_, dst_.buffer_bytes(), kItem);
  ExpectDestination();
  EXPECT_FALSE(held.gate.timed_out());
  KVT_ASSERT_OK(held.stream.Synchronize());
  KVT_EXPECT_OK(hinted->Disconnect(*hinted_peer));

  CudaIpcOptions off;
  off.completion_word = false;
  auto plain = CreateBackend(BackendConfig(off));
  ASSERT_TRUE(plain.ok()) << plain.status();
  ASSERT_TRUE((*plain)->Register(src_.Regions()).ok());
  EXPECT_FALSE((*plain)->Capabilities().completion_hints);
  auto plain_peer = (*plain)->Connect(receiver_descriptor_);
  ASSERT_TRUE(plain_peer.ok()) << plain_peer.status();
  auto id = (*plain)->PostPages(*plain_peer, OnePage(src_page, dst_page));
  ASSERT_TRUE(id.ok()) << id.status();
  KVT_ASSERT_OK(WaitFor(**plain, *id));
  EXPECT_FALSE((*plain)->CompletedHint(*id)) << "no word, no hints";
  (*plain)->Release(*id);
}

TEST_F(CudaIpcSameProcess, DisconnectWaitsForWritesInFlightAndAbortsThem) {
  HeldProducer held;
  KVT_ASSERT_OK(held.Hold());
  const std::vector<int32_t> pages = {3, 4, 5, 9};
  PageWrite w;
  w.src_pages = pages;
  w.dst_pages = pages;
  w.num_layers = kLayers;
  w.layer_begin = 0;
  w.layer_end = kLayers;
  w.ready = held.ready.get();
  auto id = sender_->PostPages(peer_, w);
  if (!id.ok()) held.gate.Open();
  ASSERT_TRUE(id.ok()) << id.status();
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    held.gate.Open();
  });
  const Status disconnected = sender_->Disconnect(peer_, Backend::DisconnectMode::kGraceful);
  opener.join();
  KVT_ASSERT_OK(disconnected);
  // Disconnect returned only after the copy ran: its bytes are there.
  ApplyPageWrite(w, src_image_, expected_, dst_.buffer_bytes(), kItem);
  ExpectDestination();
  const Status after = sender_->Check(*id);
  EXPECT_EQ(after.code(), StatusCode::kAborted) << after;
  sender_->Release(*id);
  auto again = sender_->PostPages(peer_, w);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(again.status().message(), HasSubstr("disconnected"));
  EXPECT_EQ(sender_->Disconnect(peer_).code(), StatusCode::kNotFound);
  KVT_ASSERT_OK(held.stream.Synchronize());
}

TEST_F(CudaIpcSameProcess, ReleaseOfAWriteInFlightWaitsForIt) {
  HeldProducer held;
  KVT_ASSERT_OK(held.Hold());
  const std::vector<int32_t> src_pages = {10, 11, 12};
  const std::vector<int32_t> dst_pages = {50, 2, 33};
  PageWrite w;
  w.src_pages = src_pages;
  w.dst_pages = dst_pages;
  w.num_layers = kLayers;
  w.layer_begin = 1;
  w.layer_end = 2;
  w.ready = held.ready.get();
  auto id = sender_->PostPages(peer_, w);
  if (!id.ok()) held.gate.Open();
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(sender_->Check(*id).code(), StatusCode::kInProgress);
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    held.gate.Open();
  });
  sender_->Release(*id);  // blocks until the copy ran; no byte of it lands later
  opener.join();
  ApplyPageWrite(w, src_image_, expected_, dst_.buffer_bytes(), kItem);
  ExpectDestination();
  EXPECT_EQ(sender_->Check(*id).code(), StatusCode::kNotFound);
  KVT_ASSERT_OK(held.stream.Synchronize());
}

TEST_F(CudaIpcSameProcess, ManyWritesFromTwoThreadsReuseScratch) {
  auto worker = [&](int32_t layer) {
    for (int32_t p = 1; p < kPages; ++p) {
      const int32_t src_page = p;
      const int32_t dst_page = kPages - p;
      const PageWrite w = OnePage(src_page, dst_page, layer, layer + 1);
      auto id = sender_->PostPages(peer_, w);
      ASSERT_TRUE(id.ok()) << id.status();
      KVT_ASSERT_OK(WaitFor(*sender_, *id));
      sender_->Release(*id);
    }
  };
  std::thread t1(worker, 0), t2(worker, 3);
  t1.join();
  t2.join();
  for (int32_t layer : {0, 3}) {
    for (int32_t p = 1; p < kPages; ++p) {
      const int32_t src_page = p, dst_page = kPages - p;
      const PageWrite w = OnePage(src_page, dst_page, layer, layer + 1);
      ApplyPageWrite(w, src_image_, expected_, dst_.buffer_bytes(), kItem);
    }
  }
  ExpectDestination();
}

TEST_F(CudaIpcSameProcess, RefusesBadWritesAndUnknownIds) {
  const std::vector<int32_t> pages = {1, kPages};  // page kPages is past the end
  PageWrite w;
  w.src_pages = pages;
  w.dst_pages = pages;
  w.num_layers = kLayers;
  w.layer_begin = 0;
  w.layer_end = 1;
  auto past = sender_->PostPages(peer_, w);
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.status().code(), StatusCode::kOutOfRange);
  const CopyRun run{0, 0, dst_.buffer_bytes(), 1};
  auto run_past = sender_->PostWrite(peer_, {&run, 1});
  ASSERT_FALSE(run_past.ok());
  EXPECT_EQ(run_past.status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(sender_->PostPages(peer_ + 100, w).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(sender_->Check(12345).code(), StatusCode::kNotFound);
  sender_->Release(12345);  // unknown: nothing happens
  EXPECT_EQ(sender_->Disconnect(peer_ + 100).code(), StatusCode::kNotFound);
  EXPECT_EQ(sender_->AllocateHost(4096).status().code(), StatusCode::kUnimplemented);
  // An empty write completes at once.
  PageWrite empty;
  empty.num_layers = kLayers;
  auto nothing = sender_->PostPages(peer_, empty);
  ASSERT_TRUE(nothing.ok()) << nothing.status();
  EXPECT_TRUE(sender_->Check(*nothing).ok());
  sender_->Release(*nothing);
  ExpectDestination();  // nothing moved
}

TEST_F(CudaIpcSameProcess, ConnectValidatesTheDescriptor) {
  PeerDescriptor d = receiver_descriptor_;
  d.backend = "ucx";
  EXPECT_EQ(sender_->Connect(d).status().code(), StatusCode::kInvalidArgument);

  // Another buffer list connects (copy runs name the peer's buffer); page writes refuse it.
  d = receiver_descriptor_;
  d.regions.pop_back();
  auto fewer = sender_->Connect(d);
  ASSERT_TRUE(fewer.ok()) << fewer.status();
  const int32_t page = 1;
  PageWrite write;
  write.src_pages = {&page, 1};
  write.dst_pages = {&page, 1};
  write.num_layers = kLayers;
  write.layer_end = kLayers;
  auto pages = sender_->PostPages(*fewer, write);
  ASSERT_FALSE(pages.ok());
  EXPECT_EQ(pages.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(pages.status().message(), HasSubstr("published 7 buffers"));
  EXPECT_TRUE(sender_->Disconnect(*fewer).ok());

  d = receiver_descriptor_;
  d.regions[3].key.resize(10);
  auto short_key = sender_->Connect(d);
  ASSERT_FALSE(short_key.ok());
  EXPECT_EQ(short_key.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(short_key.status().message(), HasSubstr("buffer 3"));

  d = receiver_descriptor_;
  d.address = "garbage";
  EXPECT_EQ(sender_->Connect(d).status().code(), StatusCode::kInvalidArgument);

  auto address = cuda_ipc::DecodeAddress(receiver_descriptor_.address);
  ASSERT_TRUE(address.ok()) << address.status();
  address->boot_id = "00000000-1111-2222-3333-444444444444";
  d = receiver_descriptor_;
  d.address = cuda_ipc::EncodeAddress(*address);
  auto other_host = sender_->Connect(d);
  ASSERT_FALSE(other_host.ok());
  EXPECT_EQ(other_host.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(other_host.status().message(), HasSubstr("same host only"));
  EXPECT_THAT(other_host.status().message(), HasSubstr("ucx"));

  auto fresh = NewBackend();
  ASSERT_TRUE(fresh);
  auto unregistered = fresh->Connect(receiver_descriptor_);
  ASSERT_FALSE(unregistered.ok());
  EXPECT_EQ(unregistered.status().code(), StatusCode::kFailedPrecondition);
}

TEST(CudaIpcRegister, RefusesWhatItCannotShare) {
  KVT_SKIP_WITHOUT_GPU();
  auto backend = NewBackend();
  ASSERT_TRUE(backend);
  const BackendCapabilities caps = backend->Capabilities();
  EXPECT_TRUE(caps.cuda_memory && caps.inter_process && caps.page_writes);
  EXPECT_FALSE(caps.host_memory || caps.inter_node);

  EXPECT_EQ(backend->Register({}).status().code(), StatusCode::kInvalidArgument);

  std::vector<uint8_t> host(1 << 16);
  const uint64_t host_base = reinterpret_cast<uint64_t>(host.data());
  const LocalRegion host_region{host_base, host.size(), 4096, MemoryKind::kHost, -1};
  auto as_host = backend->Register({&host_region, 1});
  ASSERT_FALSE(as_host.ok());
  EXPECT_EQ(as_host.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(as_host.status().message(), HasSubstr("ucx or loopback"));

  const LocalRegion lying{host_base, host.size(), 4096, MemoryKind::kCuda, 0};
  auto not_device = backend->Register({&lying, 1});
  ASSERT_FALSE(not_device.ok());
  EXPECT_EQ(not_device.status().code(), StatusCode::kInvalidArgument) << not_device.status();

  GpuPool pool;
  KVT_ASSERT_OK(pool.Init(1, 8, 4096));
  std::vector<LocalRegion> regions = pool.Regions();
  regions[1].length += uint64_t{64} << 20;  // far past the end of the allocation
  auto past = backend->Register(regions);
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(past.status().message(), HasSubstr("runs past the end of its CUDA allocation"));

  regions = pool.Regions();
  regions[1].device = 7;
  auto mixed = backend->Register(regions);
  ASSERT_FALSE(mixed.ok());
  EXPECT_THAT(mixed.status().message(), HasSubstr("several devices"));

  regions = pool.Regions();
  auto good = backend->Register(regions);
  ASSERT_TRUE(good.ok()) << good.status();
  // Both buffers share one allocation: one handle, different offsets.
  auto k0 = cuda_ipc::DecodeRegionKey(good->regions[0].key, good->regions[0].length);
  auto k1 = cuda_ipc::DecodeRegionKey(good->regions[1].key, good->regions[1].length);
  ASSERT_TRUE(k0.ok() && k1.ok());
  EXPECT_EQ(k0->handle, k1->handle);
  EXPECT_EQ(k0->offset, GpuPool::kGap);
  EXPECT_EQ(k1->offset, GpuPool::kGap + 8 * 4096);
  EXPECT_GE(k0->allocation_bytes, GpuPool::kGap + pool.bytes());
  auto address = cuda_ipc::DecodeAddress(good->address);
  ASSERT_TRUE(address.ok()) << address.status();
  EXPECT_EQ(address->pid, static_cast<uint64_t>(getpid()));
  EXPECT_EQ(address->boot_id, cuda_ipc::ThisBootId());
  EXPECT_FALSE(address->pci_bus_id.empty());
}

TEST(CudaIpcCrossDevice, WritesIntoAPoolOnAnotherGpu) {
  KVT_SKIP_WITHOUT_GPUS(2, "the pools sit on two devices");
  GpuPool src, dst;
  KVT_ASSERT_OK(src.Init(2, 16, 4096, 0));
  KVT_ASSERT_OK(dst.Init(2, 16, 4096, 1));
  const std::vector<uint8_t> image = RandomBytes(src.bytes(), 3);
  KVT_ASSERT_OK(src.Upload(image));
  KVT_ASSERT_OK(dst.Fill(kPoison));
  auto a = NewBackend(), b = NewBackend();
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(a->Register(src.Regions()).ok());
  auto rd = b->Register(dst.Regions());
  ASSERT_TRUE(rd.ok()) << rd.status();
  int can = 0;
  ASSERT_EQ(cudaDeviceCanAccessPeer(&can, 0, 1), cudaSuccess);
  auto peer = a->Connect(*rd);
  if (can == 0) {
    ASSERT_FALSE(peer.ok());
    EXPECT_EQ(peer.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(peer.status().message(), HasSubstr("cudaDeviceCanAccessPeer"));
    return;
  }
  ASSERT_TRUE(peer.ok()) << peer.status();
  const std::vector<int32_t> src_pages = {1, 5, 9}, dst_pages = {15, 2, 7};
  PageWrite w;
  w.src_pages = src_pages;
  w.dst_pages = dst_pages;
  w.num_layers = 2;
  w.layer_begin = 0;
  w.layer_end = 2;
  auto id = a->PostPages(*peer, w);
  ASSERT_TRUE(id.ok()) << id.status();
  KVT_ASSERT_OK(WaitFor(*a, *id));
  a->Release(*id);
  std::vector<uint8_t> expected(dst.bytes(), kPoison);
  ApplyPageWrite(w, image, expected, dst.buffer_bytes(), 4096);
  auto actual = dst.Download();
  ASSERT_TRUE(actual.ok()) << actual.status();
  EXPECT_EQ(DescribeMismatch(expected, *actual, dst.buffer_bytes(), dst.item()), "");
}

// ---- Two processes ------------------------------------------------------------------------

constexpr char kChildEnv[] = "KVT_CUDA_IPC_TEST_CHILD_FDS";

using testing::Channel;

// The child process: owns the destination pool, publishes it, and checks it on request.
class Child : public testing::ChildProcess {
 public:
  Status Start() { return ChildProcess::Start(kChildEnv, "CudaIpcChild.DISABLED_Owner"); }

  StatusOr<PeerDescriptor> Descriptor() {
    auto message = channel().Receive(std::chrono::seconds(60));
    if (!message.ok()) return message.status().WithContext("waiting for the child's descriptor");
    auto decoded = testing::DecodeDescriptor(*message);
    if (!decoded.ok()) return decoded.status();
    return std::move(decoded->descriptor);
  }

  StatusOr<int> Stop() { return ChildProcess::Stop(std::chrono::seconds(30)); }
};

// The hidden child: runs only when started by Child::Start.
TEST(CudaIpcChild, DISABLED_Owner) {
  const char* fds = std::getenv(kChildEnv);
  if (fds == nullptr) GTEST_SKIP() << "runs only as the child of the two-process tests";
  int in = -1, out = -1;
  ASSERT_EQ(std::sscanf(fds, "%d,%d", &in, &out), 2);
  Channel channel(in, out);
  ASSERT_TRUE(cuda::HasDevice()) << cuda::DeviceCount().reason;
  GpuPool pool;
  KVT_ASSERT_OK(pool.Init(kLayers, kPages, kItem));
  KVT_ASSERT_OK(pool.Fill(kPoison));
  auto backend = NewBackend();
  ASSERT_TRUE(backend);
  auto descriptor = backend->Register(pool.Regions());
  ASSERT_TRUE(descriptor.ok()) << descriptor.status();
  KVT_ASSERT_OK(channel.Send(testing::EncodeDescriptor(*descriptor)));
  while (true) {
    auto command = channel.Receive(std::chrono::seconds(120));
    if (!command.ok()) break;  // the parent is gone
    if (*command == "verify") {
      auto expected = channel.Receive(std::chrono::seconds(60));
      ASSERT_TRUE(expected.ok()) << expected.status();
      auto actual = pool.Download();
      ASSERT_TRUE(actual.ok()) << actual.status();
      const std::vector<uint8_t> want(expected->begin(), expected->end());
      KVT_ASSERT_OK(
          channel.Send(DescribeMismatch(want, *actual, pool.buffer_bytes(), pool.item())));
    } else if (*command == "exit") {
      KVT_ASSERT_OK(channel.Send("bye"));
      break;
    }
  }
}

class CudaIpcTwoProcesses : public ::testing::Test {
 protected:
  void SetUp() override {
    KVT_SKIP_WITHOUT_GPU();
    signal(SIGPIPE, SIG_IGN);  // a dead child must fail a write, not kill the test
    KVT_ASSERT_OK(src_.Init(kLayers, kPages, kItem));
    src_image_ = RandomBytes(src_.bytes(), 42);
    KVT_ASSERT_OK(src_.Upload(src_image_));
    expected_.assign(src_.bytes(), kPoison);  // the child's pool starts poisoned
    sender_ = NewBackend();
    ASSERT_TRUE(sender_);
    auto sd = sender_->Register(src_.Regions());
    ASSERT_TRUE(sd.ok()) << sd.status();
    mappings_before_ = CudaIpcOpenMappingsForTest();
    KVT_ASSERT_OK(child_.Start());
    auto d = child_.Descriptor();
    ASSERT_TRUE(d.ok()) << d.status();
    child_descriptor_ = *d;
    auto address = cuda_ipc::DecodeAddress(child_descriptor_.address);
    ASSERT_TRUE(address.ok()) << address.status();
    ASSERT_NE(address->pid, static_cast<uint64_t>(getpid()));
  }

  void ExpectChildHasExpected() {
    auto verdict = child_.Verify(expected_);
    ASSERT_TRUE(verdict.ok()) << verdict.status();
    EXPECT_EQ(*verdict, "") << "the child's pool differs";
  }

  GpuPool src_;
  std::vector<uint8_t> src_image_, expected_;
  std::unique_ptr<Backend> sender_;
  size_t mappings_before_ = 0;
  Child child_;
  PeerDescriptor child_descriptor_;
};

TEST_F(CudaIpcTwoProcesses, PagesUnitsAndRunsLandByteExactInTheOtherProcess) {
  auto peer = sender_->Connect(child_descriptor_);
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_EQ(CudaIpcOpenMappingsForTest(), mappings_before_ + 1);  // one pool, one allocation

  std::mt19937 rng(9);
  const std::vector<int32_t> src_pages = DistinctPages(17, kPages, rng);
  const std::vector<int32_t> dst_pages = DistinctPages(17, kPages, rng);
  PageWrite whole;
  whole.src_pages = src_pages;
  whole.dst_pages = dst_pages;
  whole.num_layers = kLayers;
  whole.layer_begin = 0;
  whole.layer_end = 2;
  auto a = sender_->PostPages(*peer, whole);
  ASSERT_TRUE(a.ok()) << a.status();

  const std::vector<int32_t> unit_src = DistinctPages(9, kPages, rng);
  const std::vector<int32_t> unit_dst = DistinctPages(9, kPages, rng);
  const std::vector<PageUnit> units = {{0, 1024, 1024}, {1030, 5, 17}};
  PageWrite parts;
  parts.src_pages = unit_src;
  parts.dst_pages = unit_dst;
  parts.num_layers = kLayers;
  parts.layer_begin = 2;
  parts.layer_end = kLayers;
  parts.units = units;
  auto b = sender_->PostPages(*peer, parts);
  ASSERT_TRUE(b.ok()) << b.status();

  std::vector<CopyRun> runs;
  for (uint32_t buf = 0; buf < 2 * kLayers; ++buf) {
    runs.push_back({buf, 60 * kItem, 61 * kItem, kItem + 100});  // beyond the pages above
  }
  auto c = sender_->PostWrite(*peer, runs);
  ASSERT_TRUE(c.ok()) << c.status();

  for (WriteId id : {*a, *b, *c}) {
    KVT_ASSERT_OK(WaitFor(*sender_, id));
    sender_->Release(id);
  }
  ApplyPageWrite(whole, src_image_, expected_, src_.buffer_bytes(), kItem);
  ApplyPageWrite(parts, src_image_, expected_, src_.buffer_bytes(), kItem);
  ApplyRuns(runs, src_image_, expected_, src_.buffer_bytes());
  ExpectChildHasExpected();

  KVT_ASSERT_OK(sender_->Disconnect(*peer));
  EXPECT_EQ(CudaIpcOpenMappingsForTest(), mappings_before_);
  auto exit_code = child_.Stop();
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
}

TEST_F(CudaIpcTwoProcesses, OneMappingPerAllocationWhateverTheConnections) {
  auto first = sender_->Connect(child_descriptor_);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = sender_->Connect(child_descriptor_);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(CudaIpcOpenMappingsForTest(), mappings_before_ + 1);

  // Another backend of this process connecting to the same pool shares the mapping too.
  GpuPool other_src;
  KVT_ASSERT_OK(other_src.Init(kLayers, kPages, kItem));
  KVT_ASSERT_OK(other_src.Upload(src_image_));
  auto other = NewBackend();
  ASSERT_TRUE(other);
  ASSERT_TRUE(other->Register(other_src.Regions()).ok());
  auto third = other->Connect(child_descriptor_);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(CudaIpcOpenMappingsForTest(), mappings_before_ + 1);

  KVT_ASSERT_OK(sender_->Disconnect(*first));
  EXPECT_EQ(CudaIpcOpenMappingsForTest(), mappings_before_ + 1);

  // The mapping still serves the other connections.
  const std::vector<int32_t> src_pages = {4, 8}, dst_pages = {20, 21};
  PageWrite w;
  w.src_pages = src_pages;
  w.dst_pages = dst_pages;
  w.num_layers = kLayers;
  w.layer_begin = 0;
  w.layer_end = kLayers;
  auto id = sender_->PostPages(*second, w);
  ASSERT_TRUE(id.ok()) << id.status();
  KVT_ASSERT_OK(WaitFor(*sender_, *id));
  sender_->Release(*id);
  ApplyPageWrite(w, src_image_, expected_, src_.buffer_bytes(), kItem);
  ExpectChildHasExpected();

  KVT_ASSERT_OK(sender_->Disconnect(*second));
  EXPECT_EQ(CudaIpcOpenMappingsForTest(), mappings_before_ + 1);  // `other` still holds it
  other.reset();  // a destructor disconnects its live peers
  EXPECT_EQ(CudaIpcOpenMappingsForTest(), mappings_before_);
  auto exit_code = child_.Stop();
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
}

// A write to the peer waits for its producer while one thread releases it (the release waits
// for the GPU without the backend's lock, and the write is no longer listed) and another
// disconnects the peer. The disconnect must not close the peer's mappings while the write may
// still go through them: it waits for that write too, and the bytes land.
TEST_F(CudaIpcTwoProcesses, ADisconnectWaitsForAWriteAnotherThreadIsReleasing) {
  auto peer = sender_->Connect(child_descriptor_);
  ASSERT_TRUE(peer.ok()) << peer.status();
  const std::vector<int32_t> src_pages = {2, 6}, dst_pages = {30, 31};
  const PageWrite w = Pages(src_pages, dst_pages);
  HeldProducer held;
  auto id = held.PostGated(*sender_, *peer, w);
  ASSERT_TRUE(id.ok()) << id.status();
  std::thread releasing([&] { sender_->Release(*id); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the release is waiting
  std::atomic<bool> disconnected{false};
  Status disconnect_status;
  std::thread disconnecting([&] {
    disconnect_status = sender_->Disconnect(*peer);
    disconnected = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const bool disconnected_while_held = disconnected.load();
  const size_t mappings_while_held = CudaIpcOpenMappingsForTest();
  held.gate.Open();
  releasing.join();
  disconnecting.join();
  EXPECT_FALSE(disconnected_while_held)
      << "Disconnect returned while a write to the peer was still waiting for its producer";
  EXPECT_EQ(mappings_while_held, mappings_before_ + 1)
      << "the peer's mapping closed while a write through it was still to run";
  KVT_EXPECT_OK(disconnect_status);
  EXPECT_EQ(CudaIpcOpenMappingsForTest(), mappings_before_);
  EXPECT_FALSE(held.gate.timed_out());
  KVT_ASSERT_OK(held.stream.Synchronize());
  ApplyPageWrite(w, src_image_, expected_, src_.buffer_bytes(), kItem);
  ExpectChildHasExpected();
  auto exit_code = child_.Stop();
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
}

TEST_F(CudaIpcTwoProcesses, AKilledPeerIsDisconnectedCleanly) {
  auto peer = sender_->Connect(child_descriptor_);
  ASSERT_TRUE(peer.ok()) << peer.status();
  const std::vector<int32_t> pages = {1, 2, 3};
  PageWrite w;
  w.src_pages = pages;
  w.dst_pages = pages;
  w.num_layers = kLayers;
  w.layer_begin = 0;
  w.layer_end = 1;
  auto done = sender_->PostPages(*peer, w);
  ASSERT_TRUE(done.ok()) << done.status();
  KVT_ASSERT_OK(WaitFor(*sender_, *done));

  child_.Kill();
  const auto start = Clock::now();
  KVT_ASSERT_OK(sender_->Disconnect(*peer, Backend::DisconnectMode::kPeerDead));
  const auto took = Clock::now() - start;
  // A hang guard, not a performance check: nothing was in flight, so nothing to wait for.
  EXPECT_LT(took, std::chrono::seconds(10));
  EXPECT_EQ(CudaIpcOpenMappingsForTest(), mappings_before_);
  EXPECT_TRUE(sender_->Check(*done).ok());  // it had completed before the peer died
  sender_->Release(*done);

  auto after = sender_->PostPages(*peer, w);
  ASSERT_FALSE(after.ok());
  EXPECT_EQ(after.status().code(), StatusCode::kNotFound);
  const CopyRun run{0, 0, 0, 16};
  EXPECT_EQ(sender_->PostWrite(*peer, {&run, 1}).status().code(), StatusCode::kNotFound);

  // Connecting again to the dead peer's descriptor returns (never hangs): refused as
  // Unavailable when the driver freed the allocation with its exporter, or, where the driver
  // still lets it be opened, connected and then cleanly disconnected again.
  auto again = sender_->Connect(child_descriptor_);
  if (again.ok()) {
    KVT_ASSERT_OK(sender_->Disconnect(*again, Backend::DisconnectMode::kPeerDead));
  } else {
    EXPECT_EQ(again.status().code(), StatusCode::kUnavailable) << again.status();
    EXPECT_THAT(again.status().message(), HasSubstr("cudaIpcOpenMemHandle"));
  }
  EXPECT_EQ(CudaIpcOpenMappingsForTest(), mappings_before_);
}

}  // namespace
}  // namespace kvt::transfer

// The ucx backend's staged path on CUDA pools: two ucx backends in one process, each with a
// device "pool" (one cudaMalloc sliced into 2L regions, as the pool registers it), moving page
// writes through pinned bounce buffers with the gather/scatter kernels. Skips without a device.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <chrono>
#include <cstring>
#include <iostream>
#include <memory>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "backend_test_util.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/testing/gpu.h"
#include "kvt/testing/status.h"
#include "kvt/transfer/backend.h"
#include "kvt/transfer/backends.h"

namespace kvt::transfer {
namespace {

using Clock = std::chrono::steady_clock;
using testing::DistinctPages;
using testing::WaitFor;

// A device pool: 2L buffers (K of layers 0..L-1, then V) of `pages` pages of `item` bytes, all in
// one allocation, with a host image for expectations.
class DevicePool {
 public:
  Status Init(int32_t layers, int64_t pages, uint64_t item) {
    layers_ = layers;
    pages_ = pages;
    item_ = item;
    auto buffer = cuda::DeviceBuffer::Allocate(BufferBytes() * 2 * layers, 0);
    if (!buffer.ok()) return buffer.status();
    memory_ = std::move(buffer).value();
    image.assign(memory_.size(), 0);
    return OkStatus();
  }
  uint64_t BufferBytes() const { return static_cast<uint64_t>(pages_) * item_; }
  std::vector<LocalRegion> Regions() const {
    std::vector<LocalRegion> regions;
    for (int32_t b = 0; b < 2 * layers_; ++b) {
      regions.push_back(LocalRegion{reinterpret_cast<uint64_t>(memory_.data()) + b * BufferBytes(),
                                    BufferBytes(), item_, MemoryKind::kCuda, 0, b % layers_});
    }
    return regions;
  }
  void Fill(uint32_t seed) {
    std::mt19937 rng(seed);
    testing::FillRandom(image, rng);
  }
  void Poison() { std::fill(image.begin(), image.end(), 0xEE); }
  Status Upload() { return cuda::Copy(memory_.data(), image.data(), image.size()); }
  StatusOr<std::vector<uint8_t>> Download() const {
    std::vector<uint8_t> out(memory_.size());
    Status s = cuda::Copy(out.data(), memory_.data(), out.size());
    if (!s.ok()) return s;
    return out;
  }
  uint8_t* Page(std::vector<uint8_t>& bytes, int32_t buffer, int32_t page) const {
    return bytes.data() + buffer * BufferBytes() + page * item_;
  }
  void* device() const { return memory_.data(); }
  size_t size() const { return memory_.size(); }

  // Applies a page write from `src` to this pool's image.
  void Apply(const DevicePool& src, const std::vector<uint8_t>& src_bytes,
             const std::vector<int32_t>& src_pages, const std::vector<int32_t>& dst_pages,
             int32_t begin, int32_t end, const std::vector<PageUnit>& units) {
    PageWrite w;
    w.src_pages = src_pages;
    w.dst_pages = dst_pages;
    w.num_layers = layers_;
    w.layer_begin = begin;
    w.layer_end = end;
    w.units = units;
    testing::ApplyPageWrite(
        w, item_,
        [&](int32_t b, int32_t page) {
          return src_bytes.data() + b * src.BufferBytes() + page * src.item_;
        },
        [&](int32_t b, int32_t page) { return Page(image, b, page); });
  }

  std::vector<uint8_t> image;

 private:
  int32_t layers_ = 0;
  int64_t pages_ = 0;
  uint64_t item_ = 0;
  cuda::DeviceBuffer memory_;
};

// Sleeps on a stream (a host function), standing in for a producer's kernel that runs long.
void HostSleep(void* ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(reinterpret_cast<intptr_t>(ms)));
}
Status EnqueueSleep(cudaStream_t stream, int ms) {
  return cuda::ToStatus(
      cudaLaunchHostFunc(stream, &HostSleep, reinterpret_cast<void*>(static_cast<intptr_t>(ms))),
      "cudaLaunchHostFunc");
}

// A producer whose stream is busy for `ms` (a host sleep) and the event recorded after it: the
// `ready` a forward pass would hand the backend.
struct BusyProducer {
  cuda::Stream stream;
  cuda::Event ready;
};
StatusOr<BusyProducer> StartBusyProducer(int ms) {
  BusyProducer p;
  KVT_ASSIGN_OR_RETURN(p.stream, cuda::Stream::Create(0));
  KVT_ASSIGN_OR_RETURN(p.ready, cuda::Event::Create(false));
  KVT_RETURN_IF_ERROR(EnqueueSleep(p.stream.get(), ms));
  KVT_RETURN_IF_ERROR(p.ready.Record(p.stream.get()));
  return p;
}

constexpr int32_t kLayers = 4;
constexpr int64_t kPages = 96;
constexpr uint64_t kItem = 8192;  // 4 tokens x 2 KiB

// Parameter: UCX transports ("" = UCX's choice).
class UcxStagedGpu : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    KVT_SKIP_WITHOUT_GPU();
    ASSERT_TRUE(src_.Init(kLayers, kPages, kItem).ok());
    ASSERT_TRUE(dst_.Init(kLayers, kPages, kItem).ok());
    src_.Fill(1);
    ASSERT_TRUE(src_.Upload().ok());
    dst_.Poison();
    ASSERT_TRUE(dst_.Upload().ok());
  }

  // Small slots (64 KiB: 8 pages of one layer's K and V, or 2 pages of all 4 layers) so writes
  // are many chunks; the receiver has fewer slots than the sender.
  void Start(int sender_slots = 4, int receiver_slots = 3, size_t slot_bytes = 64 << 10) {
    UcxOptions options;
    options.transports = GetParam();
    options.cuda_mode = UcxCudaMode::kStaged;
    options.staging_slot_bytes = slot_bytes;
    options.staging_slots = sender_slots;
    auto a = CreateBackend(options);
    ASSERT_TRUE(a.ok()) << a.status();
    options.staging_slots = receiver_slots;
    auto b = CreateBackend(options);
    ASSERT_TRUE(b.ok()) << b.status();
    sender_ = std::move(a).value();
    receiver_ = std::move(b).value();
    auto src_regions = src_.Regions();
    auto dst_regions = dst_.Regions();
    auto sd = sender_->Register(src_regions);
    ASSERT_TRUE(sd.ok()) << sd.status();
    auto rd = receiver_->Register(dst_regions);
    ASSERT_TRUE(rd.ok()) << rd.status();
    EXPECT_TRUE(sender_->Capabilities().page_writes);
    auto peer = sender_->Connect(*rd);
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
  }

  void TearDown() override {
    sender_.reset();
    receiver_.reset();
  }

  StatusOr<WriteId> Post(const std::vector<int32_t>& src, const std::vector<int32_t>& dst,
                         int32_t begin, int32_t end, const std::vector<PageUnit>& units = {},
                         cudaEvent_t ready = nullptr) {
    PageWrite w;
    w.src_pages = src;
    w.dst_pages = dst;
    w.num_layers = kLayers;
    w.layer_begin = begin;
    w.layer_end = end;
    w.units = units;
    w.ready = ready;
    return sender_->PostPages(peer_, w);
  }

  void ExpectDestination(const std::vector<uint8_t>& expected) {
    auto got = dst_.Download();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(testing::DescribeMismatch(expected, *got, dst_.BufferBytes(), kItem), "");
  }

  DevicePool src_;
  DevicePool dst_;
  std::unique_ptr<Backend> sender_;
  std::unique_ptr<Backend> receiver_;
  PeerId peer_ = 0;
};

TEST_P(UcxStagedGpu, CapabilitiesAndCopyRunsOnAStagedPool) {
  Start();
  EXPECT_FALSE(sender_->Capabilities().cuda_memory) << "this UCX writes CUDA memory directly";
  CopyRun run{0, kItem, kItem, kItem};
  auto w = sender_->PostWrite(peer_, {&run, 1});
  EXPECT_EQ(w.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(w.status().message().find("page writes"), std::string::npos) << w.status();
}

// Random page lists over several layer batches, in flight together; the last write is larger
// than every slot of both sides together, so credits and slots are reused many times.
TEST_P(UcxStagedGpu, PageWritesAcrossLayerBatchesAreByteExact) {
  Start();
  std::mt19937 rng(7);
  std::vector<WriteId> writes;
  const std::vector<std::pair<int32_t, int32_t>> batches = {{0, 1}, {1, 2}, {2, 4}, {0, kLayers}};
  for (auto [begin, end] : batches) {
    const int64_t n = end - begin == kLayers ? kPages - 1 : 20 + rng() % 40;
    const std::vector<int32_t> src = DistinctPages(n, kPages, rng);
    const std::vector<int32_t> dst = DistinctPages(n, kPages, rng);
    auto w = Post(src, dst, begin, end);
    ASSERT_TRUE(w.ok()) << w.status();
    writes.push_back(*w);
    dst_.Apply(src_, src_.image, src, dst, begin, end, {});
  }
  for (WriteId w : writes) {
    Status st = WaitFor(*sender_, w, std::chrono::seconds(30));
    ASSERT_TRUE(st.ok()) << st;
    sender_->Release(w);
  }
  ExpectDestination(dst_.image);
}

TEST_P(UcxStagedGpu, UnitsMovePartsOfPages) {
  Start();
  std::mt19937 rng(9);
  // A head range of each token and an odd-sized, odd-offset piece (narrow kernel accesses).
  const std::vector<PageUnit> units = {{0, 4096, 1024}, {2048, 2048, 1024}, {5001, 77, 333}};
  const std::vector<int32_t> src = DistinctPages(50, kPages, rng);
  const std::vector<int32_t> dst = DistinctPages(50, kPages, rng);
  auto w = Post(src, dst, 1, kLayers, units);
  ASSERT_TRUE(w.ok()) << w.status();
  Status st = WaitFor(*sender_, *w, std::chrono::seconds(30));
  ASSERT_TRUE(st.ok()) << st;
  dst_.Apply(src_, src_.image, src, dst, 1, kLayers, units);
  ExpectDestination(dst_.image);
}

// The copy waits for `ready` on the GPU: the producer rewrites the source after a long sleep on
// its stream; PostPages returns at once, the event is re-recorded on an idle stream right after
// the post (allowed), and the destination must hold the rewritten bytes.
TEST_P(UcxStagedGpu, ReadyEventGatesTheCopy) {
  Start();
  auto producer = cuda::Stream::Create(0);
  auto idle = cuda::Stream::Create(0);
  auto ready = cuda::Event::Create(false);
  auto fresh = cuda::PinnedBuffer::Allocate(src_.size());
  ASSERT_TRUE(producer.ok() && idle.ok() && ready.ok() && fresh.ok());
  std::mt19937 rng(11);
  std::vector<uint8_t> fresh_image(src_.size());
  for (auto& b : fresh_image) b = static_cast<uint8_t>(rng());
  std::memcpy(fresh->data(), fresh_image.data(), fresh_image.size());

  ASSERT_TRUE(EnqueueSleep(producer->get(), 300).ok());
  ASSERT_EQ(cudaMemcpyAsync(src_.device(), fresh->data(), src_.size(), cudaMemcpyHostToDevice,
                            producer->get()),
            cudaSuccess);
  ASSERT_TRUE(ready->Record(producer->get()).ok());

  const std::vector<int32_t> src = DistinctPages(40, kPages, rng);
  const std::vector<int32_t> dst = DistinctPages(40, kPages, rng);
  const auto start = Clock::now();
  auto w = Post(src, dst, 0, kLayers, {}, ready->get());
  const auto post_time = Clock::now() - start;
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_LT(post_time, std::chrono::milliseconds(150)) << "PostPages waited on the CPU";
  ASSERT_TRUE(ready->Record(idle->get()).ok());
  Status st = WaitFor(*sender_, *w, std::chrono::seconds(30));
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_GE(Clock::now() - start, std::chrono::milliseconds(250));
  dst_.Apply(src_, fresh_image, src, dst, 0, kLayers, {});
  ExpectDestination(dst_.image);
  ASSERT_TRUE(producer->Synchronize().ok());
}

// While a write's gathers wait for `ready` (a producer busy for 400 ms), no thread of this
// process spins: the copier's completion callback wakes the progress thread, which sleeps
// meanwhile. Before the completion eventfd, the progress thread polled the gathers' events and
// burned a core for the whole wait.
TEST_P(UcxStagedGpu, GatedCopyWaitsWithoutSpinning) {
  Start();
  auto producer = StartBusyProducer(400);
  ASSERT_TRUE(producer.ok()) << producer.status();
  std::mt19937 rng(17);
  const std::vector<int32_t> src = DistinctPages(40, kPages, rng);
  const std::vector<int32_t> dst = DistinctPages(40, kPages, rng);
  auto cpu_seconds = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
           static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
  };
  const auto start = Clock::now();
  const double cpu_start = cpu_seconds();
  auto w = Post(src, dst, 0, kLayers, {}, producer->ready.get());
  ASSERT_TRUE(w.ok()) << w.status();
  Status st = WaitFor(*sender_, *w, std::chrono::seconds(30), std::chrono::milliseconds(5));
  ASSERT_TRUE(st.ok()) << st;
  const double wall = std::chrono::duration<double>(Clock::now() - start).count();
  const double cpu = cpu_seconds() - cpu_start;
  EXPECT_GE(wall, 0.35);
  // A spinning progress thread alone would use about `wall`; a sleeping one a few percent.
  EXPECT_LT(cpu, 0.4 * wall) << "CPU " << cpu << " s over " << wall << " s of waiting";
  dst_.Apply(src_, src_.image, src, dst, 0, kLayers, {});
  ExpectDestination(dst_.image);
  ASSERT_TRUE(producer->stream.Synchronize().ok());
}

// Release of a write whose chunks are still gated: it returns once they are accounted for, and no
// byte of it lands, then or later.
TEST_P(UcxStagedGpu, ReleaseInFlightLandsNothing) {
  Start();
  auto producer = StartBusyProducer(400);
  ASSERT_TRUE(producer.ok()) << producer.status();
  std::mt19937 rng(13);
  const std::vector<int32_t> src = DistinctPages(kPages - 1, kPages, rng);
  const std::vector<int32_t> dst = DistinctPages(kPages - 1, kPages, rng);
  auto w = Post(src, dst, 0, kLayers, {}, producer->ready.get());
  ASSERT_TRUE(w.ok()) << w.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(sender_->Check(*w).code(), StatusCode::kInProgress);
  const auto start = Clock::now();
  sender_->Release(*w);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(11));
  EXPECT_EQ(sender_->Check(*w).code(), StatusCode::kNotFound);
  ASSERT_TRUE(producer->stream.Synchronize().ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ExpectDestination(dst_.image);  // still all poison

  // The connection still works.
  const std::vector<int32_t> one = {5};
  auto again = Post(one, one, 0, 1);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE(WaitFor(*sender_, *again, std::chrono::seconds(30)).ok());
  dst_.Apply(src_, src_.image, one, one, 0, 1, {});
  ExpectDestination(dst_.image);
}

// kPeerDead with writes in flight: they fail (Aborted) promptly and nothing hangs, including the
// teardown that follows.
TEST_P(UcxStagedGpu, PeerDeadDisconnectFailsWritesInFlight) {
  Start();
  auto producer = StartBusyProducer(300);
  ASSERT_TRUE(producer.ok()) << producer.status();
  std::mt19937 rng(17);
  std::vector<WriteId> writes;
  for (int i = 0; i < 3; ++i) {
    const std::vector<int32_t> src = DistinctPages(60, kPages, rng);
    const std::vector<int32_t> dst = DistinctPages(60, kPages, rng);
    auto w = Post(src, dst, 0, kLayers, {}, i == 0 ? producer->ready.get() : nullptr);
    ASSERT_TRUE(w.ok()) << w.status();
    writes.push_back(*w);
  }
  const auto start = Clock::now();
  ASSERT_TRUE(sender_->Disconnect(peer_, Backend::DisconnectMode::kPeerDead).ok());
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  for (WriteId w : writes) {
    Status st = WaitFor(*sender_, w, std::chrono::seconds(10));
    EXPECT_EQ(st.code(), StatusCode::kAborted) << st;
    sender_->Release(w);
  }
  ASSERT_TRUE(producer->stream.Synchronize().ok());
}

// Not a timed assertion: prints what one large write achieves, for the record.
TEST_P(UcxStagedGpu, ReportsThroughputOfALargeWrite) {
  // Default-sized slots (8 x 4 MiB) over a larger pool: 32 layers of 2 KiB-token pages.
  constexpr int32_t kBigLayers = 32;
  constexpr int64_t kBigPages = 256;
  constexpr uint64_t kBigItem = 32 << 10;  // 16 tokens x 2 KiB
  DevicePool src, dst;
  ASSERT_TRUE(src.Init(kBigLayers, kBigPages, kBigItem).ok());
  ASSERT_TRUE(dst.Init(kBigLayers, kBigPages, kBigItem).ok());
  src.Fill(3);
  ASSERT_TRUE(src.Upload().ok());
  dst.Poison();
  ASSERT_TRUE(dst.Upload().ok());
  const UcxOptions options{.transports = GetParam(), .cuda_mode = UcxCudaMode::kStaged};
  auto a = CreateBackend(options);
  auto b = CreateBackend(options);
  ASSERT_TRUE(a.ok() && b.ok());
  auto sr = src.Regions();
  auto dr = dst.Regions();
  ASSERT_TRUE((*a)->Register(sr).ok());
  auto rd = (*b)->Register(dr);
  ASSERT_TRUE(rd.ok()) << rd.status();
  auto peer = (*a)->Connect(*rd);
  ASSERT_TRUE(peer.ok()) << peer.status();
  std::mt19937 rng(19);
  const std::vector<int32_t> pages_src = DistinctPages(kBigPages - 1, kBigPages, rng);
  const std::vector<int32_t> pages_dst = DistinctPages(kBigPages - 1, kBigPages, rng);
  PageWrite w;
  w.src_pages = pages_src;
  w.dst_pages = pages_dst;
  w.num_layers = kBigLayers;
  w.layer_begin = 0;
  w.layer_end = kBigLayers;
  const double bytes = 2.0 * kBigLayers * (kBigPages - 1) * kBigItem;
  for (int round = 0; round < 2; ++round) {  // the first round warms up connections
    const auto start = Clock::now();
    auto id = (*a)->PostPages(*peer, w);
    ASSERT_TRUE(id.ok()) << id.status();
    Status st = WaitFor(**a, *id, std::chrono::seconds(120));
    ASSERT_TRUE(st.ok()) << st;
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    (*a)->Release(*id);
    if (round == 1) {
      std::cout << "[ staged ] transports '" << GetParam() << "': " << bytes / 1e9 << " GB in "
                << s * 1e3 << " ms = " << bytes / s / 1e9 << " GB/s\n";
      RecordProperty("staged_gbps", std::to_string(bytes / s / 1e9));
    }
  }
  dst.Apply(src, src.image, pages_src, pages_dst, 0, kBigLayers, {});
  auto got = dst.Download();
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(*got == dst.image);
}

// A mixed layout on the device (K/V of 256-byte pages, latent buffers of 96, a draft model's K/V
// of 512: layers 0 1 0 1 2 3 4 4) moves byte-exact over layer batches that cross groups, through
// slots small enough that chunks split pages; every page outside the writes keeps its poison.
TEST_P(UcxStagedGpu, MixedLayoutsMoveEveryBufferOfTheLayersByteExact) {
  const testing::MixedLayout mixed;
  auto src_memory = cuda::DeviceBuffer::Allocate(mixed.ImageBytes(), 0);
  ASSERT_TRUE(src_memory.ok()) << src_memory.status();
  auto dst_memory = cuda::DeviceBuffer::Allocate(mixed.ImageBytes(), 0);
  ASSERT_TRUE(dst_memory.ok()) << dst_memory.status();
  std::vector<uint8_t> src(mixed.ImageBytes());
  std::mt19937 rng(43);
  testing::FillRandom(src, rng);
  std::vector<uint8_t> expected(mixed.ImageBytes(), 0xEE);
  ASSERT_TRUE(cuda::Copy(src_memory->data(), src.data(), src.size()).ok());
  ASSERT_TRUE(cuda::Copy(dst_memory->data(), expected.data(), expected.size()).ok());

  UcxOptions options;
  options.transports = GetParam();
  options.cuda_mode = UcxCudaMode::kStaged;
  options.staging_slot_bytes = 4096;
  options.staging_slots = 3;
  auto a = CreateBackend(options);
  ASSERT_TRUE(a.ok()) << a.status();
  options.staging_slots = 2;
  auto b = CreateBackend(options);
  ASSERT_TRUE(b.ok()) << b.status();
  sender_ = std::move(a).value();
  receiver_ = std::move(b).value();
  auto sd = sender_->Register(
      mixed.Regions(reinterpret_cast<uint64_t>(src_memory->data()), MemoryKind::kCuda, 0));
  ASSERT_TRUE(sd.ok()) << sd.status();
  auto rd = receiver_->Register(
      mixed.Regions(reinterpret_cast<uint64_t>(dst_memory->data()), MemoryKind::kCuda, 0));
  ASSERT_TRUE(rd.ok()) << rd.status();
  auto peer = sender_->Connect(*rd);
  ASSERT_TRUE(peer.ok()) << peer.status();

  const std::vector<std::pair<int32_t, int32_t>> batches = {{0, 2}, {2, 3}, {3, 5}, {1, 4}, {0, 5}};
  for (auto [begin, end] : batches) {
    const std::vector<int32_t> src_pages = DistinctPages(7, mixed.pages, rng);
    const std::vector<int32_t> dst_pages = DistinctPages(7, mixed.pages, rng);
    PageWrite w;
    w.src_pages = src_pages;
    w.dst_pages = dst_pages;
    w.num_layers = mixed.num_layers;
    w.layer_begin = begin;
    w.layer_end = end;
    auto id = sender_->PostPages(*peer, w);
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_TRUE(WaitFor(*sender_, *id).ok()) << sender_->Check(*id);
    sender_->Release(*id);
    mixed.Apply(w, src, expected);
    std::vector<uint8_t> got(mixed.ImageBytes());
    ASSERT_TRUE(cuda::Copy(got.data(), dst_memory->data(), got.size()).ok());
    ASSERT_EQ(mixed.Mismatch(expected, got), "") << "layers [" << begin << ", " << end << ")";
  }
  sender_.reset();
  receiver_.reset();
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxStagedGpu,
                         ::testing::Values(std::string(""), std::string("shm,self"),
                                           std::string("tcp")),
                         testing::TransportsTestName);

}  // namespace
}  // namespace kvt::transfer

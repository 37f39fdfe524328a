// The transfer engine on CUDA pools: a prefill and a decode engine in one process, each with
// its own pool on device 0, talking over the real control plane on loopback, parameterized over
// the device backends (cuda_ipc; ucx staged through host bounce buffers). The prefill side
// writes the deterministic pattern with the fill kernel and the decode side verifies every byte
// with the verify kernel. Skips without a CUDA device.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kvt/kernels/cuda_util.h"
#include "kvt/kernels/kernels.h"
#include "kvt/pool/kv_pool.h"
#include "kvt/testing/gpu.h"
#include "kvt/testing/random.h"
#include "kvt/transfer/engine.h"

namespace kvt::transfer {
namespace {

using namespace std::chrono_literals;

pool::PoolOptions CudaPoolOptions(int64_t layers = 4, int64_t page_size = 16, int64_t pages = 256) {
  pool::PoolOptions o;
  o.size = page_size * pages;
  o.page_size = page_size;
  o.head_num = 8;
  o.head_dim = 128;
  o.layer_num = layers;
  o.dtype = DType::kBF16;
  o.pd_disaggregation_enabled = true;
  o.memory = pool::MemoryKind::kCuda;
  o.device = 0;
  return o;
}

// Device-resident pattern tables (K and V bases of every layer, the request's pages).
class DevicePattern {
 public:
  static DevicePattern Make(const pool::KvPool& pool, uint64_t request,
                            const std::vector<int32_t>& pages) {
    DevicePattern p;
    auto infos = pool.GetContiguousBufInfos();
    EXPECT_TRUE(infos.ok()) << infos.status();
    const int32_t layers = static_cast<int32_t>(pool.options().layer_num);
    std::vector<uint64_t> bases(infos->data_ptrs.begin(), infos->data_ptrs.end());
    p.bases_ = Upload(bases.data(), bases.size() * sizeof(uint64_t));
    p.pages_ = Upload(pages.data(), pages.size() * sizeof(int32_t));
    p.args_.request = request;
    p.args_.k_bases = p.bases_.as<uint64_t>();
    p.args_.v_bases = p.bases_.as<uint64_t>() + layers;
    p.args_.first_layer = 0;
    p.args_.num_layers = layers;
    p.args_.pages = p.pages_.as<int32_t>();
    p.args_.num_tokens = static_cast<int64_t>(pages.size()) * pool.options().page_size;
    p.args_.page_size = pool.options().page_size;
    p.args_.row_bytes =
        pool.options().head_num * pool.options().head_dim * ItemSize(pool.options().dtype);
    return p;
  }

  // Arguments for layers [first, first + count).
  kernels::PatternArgs Layers(int32_t first, int32_t count) const {
    kernels::PatternArgs a = args_;
    a.k_bases += first;
    a.v_bases += first;
    a.first_layer = first;
    a.num_layers = count;
    return a;
  }
  const kernels::PatternArgs& all() const { return args_; }

 private:
  static cuda::DeviceBuffer Upload(const void* data, size_t bytes) {
    auto buffer = cuda::DeviceBuffer::Allocate(std::max<size_t>(bytes, 16), 0);
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    if (!buffer.ok()) return {};
    EXPECT_TRUE(cuda::Copy(buffer->data(), data, bytes).ok());
    return std::move(buffer).value();
  }
  cuda::DeviceBuffer bases_, pages_;
  kernels::PatternArgs args_;
};

std::vector<int32_t> RandomPages(std::mt19937& rng, int64_t num_pages, size_t count) {
  return ::kvt::testing::DistinctIndices(static_cast<int64_t>(count), num_pages, rng,
                                         /*first=*/1);  // page 0 is the dummy page
}

class EngineGpuTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { KVT_SKIP_WITHOUT_GPU(); }

  void Start(const pool::PoolOptions& options = CudaPoolOptions()) {
    auto src = pool::KvPool::Create(options);
    ASSERT_TRUE(src.ok()) << src.status();
    auto dst = pool::KvPool::Create(options);
    ASSERT_TRUE(dst.ok()) << dst.status();
    src_pool_ = std::move(src).value();
    dst_pool_ = std::move(dst).value();
    EngineOptions p;
    p.name = "prefill-gpu";
    p.prefill = true;
    if (GetParam() == "ucx_staged") {
      p.backend = UcxOptions{.cuda_mode = UcxCudaMode::kStaged};
    } else {
      p.backend = *DefaultBackendConfig(GetParam());
    }
    p.default_deadline = 20s;
    auto prefill = TransferEngine::Create(p, src_pool_.get());
    ASSERT_TRUE(prefill.ok()) << prefill.status();
    prefill_ = std::move(prefill).value();
    EngineOptions d = p;
    d.name = "decode-gpu";
    d.prefill = false;
    auto decode = TransferEngine::Create(d, dst_pool_.get());
    ASSERT_TRUE(decode.ok()) << decode.status();
    decode_ = std::move(decode).value();
    auto peer = decode_->ConnectPeer("127.0.0.1", prefill_->port());
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
    auto stream = cuda::Stream::Create(0);
    ASSERT_TRUE(stream.ok()) << stream.status();
    stream_ = std::move(stream).value();
  }

  void TearDown() override {
    decode_.reset();
    prefill_.reset();
  }

  uint64_t Mismatches(uint64_t request, const std::vector<int32_t>& pages) {
    DevicePattern pattern = DevicePattern::Make(*dst_pool_, request, pages);
    auto check = kernels::VerifyPatternCuda(pattern.all(), stream_.get());
    EXPECT_TRUE(check.ok()) << check.status();
    return check.ok() ? check->mismatches : ~0ull;
  }

  int32_t layers() const { return static_cast<int32_t>(src_pool_->options().layer_num); }
  int64_t num_pages() const { return src_pool_->options().size / src_pool_->options().page_size; }

  std::unique_ptr<pool::KvPool> src_pool_, dst_pool_;
  std::unique_ptr<TransferEngine> prefill_, decode_;
  PeerHandle peer_ = 0;
  cuda::Stream stream_;
};

TEST_P(EngineGpuTest, WholeRequestArrivesByteExact) {
  Start();
  std::mt19937 rng(7);
  const auto src = RandomPages(rng, num_pages(), 40);
  const auto dst = RandomPages(rng, num_pages(), 40);
  DevicePattern pattern = DevicePattern::Make(*src_pool_, 11, src);
  ASSERT_TRUE(kernels::FillPatternCuda(pattern.all(), stream_.get()).ok());
  ASSERT_TRUE(stream_.Synchronize().ok());
  ASSERT_GT(Mismatches(11, dst), 0u)
      << "the destination pages must not hold the pattern before the transfer";
  ASSERT_TRUE(decode_->Receive("whole", peer_, dst).ok());
  ASSERT_TRUE(prefill_->Send("whole", src).ok());
  ASSERT_TRUE(prefill_->LayersReady("whole", layers()).ok());
  auto done = decode_->WaitRequest("whole", 20s);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->state, RequestState::kSuccess) << done->status;
  EXPECT_TRUE(done->pages_reusable);
  EXPECT_EQ(Mismatches(11, dst), 0u);
}

// The producer enqueues each layer's fill on its stream and hands the layer over with an event
// right away; the stream is held back by a host function until every LayersReady call was made,
// so a copy that did not wait for the events on the GPU would read unwritten pages.
TEST_P(EngineGpuTest, LayerwiseCopiesWaitForTheProducersEvents) {
  Start();
  std::mt19937 rng(8);
  const auto src = RandomPages(rng, num_pages(), 24);
  const auto dst = RandomPages(rng, num_pages(), 24);
  DevicePattern pattern = DevicePattern::Make(*src_pool_, 12, src);
  ASSERT_TRUE(decode_->Receive("layerwise", peer_, dst).ok());
  ASSERT_TRUE(prefill_->Send("layerwise", src).ok());

  auto gate = std::make_shared<std::atomic<bool>>(false);
  ASSERT_EQ(cudaLaunchHostFunc(
                stream_.get(),
                [](void* arg) {
                  auto* open = static_cast<std::atomic<bool>*>(arg);
                  // Bounded: the test opens the gate within a second.
                  for (int i = 0; i < 10000 && !open->load(); ++i) {
                    std::this_thread::sleep_for(1ms);
                  }
                },
                gate.get()),
            cudaSuccess);
  std::vector<cuda::Event> events;
  for (int32_t l = 0; l < layers(); ++l) {
    ASSERT_TRUE(kernels::FillPatternCuda(pattern.Layers(l, 1), stream_.get()).ok());
    auto event = cuda::Event::Create(/*timing=*/false);
    ASSERT_TRUE(event.ok()) << event.status();
    ASSERT_TRUE(event->Record(stream_.get()).ok());
    ASSERT_TRUE(prefill_->LayersReady("layerwise", l + 1, event->get()).ok());
    events.push_back(std::move(event).value());
  }
  // Every layer was handed over, but none is written yet: the request cannot be done.
  std::this_thread::sleep_for(100ms);
  auto early = decode_->GetRequest("layerwise");
  ASSERT_TRUE(early.ok());
  EXPECT_FALSE(IsFinal(early->state)) << "the copy ran before the producer's events";
  gate->store(true);
  auto done = decode_->WaitRequest("layerwise", 20s);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->state, RequestState::kSuccess) << done->status;
  EXPECT_EQ(Mismatches(12, dst), 0u);
  ASSERT_TRUE(stream_.Synchronize().ok());
}

TEST_P(EngineGpuTest, RandomRequestsAllVerify) {
  Start();
  std::mt19937 rng(9);
  std::uniform_int_distribution<size_t> count(1, 12);
  // Disjoint page sets per request on each side so that all requests can be in flight at once.
  std::vector<int32_t> src_free = RandomPages(rng, num_pages(), num_pages() - 1);
  std::vector<int32_t> dst_free = RandomPages(rng, num_pages(), num_pages() - 1);
  struct Req {
    std::string room;
    std::vector<int32_t> src, dst;
  };
  std::vector<Req> reqs;
  for (int i = 0; i < 20; ++i) {
    const size_t n = count(rng);
    Req r;
    r.room = "random-" + std::to_string(i);
    r.src.assign(src_free.end() - static_cast<std::ptrdiff_t>(n), src_free.end());
    r.dst.assign(dst_free.end() - static_cast<std::ptrdiff_t>(n), dst_free.end());
    src_free.resize(src_free.size() - n);
    dst_free.resize(dst_free.size() - n);
    DevicePattern pattern = DevicePattern::Make(*src_pool_, 100 + i, r.src);
    ASSERT_TRUE(kernels::FillPatternCuda(pattern.all(), stream_.get()).ok());
    reqs.push_back(std::move(r));
  }
  ASSERT_TRUE(stream_.Synchronize().ok());
  for (const Req& r : reqs) {
    ASSERT_TRUE(decode_->Receive(r.room, peer_, r.dst).ok());
    ASSERT_TRUE(prefill_->Send(r.room, r.src).ok());
    ASSERT_TRUE(prefill_->LayersReady(r.room, layers()).ok());
  }
  for (size_t i = 0; i < reqs.size(); ++i) {
    auto done = decode_->WaitRequest(reqs[i].room, 20s);
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_EQ(done->state, RequestState::kSuccess) << reqs[i].room << ": " << done->status;
    EXPECT_EQ(Mismatches(100 + i, reqs[i].dst), 0u) << reqs[i].room;
  }
  EXPECT_EQ(prefill_->stats().requests_succeeded, reqs.size());
}

TEST_P(EngineGpuTest, OutOfRangePagesFailOnlyThatRequest) {
  Start();
  std::mt19937 rng(10);
  const auto src = RandomPages(rng, num_pages(), 4);
  const auto dst = RandomPages(rng, num_pages(), 4);
  // The decode side cannot name pages outside its pool; the prefill side's are checked on Send.
  EXPECT_EQ(prefill_->Send("bad", {1, 2, static_cast<int32_t>(num_pages() + 1)}).code(),
            StatusCode::kOutOfRange);
  DevicePattern pattern = DevicePattern::Make(*src_pool_, 13, src);
  ASSERT_TRUE(kernels::FillPatternCuda(pattern.all(), stream_.get()).ok());
  ASSERT_TRUE(stream_.Synchronize().ok());
  ASSERT_TRUE(decode_->Receive("good", peer_, dst).ok());
  ASSERT_TRUE(prefill_->Send("good", src).ok());
  ASSERT_TRUE(prefill_->LayersReady("good", layers()).ok());
  auto done = decode_->WaitRequest("good", 20s);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->state, RequestState::kSuccess) << done->status;
  EXPECT_EQ(Mismatches(13, dst), 0u);
}

// A write gated on a producer that computes for 400 ms (a host function holding its stream, as a
// long forward pass would): the prefill engine sleeps while it waits instead of watching the
// write, so the process uses well under a tenth of a core over the wait.
TEST_P(EngineGpuTest, GatedWriteCostsNoCpuWhileItWaits) {
  Start();
  std::mt19937 rng(14);
  const auto src = RandomPages(rng, num_pages(), 32);
  const auto dst = RandomPages(rng, num_pages(), 32);
  // One request first, so that setting the link up (a staged receiver maps and page-locks the
  // sender's bounce slots when their first hello arrives) is not timed as waiting.
  ASSERT_TRUE(decode_->Receive("warm-up", peer_, dst).ok());
  ASSERT_TRUE(prefill_->Send("warm-up", src).ok());
  ASSERT_TRUE(prefill_->LayersReady("warm-up", layers()).ok());
  auto warm = decode_->WaitRequest("warm-up", 20s);
  ASSERT_TRUE(warm.ok()) << warm.status();
  ASSERT_EQ(warm->state, RequestState::kSuccess) << warm->status;
  DevicePattern pattern = DevicePattern::Make(*src_pool_, 15, src);
  ASSERT_TRUE(decode_->Receive("gated", peer_, dst).ok());
  ASSERT_TRUE(prefill_->Send("gated", src).ok());
  auto cpu_seconds = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
           static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
  };
  ASSERT_EQ(cudaLaunchHostFunc(
                stream_.get(), [](void*) { std::this_thread::sleep_for(400ms); }, nullptr),
            cudaSuccess);
  ASSERT_TRUE(kernels::FillPatternCuda(pattern.all(), stream_.get()).ok());
  auto ready = cuda::Event::Create(/*timing=*/false);
  ASSERT_TRUE(ready.ok()) << ready.status();
  ASSERT_TRUE(ready->Record(stream_.get()).ok());
  const auto start = std::chrono::steady_clock::now();
  const double cpu_start = cpu_seconds();
  ASSERT_TRUE(prefill_->LayersReady("gated", layers(), ready->get()).ok());
  auto done = decode_->WaitRequest("gated", 20s);
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double cpu = cpu_seconds() - cpu_start;
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->state, RequestState::kSuccess) << done->status;
  EXPECT_GE(wall, 0.35);
  EXPECT_LT(cpu, 0.1 * wall) << "CPU " << cpu << " s over " << wall << " s of waiting";
  EXPECT_EQ(Mismatches(15, dst), 0u);
  ASSERT_TRUE(stream_.Synchronize().ok());
}

INSTANTIATE_TEST_SUITE_P(DeviceBackends, EngineGpuTest, ::testing::Values("cuda_ipc", "ucx_staged"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace kvt::transfer

// KvPool on CUDA memory: the same round trips as the host tests, compared byte for byte with a
// host pool fed the same random data (the CPU kernels are the oracle).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>

#include "kvt/kernels/cuda_util.h"
#include "kvt/pool/kv_pool.h"
#include "kvt/testing/gpu.h"
#include "pool_test_util.h"

namespace kvt::pool {
namespace {

using testing::AllRows;
using ::testing::HasSubstr;
using testing::RandomBytes;
using testing::RandomFiniteBf16;

class CudaPoolTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override { KVT_SKIP_WITHOUT_GPU(); }

  PoolOptions Options(int64_t layers = 3) const {
    PoolOptions o;
    o.size = 256;
    o.page_size = 16;
    o.head_num = 4;
    o.head_dim = 64;
    o.layer_num = layers;
    o.dtype = GetParam();
    o.offload_chunk_page_num = 50;
    return o;
  }

  // A host and a CUDA pool of the same layout.
  void MakePair(const PoolOptions& o) {
    PoolOptions h = o, d = o;
    h.memory = MemoryKind::kHost;
    d.memory = MemoryKind::kCuda;
    auto hp = KvPool::Create(h);
    auto dp = KvPool::Create(d);
    ASSERT_TRUE(hp.ok()) << hp.status();
    ASSERT_TRUE(dp.ok()) << dp.status();
    host_ = std::move(hp).value();
    cuda_ = std::move(dp).value();
  }

  void FillBoth(uint32_t seed) {
    const auto rows = AllRows(*host_);
    const auto flat = RandomBytes(static_cast<size_t>(host_->FlatDataBytes(rows.size())), seed);
    ASSERT_TRUE(host_->Transfer(rows, flat.data(), flat.size(), MemoryKind::kHost).ok());
    ASSERT_TRUE(cuda_->Transfer(rows, flat.data(), flat.size(), MemoryKind::kHost).ok());
  }

  void ExpectSame() {
    const auto rows = AllRows(*host_);
    auto h = host_->GetFlatData(rows);
    auto d = cuda_->GetFlatData(rows);
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_TRUE(*h == *d) << "CUDA pool differs from the host pool";
  }

  std::unique_ptr<KvPool> host_;
  std::unique_ptr<KvPool> cuda_;
};

TEST_P(CudaPoolTest, ZeroedAtCreation) {
  MakePair(Options());
  ExpectSame();
  auto d = cuda_->GetFlatData(AllRows(*cuda_));
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(std::all_of(d->begin(), d->end(), [](uint8_t b) { return b == 0; }));
  auto k = cuda_->GetKeyBuffer(0);
  ASSERT_TRUE(k.ok());
  EXPECT_EQ(k->memory, MemoryKind::kCuda);
}

TEST_P(CudaPoolTest, SetKvBufferFromHostAndDeviceMatchesCpu) {
  MakePair(Options());
  const std::vector<int32_t> loc = {0, 17, 100, 271, 33};
  const int64_t elems = static_cast<int64_t>(loc.size()) * 4 * 64;
  const auto k = RandomFiniteBf16(elems, 1), v = RandomFiniteBf16(elems, 2);
  const KvRows rows{k.data(), v.data(), DType::kBF16, MemoryKind::kHost};
  ASSERT_TRUE(host_->SetKvBuffer(1, loc, rows, 0.5f, 2.0f).ok());
  ASSERT_TRUE(cuda_->SetKvBuffer(1, loc, rows, 0.5f, 2.0f).ok());
  ExpectSame();
  // Input already on the device.
  auto dk = kvt::cuda::DeviceBuffer::Allocate(k.size());
  auto dv = kvt::cuda::DeviceBuffer::Allocate(v.size());
  ASSERT_TRUE(dk.ok() && dv.ok());
  ASSERT_TRUE(kvt::cuda::Copy(dk->data(), k.data(), k.size()).ok());
  ASSERT_TRUE(kvt::cuda::Copy(dv->data(), v.data(), v.size()).ok());
  const std::vector<int32_t> loc2 = {5, 6, 7, 8, 9};
  ASSERT_TRUE(host_->SetKvBuffer(2, loc2, rows).ok());
  ASSERT_TRUE(
      cuda_->SetKvBuffer(2, loc2, KvRows{dk->data(), dv->data(), DType::kBF16, MemoryKind::kCuda})
          .ok());
  ExpectSame();
}

TEST_P(CudaPoolTest, MoveMatchesCpuBothPaths) {
  for (bool tiled : {false, true}) {
    PoolOptions o = Options();
    o.enable_kv_cache_copy = tiled;
    MakePair(o);
    FillBoth(7);
    const std::vector<int32_t> tgt = {16, 17, 18, 200, 3};
    const std::vector<int32_t> src = {100, 101, 102, 40, 271};
    ASSERT_TRUE(host_->MoveKvCache(tgt, src).ok());
    ASSERT_TRUE(cuda_->MoveKvCache(tgt, src).ok());
    ExpectSame();
  }
}

TEST_P(CudaPoolTest, CpuCopyRoundTrip) {
  MakePair(Options());
  FillBoth(9);
  std::vector<int32_t> idx;
  for (int32_t r = 3; r < 272; r += 2) idx.push_back(r);  // 135 rows: 3 chunks of 50
  auto hc = host_->GetCpuCopy(idx);
  auto dc = cuda_->GetCpuCopy(idx);
  ASSERT_TRUE(hc.ok() && dc.ok());
  ASSERT_EQ(dc->layers[0].size(), 3u);
  for (size_t l = 0; l < hc->layers.size(); ++l) {
    for (size_t c = 0; c < hc->layers[l].size(); ++c) {
      EXPECT_EQ(hc->layers[l][c].k, dc->layers[l][c].k);
      EXPECT_EQ(hc->layers[l][c].v, dc->layers[l][c].v);
    }
  }
  ASSERT_TRUE(cuda_->ClearKvBuffers().ok());
  ASSERT_TRUE(host_->ClearKvBuffers().ok());
  ASSERT_TRUE(cuda_->LoadCpuCopy(*dc, idx).ok());
  ASSERT_TRUE(host_->LoadCpuCopy(*hc, idx).ok());
  ExpectSame();
}

TEST_P(CudaPoolTest, FlatRoundTripHostAndDeviceBuffers) {
  MakePair(Options());
  FillBoth(13);
  const std::vector<int32_t> idx = {31, 32, 33, 34, 150, 0};
  auto hf = host_->GetFlatData(idx);
  auto df = cuda_->GetFlatData(idx);
  ASSERT_TRUE(hf.ok() && df.ok());
  EXPECT_TRUE(*hf == *df);
  // Into device memory, then back into other rows from device memory.
  const int64_t bytes = cuda_->FlatDataBytes(idx.size());
  auto dev = kvt::cuda::DeviceBuffer::Allocate(bytes);
  ASSERT_TRUE(dev.ok());
  ASSERT_TRUE(cuda_->GetFlatDataInto(idx, dev->data(), bytes, MemoryKind::kCuda).ok());
  const std::vector<int32_t> dst = {240, 241, 242, 243, 244, 245};
  ASSERT_TRUE(cuda_->Transfer(dst, dev->data(), bytes, MemoryKind::kCuda).ok());
  ASSERT_TRUE(host_->Transfer(dst, hf->data(), bytes, MemoryKind::kHost).ok());
  ExpectSame();
}

TEST_P(CudaPoolTest, BufferInfosPointAtDeviceMemory) {
  MakePair(Options(2));
  auto infos = cuda_->GetContiguousBufInfos();
  ASSERT_TRUE(infos.ok());
  ASSERT_EQ(infos->data_ptrs.size(), 4u);
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, reinterpret_cast<void*>(infos->data_ptrs[3])),
            cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeDevice);
  EXPECT_EQ(infos->item_lens, host_->GetContiguousBufInfos()->item_lens);
}

TEST_P(CudaPoolTest, GuardsAreTheSame) {
  MakePair(Options());
  const std::vector<int32_t> bad = {1, 272};
  Status st = cuda_->MoveKvCache(bad, bad);
  EXPECT_EQ(st.code(), StatusCode::kOutOfRange);
  EXPECT_THAT(st.message(), HasSubstr("tgt_loc[1] = 272"));
}

INSTANTIATE_TEST_SUITE_P(DTypes, CudaPoolTest,
                         ::testing::Values(DType::kBF16, DType::kFP32, DType::kFP8E4M3),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

TEST(CudaPoolConversionTest, Fp32IntoFp8WithScaleMatchesCpu) {
  KVT_SKIP_WITHOUT_GPU();
  for (DType pool_dtype : {DType::kFP8E4M3, DType::kFP8E5M2, DType::kBF16, DType::kFP16}) {
    PoolOptions o;
    o.size = 64;
    o.page_size = 16;
    o.head_num = 2;
    o.head_dim = 32;
    o.layer_num = 1;
    o.dtype = pool_dtype;
    PoolOptions d = o;
    d.memory = MemoryKind::kCuda;
    auto host = KvPool::Create(o);
    auto cuda = KvPool::Create(d);
    ASSERT_TRUE(host.ok() && cuda.ok());
    std::vector<float> k(8 * 64), v(8 * 64);
    std::mt19937 rng(3);
    std::normal_distribution<float> normal(0.0f, 40.0f);
    for (auto& x : k) x = normal(rng);
    for (auto& x : v) x = normal(rng);
    const std::vector<int32_t> loc = {1, 2, 3, 4, 60, 61, 62, 63};
    const KvRows rows{k.data(), v.data(), DType::kFP32, MemoryKind::kHost};
    ASSERT_TRUE((*host)->SetKvBuffer(0, loc, rows, 3.0f, 0.25f).ok());
    ASSERT_TRUE((*cuda)->SetKvBuffer(0, loc, rows, 3.0f, 0.25f).ok());
    auto a = (*host)->GetFlatData(loc);
    auto b = (*cuda)->GetFlatData(loc);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_TRUE(*a == *b) << DTypeName(pool_dtype);
  }
}

}  // namespace
}  // namespace kvt::pool

// StoreCuda, TiledCopyCuda, FillPatternCuda and VerifyPatternCuda against their CPU references
// on random data, outputs poisoned with 0xA5 first, every byte compared.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kvt/common/dtype.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/kernels/dtype_convert.h"
#include "kvt/kernels/kernels.h"

namespace kvt::kernels {
namespace {

using testing::DeviceBytes;
using testing::DistinctIndices;
using testing::ToDevice;

// Random element bytes of `dtype`: ordinary values, values past the fp8 ranges, and a few
// NaN / inf / zero / subnormal inputs.
void RandomElements(DType dtype, int64_t n, uint8_t* out, std::mt19937& rng) {
  std::uniform_int_distribution<int> kind(0, 40);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> exp(-30, 18);
  for (int64_t i = 0; i < n; ++i) {
    float x;
    switch (kind(rng)) {
      case 0:
        x = std::numeric_limits<float>::quiet_NaN();
        break;
      case 1:
        x = std::numeric_limits<float>::infinity();
        break;
      case 2:
        x = -0.0f;
        break;
      case 3:
        x = std::numeric_limits<float>::denorm_min() * 7;
        break;
      default:
        x = std::ldexp(mant(rng), exp(rng)) * ((rng() & 1) ? 1.0f : -1.0f);
    }
    switch (dtype) {
      case DType::kFP32:
        std::memcpy(out + 4 * i, &x, 4);
        break;
      case DType::kBF16: {
        uint16_t v = FloatToBf16(x);
        std::memcpy(out + 2 * i, &v, 2);
        break;
      }
      case DType::kFP16: {
        uint16_t v = FloatToFp16(x);
        std::memcpy(out + 2 * i, &v, 2);
        break;
      }
      default:
        out[i] = static_cast<uint8_t>(rng());
    }
  }
}

struct Pair {
  DType src, dst;
};
void PrintTo(const Pair& p, std::ostream* os) {
  *os << DTypeName(p.src) << "->" << DTypeName(p.dst);
}

std::vector<Pair> AllPairs() {
  std::vector<Pair> out;
  for (DType s : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (DType d : {DType::kBF16, DType::kFP16, DType::kFP32, DType::kFP8E4M3, DType::kFP8E5M2}) {
      out.push_back({s, d});
    }
  }
  out.push_back({DType::kFP8E4M3, DType::kFP8E4M3});
  return out;
}

class StoreGpuTest : public ::testing::TestWithParam<Pair> {};

TEST_P(StoreGpuTest, MatchesCpuReferenceBitForBit) {
  KVT_SKIP_WITHOUT_GPU();
  const Pair p = GetParam();
  const int64_t si = ItemSize(p.src), di = ItemSize(p.dst);
  std::mt19937 rng(static_cast<unsigned>(static_cast<int>(p.src) * 8 + static_cast<int>(p.dst)));
  struct Shape {
    int64_t rows, elems;
    bool k_scale, v_scale;
  };
  for (const Shape& shape : {Shape{37, 1024, false, false}, Shape{5, 13, true, false},
                             Shape{300, 136, true, true}, Shape{1, 1, false, true}}) {
    const int64_t pool_rows = shape.rows * 2 + 5;
    DeviceBytes src[2], dst[2];
    for (int kv = 0; kv < 2; ++kv) {
      KVT_ASSERT_OK(src[kv].Init(shape.rows * shape.elems * si, 0));
      KVT_ASSERT_OK(dst[kv].Init(pool_rows * shape.elems * di, 0));
      RandomElements(p.src, shape.rows * shape.elems, src[kv].host.data(), rng);
      std::fill(dst[kv].host.begin(), dst[kv].host.end(), 0xA5);
      KVT_ASSERT_OK(src[kv].Upload());
      KVT_ASSERT_OK(dst[kv].Upload());
    }
    const std::vector<int32_t> loc = DistinctIndices(shape.rows, pool_rows, rng);
    auto d_loc = ToDevice(loc);
    ASSERT_TRUE(d_loc.ok());
    StoreArgs a;
    a.src_dtype = p.src;
    a.dst_dtype = p.dst;
    a.num_rows = shape.rows;
    a.row_elems = shape.elems;
    a.has_k_scale = shape.k_scale;
    a.k_scale = 0.37f;
    a.has_v_scale = shape.v_scale;
    a.v_scale = 3.1f;
    StoreArgs dev = a, host = a;
    dev.k_src = src[0].dev();
    dev.v_src = src[1].dev();
    dev.k_dst = dst[0].dev();
    dev.v_dst = dst[1].dev();
    dev.loc = d_loc->as<int32_t>();
    host.k_src = src[0].host.data();
    host.v_src = src[1].host.data();
    host.k_dst = dst[0].host.data();
    host.v_dst = dst[1].host.data();
    host.loc = loc.data();
    auto stream = cuda::Stream::Create();
    ASSERT_TRUE(stream.ok());
    KVT_ASSERT_OK(StoreCuda(dev, stream->get()));
    KVT_ASSERT_OK(stream->Synchronize());
    KVT_ASSERT_OK(StoreCpu(host));
    for (int kv = 0; kv < 2; ++kv) {
      auto got = dst[kv].Download();
      ASSERT_TRUE(got.ok());
      ASSERT_EQ(*got, dst[kv].host)
          << "rows " << shape.rows << " elems " << shape.elems << " kv " << kv;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Pairs, StoreGpuTest, ::testing::ValuesIn(AllPairs()),
                         [](const auto& info) {
                           return std::string(DTypeName(info.param.src)) + "_to_" +
                                  std::string(DTypeName(info.param.dst));
                         });

TEST(StoreGpuTest, EmptyInputsLaunchNothing) {
  KVT_SKIP_WITHOUT_GPU();
  StoreArgs a;
  a.src_dtype = DType::kFP32;
  a.dst_dtype = DType::kFP8E4M3;
  a.row_elems = 128;  // no rows
  KVT_ASSERT_OK(StoreCuda(a, nullptr));
  KVT_ASSERT_OK(cuda::ToStatus(cudaDeviceSynchronize(), "sync"));
}

TEST(TiledCopyGpuTest, MatchesCpuReference) {
  KVT_SKIP_WITHOUT_GPU();
  std::mt19937 rng(8);
  struct T {
    int32_t buffers;
    int64_t locs;
    bool aligned;
    size_t misalign;
  };
  for (const T& t : {T{64, 40, true, 0}, T{6, 300, true, 0}, T{5, 17, false, 0}, T{4, 9, true, 3},
                     T{3, 1, false, 1}}) {
    const int64_t rows = 2 * t.locs + 7;
    std::vector<std::unique_ptr<DeviceBytes>> bufs;
    std::vector<int64_t> row_bytes;
    std::vector<uint64_t> dev_bases, host_bases;
    int64_t max_row = 0;
    for (int32_t b = 0; b < t.buffers; ++b) {
      const int64_t rb = t.aligned ? 16 * std::uniform_int_distribution<int64_t>(1, 700)(rng)
                                   : std::uniform_int_distribution<int64_t>(1, 9000)(rng);
      row_bytes.push_back(rb);
      max_row = std::max(max_row, rb);
      bufs.push_back(std::make_unique<DeviceBytes>());
      KVT_ASSERT_OK(bufs.back()->Init(rows * rb, t.misalign));
      bufs.back()->Randomize(rng);
      KVT_ASSERT_OK(bufs.back()->Upload());
      dev_bases.push_back(bufs.back()->addr());
      host_bases.push_back(bufs.back()->host_addr());
    }
    const std::vector<int32_t> picked = DistinctIndices(2 * t.locs, rows, rng);
    std::vector<int32_t> src(picked.begin(), picked.begin() + t.locs);
    std::vector<int32_t> tgt(picked.begin() + t.locs, picked.end());
    auto d_bases = ToDevice(dev_bases);
    auto d_rows = ToDevice(row_bytes);
    auto d_src = ToDevice(src);
    auto d_tgt = ToDevice(tgt);
    ASSERT_TRUE(d_bases.ok() && d_rows.ok() && d_src.ok() && d_tgt.ok());
    TiledCopyArgs a;
    a.num_buffers = t.buffers;
    a.num_locs = t.locs;
    a.max_row_bytes = max_row;
    a.bytes_per_tile = TileBytesForStride(max_row);
    TiledCopyArgs dev = a, host = a;
    dev.bases = d_bases->as<uint64_t>();
    dev.row_bytes = d_rows->as<int64_t>();
    dev.src_loc = d_src->as<int32_t>();
    dev.tgt_loc = d_tgt->as<int32_t>();
    host.bases = host_bases.data();
    host.row_bytes = row_bytes.data();
    host.src_loc = src.data();
    host.tgt_loc = tgt.data();
    KVT_ASSERT_OK(TiledCopyCuda(dev, nullptr));
    KVT_ASSERT_OK(cuda::ToStatus(cudaDeviceSynchronize(), "sync"));
    KVT_ASSERT_OK(TiledCopyCpu(host));
    for (int32_t b = 0; b < t.buffers; ++b) {
      auto got = bufs[b]->Download();
      ASSERT_TRUE(got.ok());
      ASSERT_EQ(*got, bufs[b]->host) << "buffer " << b << " row bytes " << row_bytes[b];
    }
  }
}

TEST(PatternGpuTest, FillMatchesCpuAndVerifyLocatesFlips) {
  KVT_SKIP_WITHOUT_GPU();
  std::mt19937 rng(21);
  struct P {
    int32_t layers;
    int64_t page_size, tokens, row_bytes;
  };
  for (const P& p : {P{4, 16, 100, 2048}, P{2, 1, 7, 37}, P{3, 5, 64, 8}, P{1, 64, 129, 130}}) {
    const int64_t pages_needed = (p.tokens + p.page_size - 1) / p.page_size;
    const int64_t pool_pages = pages_needed + 4;
    const int64_t buf_bytes = pool_pages * p.page_size * p.row_bytes;
    std::vector<std::unique_ptr<DeviceBytes>> k, v;
    std::vector<uint64_t> kd, vd, kh, vh;
    for (int32_t l = 0; l < p.layers; ++l) {
      for (auto* side : {&k, &v}) {
        side->push_back(std::make_unique<DeviceBytes>());
        KVT_ASSERT_OK(side->back()->Init(buf_bytes, 0));
        std::fill(side->back()->host.begin(), side->back()->host.end(), 0xA5);
        KVT_ASSERT_OK(side->back()->Upload());
      }
      kd.push_back(k.back()->addr());
      vd.push_back(v.back()->addr());
      kh.push_back(k.back()->host_addr());
      vh.push_back(v.back()->host_addr());
    }
    const std::vector<int32_t> pages = DistinctIndices(pages_needed, pool_pages, rng);
    auto d_k = ToDevice(kd);
    auto d_v = ToDevice(vd);
    auto d_pages = ToDevice(pages);
    ASSERT_TRUE(d_k.ok() && d_v.ok() && d_pages.ok());
    PatternArgs a;
    a.request = rng();
    a.first_layer = 3;
    a.num_layers = p.layers;
    a.num_tokens = p.tokens;
    a.page_size = p.page_size;
    a.row_bytes = p.row_bytes;
    PatternArgs dev = a, host = a;
    dev.k_bases = d_k->as<uint64_t>();
    dev.v_bases = d_v->as<uint64_t>();
    dev.pages = d_pages->as<int32_t>();
    host.k_bases = kh.data();
    host.v_bases = vh.data();
    host.pages = pages.data();

    KVT_ASSERT_OK(FillPatternCuda(dev, nullptr));
    KVT_ASSERT_OK(cuda::ToStatus(cudaDeviceSynchronize(), "sync"));
    KVT_ASSERT_OK(FillPatternCpu(host));
    for (int32_t l = 0; l < p.layers; ++l) {
      auto gk = k[l]->Download();
      auto gv = v[l]->Download();
      ASSERT_TRUE(gk.ok() && gv.ok());
      ASSERT_EQ(*gk, k[l]->host) << "K of layer " << l;
      ASSERT_EQ(*gv, v[l]->host) << "V of layer " << l;
    }
    auto clean = VerifyPatternCuda(dev, nullptr);
    ASSERT_TRUE(clean.ok()) << clean.status();
    EXPECT_EQ(clean->mismatches, 0u);

    // Flip bytes at random places (on both copies); GPU and CPU verification must agree.
    for (int flips = 1; flips <= 3; ++flips) {
      const int32_t l = std::uniform_int_distribution<int32_t>(0, p.layers - 1)(rng);
      const int kv = static_cast<int>(rng() & 1);
      const int64_t t = std::uniform_int_distribution<int64_t>(0, p.tokens - 1)(rng);
      const int64_t byte = std::uniform_int_distribution<int64_t>(0, p.row_bytes - 1)(rng);
      const int64_t row = pages[t / p.page_size] * p.page_size + t % p.page_size;
      DeviceBytes& buf = kv == 0 ? *k[l] : *v[l];
      const int64_t at = row * p.row_bytes + byte;
      buf.host[at] ^= 0x5A;
      KVT_ASSERT_OK(cuda::Copy(buf.dev() + at, &buf.host[at], 1));
      auto want = VerifyPatternCpu(host);
      auto got = VerifyPatternCuda(dev, nullptr);
      ASSERT_TRUE(want.ok() && got.ok()) << got.status();
      EXPECT_EQ(got->mismatches, want->mismatches);
      EXPECT_EQ(got->layer, want->layer);
      EXPECT_EQ(got->kv, want->kv);
      EXPECT_EQ(got->token, want->token);
      EXPECT_EQ(got->byte, want->byte);
      EXPECT_EQ(got->expected, want->expected);
      EXPECT_EQ(got->actual, want->actual);
    }
  }
}

}  // namespace
}  // namespace kvt::kernels

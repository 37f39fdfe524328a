// StoreCpu against a naive loop built on the independent conversion oracle, for every supported
// (src, dst) pair, with and without scales; argument validation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "convert_oracle.h"
#include "kvt/common/dtype.h"
#include "kvt/kernels/kernels.h"
#include "test_buffers.h"

namespace kvt::kernels {
namespace {

using testing::DistinctIndices;
using testing::Uniform;

const testing::Format* FormatOf(DType d) {
  switch (d) {
    case DType::kBF16:
      return &testing::kBf16;
    case DType::kFP16:
      return &testing::kFp16;
    case DType::kFP8E4M3:
      return &testing::kE4M3;
    case DType::kFP8E5M2:
      return &testing::kE5M2;
    default:
      return nullptr;  // fp32
  }
}

float ToFloat(DType d, const uint8_t* p) {
  if (d == DType::kFP32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint32_t code = 0;
  std::memcpy(&code, p, static_cast<size_t>(ItemSize(d)));
  return static_cast<float>(testing::Decode(*FormatOf(d), code));
}

void FromFloat(DType d, float x, uint8_t* p) {
  if (d == DType::kFP32) {
    std::memcpy(p, &x, 4);
    return;
  }
  const uint32_t code = testing::Encode(*FormatOf(d), static_cast<double>(x));
  std::memcpy(p, &code, static_cast<size_t>(ItemSize(d)));
}

// A random source element: mostly ordinary magnitudes, some beyond fp8 range, a few specials.
float RandomValue(std::mt19937& rng) {
  const int64_t kind = Uniform(rng, 0, 40);
  if (kind == 0) return std::numeric_limits<float>::quiet_NaN();
  if (kind == 1) return -std::numeric_limits<float>::infinity();
  if (kind == 2) return 0.0f;
  if (kind == 3) return -0.0f;
  const float mag = std::ldexp(std::uniform_real_distribution<float>(1.0f, 2.0f)(rng),
                               static_cast<int>(Uniform(rng, -22, 18)));
  return (rng() & 1) ? mag : -mag;
}

struct Pair {
  DType src, dst;
};

void PrintTo(const Pair& p, std::ostream* os) {
  *os << DTypeName(p.src) << "->" << DTypeName(p.dst);
}

class StoreCpuTest : public ::testing::TestWithParam<Pair> {};

TEST_P(StoreCpuTest, MatchesNaiveLoopOnRandomRows) {
  const DType src_t = GetParam().src, dst_t = GetParam().dst;
  const int64_t si = ItemSize(src_t), di = ItemSize(dst_t);
  std::mt19937 rng(static_cast<unsigned>(static_cast<int>(src_t) * 16 + static_cast<int>(dst_t)));
  for (int iter = 0; iter < 40; ++iter) {
    const int64_t num_rows = Uniform(rng, 1, 20);
    const int64_t row_elems = Uniform(rng, 1, 70);
    const int64_t pool_rows = num_rows + Uniform(rng, 0, 12);
    StoreArgs a;
    a.src_dtype = src_t;
    a.dst_dtype = dst_t;
    a.num_rows = num_rows;
    a.row_elems = row_elems;
    a.has_k_scale = iter % 2 == 1;
    a.k_scale = std::uniform_real_distribution<float>(0.05f, 8.0f)(rng);
    a.has_v_scale = iter % 3 == 1;
    a.v_scale = std::uniform_real_distribution<float>(0.05f, 8.0f)(rng);
    std::vector<uint8_t> src[2], dst[2], want[2];
    for (int kv = 0; kv < 2; ++kv) {
      src[kv].resize(num_rows * row_elems * si);
      for (int64_t e = 0; e < num_rows * row_elems; ++e) {
        FromFloat(src_t, RandomValue(rng), &src[kv][e * si]);
      }
      dst[kv].assign(pool_rows * row_elems * di, 0xA5);
    }
    const std::vector<int32_t> loc = DistinctIndices(num_rows, pool_rows, rng);
    for (int kv = 0; kv < 2; ++kv) {
      want[kv] = dst[kv];
      const bool has_scale = kv == 0 ? a.has_k_scale : a.has_v_scale;
      const float scale = kv == 0 ? a.k_scale : a.v_scale;
      for (int64_t r = 0; r < num_rows; ++r) {
        for (int64_t e = 0; e < row_elems; ++e) {
          const uint8_t* in = &src[kv][(r * row_elems + e) * si];
          uint8_t* out = &want[kv][(loc[r] * row_elems + e) * di];
          if (src_t == dst_t) {
            std::memcpy(out, in, static_cast<size_t>(di));
            continue;
          }
          float x = ToFloat(src_t, in);
          if (has_scale) {
            uint8_t tmp[4];
            FromFloat(src_t, x / scale, tmp);  // torch's div_ result lives in src dtype
            x = ToFloat(src_t, tmp);
          }
          FromFloat(dst_t, x, out);
        }
      }
    }
    a.k_src = src[0].data();
    a.v_src = src[1].data();
    a.k_dst = dst[0].data();
    a.v_dst = dst[1].data();
    a.loc = loc.data();
    Status s = StoreCpu(a);
    ASSERT_TRUE(s.ok()) << s;
    for (int kv = 0; kv < 2; ++kv) {
      ASSERT_EQ(dst[kv], want[kv])
          << DTypeName(src_t) << "->" << DTypeName(dst_t) << " iter " << iter << " kv " << kv;
    }
  }
}

std::vector<Pair> AllPairs() {
  std::vector<Pair> out;
  for (DType s : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (DType d : {DType::kBF16, DType::kFP16, DType::kFP32, DType::kFP8E4M3, DType::kFP8E5M2}) {
      out.push_back({s, d});
    }
  }
  out.push_back({DType::kFP8E4M3, DType::kFP8E4M3});  // byte copies
  out.push_back({DType::kFP8E5M2, DType::kFP8E5M2});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Pairs, StoreCpuTest, ::testing::ValuesIn(AllPairs()),
                         [](const auto& info) {
                           return std::string(DTypeName(info.param.src)) + "_to_" +
                                  std::string(DTypeName(info.param.dst));
                         });

TEST(StoreCpuValidationTest, RejectsBadArguments) {
  uint8_t buf[64] = {};
  int32_t loc[1] = {0};
  StoreArgs a;
  a.k_src = a.v_src = buf;
  a.k_dst = a.v_dst = buf + 32;
  a.loc = loc;
  a.num_rows = 1;
  a.row_elems = 4;

  StoreArgs b = a;
  b.num_rows = -2;
  Status s = StoreCpu(b);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("num_rows is -2"), std::string::npos) << s;

  b = a;
  b.v_dst = nullptr;
  s = StoreCpu(b);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("v_dst is null"), std::string::npos) << s;

  b = a;
  b.loc = nullptr;
  s = StoreCpu(b);
  EXPECT_NE(s.message().find("loc is null"), std::string::npos) << s;

  b = a;
  b.src_dtype = DType::kFP8E4M3;
  b.dst_dtype = DType::kBF16;
  s = StoreCpu(b);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("fp8_e4m3"), std::string::npos) << s;

  b = a;
  b.num_rows = 0;
  b.k_src = nullptr;
  EXPECT_TRUE(StoreCpu(b).ok());  // empty: a no-op
}

}  // namespace
}  // namespace kvt::kernels

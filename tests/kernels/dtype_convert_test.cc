// dtype_convert.h against the independent oracle (convert_oracle.h): every code decodes to its
// value; edge values, code midpoints (ties), their neighbours and random floats encode to the
// oracle's code.
#include "kvt/kernels/dtype_convert.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "convert_oracle.h"

namespace kvt::kernels {
namespace {

using testing::Decode;
using testing::Encode;
using testing::Format;

float F(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
uint32_t B(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

struct Case {
  const char* name;
  const Format* format;
  uint32_t (*encode)(float);
  float (*decode)(uint32_t);
};

const Case kCases[] = {
    {"bf16", &testing::kBf16, [](float f) -> uint32_t { return FloatToBf16(f); },
     [](uint32_t c) { return Bf16ToFloat(static_cast<uint16_t>(c)); }},
    {"fp16", &testing::kFp16, [](float f) -> uint32_t { return FloatToFp16(f); },
     [](uint32_t c) { return Fp16ToFloat(static_cast<uint16_t>(c)); }},
    {"e4m3", &testing::kE4M3, [](float f) -> uint32_t { return FloatToFp8E4M3(f); },
     [](uint32_t c) { return Fp8E4M3ToFloat(static_cast<uint8_t>(c)); }},
    {"e5m2", &testing::kE5M2, [](float f) -> uint32_t { return FloatToFp8E5M2(f); },
     [](uint32_t c) { return Fp8E5M2ToFloat(static_cast<uint8_t>(c)); }},
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class ConvertTest : public ::testing::TestWithParam<Case> {
 protected:
  void ExpectEncode(float x) {
    const Case& c = GetParam();
    const uint32_t want = Encode(*c.format, static_cast<double>(x));
    const uint32_t got = c.encode(x);
    ASSERT_EQ(got, want) << c.name << " of float bits 0x" << std::hex << B(x) << " (" << x << ")";
  }
};

TEST_P(ConvertTest, EveryCodeDecodesExactly) {
  const Case& c = GetParam();
  const uint32_t n = 1u << c.format->total_bits();
  for (uint32_t code = 0; code < n; ++code) {
    const double want = Decode(*c.format, code);
    const float got = c.decode(code);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c.name << " code " << code;
    } else {
      ASSERT_EQ(static_cast<double>(got), want) << c.name << " code " << code;
      ASSERT_EQ(std::signbit(got), std::signbit(want)) << c.name << " code " << code;
    }
  }
}

TEST_P(ConvertTest, EdgeValues) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {0.0f,
                  -0.0f,
                  inf,
                  -inf,
                  std::numeric_limits<float>::quiet_NaN(),
                  -std::numeric_limits<float>::quiet_NaN(),
                  F(0x7F800001),
                  F(0xFFC12345),
                  std::numeric_limits<float>::denorm_min(),
                  -std::numeric_limits<float>::denorm_min(),
                  std::numeric_limits<float>::min(),
                  std::numeric_limits<float>::max(),
                  -std::numeric_limits<float>::max(),
                  1.0f,
                  -1.0f,
                  448.0f,
                  464.0f,
                  464.001f,
                  479.99f,
                  480.0f,
                  -480.0f,
                  57344.0f,
                  61439.0f,
                  61440.0f,
                  65504.0f,
                  65519.99f,
                  65520.0f,
                  65536.0f,
                  1e-8f,
                  -1e-8f,
                  5.96e-8f,
                  2.98e-8f,
                  1.9531250e-3f,
                  9.765625e-4f,
                  1.52587890625e-5f,
                  7.62939453125e-6f}) {
    ExpectEncode(x);
  }
}

TEST_P(ConvertTest, MidpointsAndNeighboursOfEveryCode) {
  const Case& c = GetParam();
  const uint32_t half = 1u << (c.format->total_bits() - 1);
  for (uint32_t code = 0; code + 1 < half; ++code) {
    const double lo = Decode(*c.format, code), hi = Decode(*c.format, code + 1);
    if (!std::isfinite(lo) || !std::isfinite(hi)) continue;
    const float mid = static_cast<float>((lo + hi) / 2);  // exact: fewer mantissa bits than float
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);
    for (float x :
         {static_cast<float>(lo), mid, std::nextafter(mid, 0.0f),
          std::nextafter(mid, std::numeric_limits<float>::infinity()), static_cast<float>(hi)}) {
      ExpectEncode(x);
      ExpectEncode(-x);
    }
  }
}

TEST_P(ConvertTest, RandomBitPatterns) {
  std::mt19937 rng(1234);
  for (int i = 0; i < 200000; ++i) ExpectEncode(F(rng()));
}

TEST_P(ConvertTest, RandomValuesNearTheFormatsRange) {
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> exp_dist(-30.0f, 20.0f);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  for (int i = 0; i < 200000; ++i) {
    float x = std::ldexp(mant(rng), static_cast<int>(exp_dist(rng)));
    ExpectEncode((rng() & 1) ? x : -x);
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, ConvertTest, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(ConvertTest, TorchSpecificEncodings) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(FloatToBf16(nan), 0x7FC0);
  EXPECT_EQ(FloatToBf16(-nan), 0x7FC0);  // c10::BFloat16 drops the NaN's sign
  EXPECT_EQ(FloatToFp16(-nan), 0xFE00);
  EXPECT_EQ(FloatToFp8E4M3(1000.0f), 0x7F);  // e4m3fn overflow is NaN, not saturation
  EXPECT_EQ(FloatToFp8E4M3(-1000.0f), 0xFF);
  EXPECT_EQ(FloatToFp8E4M3(464.0f), 0x7E);  // tie to even: 448
  EXPECT_EQ(FloatToFp8E4M3(470.0f), 0x7F);  // above the tie rounds to the NaN code
  EXPECT_EQ(FloatToFp8E5M2(1e6f), 0x7C);    // e5m2 overflow is inf
  EXPECT_EQ(FloatToFp8E5M2(-1e6f), 0xFC);
  EXPECT_EQ(FloatToFp8E5M2(nan), 0x7F);
  EXPECT_EQ(FloatToFp8E4M3(std::ldexp(1.0f, -9)), 0x01);   // smallest subnormal
  EXPECT_EQ(FloatToFp8E4M3(std::ldexp(1.0f, -10)), 0x00);  // tie to even zero
  EXPECT_EQ(FloatToFp8E4M3(std::ldexp(1.5f, -10)), 0x01);
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(FloatToFp16(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(FloatToBf16(1.00390625f), 0x3F80);  // 1 + 2^-8: tie to even 1.0
  EXPECT_EQ(FloatToBf16(1.01171875f), 0x3F82);  // 1 + 3*2^-8: tie to even 1 + 2^-6
}

TEST(ConvertTest, ScaledConversionRoundsToTheSourceDtypeFirst) {
  // 1.00390625 is exact in fp32 but not in bf16; divided by 1 it must first round to bf16.
  const uint16_t x = FloatToBf16(3.0f);
  const float scale = 7.0f;
  const uint16_t q = FloatToBf16(3.0f / 7.0f);
  EXPECT_EQ((ConvertScaled<Bf16Type, Fp8E4M3Type>(x, true, scale)), FloatToFp8E4M3(Bf16ToFloat(q)));
  EXPECT_EQ((ConvertScaled<Fp32Type, Fp8E5M2Type>(3.0f, true, scale)), FloatToFp8E5M2(3.0f / 7.0f));
  EXPECT_EQ((ConvertScaled<Fp16Type, Bf16Type>(FloatToFp16(2.5f), false, 0.0f)), FloatToBf16(2.5f));
}

}  // namespace
}  // namespace kvt::kernels

// Element conversions between float and the KV-cache dtypes (bf16, fp16, fp8 e4m3fn, fp8 e5m2),
// written once for host and device so that StoreCpu and StoreCuda agree bit for bit.
//
// The conversions from float reproduce PyTorch's scalar c10 conversions (what `Tensor.to()`
// computes on the CPU): round to nearest, ties to even, no saturation:
//   bf16:      NaN -> 0x7FC0 (sign dropped, as c10::BFloat16 does); overflow rounds to +-inf.
//   fp16:      NaN -> sign | 0x7E00; overflow (|x| >= 65520) -> +-inf.
//   fp8 e4m3fn (no inf; 0x7F/0xFF are NaN, max finite 448): |x| >= 480, inf and NaN -> NaN with
//              the input's sign; (464, 480) rounds up to the NaN encoding, 464 ties down to 448.
//   fp8 e5m2:  |x| >= 61440 rounds to +-inf (0x7C), NaN -> sign | 0x7F.
// Subnormal inputs and outputs are handled exactly (no flush to zero). The conversions to float
// are exact. Integer arithmetic (plus one explicitly round-to-nearest float add for the fp8
// subnormal range) keeps the device result independent of fast-math and FTZ flags.
//
// Note: torch's CUDA `bf16.to()` canonicalises NaN as 0x7FFF and its CUDA `div_` by a Python
// scalar multiplies by the reciprocal; kvt follows torch's CPU results on both devices.
//
// Every function is pure and thread-safe.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvt/kernels/host_device.h"

namespace kvt::kernels {

KVT_HOST_DEVICE uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

KVT_HOST_DEVICE float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// IEEE round-to-nearest add and divide on both sides (nvcc's plain operators may be contracted
// or approximated under flags; these may not).
KVT_HOST_DEVICE float AddRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

KVT_HOST_DEVICE float DivRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// ---- bf16 ---------------------------------------------------------------------------------

KVT_HOST_DEVICE float Bf16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

KVT_HOST_DEVICE uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  uint32_t rounding_bias = 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

// ---- fp16 ---------------------------------------------------------------------------------

KVT_HOST_DEVICE float Fp16ToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  if (exp == 0x1Fu) return BitsFloat(sign | 0x7F800000u | (mant << 13));  // inf / NaN
  if (exp == 0) {
    if (mant == 0) return BitsFloat(sign);
    // Subnormal: shift the leading one into the implicit position.
    int e = 1;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --e;
    }
    mant &= 0x3FFu;
    return BitsFloat(sign | (static_cast<uint32_t>(e + 112) << 23) | (mant << 13));
  }
  return BitsFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}

KVT_HOST_DEVICE uint16_t FloatToFp16(float f) {
  uint32_t u = FloatBits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;   // NaN
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds to inf
  if (a < 0x38800000u) {                        // below 2^-14: fp16 subnormal or zero
    if (a < 0x33000000u) return sign;           // <= 2^-25 (ties to even zero)
    uint32_t exp = a >> 23;
    uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
    uint32_t shift = 126u - exp;  // units of 2^-24
    uint32_t q = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return sign | static_cast<uint16_t>(q);
  }
  // Normal: rebias and round the 13 dropped mantissa bits; a carry moves into the exponent.
  uint32_t r = a + 0xFFFu + ((a >> 13) & 1u);
  return sign | static_cast<uint16_t>((r - (112u << 23)) >> 13);
}

// ---- fp8 e4m3fn -----------------------------------------------------------------------------

KVT_HOST_DEVICE float Fp8E4M3ToFloat(uint8_t v) {
  uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  uint32_t exp = (v >> 3) & 0xFu;
  uint32_t mant = v & 0x7u;
  if (exp == 0xFu && mant == 0x7u) return BitsFloat(sign | 0x7FC00000u);  // the only NaN
  if (exp == 0) {
    if (mant == 0) return BitsFloat(sign);
    int e = 1;
    while ((mant & 0x8u) == 0) {
      mant <<= 1;
      --e;
    }
    mant &= 0x7u;
    return BitsFloat(sign | (static_cast<uint32_t>(e + 120) << 23) | (mant << 20));
  }
  return BitsFloat(sign | ((exp + 120u) << 23) | (mant << 20));
}

// c10::detail::fp8e4m3fn_from_fp32_value, step for step.
KVT_HOST_DEVICE uint8_t FloatToFp8E4M3(float f) {
  constexpr uint32_t kFp8Max = 1087u << 20;     // 480.0f: from here on the result is NaN
  constexpr uint32_t kDenormMask = 141u << 23;  // 2^14: one ulp there is e4m3's 2^-9
  uint32_t bits = FloatBits(f);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint8_t result;
  if (bits >= kFp8Max) {
    result = 0x7Fu;
  } else if (bits < (121u << 23)) {  // below 2^-6, the smallest normal
    float sum = AddRn(BitsFloat(bits), BitsFloat(kDenormMask));
    result = static_cast<uint8_t>(FloatBits(sum) - kDenormMask);
  } else {
    uint32_t mant_odd = (bits >> 20) & 1u;
    bits += (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu;
    bits += mant_odd;
    result = static_cast<uint8_t>(bits >> 20);
  }
  return result | static_cast<uint8_t>(sign >> 24);
}

// ---- fp8 e5m2 -----------------------------------------------------------------------------

KVT_HOST_DEVICE float Fp8E5M2ToFloat(uint8_t v) {
  // e5m2 is the top byte of an fp16.
  return Fp16ToFloat(static_cast<uint16_t>(static_cast<uint16_t>(v) << 8));
}

// c10::detail::fp8e5m2_from_fp32_value, step for step.
KVT_HOST_DEVICE uint8_t FloatToFp8E5M2(float f) {
  constexpr uint32_t kFp32Inf = 255u << 23;
  constexpr uint32_t kFp8Max = 143u << 23;      // 65536.0f
  constexpr uint32_t kDenormMask = 134u << 23;  // 2^7: one ulp there is e5m2's 2^-16
  uint32_t bits = FloatBits(f);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint8_t result;
  if (bits >= kFp8Max) {
    result = bits > kFp32Inf ? 0x7Fu : 0x7Cu;
  } else if (bits < (113u << 23)) {  // below 2^-14, the smallest normal
    float sum = AddRn(BitsFloat(bits), BitsFloat(kDenormMask));
    result = static_cast<uint8_t>(FloatBits(sum) - kDenormMask);
  } else {
    uint32_t mant_odd = (bits >> 21) & 1u;
    bits += (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFFFu;
    bits += mant_odd;
    result = static_cast<uint8_t>(bits >> 21);
  }
  return result | static_cast<uint8_t>(sign >> 24);
}

// ---- Type tags for templated kernels --------------------------------------------------------

struct Bf16Type {
  using Storage = uint16_t;
  static KVT_HOST_DEVICE float ToFloat(Storage v) { return Bf16ToFloat(v); }
  static KVT_HOST_DEVICE Storage FromFloat(float f) { return FloatToBf16(f); }
};
struct Fp16Type {
  using Storage = uint16_t;
  static KVT_HOST_DEVICE float ToFloat(Storage v) { return Fp16ToFloat(v); }
  static KVT_HOST_DEVICE Storage FromFloat(float f) { return FloatToFp16(f); }
};
struct Fp32Type {
  using Storage = float;
  static KVT_HOST_DEVICE float ToFloat(Storage v) { return v; }
  static KVT_HOST_DEVICE Storage FromFloat(float f) { return f; }
};
struct Fp8E4M3Type {
  using Storage = uint8_t;
  static KVT_HOST_DEVICE float ToFloat(Storage v) { return Fp8E4M3ToFloat(v); }
  static KVT_HOST_DEVICE Storage FromFloat(float f) { return FloatToFp8E4M3(f); }
};
struct Fp8E5M2Type {
  using Storage = uint8_t;
  static KVT_HOST_DEVICE float ToFloat(Storage v) { return Fp8E5M2ToFloat(v); }
  static KVT_HOST_DEVICE Storage FromFloat(float f) { return FloatToFp8E5M2(f); }
};

// The store's element conversion (tokenspeed's set_kv_buffer): optionally divide by `scale`
// in float and round the quotient to Src (torch's `div_` on a Src tensor), then convert to Dst.
template <typename Src, typename Dst>
KVT_HOST_DEVICE typename Dst::Storage ConvertScaled(typename Src::Storage v, bool has_scale,
                                                    float scale) {
  float x = Src::ToFloat(v);
  if (has_scale) x = Src::ToFloat(Src::FromFloat(DivRn(x, scale)));
  return Dst::FromFloat(x);
}

}  // namespace kvt::kernels

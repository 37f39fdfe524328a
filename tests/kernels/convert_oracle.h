// Test-only oracle for the fp conversions: decodes every code of a format from its bit fields
// with ldexp, and rounds by searching the sorted code values (ties to the even code), without
// sharing any code with kvt/kernels/dtype_convert.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace kvt::kernels::testing {

struct Format {
  int exp_bits;
  int mant_bits;
  bool ieee_inf;      // all-ones exponent is inf/NaN (IEEE); false for e4m3fn (only S.1111.111 NaN)
  uint32_t nan_code;  // the code a NaN input becomes (sign added if nan_keeps_sign)
  bool nan_keeps_sign;
  int total_bits() const { return 1 + exp_bits + mant_bits; }
};

inline const Format kBf16{8, 7, true, 0x7FC0, false};
inline const Format kFp16{5, 10, true, 0x7E00, true};
inline const Format kE4M3{4, 3, false, 0x7F, true};
inline const Format kE5M2{5, 2, true, 0x7F, true};

// Value of a non-negative code (sign bit clear); NaN for NaN codes, inf for inf.
inline double DecodeMagnitude(const Format& f, uint32_t code) {
  const uint32_t mant = code & ((1u << f.mant_bits) - 1);
  const uint32_t exp = code >> f.mant_bits;
  const uint32_t max_exp = (1u << f.exp_bits) - 1;
  const int bias = (1 << (f.exp_bits - 1)) - 1;
  if (f.ieee_inf && exp == max_exp) {
    return mant == 0 ? std::numeric_limits<double>::infinity()
                     : std::numeric_limits<double>::quiet_NaN();
  }
  if (!f.ieee_inf && exp == max_exp && mant == (1u << f.mant_bits) - 1) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  if (exp == 0) return std::ldexp(static_cast<double>(mant), 1 - bias - f.mant_bits);
  return std::ldexp(static_cast<double>(mant + (1u << f.mant_bits)),
                    static_cast<int>(exp) - bias - f.mant_bits);
}

inline double Decode(const Format& f, uint32_t code) {
  const uint32_t sign_bit = 1u << (f.total_bits() - 1);
  const double m = DecodeMagnitude(f, code & (sign_bit - 1));
  return (code & sign_bit) ? -m : m;
}

// Rounds x (any double; the tests pass float values) to the format: nearest finite code, ties to
// the even code; values at or past the midpoint between the largest finite value and the next
// power of the ulp ladder become inf (IEEE formats) or NaN (e4m3fn).
inline uint32_t Encode(const Format& f, double x) {
  const uint32_t sign_bit = 1u << (f.total_bits() - 1);
  if (std::isnan(x)) {
    return f.nan_keeps_sign && std::signbit(x) ? (f.nan_code | sign_bit) : f.nan_code;
  }
  const uint32_t sign = std::signbit(x) ? sign_bit : 0;
  const double a = std::fabs(x);
  // Non-negative codes increase with their value, and the finite ones are 0..max_code.
  const uint32_t max_code =
      f.ieee_inf ? ((((1u << f.exp_bits) - 1) << f.mant_bits) - 1) : f.nan_code - 1;
  const double max_v = DecodeMagnitude(f, max_code);
  const double ulp = max_v - DecodeMagnitude(f, max_code - 1);
  const uint32_t overflow_code =
      f.ieee_inf ? (((1u << f.exp_bits) - 1) << f.mant_bits) : f.nan_code;
  // A virtual code max + ulp with an even mantissa stands for the overflow result.
  const double virt = max_v + ulp;
  if (a >= virt) return sign | overflow_code;
  if (a > max_v) {
    const double mid = (max_v + virt) / 2;
    if (a < mid) return sign | max_code;
    if (a > mid) return sign | overflow_code;
    return sign | ((max_code & 1) ? overflow_code : max_code);
  }
  // Binary search the first code with value >= a.
  uint32_t lo = 0, hi = max_code;
  while (lo < hi) {
    uint32_t mid = (lo + hi) / 2;
    if (DecodeMagnitude(f, mid) >= a) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  const uint32_t up = lo;
  const double up_v = DecodeMagnitude(f, up);
  if (up_v == a || lo == 0) return sign | up;
  const uint32_t down = lo - 1;
  const double down_v = DecodeMagnitude(f, down);
  const double d_up = up_v - a, d_down = a - down_v;
  if (d_down < d_up) return sign | down;
  if (d_up < d_down) return sign | up;
  return sign | ((down & 1) ? up : down);
}

}  // namespace kvt::kernels::testing

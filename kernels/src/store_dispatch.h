// Private to kvt::kernels: maps a (src, dst) DType pair of a converting store onto the type
// tags of dtype_convert.h, for the CPU loop and the CUDA launch alike. Pure.
#pragma once

#include "kvt/common/dtype.h"
#include "kvt/kernels/dtype_convert.h"

namespace kvt::kernels::internal {

template <typename Src, typename Fn>
bool VisitDst(DType dst, Fn&& fn) {
  switch (dst) {
    case DType::kBF16:
      fn(Src{}, Bf16Type{});
      return true;
    case DType::kFP16:
      fn(Src{}, Fp16Type{});
      return true;
    case DType::kFP32:
      fn(Src{}, Fp32Type{});
      return true;
    case DType::kFP8E4M3:
      fn(Src{}, Fp8E4M3Type{});
      return true;
    case DType::kFP8E5M2:
      fn(Src{}, Fp8E5M2Type{});
      return true;
    default:
      return false;
  }
}

// Calls fn(SrcTag{}, DstTag{}) for a supported conversion; false if there is none.
template <typename Fn>
bool VisitConversion(DType src, DType dst, Fn&& fn) {
  switch (src) {
    case DType::kBF16:
      return VisitDst<Bf16Type>(dst, fn);
    case DType::kFP16:
      return VisitDst<Fp16Type>(dst, fn);
    case DType::kFP32:
      return VisitDst<Fp32Type>(dst, fn);
    default:
      return false;
  }
}

}  // namespace kvt::kernels::internal

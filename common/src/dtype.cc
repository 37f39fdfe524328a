#include "kvt/common/dtype.h"

#include <array>
#include <utility>

namespace kvt {

int64_t ItemSize(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
    case DType::kFP16:
      return 2;
    case DType::kFP32:
      return 4;
    case DType::kFP8E4M3:
    case DType::kFP8E5M2:
    case DType::kUInt8:
      return 1;
  }
  return 0;
}

DType StoreDType(DType dtype) {
  return (dtype == DType::kFP8E4M3 || dtype == DType::kFP8E5M2) ? DType::kUInt8 : dtype;
}

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bf16";
    case DType::kFP16:
      return "fp16";
    case DType::kFP32:
      return "fp32";
    case DType::kFP8E4M3:
      return "fp8_e4m3";
    case DType::kFP8E5M2:
      return "fp8_e5m2";
    case DType::kUInt8:
      return "uint8";
  }
  return "unknown";
}

StatusOr<DType> ParseDType(std::string_view name) {
  static constexpr std::array<std::pair<std::string_view, DType>, 14> kNames = {{
      {"bf16", DType::kBF16},
      {"bfloat16", DType::kBF16},
      {"fp16", DType::kFP16},
      {"float16", DType::kFP16},
      {"half", DType::kFP16},
      {"fp32", DType::kFP32},
      {"float32", DType::kFP32},
      {"float", DType::kFP32},
      {"fp8_e4m3", DType::kFP8E4M3},
      {"float8_e4m3fn", DType::kFP8E4M3},
      {"fp8_e5m2", DType::kFP8E5M2},
      {"float8_e5m2", DType::kFP8E5M2},
      {"uint8", DType::kUInt8},
      {"u8", DType::kUInt8},
  }};
  for (const auto& [n, d] : kNames) {
    if (n == name) return d;
  }
  return InvalidArgument("unknown dtype '" + std::string(name) +
                         "'; use one of bf16, fp16, fp32, fp8_e4m3, fp8_e5m2");
}

bool IsPoolDType(DType dtype) { return dtype != DType::kUInt8; }

}  // namespace kvt

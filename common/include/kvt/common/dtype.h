// Element types of KV pools and their storage types.
//
// fp8 pools store their elements as uint8 and view them back as fp8 (as tokenspeed does: the
// store dtype differs from the dtype). Every function here is pure and thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kvt/common/status.h"

namespace kvt {

enum class DType : uint8_t {
  kBF16 = 0,
  kFP16 = 1,
  kFP32 = 2,
  kFP8E4M3 = 3,
  kFP8E5M2 = 4,
  kUInt8 = 5,  // the store type of the fp8 types; never a pool's element type
};

// Bytes of one element.
int64_t ItemSize(DType dtype);

// The type the bytes are stored as: uint8 for the fp8 types, the type itself otherwise.
DType StoreDType(DType dtype);

// "bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "uint8".
std::string_view DTypeName(DType dtype);

// Parses the names above (and the aliases "bfloat16", "float16", "half", "float32", "float",
// "float8_e4m3fn", "float8_e5m2"). Unknown names give InvalidArgument listing the valid ones.
StatusOr<DType> ParseDType(std::string_view name);

// True for the element types a pool may hold (all but kUInt8).
bool IsPoolDType(DType dtype);

}  // namespace kvt

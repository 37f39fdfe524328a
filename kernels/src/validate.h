// Private to kvt::kernels: argument checks shared by the CUDA and CPU entry points, so both
// refuse exactly the same calls with the same messages. Pure functions.
#pragma once

#include <cstdint>

#include "kvt/common/status.h"
#include "kvt/kernels/kernels.h"

namespace kvt::kernels::internal {

Status NonNegative(const char* fn, const char* name, int64_t value);

Status ValidatePageCopy(const PageCopyArgs& args, const char* fn);
Status ValidatePack(const PackArgs& args, const char* fn);
// Store: src in {bf16, fp16, fp32} and dst a pool dtype, or src == dst (a byte copy).
Status ValidateStore(const StoreArgs& args, const char* fn);
Status ValidateTiledCopy(const TiledCopyArgs& args, const char* fn);
Status ValidatePattern(const PatternArgs& args, const char* fn);

}  // namespace kvt::kernels::internal

#include <cstdint>
#include <cub/device/device_memcpy.cuh>

#include "bench_cub.h"

namespace kvt::bench {

StatusOr<CubBatchedCopy> CubBatchedCopy::Create(const CopyList& list) {
  CubBatchedCopy c;
  c.count_ = list.size();
  if (c.count_ == 0) return c;
  const size_t bytes = c.count_ * sizeof(void*);
  static_assert(sizeof(size_t) == sizeof(void*));
  KVT_ASSIGN_OR_RETURN(c.srcs_, cuda::DeviceBuffer::Allocate(bytes));
  KVT_ASSIGN_OR_RETURN(c.dsts_, cuda::DeviceBuffer::Allocate(bytes));
  KVT_ASSIGN_OR_RETURN(c.sizes_, cuda::DeviceBuffer::Allocate(bytes));
  KVT_RETURN_IF_ERROR(cuda::Copy(c.srcs_.data(), list.srcs.data(), bytes));
  KVT_RETURN_IF_ERROR(cuda::Copy(c.dsts_.data(), list.dsts.data(), bytes));
  KVT_RETURN_IF_ERROR(cuda::Copy(c.sizes_.data(), list.sizes.data(), bytes));
  BENCH_CUDA(cub::DeviceMemcpy::Batched(nullptr, c.temp_bytes_, c.srcs_.as<const void*>(),
                                        c.dsts_.as<void*>(), c.sizes_.as<size_t>(),
                                        static_cast<int64_t>(c.count_)));
  KVT_ASSIGN_OR_RETURN(c.temp_,
                       cuda::DeviceBuffer::Allocate(c.temp_bytes_ > 0 ? c.temp_bytes_ : 1));
  return c;
}

Status CubBatchedCopy::Run(cudaStream_t stream) const {
  if (count_ == 0) return OkStatus();
  size_t temp_bytes = temp_bytes_;
  BENCH_CUDA(cub::DeviceMemcpy::Batched(temp_.data(), temp_bytes, srcs_.as<const void*>(),
                                        dsts_.as<void*>(), sizes_.as<size_t>(),
                                        static_cast<int64_t>(count_), stream));
  return OkStatus();
}

}  // namespace kvt::bench

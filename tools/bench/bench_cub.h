// cub::DeviceMemcpy::Batched as a peer of kvt's page copy: NVIDIA's own SM-based batched memcpy
// (CCCL), which copies a list of (source, destination, size) buffers in one launch the way
// PageCopyCuda copies (buffer, page) items, but from per-item pointer arrays instead of base
// tables and index lists. Kept in its own translation unit because cub is a CUDA-only header
// library.
//
// Thread safety: one object per thread.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "bench_gpu.h"
#include "kvt/common/status.h"
#include "kvt/kernels/cuda_util.h"

namespace kvt::bench {

class CubBatchedCopy {
 public:
  // Uploads the list's pointers and sizes and sizes cub's temporary storage. The list's pointers
  // must be device memory of the current device.
  static StatusOr<CubBatchedCopy> Create(const CopyList& list);

  // Enqueues one cub::DeviceMemcpy::Batched over the whole list on `stream`.
  Status Run(cudaStream_t stream) const;

 private:
  cuda::DeviceBuffer srcs_, dsts_, sizes_, temp_;
  size_t count_ = 0;
  size_t temp_bytes_ = 0;
};

}  // namespace kvt::bench

// Launch knobs of the page gather/scatter kernel, for benchmarks and tuning experiments.
// Production callers use PageCopyCuda (kernels.h), which uses the defaults below; kvt-bench
// sweeps these to find them. Thread safety: as kernels.h (reentrant).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvt/common/status.h"
#include "kvt/kernels/kernels.h"

namespace kvt::kernels {

struct PageCopyTuning {
  // 16-byte loads each lane keeps in flight before its stores: 4 or 8.
  int32_t unroll = 4;
  // Resident blocks per multiprocessor in the persistent grid; 0 = as many as fit.
  int32_t blocks_per_sm = 0;
  // Threads per block (a multiple of 32, at most 1024).
  int32_t threads_per_block = 512;
  // Threads that copy one (buffer, page) item together: a power of two in [32, 512] dividing
  // threads_per_block, or 0 for "as many as one round of 16-byte accesses fills". One warp per
  // item measured best on an H200 (docs/kernels.md): larger groups were slower.
  int32_t threads_per_item = 32;
  // Streaming cache hints (ld.global.cs / st.global.cs) instead of ld.global.nc / plain stores.
  bool streaming = true;
  // Enumerate items page-major (i * num_buffers + b) instead of buffer-major (b * num_pages + i).
  bool page_major = false;
};

// The tuning PageCopyCuda uses.
PageCopyTuning DefaultPageCopyTuning();

// PageCopyCuda with explicit launch knobs (validated: unroll 4|8, threads a multiple of 32).
Status PageCopyCudaTuned(const PageCopyArgs& args, const PageCopyTuning& tuning,
                         cudaStream_t stream);

}  // namespace kvt::kernels

// Launch knobs of the page gather/scatter kernel, for benchmarks and tuning experiments.
// Production callers use PageCopyCuda (kernels.h), which uses the defaults below; kvt-bench
// sweeps these to find them. Thread safety: as kernels.h (reentrant).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvt/common/status.h"
#include "kvt/kernels/kernels.h"

namespace kvt::kernels {

// The member defaults are DefaultPageCopyTuning(), the best variant measured on an H200
// (docs/kernels.md, run 3: unroll 8 with uncapped registers, 256 threads, 8 KiB chunks).
struct PageCopyTuning {
  // 16-byte loads each lane keeps in flight before its stores: 4 or 8. Unroll 8 is compiled
  // without a second-block register cap (about 100 registers, no spills): 2 blocks of 256 per SM.
  int32_t unroll = 8;
  // Resident blocks per multiprocessor in the persistent grid; 0 = as many as fit.
  int32_t blocks_per_sm = 0;
  // Threads per block (a multiple of 32, at most 512).
  int32_t threads_per_block = 256;
  // Threads that copy one unit together: a power of two in [32, 512] dividing
  // threads_per_block, or 0 for "as many as one round of 16-byte accesses fills". One warp per
  // unit measured best on an H200 (docs/kernels.md): larger groups were slower.
  int32_t threads_per_item = 32;
  // Streaming cache hints (ld.global.cs / st.global.cs) instead of ld.global.nc / plain stores.
  bool streaming = true;
  // Enumerate items page-major (i * num_buffers + b) instead of buffer-major (b * num_pages + i).
  bool page_major = false;
  // Unit of work handed to a group: items larger than this are split into chunks of this many
  // bytes (the last one shorter), so that every group gets many units and the grid's last round
  // is balanced. 0 = whole items. Must be a multiple of 16 (chunk starts keep the item's
  // alignment).
  int32_t chunk_bytes = 8192;
  // Before copying a unit, its group's first lane asks L2 to fetch the unit's whole source range
  // (cp.async.bulk.prefetch.L2; skipped when the source or length is not 16-aligned). Measured
  // slower on an H200 (docs/kernels.md); kept as an experiment knob.
  bool prefetch_l2 = false;
};

// The tuning PageCopyCuda uses.
PageCopyTuning DefaultPageCopyTuning();

// PageCopyCuda with explicit launch knobs (validated: unroll 4|8, threads a multiple of 32,
// chunk_bytes 0 or a multiple of 16).
Status PageCopyCudaTuned(const PageCopyArgs& args, const PageCopyTuning& tuning,
                         cudaStream_t stream);

}  // namespace kvt::kernels

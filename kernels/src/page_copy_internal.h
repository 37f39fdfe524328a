// Private to kvt::kernels: the one description of a batched (buffer, page) copy that PageCopy,
// Pack, Unpack and the same-dtype Store all lower to, so that one CUDA kernel and one CPU loop
// serve every caller. Thread safety: plain values.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvt/common/status.h"
#include "kvt/kernels/host_device.h"
#include "kvt/kernels/kernels.h"
#include "kvt/kernels/tuning.h"

namespace kvt::kernels::internal {

// One side (source or destination) of a copy. Item (b, i) lives at
//   BufferBase(b) + (pages ? pages[i] : i) * page_stride + offset
// where BufferBase(b) is bases[b] when a table is given, else base + b * buffer_stride. The
// second form describes a staging area (pack/unpack) or two raw pointers (K and V of a store;
// the stride is then their difference modulo 2^64, which unsigned arithmetic undoes exactly).
struct CopySide {
  const uint64_t* bases = nullptr;
  uint64_t base = 0;
  uint64_t buffer_stride = 0;
  const int32_t* pages = nullptr;
  int64_t page_stride = 0;
  int64_t offset = 0;
};

struct CopyDesc {
  CopySide src;
  CopySide dst;
  int32_t num_buffers = 0;
  int64_t num_pages = 0;
  int64_t bytes = 0;
  bool page_major = false;  // see the note below; a tuning knob for experiments
  // Work split (set by CopyDevice from the tuning): each item is chunks_per_item units of
  // chunk_bytes (the last one shorter); chunks_per_item == 1 means whole items.
  int64_t chunk_bytes = 0;
  uint32_t chunks_per_item = 1;
  bool prefetch_l2 = false;
};

// Items are enumerated buffer-major (b * num_pages + i): warps working at the same time then
// touch the same buffer, which keeps their pages within fewer GPU TLB entries.

CopyDesc DescFromPageCopy(const PageCopyArgs& args);
CopyDesc DescFromPack(const PackArgs& args);    // pool -> staging
CopyDesc DescFromUnpack(const PackArgs& args);  // staging -> pool

// The CPU copy of every item.
void CopyHost(const CopyDesc& desc);

// How a launch splits items of `item_bytes` into units: chunks of tuning.chunk_bytes (the last
// one shorter) when the item is longer, else whole items (also when it would take more than
// 2^31 - 1 chunks). `chunk_bytes` is the unit's length, the last chunk's possibly less.
struct UnitSplit {
  int64_t chunk_bytes = 0;
  uint32_t chunks_per_item = 1;
};
UnitSplit SplitItems(const PageCopyTuning& tuning, int64_t item_bytes);

// The chunk size a launch of `num_items` items of `item_bytes` uses on `sms` multiprocessors:
// tuning.chunk_bytes, or for a launch with fewer units than kSmallLaunchUnitsPerSm per
// multiprocessor at that size, the smallest power of two that still makes about that many units,
// no smaller than tuning.min_chunk_bytes (PageCopyTuning::min_chunk_bytes).
int64_t LaunchChunkBytes(const PageCopyTuning& tuning, int64_t item_bytes, uint64_t num_items,
                         int sms);

// Blocks of a launch with `groups_per_block` groups per block: one group per unit, capped at
// sms x blocks_per_sm when the tuning sets blocks_per_sm, else at sms x `fit_per_sm` (the
// blocks that fit at once) for a persistent grid, and always at gridDim.x's limit (2^31 - 1).
// Groups loop over units, so a capped grid still covers them all.
uint64_t GridBlocks(const PageCopyTuning& tuning, uint64_t num_units, uint64_t groups_per_block,
                    int sms, int fit_per_sm);

// Launches the CUDA copy (no validation: callers validated). Empty descriptions are no-ops.
Status CopyDevice(const CopyDesc& desc, const PageCopyTuning& tuning, cudaStream_t stream);

// Multiprocessor count of the current device, read once per device and cached.
StatusOr<int> CurrentDeviceSmCount();

}  // namespace kvt::kernels::internal

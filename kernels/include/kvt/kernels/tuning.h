// Launch knobs of the page gather/scatter kernel, for benchmarks and tuning. Production callers
// use PageCopyCuda (kernels.h), which uses the defaults below; `kvt-bench kernels --sweep` times
// alternatives. Thread safety: as kernels.h (reentrant).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvt/common/status.h"
#include "kvt/kernels/kernels.h"

namespace kvt::kernels {

// Launch parameters of the page copy kernel. The member defaults are DefaultPageCopyTuning():
// one-pass grid, one warp per 16 KiB unit, auto unroll, 512 threads, ld.global.nc loads with
// plain stores.
struct PageCopyTuning {
  // 16-byte loads each lane keeps in flight before its stores: 4 or 8, or 0 for auto: 8 when a
  // unit (chunk or whole item) fills one round of 32 lanes x 8 x 16 bytes (4 KiB), else 4.
  // Unroll 8 is compiled without a second-block register cap.
  int32_t unroll = 0;
  // Grid policy. false (default): one-pass grid, one group per unit: the launch has as many
  // blocks as the work needs and the hardware hands blocks to multiprocessors as others finish.
  // true: persistent grid of the blocks that fit at once, each group looping over units.
  bool persistent = false;
  // Caps the grid at this many blocks per multiprocessor, groups looping over the remaining
  // units; 0 = no cap (one-pass) or, with persistent, as many as fit.
  int32_t blocks_per_sm = 0;
  // Threads per block (a multiple of 32, at most 512).
  int32_t threads_per_block = 512;
  // Threads that copy one unit together: a power of two in [32, 512] dividing
  // threads_per_block, or 0 for "as many as one round of 16-byte accesses fills".
  int32_t threads_per_item = 32;
  // Streaming cache hints (ld.global.cs / st.global.cs) instead of ld.global.nc / plain stores.
  bool streaming = false;
  // Enumerate items page-major (i * num_buffers + b) instead of buffer-major (b * num_pages + i).
  bool page_major = false;
  // Unit of work handed to a group: items larger than this are split into chunks of this many
  // bytes (the last one shorter). In the one-pass grid this sets how much one group copies; in
  // a persistent grid it also balances the grid's last round. 0 = whole items. Must be a
  // multiple of 16 (chunk starts keep the item's alignment).
  int32_t chunk_bytes = 16384;
  // A launch too small to give every multiprocessor kSmallLaunchUnitsPerSm units of chunk_bytes
  // (one page of 16 or 64 tokens: a hundred-odd 16 KiB units, a few blocks, each warp looping
  // over its unit one memory round trip after another) splits its items into smaller chunks,
  // down to this many bytes (a power of two chunk, enough of them for every multiprocessor), so
  // that many warps copy it at once. 0 = never, as when it is not below chunk_bytes (or
  // chunk_bytes is 0); else a multiple of 16.
  int32_t min_chunk_bytes = 2048;
  // Before copying a unit, its group's first lane asks L2 to fetch the unit's whole source range
  // (cp.async.bulk.prefetch.L2; skipped when the source or length is not 16-aligned). Off by
  // default.
  bool prefetch_l2 = false;
};

// Units per multiprocessor below which a launch splits its items finer
// (PageCopyTuning::min_chunk_bytes).
inline constexpr int kSmallLaunchUnitsPerSm = 16;

// The tuning PageCopyCuda uses.
PageCopyTuning DefaultPageCopyTuning();

// The unroll a launch with `tuning` uses on items of `item_bytes`: tuning.unroll, or for 0
// (auto) 8 when a unit (a chunk_bytes chunk, or the whole item) fills one round of its group at
// unroll 8 (threads_per_item x 8 x 16 bytes, an automatic group counting as one warp: 4 KiB),
// else 4 (a smaller unit at unroll 8 would leave lanes idle).
int32_t EffectiveUnroll(const PageCopyTuning& tuning, int64_t item_bytes);

// PageCopyCuda with explicit launch knobs (validated: unroll 0|4|8, threads a multiple of 32,
// chunk_bytes 0 or a multiple of 16, threads_per_item and blocks_per_sm as above).
Status PageCopyCudaTuned(const PageCopyArgs& args, const PageCopyTuning& tuning,
                         cudaStream_t stream);

// PackCuda / UnpackCuda with explicit launch knobs (validated as above).
Status PackCudaTuned(const PackArgs& args, const PageCopyTuning& tuning, cudaStream_t stream);
Status UnpackCudaTuned(const PackArgs& args, const PageCopyTuning& tuning, cudaStream_t stream);

}  // namespace kvt::kernels

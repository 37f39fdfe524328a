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
// (docs/kernels.md, session 6: one group per unit, auto unroll, 512 threads, 16 KiB chunks,
// ld.global.nc loads and plain stores).
struct PageCopyTuning {
  // 16-byte loads each lane keeps in flight before its stores: 4 or 8, or 0 for auto: 8 when a
  // unit (chunk or whole item) fills one round of 32 lanes x 8 x 16 bytes (4 KiB), else 4.
  // Unroll 8 is compiled without a second-block register cap (about 100 registers, no spills).
  int32_t unroll = 0;
  // Grid policy. false (default): one-pass grid, one group per unit: the launch has as many
  // blocks as the work needs and the hardware hands blocks to multiprocessors as others finish.
  // true: persistent grid of the blocks that fit at once, each group looping over units
  // (the default until session 5: 3-4 % slower on an H200, docs/kernels.md).
  bool persistent = false;
  // Caps the grid at this many blocks per multiprocessor, groups looping over the remaining
  // units; 0 = no cap (one-pass) or, with persistent, as many as fit.
  int32_t blocks_per_sm = 0;
  // Threads per block (a multiple of 32, at most 512).
  int32_t threads_per_block = 512;
  // Threads that copy one unit together: a power of two in [32, 512] dividing
  // threads_per_block, or 0 for "as many as one round of 16-byte accesses fills". One warp per
  // unit measured best on an H200 (docs/kernels.md): larger groups were slower.
  int32_t threads_per_item = 32;
  // Streaming cache hints (ld.global.cs / st.global.cs) instead of ld.global.nc / plain stores.
  // In a one-pass grid the plain form moved about 3 % more on an H200 (docs/kernels.md).
  bool streaming = false;
  // Enumerate items page-major (i * num_buffers + b) instead of buffer-major (b * num_pages + i).
  bool page_major = false;
  // Unit of work handed to a group: items larger than this are split into chunks of this many
  // bytes (the last one shorter). In the one-pass grid this sets how much one group copies; in
  // a persistent grid it also balances the grid's last round. 0 = whole items. Must be a
  // multiple of 16 (chunk starts keep the item's alignment).
  int32_t chunk_bytes = 16384;
  // Before copying a unit, its group's first lane asks L2 to fetch the unit's whole source range
  // (cp.async.bulk.prefetch.L2; skipped when the source or length is not 16-aligned). Measured
  // slower on an H200 (docs/kernels.md); kept as an experiment knob.
  bool prefetch_l2 = false;
  // Register software pipelining of the 16-byte path (session 3 experiment): each lane keeps two
  // batches of `unroll` 16-byte registers and issues the loads of batch k+1 before the stores of
  // batch k, so a warp always has loads in flight. Needs threads_per_item 32.
  bool pipeline = false;
  // Loads through shared memory with Ampere-style cp.async (session 3 experiment): each warp owns
  // a ring of async_stages stages of 32 x unroll x 16 bytes in dynamic shared memory, issues the
  // cp.async loads of stage k + async_stages - 1 while it drains stage k to global memory, so
  // bytes in flight cost no registers. 16-aligned units only (others take the narrow path).
  // Needs threads_per_item 32, not pipeline, and threads_per_block / 32 * async_stages * unroll
  // * 512 bytes of shared memory per block (at most 227 KiB).
  bool async_smem = false;
  // Ring stages per warp for async_smem: 2..8 (checked whatever async_smem is).
  int32_t async_stages = 4;
};

// The tuning PageCopyCuda uses.
PageCopyTuning DefaultPageCopyTuning();

// The unroll a launch with `tuning` uses on items of `item_bytes`: tuning.unroll, or for 0
// (auto) 8 when a unit (a chunk_bytes chunk, or the whole item) fills one round of its group at
// unroll 8 (threads_per_item x 8 x 16 bytes, an automatic group counting as one warp: 4 KiB),
// else 4. (On an H200, 2 KiB items at unroll 8 left half the lanes idle: 0.77-0.80 of the
// contiguous copy against 0.96 at unroll 4.)
int32_t EffectiveUnroll(const PageCopyTuning& tuning, int64_t item_bytes);

// PageCopyCuda with explicit launch knobs (validated: unroll 0|4|8, threads a multiple of 32,
// chunk_bytes 0 or a multiple of 16, the pipeline / async_smem constraints above).
Status PageCopyCudaTuned(const PageCopyArgs& args, const PageCopyTuning& tuning,
                         cudaStream_t stream);

// PackCuda / UnpackCuda with explicit launch knobs (validated as above).
Status PackCudaTuned(const PackArgs& args, const PageCopyTuning& tuning, cudaStream_t stream);
Status UnpackCudaTuned(const PackArgs& args, const PageCopyTuning& tuning, cudaStream_t stream);

}  // namespace kvt::kernels

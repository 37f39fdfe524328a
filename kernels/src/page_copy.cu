// The page gather/scatter kernel behind PageCopyCuda, PackCuda, UnpackCuda and the same-dtype
// StoreCuda.
//
// Design (DESIGN.md: one launch moves every (buffer, page) item of a batch):
//  - one warp (by default; a larger power-of-two group is a tuning knob) per unit of work; a
//    unit is a whole item or, with PageCopyTuning::chunk_bytes, one fixed-size chunk of it;
//    items are enumerated buffer-major so concurrently running warps stay within one buffer
//    (fewer TLB entries live at once);
//  - one-pass grid by default: as many blocks as there are units for their groups, handed to
//    the multiprocessors by the hardware as earlier blocks finish. On an H200 this moved 3-4 %
//    more than the persistent grid (the blocks that fit at once, groups looping over units)
//    that sessions 1-5 used, which stays a knob (PageCopyTuning::persistent). Every kernel
//    still loops (grid-stride) so that a capped grid (blocks_per_sm, or more units than a grid
//    can have blocks) covers all units;
//  - access width chosen per unit on the device from the actual addresses: 16-byte vectors when
//    source and destination are 16-aligned, else 8/4/2/1; the remainder (< width) byte-wise;
//    chunk starts are multiples of 16 bytes into the item, so a chunk keeps the item's alignment;
//  - each lane issues `kUnroll` independent loads before its stores (auto: 8 when a unit fills
//    one round of 8, else 4), and in a looping grid the next unit's table
//    reads are issued before the current unit's copy, so the dependent index->address->data
//    chain of one unit overlaps the copy of the previous one;
//  - optionally (prefetch_l2) the group's first lane asks L2 for the unit's whole source range
//    with one bulk prefetch before the copy.
// Two opt-in variants of the 16-byte path (session 3 experiments, one warp per unit; the
// grid-stride loop and the narrow path are shared):
//  - pipeline: register double buffering, the loads of batch k+1 issued before the stores of
//    batch k (PageCopyPipelinedKernel);
//  - async_smem: cp.async global -> shared into a per-warp ring of stages, drained with
//    ld.shared -> st.global (PageCopyAsyncKernel).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "kvt/kernels/cuda_util.h"
#include "kvt/kernels/kernels.h"
#include "kvt/kernels/tuning.h"
#include "page_copy_internal.h"
#include "validate.h"

namespace kvt::kernels {
namespace internal {
namespace {

// Blocks of up to 512 threads: lets the compiler use up to 128 registers (the unroll-8 path
// needs about 100 without spilling), so 1024-thread blocks are refused by ValidateTuning.
constexpr int kMaxPageCopyThreads = 512;

// async_smem: ring depth per warp, and the dynamic shared memory a block may ask for (Hopper's
// opt-in maximum per block; checked again against the device at launch).
constexpr int kMinAsyncStages = 2;
constexpr int kMaxAsyncStages = 8;
constexpr int64_t kMaxAsyncSmemBytes = 227 * 1024;

template <bool kStreaming, typename T>
__device__ __forceinline__ T LoadOnce(const T* p) {
  if constexpr (kStreaming) {
    return __ldcs(p);
  } else {
    return __ldg(p);
  }
}

template <bool kStreaming, typename T>
__device__ __forceinline__ void StoreOnce(T* p, const T& v) {
  if constexpr (kStreaming) {
    __stcs(p, v);
  } else {
    *p = v;
  }
}

// Copies n elements of T with the `group` threads copying one item: lane-interleaved
// (coalesced), kUnroll loads in flight per thread before its stores. Pointers advance by the
// step so each unrolled access is base + immediate offset (fewer registers than 64-bit indices).
template <typename T, int kUnroll, bool kStreaming, int kGroup>
__device__ __forceinline__ void CopyRun(const T* __restrict__ src, T* __restrict__ dst, int64_t n,
                                        int lane) {
  constexpr int group = kGroup;
  constexpr int64_t step = static_cast<int64_t>(group) * kUnroll;
  const T* s = src + lane;
  T* d = dst + lane;
  int64_t left = n - lane;  // elements from this thread's position to the end
  // Not unrolled further: kUnroll accesses in flight are the design, and a compiler unroll of
  // this loop multiplies the live registers (spills under the 64-register cap).
#pragma unroll 1
  for (; left > static_cast<int64_t>(kUnroll - 1) * group; left -= step, s += step, d += step) {
    T r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = LoadOnce<kStreaming>(s + u * group);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) StoreOnce<kStreaming>(d + u * group, r[u]);
  }
  if (left > 0) {
    T r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (static_cast<int64_t>(u) * group < left) r[u] = LoadOnce<kStreaming>(s + u * group);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (static_cast<int64_t>(u) * group < left) StoreOnce<kStreaming>(d + u * group, r[u]);
    }
  }
}

// CopyRun with register double buffering: batch a is in registers while batch b's loads are
// issued, then a is stored (and the roles swap), so a thread's loads are in flight while it
// stores. The loop body handles two batches so that the roles swap without register moves. A
// batch is full when this thread's last access in it exists (as in CopyRun); the final partial
// batch is loaded before the last full one is stored.
template <typename T, int kUnroll, bool kStreaming, int kGroup>
__device__ __forceinline__ void CopyRunPipelined(const T* __restrict__ src, T* __restrict__ dst,
                                                 int64_t n, int lane) {
  constexpr int64_t step = static_cast<int64_t>(kGroup) * kUnroll;
  constexpr int64_t full = static_cast<int64_t>(kUnroll - 1) * kGroup;  // left > full: full batch
  const T* s = src + lane;
  T* d = dst + lane;
  int64_t left = n - lane;  // elements from the next load's position to the end
  T a[kUnroll], b[kUnroll];
  if (left > full) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) a[u] = LoadOnce<kStreaming>(s + u * kGroup);
    s += step;
    left -= step;
    // Invariant at the top: a holds the batch for d, s / left describe the next batch.
#pragma unroll 1
    while (left > full) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) b[u] = LoadOnce<kStreaming>(s + u * kGroup);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) StoreOnce<kStreaming>(d + u * kGroup, a[u]);
      s += step;
      d += step;
      left -= step;
      if (left <= full) {  // b pending: move it to a for the common epilogue
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) a[u] = b[u];
        break;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) a[u] = LoadOnce<kStreaming>(s + u * kGroup);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) StoreOnce<kStreaming>(d + u * kGroup, b[u]);
      s += step;
      d += step;
      left -= step;
    }
    // a (a full batch) is pending for d; the partial batch's loads go out before its stores.
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (static_cast<int64_t>(u) * kGroup < left) b[u] = LoadOnce<kStreaming>(s + u * kGroup);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) StoreOnce<kStreaming>(d + u * kGroup, a[u]);
    d += step;
  } else {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (static_cast<int64_t>(u) * kGroup < left) b[u] = LoadOnce<kStreaming>(s + u * kGroup);
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (static_cast<int64_t>(u) * kGroup < left) StoreOnce<kStreaming>(d + u * kGroup, b[u]);
  }
}

// Units whose source or destination is not 16-aligned: 8/4/2/1-byte accesses (unrolled 2 deep,
// so the 16-byte path sets the kernel's register count), then the tail.
template <bool kStreaming, int kGroup>
__device__ __forceinline__ void CopyNarrow(uint64_t s, uint64_t d, int64_t bytes, int lane) {
  const uint64_t mis = s | d;
  int64_t done;
  if ((mis & 7) == 0) {
    const int64_t n = bytes >> 3;
    CopyRun<uint2, 2, kStreaming, kGroup>(reinterpret_cast<const uint2*>(s),
                                          reinterpret_cast<uint2*>(d), n, lane);
    done = n << 3;
  } else if ((mis & 3) == 0) {
    const int64_t n = bytes >> 2;
    CopyRun<unsigned int, 2, kStreaming, kGroup>(reinterpret_cast<const unsigned int*>(s),
                                                 reinterpret_cast<unsigned int*>(d), n, lane);
    done = n << 2;
  } else if ((mis & 1) == 0) {
    const int64_t n = bytes >> 1;
    CopyRun<unsigned short, 2, kStreaming, kGroup>(reinterpret_cast<const unsigned short*>(s),
                                                   reinterpret_cast<unsigned short*>(d), n, lane);
    done = n << 1;
  } else {
    CopyRun<unsigned char, 2, kStreaming, kGroup>(reinterpret_cast<const unsigned char*>(s),
                                                  reinterpret_cast<unsigned char*>(d), bytes, lane);
    done = bytes;
  }
  // Tail shorter than the access width.
  for (int64_t k = done + lane; k < bytes; k += kGroup) {
    reinterpret_cast<unsigned char*>(d)[k] = reinterpret_cast<const unsigned char*>(s)[k];
  }
}

// The bytes of [n * 16, bytes): the tail shorter than 16 bytes after the vector body.
template <int kGroup>
__device__ __forceinline__ void CopyTail16(uint64_t s, uint64_t d, int64_t n, int64_t bytes,
                                           int lane) {
  for (int64_t k = (n << 4) + lane; k < bytes; k += kGroup) {
    reinterpret_cast<unsigned char*>(d)[k] = reinterpret_cast<const unsigned char*>(s)[k];
  }
}

template <int kUnroll, bool kStreaming, int kGroup, bool kPipeline = false>
__device__ __forceinline__ void CopyItem(uint64_t s, uint64_t d, int64_t bytes, int lane) {
  // Only the 16-byte path (pool pages are 16-aligned) is unrolled kUnroll deep.
  if (((s | d) & 15) != 0) {
    CopyNarrow<kStreaming, kGroup>(s, d, bytes, lane);
    return;
  }
  const int64_t n = bytes >> 4;
  if constexpr (kPipeline) {
    CopyRunPipelined<uint4, kUnroll, kStreaming, kGroup>(reinterpret_cast<const uint4*>(s),
                                                         reinterpret_cast<uint4*>(d), n, lane);
  } else {
    CopyRun<uint4, kUnroll, kStreaming, kGroup>(reinterpret_cast<const uint4*>(s),
                                                reinterpret_cast<uint4*>(d), n, lane);
  }
  CopyTail16<kGroup>(s, d, n, bytes, lane);
}

// ---- async_smem: cp.async global -> shared rings ------------------------------------------
//
// Each warp owns `stages` consecutive stages of dynamic shared memory; a stage holds
// kUnroll rounds of 32 lanes x 16 bytes, and lane L's element u of a stage sits at
// stage + (u * 32 + L) * 16, the bytes that lane itself loads from global memory at
// unit + (stage_index * 32 * kUnroll + u * 32 + L) * 16. A lane only ever reads back what it
// itself wrote with cp.async, so completion is per thread (cp.async.wait_group) and no warp or
// block barrier is needed.

// 16 bytes global -> shared, cached in L2 only (.cg); both addresses 16-aligned.
__device__ __forceinline__ void CpAsync16(uint32_t smem, const void* gmem) {
  const size_t g = __cvta_generic_to_global(gmem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem), "l"(g) : "memory");
}

// Closes this thread's current cp.async group (an empty group when it issued none since the
// last commit: it counts, and is complete at once).
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// Waits until at most `pending` of this thread's most recent groups are incomplete (every older
// group complete). wait_group takes an immediate, hence the switch (warp-uniform); anything
// outside 1..7 waits for all, which is always correct.
__device__ __forceinline__ void CpAsyncWaitPending(int pending) {
  switch (pending) {
    case 1:
      CpAsyncWait<1>();
      break;
    case 2:
      CpAsyncWait<2>();
      break;
    case 3:
      CpAsyncWait<3>();
      break;
    case 4:
      CpAsyncWait<4>();
      break;
    case 5:
      CpAsyncWait<5>();
      break;
    case 6:
      CpAsyncWait<6>();
      break;
    case 7:
      CpAsyncWait<7>();
      break;
    default:
      CpAsyncWait<0>();
      break;
  }
}

// volatile: stays ordered after the wait_group that made the data visible and before the
// cp.async that later overwrites the slot (both volatile asm as well).
__device__ __forceinline__ uint4 LoadShared16(uint32_t smem) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(smem));
  return v;
}

// Copies n 16-byte elements (16-aligned source and destination) through the calling warp's
// ring at shared address `ring` (stages x 32 x kUnroll x 16 bytes). Stage j of the unit is
// elements [j * 32 * kUnroll, (j + 1) * 32 * kUnroll) and goes to ring slot j % stages.
//
// Group accounting, per thread (every lane commits exactly one group per stage index, empty
// where its part of the stage is past the end, so the count is the same in every lane):
//   prologue: stages 0 .. S-2 issued, one group each           -> S-1 groups committed
//   iteration k (0 <= k < num_stages):
//     issue stage k+S-1 into slot (k+S-1) % S = (k-1) % S,     -> k+S groups committed
//       the slot drained in iteration k-1 (never used when k = 0)
//     wait_group S-1: all but the newest S-1 groups complete   -> groups 0..k complete
//     drain stage k from slot k % S (ld.shared -> st.global)
// After the last iteration every non-empty group (stages < num_stages) has been waited for, so
// nothing is in flight when the warp moves to its next unit (the ring is drained per unit; the
// final wait_group 0 only makes that explicit).
template <int kUnroll, bool kStreaming>
__device__ __forceinline__ void CopyRunAsync(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                             int64_t n, int lane, uint32_t ring, int stages) {
  constexpr int kStep = 32 * kUnroll;  // elements per stage
  constexpr uint32_t kStageBytes = static_cast<uint32_t>(kStep) * 16;
  if (n <= 0) return;
  const int64_t num_stages = (n + kStep - 1) / kStep;  // warp-uniform
  const uint32_t lane_ring = ring + static_cast<uint32_t>(lane) * 16;
  const uint32_t ring_end = lane_ring + static_cast<uint32_t>(stages) * kStageBytes;
  // Issue side: next stage to load.
  const uint4* is = src + lane;
  int64_t ileft = n - lane;  // elements from is to the end
  uint32_t islot = lane_ring;
  // Drain side: next stage to store.
  uint4* d = dst + lane;
  int64_t dleft = n - lane;
  uint32_t dslot = lane_ring;
  auto issue = [&]() {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (static_cast<int64_t>(u) * 32 < ileft) CpAsync16(islot + u * 32 * 16, is + u * 32);
    }
    CpAsyncCommit();
    is += kStep;
    ileft -= kStep;
    islot += kStageBytes;
    if (islot == ring_end) islot = lane_ring;
  };
#pragma unroll 1
  for (int j = 0; j < stages - 1; ++j) issue();
#pragma unroll 1
  for (int64_t k = 0; k < num_stages; ++k) {
    issue();
    CpAsyncWaitPending(stages - 1);
    uint4 r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (static_cast<int64_t>(u) * 32 < dleft) r[u] = LoadShared16(dslot + u * 32 * 16);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (static_cast<int64_t>(u) * 32 < dleft) StoreOnce<kStreaming>(d + u * 32, r[u]);
    }
    d += kStep;
    dleft -= kStep;
    dslot += kStageBytes;
    if (dslot == ring_end) dslot = lane_ring;
  }
  CpAsyncWait<0>();
}

template <int kUnroll, bool kStreaming>
__device__ __forceinline__ void CopyItemAsync(uint64_t s, uint64_t d, int64_t bytes, int lane,
                                              uint32_t ring, int stages) {
  if (((s | d) & 15) != 0) {
    CopyNarrow<kStreaming, 32>(s, d, bytes, lane);
    return;
  }
  const int64_t n = bytes >> 4;
  CopyRunAsync<kUnroll, kStreaming>(reinterpret_cast<const uint4*>(s), reinterpret_cast<uint4*>(d),
                                    n, lane, ring, stages);
  CopyTail16<32>(s, d, n, bytes, lane);
}

struct ItemAddr {
  uint64_t src;
  uint64_t dst;
};

__device__ __forceinline__ uint64_t SideAddr(const CopySide& side, uint64_t b, uint64_t i) {
  const uint64_t base = side.bases ? __ldg(side.bases + b) : side.base + b * side.buffer_stride;
  const int64_t page =
      side.pages ? static_cast<int64_t>(__ldg(side.pages + i)) : static_cast<int64_t>(i);
  return base + static_cast<uint64_t>(page * side.page_stride + side.offset);
}

__device__ __forceinline__ ItemAddr AddrOf(const CopyDesc& d, uint64_t item, bool narrow) {
  // item = outer * inner_count + inner; buffer-major: (b, i), page-major: (i, b).
  const uint64_t inner_count =
      d.page_major ? static_cast<uint64_t>(d.num_buffers) : static_cast<uint64_t>(d.num_pages);
  uint64_t outer, inner;
  if (narrow) {  // 32-bit division is several times cheaper than 64-bit
    const uint32_t n = static_cast<uint32_t>(inner_count);
    outer = static_cast<uint32_t>(item) / n;
    inner = static_cast<uint32_t>(item) - static_cast<uint32_t>(outer) * n;
  } else {
    outer = item / inner_count;
    inner = item - outer * inner_count;
  }
  const uint64_t b = d.page_major ? inner : outer;
  const uint64_t i = d.page_major ? outer : inner;
  return ItemAddr{SideAddr(d.src, b, i), SideAddr(d.dst, b, i)};
}

// One unit of work: a whole item, or chunk `chunk` of it (CopyDesc::chunks_per_item > 1); the
// addresses already include the chunk's offset. The length is derived from the 32-bit chunk
// index when the unit is copied (fewer live registers across the copy than a 64-bit length).
struct Unit {
  uint64_t src;
  uint64_t dst;
  uint32_t chunk;
};

__device__ __forceinline__ Unit UnitOf(const CopyDesc& d, uint64_t unit, bool narrow) {
  if (d.chunks_per_item <= 1) {
    const ItemAddr a = AddrOf(d, unit, narrow);
    return Unit{a.src, a.dst, 0};
  }
  uint64_t item;
  uint32_t chunk;
  if (narrow) {
    const uint32_t q = static_cast<uint32_t>(unit) / d.chunks_per_item;
    chunk = static_cast<uint32_t>(unit) - q * d.chunks_per_item;
    item = q;
  } else {
    item = unit / d.chunks_per_item;
    chunk = static_cast<uint32_t>(unit - item * d.chunks_per_item);
  }
  const ItemAddr a = AddrOf(d, item, narrow);
  const uint64_t off = static_cast<uint64_t>(chunk) * static_cast<uint64_t>(d.chunk_bytes);
  return Unit{a.src + off, a.dst + off, chunk};
}

__device__ __forceinline__ int64_t UnitBytes(const CopyDesc& d, uint32_t chunk) {
  const int64_t left = d.bytes - static_cast<int64_t>(chunk) * d.chunk_bytes;
  return left < d.chunk_bytes ? left : d.chunk_bytes;
}

// Asks L2 to fetch [src, src + bytes) from memory (a hint: no completion to wait for). The bulk
// prefetch wants a 16-aligned address and a multiple of 16 bytes; other units skip it.
__device__ __forceinline__ void PrefetchL2(uint64_t src, int64_t bytes) {
  if (((src | static_cast<uint64_t>(bytes)) & 15) != 0 || bytes <= 0 || bytes > 0x7FFFFFF0) return;
  const size_t g = __cvta_generic_to_global(reinterpret_cast<const void*>(src));
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(g),
               "r"(static_cast<uint32_t>(bytes))
               : "memory");
}

// The grid-stride loop over units shared by the kernels: a group of kGroup threads (a warp or
// more; groups never straddle blocks) copies one unit at a time with copy(src, dst, bytes,
// lane); the next unit's table reads are issued before the current unit's copy.
template <int kGroup, typename CopyFn>
__device__ __forceinline__ void ForEachUnit(const CopyDesc& d, const uint64_t num_units,
                                            CopyFn copy) {
  const int lane = threadIdx.x & (kGroup - 1);
  const uint64_t first = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kGroup;
  const uint64_t num_groups = (static_cast<uint64_t>(gridDim.x) * blockDim.x) / kGroup;
  const bool narrow = num_units <= 0xFFFFFFFFull;
  uint64_t unit = first;
  if (unit >= num_units) return;
  Unit cur = UnitOf(d, unit, narrow);
  while (true) {
    const uint64_t next = unit + num_groups;
    const bool has_next = next < num_units;
    Unit nxt{0, 0, 0};
    if (has_next) nxt = UnitOf(d, next, narrow);
    const int64_t bytes = UnitBytes(d, cur.chunk);
    if (d.prefetch_l2 && lane == 0) PrefetchL2(cur.src, bytes);
    copy(cur.src, cur.dst, bytes, lane);
    if (!has_next) break;
    cur = nxt;
    unit = next;
  }
}

// The default kernel. The unroll-8 paths get the whole register file (no second-block cap):
// capped at 64 registers they spilled (docs/kernels.md).
template <int kUnroll, bool kStreaming, int kGroup>
__global__ void __launch_bounds__(kMaxPageCopyThreads, kUnroll == 8 ? 1 : 2)
    PageCopyKernel(const CopyDesc d, const uint64_t num_units) {
  ForEachUnit<kGroup>(d, num_units, [](uint64_t s, uint64_t t, int64_t bytes, int lane) {
    CopyItem<kUnroll, kStreaming, kGroup>(s, t, bytes, lane);
  });
}

// PageCopyTuning::pipeline (one warp per unit): 2 x kUnroll 16-byte registers per lane. Unroll 4
// with streaming hints fits 64 registers without spilling (4 blocks of 256 per SM); the others
// get up to 128 (ld.global.nc at unroll 4 spilled 8 bytes under the 64 cap; unroll 8 needs ~103).
template <int kUnroll, bool kStreaming>
__global__ void __launch_bounds__(kMaxPageCopyThreads, kUnroll == 4 && kStreaming ? 2 : 1)
    PageCopyPipelinedKernel(const CopyDesc d, const uint64_t num_units) {
  ForEachUnit<32>(d, num_units, [](uint64_t s, uint64_t t, int64_t bytes, int lane) {
    CopyItem<kUnroll, kStreaming, 32, true>(s, t, bytes, lane);
  });
}

// PageCopyTuning::async_smem (one warp per unit): the dynamic shared memory holds one ring of
// `stages` stages per warp (AsyncSmemBytes). Unroll 8 spilled under the 64-register cap, so it
// gets up to 128 (shared memory, not registers, bounds its blocks per SM anyway).
template <int kUnroll, bool kStreaming>
__global__ void __launch_bounds__(kMaxPageCopyThreads, kUnroll == 8 ? 1 : 2)
    PageCopyAsyncKernel(const CopyDesc d, const uint64_t num_units, const int stages) {
  extern __shared__ uint4 page_copy_rings[];
  constexpr uint32_t kStageBytes = 32u * kUnroll * 16u;
  const uint32_t ring = static_cast<uint32_t>(__cvta_generic_to_shared(page_copy_rings)) +
                        (threadIdx.x >> 5) * static_cast<uint32_t>(stages) * kStageBytes;
  ForEachUnit<32>(d, num_units, [&](uint64_t s, uint64_t t, int64_t bytes, int lane) {
    CopyItemAsync<kUnroll, kStreaming>(s, t, bytes, lane, ring, stages);
  });
}

using KernelFn = void (*)(CopyDesc, uint64_t);

template <int kUnroll, bool kStreaming>
KernelFn PickGroup(int group) {
  switch (group) {
    case 512:
      return PageCopyKernel<kUnroll, kStreaming, 512>;
    case 256:
      return PageCopyKernel<kUnroll, kStreaming, 256>;
    case 128:
      return PageCopyKernel<kUnroll, kStreaming, 128>;
    case 64:
      return PageCopyKernel<kUnroll, kStreaming, 64>;
    default:
      return PageCopyKernel<kUnroll, kStreaming, 32>;
  }
}

// The stride between a thread's unrolled accesses is a compile-time constant (group size), so
// each access is one base register plus an immediate offset.
KernelFn PickKernel(int unroll, bool streaming, int group) {
  if (unroll == 8) return streaming ? PickGroup<8, true>(group) : PickGroup<8, false>(group);
  return streaming ? PickGroup<4, true>(group) : PickGroup<4, false>(group);
}

// The pipeline variant (one warp per unit).
KernelFn PickPipelinedKernel(int unroll, bool streaming) {
  if (unroll == 8) {
    return streaming ? PageCopyPipelinedKernel<8, true> : PageCopyPipelinedKernel<8, false>;
  }
  return streaming ? PageCopyPipelinedKernel<4, true> : PageCopyPipelinedKernel<4, false>;
}

using AsyncKernelFn = void (*)(CopyDesc, uint64_t, int);

// The async_smem variant (one warp per unit; the stage count is a kernel argument).
AsyncKernelFn PickAsyncKernel(int unroll, bool streaming) {
  if (unroll == 8) return streaming ? PageCopyAsyncKernel<8, true> : PageCopyAsyncKernel<8, false>;
  return streaming ? PageCopyAsyncKernel<4, true> : PageCopyAsyncKernel<4, false>;
}

// Dynamic shared memory of one async_smem block: a ring of async_stages stages of
// 32 x unroll x 16 bytes per warp.
int64_t AsyncSmemBytes(const PageCopyTuning& t) {
  return static_cast<int64_t>(t.threads_per_block / 32) * t.async_stages * t.unroll * 32 * 16;
}

// Occupancy of `fn` with `threads` per block and `smem` bytes of dynamic shared memory,
// computed once per slot (host-side query).
StatusOr<int> CachedBlocksPerSm(std::atomic<int>& slot, const void* fn, int threads, size_t smem) {
  int v = slot.load(std::memory_order_relaxed);
  if (v > 0) return v;
  int blocks = 0;
  KVT_CUDA_RETURN_IF_ERROR(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fn, threads, smem));
  blocks = std::max(blocks, 1);
  slot.store(blocks, std::memory_order_relaxed);
  return blocks;
}

// Occupancy of each kernel variant at each block size (and ring depth), computed once.
StatusOr<int> BlocksPerSm(const PageCopyTuning& t, int group) {
  const int u = t.unroll == 8 ? 1 : 0;
  const int st = t.streaming ? 1 : 0;
  const int threads = t.threads_per_block;
  if (t.async_smem) {
    static std::atomic<int> cache[2][2][17][9] = {};
    return CachedBlocksPerSm(cache[u][st][threads / 32][t.async_stages],
                             reinterpret_cast<const void*>(PickAsyncKernel(t.unroll, t.streaming)),
                             threads, static_cast<size_t>(AsyncSmemBytes(t)));
  }
  if (t.pipeline) {
    static std::atomic<int> cache[2][2][17] = {};
    return CachedBlocksPerSm(
        cache[u][st][threads / 32],
        reinterpret_cast<const void*>(PickPipelinedKernel(t.unroll, t.streaming)), threads, 0);
  }
  static std::atomic<int> cache[2][2][5][17] = {};
  int group_index = 0;
  while ((32 << group_index) < group) ++group_index;
  return CachedBlocksPerSm(cache[u][st][group_index][threads / 32],
                           reinterpret_cast<const void*>(PickKernel(t.unroll, t.streaming, group)),
                           threads, 0);
}

// Once per (device, async kernel): allows it the device's whole opt-in shared memory per block
// and prefers the largest shared-memory carveout (so that the occupancy query and the launch
// see several rings per SM). Fails with a clear message when `smem` does not fit the device.
Status PrepareAsyncKernel(const PageCopyTuning& t, int64_t smem) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> optin_cache[kMaxDevices][2][2] = {};  // opt-in bytes + 1; 0: not yet
  int device = 0;
  KVT_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  std::atomic<int>* slot = nullptr;
  if (device >= 0 && device < kMaxDevices) {
    slot = &optin_cache[device][t.unroll == 8 ? 1 : 0][t.streaming ? 1 : 0];
  }
  int optin = slot ? slot->load(std::memory_order_relaxed) - 1 : -1;
  if (optin < 0) {
    KVT_CUDA_RETURN_IF_ERROR(
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    const void* fn = reinterpret_cast<const void*>(PickAsyncKernel(t.unroll, t.streaming));
    KVT_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
    KVT_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
        fn, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
    if (slot) slot->store(optin + 1, std::memory_order_relaxed);
  }
  if (smem > optin) {
    return InvalidArgument("PageCopyTuning: async_smem needs " + std::to_string(smem) +
                           " bytes of shared memory per block; device " + std::to_string(device) +
                           " allows " + std::to_string(optin));
  }
  return OkStatus();
}

// Threads that copy one item. 0 (auto): the largest power of two (32 .. threads_per_block)
// whose one round of kUnroll 16-byte accesses still fits in the item. It was meant to keep the
// concurrently touched addresses in fewer, longer runs for DRAM; on an H200 it did not beat one
// warp per item (docs/kernels.md), so the default tuning asks for 32.
int ThreadsPerItem(const PageCopyTuning& t, int64_t bytes) {
  if (t.threads_per_item > 0) return t.threads_per_item;
  int g = 32;
  while (g * 2 <= t.threads_per_block && static_cast<int64_t>(g) * 2 * 16 * t.unroll <= bytes) {
    g *= 2;
  }
  return g;
}

Status ValidateTuning(const PageCopyTuning& t) {
  if (t.unroll != 0 && t.unroll != 4 && t.unroll != 8) {
    return InvalidArgument("PageCopyTuning: unroll is " + std::to_string(t.unroll) +
                           "; it must be 0 (auto), 4 or 8");
  }
  if (t.threads_per_block < 32 || t.threads_per_block > kMaxPageCopyThreads ||
      t.threads_per_block % 32 != 0) {
    return InvalidArgument(
        "PageCopyTuning: threads_per_block is " + std::to_string(t.threads_per_block) +
        "; it must be a multiple of 32 in [32, " + std::to_string(kMaxPageCopyThreads) + "]");
  }
  const int32_t g = t.threads_per_item;
  if (g != 0 && (g < 32 || g > t.threads_per_block || g > 512 || (g & (g - 1)) != 0 ||
                 t.threads_per_block % g != 0)) {
    return InvalidArgument("PageCopyTuning: threads_per_item is " + std::to_string(g) +
                           "; it must be 0 (auto) or a power of two in [32, 512] dividing "
                           "threads_per_block (" +
                           std::to_string(t.threads_per_block) + ")");
  }
  if (t.chunk_bytes < 0 || t.chunk_bytes % 16 != 0) {
    return InvalidArgument("PageCopyTuning: chunk_bytes is " + std::to_string(t.chunk_bytes) +
                           "; it must be 0 (whole items) or a positive multiple of 16");
  }
  if (t.blocks_per_sm < 0) {
    return InvalidArgument("PageCopyTuning: blocks_per_sm is " + std::to_string(t.blocks_per_sm) +
                           "; it must be >= 0 (0: no cap, or as many as fit when persistent)");
  }
  if (t.async_stages < kMinAsyncStages || t.async_stages > kMaxAsyncStages) {
    return InvalidArgument("PageCopyTuning: async_stages is " + std::to_string(t.async_stages) +
                           "; it must be in [" + std::to_string(kMinAsyncStages) + ", " +
                           std::to_string(kMaxAsyncStages) + "]");
  }
  if (t.pipeline && t.async_smem) {
    return InvalidArgument(
        "PageCopyTuning: pipeline and async_smem are both set; they are alternative variants "
        "of the 16-byte path, pick one");
  }
  if ((t.pipeline || t.async_smem) && t.threads_per_item != 32) {
    return InvalidArgument(
        "PageCopyTuning: threads_per_item is " + std::to_string(t.threads_per_item) + "; " +
        (t.pipeline ? "pipeline" : "async_smem") + " copies one unit per warp and needs 32");
  }
  if (t.unroll == 0 && (t.pipeline || t.async_smem)) {
    return InvalidArgument(std::string("PageCopyTuning: ") +
                           (t.pipeline ? "pipeline" : "async_smem") +
                           " needs an explicit unroll (4 or 8), not 0 (auto)");
  }
  if (t.async_smem && AsyncSmemBytes(t) > kMaxAsyncSmemBytes) {
    return InvalidArgument("PageCopyTuning: async_smem needs " + std::to_string(AsyncSmemBytes(t)) +
                           " bytes of shared memory per block (threads_per_block " +
                           std::to_string(t.threads_per_block) + " / 32 warps x async_stages " +
                           std::to_string(t.async_stages) + " x unroll " +
                           std::to_string(t.unroll) + " x 512 bytes); at most " +
                           std::to_string(kMaxAsyncSmemBytes) +
                           " fit (227 KiB): use fewer threads, stages or a smaller unroll");
  }
  return OkStatus();
}

}  // namespace

StatusOr<int> CurrentDeviceSmCount() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};
  int device = 0;
  KVT_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  if (device >= 0 && device < kMaxDevices) {
    int v = cache[device].load(std::memory_order_relaxed);
    if (v > 0) return v;
  }
  int sms = 0;
  KVT_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if (sms <= 0) return Internal("cudaDevAttrMultiProcessorCount answered " + std::to_string(sms));
  if (device >= 0 && device < kMaxDevices) cache[device].store(sms, std::memory_order_relaxed);
  return sms;
}

Status CopyDevice(const CopyDesc& desc, const PageCopyTuning& tuning, cudaStream_t stream) {
  if (desc.num_buffers <= 0 || desc.num_pages <= 0 || desc.bytes <= 0) return OkStatus();
  PageCopyTuning t = tuning;
  CopyDesc d = desc;
  d.page_major = t.page_major;
  d.prefetch_l2 = t.prefetch_l2;
  const uint64_t num_items =
      static_cast<uint64_t>(d.num_buffers) * static_cast<uint64_t>(d.num_pages);
  const UnitSplit split = SplitItems(t, d.bytes);
  d.chunk_bytes = split.chunk_bytes;
  d.chunks_per_item = split.chunks_per_item;
  const uint64_t num_units = num_items * d.chunks_per_item;
  t.unroll = EffectiveUnroll(t, d.bytes);
  KVT_ASSIGN_OR_RETURN(int sms, CurrentDeviceSmCount());
  const int group = ThreadsPerItem(t, d.chunk_bytes);  // 32 for pipeline / async_smem
  const int64_t smem = t.async_smem ? AsyncSmemBytes(t) : 0;
  if (t.async_smem) KVT_RETURN_IF_ERROR(PrepareAsyncKernel(t, smem));
  int fit = 0;  // only a persistent grid without a blocks_per_sm cap asks the occupancy
  if (t.persistent && t.blocks_per_sm == 0) {
    KVT_ASSIGN_OR_RETURN(fit, BlocksPerSm(t, group));
  }
  const unsigned grid = static_cast<unsigned>(
      GridBlocks(t, num_units, static_cast<uint64_t>(t.threads_per_block / group), sms, fit));
  if (t.async_smem) {
    const AsyncKernelFn fn = PickAsyncKernel(t.unroll, t.streaming);
    fn<<<grid, t.threads_per_block, static_cast<size_t>(smem), stream>>>(d, num_units,
                                                                         t.async_stages);
    return cuda::LastLaunchStatus("PageCopyAsyncKernel");
  }
  if (t.pipeline) {
    const KernelFn fn = PickPipelinedKernel(t.unroll, t.streaming);
    fn<<<grid, t.threads_per_block, 0, stream>>>(d, num_units);
    return cuda::LastLaunchStatus("PageCopyPipelinedKernel");
  }
  PickKernel(t.unroll, t.streaming, group)<<<grid, t.threads_per_block, 0, stream>>>(d, num_units);
  return cuda::LastLaunchStatus("PageCopyKernel");
}

}  // namespace internal

PageCopyTuning DefaultPageCopyTuning() { return PageCopyTuning{}; }

Status PageCopyCudaTuned(const PageCopyArgs& args, const PageCopyTuning& tuning,
                         cudaStream_t stream) {
  KVT_RETURN_IF_ERROR(internal::ValidateTuning(tuning));
  KVT_RETURN_IF_ERROR(internal::ValidatePageCopy(args, "PageCopyCuda"));
  return internal::CopyDevice(internal::DescFromPageCopy(args), tuning, stream);
}

Status PackCudaTuned(const PackArgs& args, const PageCopyTuning& tuning, cudaStream_t stream) {
  KVT_RETURN_IF_ERROR(internal::ValidateTuning(tuning));
  KVT_RETURN_IF_ERROR(internal::ValidatePack(args, "PackCuda"));
  return internal::CopyDevice(internal::DescFromPack(args), tuning, stream);
}

Status UnpackCudaTuned(const PackArgs& args, const PageCopyTuning& tuning, cudaStream_t stream) {
  KVT_RETURN_IF_ERROR(internal::ValidateTuning(tuning));
  KVT_RETURN_IF_ERROR(internal::ValidatePack(args, "UnpackCuda"));
  return internal::CopyDevice(internal::DescFromUnpack(args), tuning, stream);
}

Status PageCopyCuda(const PageCopyArgs& args, cudaStream_t stream) {
  KVT_RETURN_IF_ERROR(internal::ValidatePageCopy(args, "PageCopyCuda"));
  return internal::CopyDevice(internal::DescFromPageCopy(args), DefaultPageCopyTuning(), stream);
}

Status PackCuda(const PackArgs& args, cudaStream_t stream) {
  KVT_RETURN_IF_ERROR(internal::ValidatePack(args, "PackCuda"));
  return internal::CopyDevice(internal::DescFromPack(args), DefaultPageCopyTuning(), stream);
}

Status UnpackCuda(const PackArgs& args, cudaStream_t stream) {
  KVT_RETURN_IF_ERROR(internal::ValidatePack(args, "UnpackCuda"));
  return internal::CopyDevice(internal::DescFromUnpack(args), DefaultPageCopyTuning(), stream);
}

}  // namespace kvt::kernels

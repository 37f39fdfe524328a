// The page gather/scatter kernel behind PageCopyCuda, PackCuda, UnpackCuda and the same-dtype
// StoreCuda.
//
// Design (DESIGN.md: one launch moves every (buffer, page) item of a batch):
//  - one warp (by default; a larger power-of-two group is a tuning knob) per unit of work; a
//    unit is a whole item or, with PageCopyTuning::chunk_bytes, one fixed-size chunk of it;
//    items are enumerated buffer-major so concurrently running warps stay within one buffer
//    (fewer TLB entries live at once);
//  - one-pass grid by default: as many blocks as there are units for their groups, handed to
//    the multiprocessors by the hardware as earlier blocks finish. A persistent grid (the
//    blocks that fit at once, groups looping over units) is a tuning knob
//    (PageCopyTuning::persistent). Every kernel loops (grid-stride) so that a capped grid
//    (blocks_per_sm, or more units than a grid can have blocks) covers all units;
//  - access width chosen per unit on the device from the actual addresses: 16-byte vectors when
//    source and destination are 16-aligned, else 8/4/2/1; the remainder (< width) byte-wise;
//    chunk starts are multiples of 16 bytes into the item, so a chunk keeps the item's alignment;
//  - each lane issues `kUnroll` independent loads before its stores (auto: 8 when a unit fills
//    one round of 8, else 4), and in a looping grid the next unit's table
//    reads are issued before the current unit's copy, so the dependent index->address->data
//    chain of one unit overlaps the copy of the previous one;
//  - optionally (prefetch_l2) the group's first lane asks L2 for the unit's whole source range
//    with one bulk prefetch before the copy.
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

template <int kUnroll, bool kStreaming, int kGroup>
__device__ __forceinline__ void CopyItem(uint64_t s, uint64_t d, int64_t bytes, int lane) {
  // Only the 16-byte path (pool pages are 16-aligned) is unrolled kUnroll deep.
  if (((s | d) & 15) != 0) {
    CopyNarrow<kStreaming, kGroup>(s, d, bytes, lane);
    return;
  }
  const int64_t n = bytes >> 4;
  CopyRun<uint4, kUnroll, kStreaming, kGroup>(reinterpret_cast<const uint4*>(s),
                                              reinterpret_cast<uint4*>(d), n, lane);
  CopyTail16<kGroup>(s, d, n, bytes, lane);
}

struct ItemAddr {
  uint64_t src;
  uint64_t dst;
};

// A table entry: read-only global loads for tables in device memory, plain loads for tables in
// the launch's parameters (kParam; a generic pointer into param space, which ld.global must not
// be given).
template <bool kParam, typename T>
__device__ __forceinline__ T LoadTable(const T* p) {
  if constexpr (kParam) {
    return *p;
  } else {
    return __ldg(p);
  }
}

template <bool kParam>
__device__ __forceinline__ uint64_t SideAddr(const CopySide& side, uint64_t b, uint64_t i) {
  const uint64_t base =
      side.bases ? LoadTable<kParam>(side.bases + b) : side.base + b * side.buffer_stride;
  const int64_t page = side.pages ? static_cast<int64_t>(LoadTable<kParam>(side.pages + i))
                                  : static_cast<int64_t>(i);
  return base + static_cast<uint64_t>(page * side.page_stride + side.offset);
}

template <bool kParam>
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
  return ItemAddr{SideAddr<kParam>(d.src, b, i), SideAddr<kParam>(d.dst, b, i)};
}

// One unit of work: a whole item, or chunk `chunk` of it (CopyDesc::chunks_per_item > 1); the
// addresses already include the chunk's offset. The length is derived from the 32-bit chunk
// index when the unit is copied (fewer live registers across the copy than a 64-bit length).
struct Unit {
  uint64_t src;
  uint64_t dst;
  uint32_t chunk;
};

template <bool kParam>
__device__ __forceinline__ Unit UnitOf(const CopyDesc& d, uint64_t unit, bool narrow) {
  if (d.chunks_per_item <= 1) {
    const ItemAddr a = AddrOf<kParam>(d, unit, narrow);
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
  const ItemAddr a = AddrOf<kParam>(d, item, narrow);
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
template <int kGroup, bool kParam, typename CopyFn>
__device__ __forceinline__ void ForEachUnit(const CopyDesc& d, const uint64_t num_units,
                                            CopyFn copy) {
  const int lane = threadIdx.x & (kGroup - 1);
  const uint64_t first = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kGroup;
  const uint64_t num_groups = (static_cast<uint64_t>(gridDim.x) * blockDim.x) / kGroup;
  const bool narrow = num_units <= 0xFFFFFFFFull;
  uint64_t unit = first;
  if (unit >= num_units) return;
  Unit cur = UnitOf<kParam>(d, unit, narrow);
  while (true) {
    const uint64_t next = unit + num_groups;
    const bool has_next = next < num_units;
    Unit nxt{0, 0, 0};
    if (has_next) nxt = UnitOf<kParam>(d, next, narrow);
    const int64_t bytes = UnitBytes(d, cur.chunk);
    if (d.prefetch_l2 && lane == 0) PrefetchL2(cur.src, bytes);
    copy(cur.src, cur.dst, bytes, lane);
    if (!has_next) break;
    cur = nxt;
    unit = next;
  }
}

// The kernel. The unroll-8 paths get the whole register file (no second-block cap): under a
// 64-register cap they spill.
template <int kUnroll, bool kStreaming, int kGroup>
__global__ void __launch_bounds__(kMaxPageCopyThreads, kUnroll == 8 ? 1 : 2)
    PageCopyKernel(const CopyDesc d, const uint64_t num_units) {
  ForEachUnit<kGroup, false>(d, num_units, [](uint64_t s, uint64_t t, int64_t bytes, int lane) {
    CopyItem<kUnroll, kStreaming, kGroup>(s, t, bytes, lane);
  });
}

// Tables carried in the launch's parameters (PageCopyCudaInline): the table block, and where in
// it each of the description's tables starts (a byte offset, or -1 for none). The driver copies
// the whole parameter block on every launch and the GPU fetches it before the kernel starts, so
// the block comes in two sizes: a one-page write of a 64-buffer pool (130 words) launches with
// 1.3 KiB of parameters instead of 3.9 KiB.
inline constexpr size_t kSmallInlineTableWords = 160;

template <size_t kWords>
struct InlineTables {
  int32_t src_bases = -1;
  int32_t dst_bases = -1;
  int32_t src_pages = -1;
  int32_t dst_pages = -1;
  uint64_t words[kWords];
};

// A launch's parameters are limited to 4 KiB where the driver predates CUDA 12.1.
static_assert(sizeof(InlineTables<kPageCopyInlineTableWords>) + sizeof(CopyDesc) +
                      sizeof(uint64_t) <=
                  4096,
              "PageCopyInlineKernel's parameters must fit in 4 KiB");
static_assert(kSmallInlineTableWords < kPageCopyInlineTableWords);

template <typename T, size_t kWords>
__device__ __forceinline__ const T* InlineTable(const InlineTables<kWords>& t, int32_t offset) {
  return offset < 0 ? nullptr
                    : reinterpret_cast<const T*>(reinterpret_cast<const char*>(t.words) + offset);
}

// The kernel with its tables in its parameters: __grid_constant__ lets the threads read them in
// place (param space, no per-thread copy). Only the default tuning's shape (one warp per unit,
// no streaming hints) is compiled; PageCopyCudaInline only uses the default tuning.
template <int kUnroll, size_t kWords>
__global__ void __launch_bounds__(kMaxPageCopyThreads, kUnroll == 8 ? 1 : 2)
    PageCopyInlineKernel(const __grid_constant__ InlineTables<kWords> tables, CopyDesc d,
                         const uint64_t num_units) {
  d.src.bases = InlineTable<uint64_t>(tables, tables.src_bases);
  d.dst.bases = InlineTable<uint64_t>(tables, tables.dst_bases);
  d.src.pages = InlineTable<int32_t>(tables, tables.src_pages);
  d.dst.pages = InlineTable<int32_t>(tables, tables.dst_pages);
  ForEachUnit<32, true>(d, num_units, [](uint64_t s, uint64_t t, int64_t bytes, int lane) {
    CopyItem<kUnroll, false, 32>(s, t, bytes, lane);
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

// Occupancy of `fn` with `threads` per block, computed once per slot (host-side query).
StatusOr<int> CachedBlocksPerSm(std::atomic<int>& slot, const void* fn, int threads) {
  int v = slot.load(std::memory_order_relaxed);
  if (v > 0) return v;
  int blocks = 0;
  KVT_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fn, threads, 0));
  blocks = std::max(blocks, 1);
  slot.store(blocks, std::memory_order_relaxed);
  return blocks;
}

// Occupancy of each kernel variant at each block size, computed once.
StatusOr<int> BlocksPerSm(const PageCopyTuning& t, int group) {
  const int u = t.unroll == 8 ? 1 : 0;
  const int st = t.streaming ? 1 : 0;
  const int threads = t.threads_per_block;
  static std::atomic<int> cache[2][2][5][17] = {};
  int group_index = 0;
  while ((32 << group_index) < group) ++group_index;
  return CachedBlocksPerSm(cache[u][st][group_index][threads / 32],
                           reinterpret_cast<const void*>(PickKernel(t.unroll, t.streaming, group)),
                           threads);
}

// Threads that copy one item. 0 (auto): the largest power of two (32 .. threads_per_block)
// whose one round of kUnroll 16-byte accesses still fits in the item (concurrently touched
// addresses in fewer, longer runs). The default tuning asks for one warp per item (32).
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
  if (t.min_chunk_bytes < 0 || t.min_chunk_bytes % 16 != 0) {
    return InvalidArgument("PageCopyTuning: min_chunk_bytes is " +
                           std::to_string(t.min_chunk_bytes) +
                           "; it must be 0 (small launches keep chunk_bytes) or a positive "
                           "multiple of 16");
  }
  if (t.blocks_per_sm < 0) {
    return InvalidArgument("PageCopyTuning: blocks_per_sm is " + std::to_string(t.blocks_per_sm) +
                           "; it must be >= 0 (0: no cap, or as many as fit when persistent)");
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

namespace {

// What one launch of the copy kernel is: the description with the tuning's work split, the
// units, the grid, and the kernel shape. `grid` 0: nothing to copy.
struct Launch {
  CopyDesc d;
  uint64_t num_units = 0;
  unsigned grid = 0;
  int threads = 0;
  int group = 0;
  int unroll = 0;
  bool streaming = false;
};

StatusOr<Launch> PlanLaunch(const CopyDesc& desc, const PageCopyTuning& tuning) {
  Launch l;
  if (desc.num_buffers <= 0 || desc.num_pages <= 0 || desc.bytes <= 0) return l;
  PageCopyTuning t = tuning;
  l.d = desc;
  l.d.page_major = t.page_major;
  l.d.prefetch_l2 = t.prefetch_l2;
  const uint64_t num_items =
      static_cast<uint64_t>(l.d.num_buffers) * static_cast<uint64_t>(l.d.num_pages);
  KVT_ASSIGN_OR_RETURN(int sms, CurrentDeviceSmCount());
  t.chunk_bytes = static_cast<int32_t>(LaunchChunkBytes(t, l.d.bytes, num_items, sms));
  const UnitSplit split = SplitItems(t, l.d.bytes);
  l.d.chunk_bytes = split.chunk_bytes;
  l.d.chunks_per_item = split.chunks_per_item;
  l.num_units = num_items * l.d.chunks_per_item;
  t.unroll = EffectiveUnroll(t, l.d.bytes);
  l.group = ThreadsPerItem(t, l.d.chunk_bytes);
  int fit = 0;  // only a persistent grid without a blocks_per_sm cap asks the occupancy
  if (t.persistent && t.blocks_per_sm == 0) {
    KVT_ASSIGN_OR_RETURN(fit, BlocksPerSm(t, l.group));
  }
  l.grid = static_cast<unsigned>(
      GridBlocks(t, l.num_units, static_cast<uint64_t>(t.threads_per_block / l.group), sms, fit));
  l.threads = t.threads_per_block;
  l.unroll = t.unroll;
  l.streaming = t.streaming;
  return l;
}

}  // namespace

Status CopyDevice(const CopyDesc& desc, const PageCopyTuning& tuning, cudaStream_t stream) {
  KVT_ASSIGN_OR_RETURN(const Launch l, PlanLaunch(desc, tuning));
  if (l.grid == 0) return OkStatus();
  PickKernel(l.unroll, l.streaming, l.group)<<<l.grid, l.threads, 0, stream>>>(l.d, l.num_units);
  return cuda::LastLaunchStatus("PageCopyKernel");
}

namespace {

// Byte offset of `table` (`count` entries of T) inside `tables`, or -1 for a null table;
// InvalidArgument naming the table when it is not wholly inside or not aligned to T.
template <typename T>
StatusOr<int32_t> InlineOffset(const char* name, const T* table, int64_t count,
                               const uint64_t* tables, size_t num_words) {
  if (table == nullptr) return -1;
  const auto begin = reinterpret_cast<uintptr_t>(tables);
  const uintptr_t bytes = num_words * sizeof(uint64_t);
  const auto at = reinterpret_cast<uintptr_t>(table);
  const uintptr_t need = static_cast<uintptr_t>(count) * sizeof(T);
  if (at < begin || at - begin > bytes || need > bytes - (at - begin) ||
      (at - begin) % alignof(T) != 0) {
    return InvalidArgument(
        std::string("PageCopyCudaInline: ") + name + " (" + std::to_string(count) + " entries of " +
        std::to_string(sizeof(T)) + " bytes) is not an aligned range inside `tables` (" +
        std::to_string(bytes) + " bytes); point every table of the arguments into `tables`");
  }
  return static_cast<int32_t>(at - begin);
}

}  // namespace

Status CopyDeviceInline(const PageCopyArgs& args, const uint64_t* tables, size_t num_words,
                        cudaStream_t stream) {
  if (num_words > kPageCopyInlineTableWords) {
    return InvalidArgument("PageCopyCudaInline: tables of " + std::to_string(num_words) +
                           " words; at most " + std::to_string(kPageCopyInlineTableWords) +
                           " fit in a launch's parameters (use PageCopyCuda with tables in "
                           "device memory)");
  }
  const CopyDesc desc = DescFromPageCopy(args);
  if (desc.num_buffers <= 0 || desc.num_pages <= 0 || desc.bytes <= 0) return OkStatus();
  KVT_ASSIGN_OR_RETURN(const int32_t src_bases, InlineOffset("src_bases", args.src_bases,
                                                             args.num_buffers, tables, num_words));
  KVT_ASSIGN_OR_RETURN(const int32_t dst_bases, InlineOffset("dst_bases", args.dst_bases,
                                                             args.num_buffers, tables, num_words));
  KVT_ASSIGN_OR_RETURN(const int32_t src_pages, InlineOffset("src_pages", args.src_pages,
                                                             args.num_pages, tables, num_words));
  KVT_ASSIGN_OR_RETURN(const int32_t dst_pages, InlineOffset("dst_pages", args.dst_pages,
                                                             args.num_pages, tables, num_words));
  KVT_ASSIGN_OR_RETURN(const Launch l, PlanLaunch(desc, DefaultPageCopyTuning()));
  if (l.group != 32 || l.streaming) {
    return Internal("PageCopyCudaInline: the default tuning chose " + std::to_string(l.group) +
                    "-thread groups" + (l.streaming ? " with streaming hints" : "") +
                    "; only one warp per unit without them is compiled for inline tables");
  }
  const auto launch = [&](auto& t, auto* kernel4, auto* kernel8) {
    t.src_bases = src_bases;
    t.dst_bases = dst_bases;
    t.src_pages = src_pages;
    t.dst_pages = dst_pages;
    std::copy(tables, tables + num_words, t.words);
    std::fill(std::begin(t.words) + num_words, std::end(t.words), 0);
    (l.unroll == 8 ? kernel8 : kernel4)<<<l.grid, l.threads, 0, stream>>>(t, l.d, l.num_units);
  };
  if (num_words <= kSmallInlineTableWords) {
    InlineTables<kSmallInlineTableWords> t;
    launch(t, PageCopyInlineKernel<4, kSmallInlineTableWords>,
           PageCopyInlineKernel<8, kSmallInlineTableWords>);
  } else {
    InlineTables<kPageCopyInlineTableWords> t;
    launch(t, PageCopyInlineKernel<4, kPageCopyInlineTableWords>,
           PageCopyInlineKernel<8, kPageCopyInlineTableWords>);
  }
  return cuda::LastLaunchStatus("PageCopyInlineKernel");
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

Status PageCopyCudaInline(const PageCopyArgs& args, const uint64_t* tables, size_t num_words,
                          cudaStream_t stream) {
  KVT_RETURN_IF_ERROR(internal::ValidatePageCopy(args, "PageCopyCudaInline"));
  return internal::CopyDeviceInline(args, tables, num_words, stream);
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

// Validation and CPU reference of page copy / pack / unpack (host compiler), shared with the
// CUDA entry points in page_copy.cu.
#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "kvt/kernels/kernels.h"
#include "kvt/kernels/tuning.h"
#include "page_copy_internal.h"
#include "validate.h"

namespace kvt::kernels {
namespace internal {
namespace {

// a / b rounded up, for a >= 0 and b > 0, without a + b - 1 (which overflows near the top).
template <typename T>
T CeilDiv(T a, T b) {
  return a / b + (a % b != 0 ? 1 : 0);
}

}  // namespace

UnitSplit SplitItems(const PageCopyTuning& t, int64_t item_bytes) {
  UnitSplit u{item_bytes, 1};
  if (t.chunk_bytes > 0 && item_bytes > t.chunk_bytes) {
    const int64_t chunks = CeilDiv<int64_t>(item_bytes, t.chunk_bytes);
    // Absurdly many chunks (items of gigabytes in small chunks): keep whole items.
    if (chunks <= 0x7FFFFFFF) u = UnitSplit{t.chunk_bytes, static_cast<uint32_t>(chunks)};
  }
  return u;
}

int64_t LaunchChunkBytes(const PageCopyTuning& t, int64_t item_bytes, uint64_t num_items, int sms) {
  const int64_t chunk = t.chunk_bytes;
  if (chunk <= 0 || t.min_chunk_bytes <= 0 || t.min_chunk_bytes >= chunk || item_bytes <= 0 ||
      num_items == 0) {
    return chunk;
  }
  const uint64_t want = static_cast<uint64_t>(std::max(sms, 1)) * kSmallLaunchUnitsPerSm;
  const uint64_t units = num_items * SplitItems(t, item_bytes).chunks_per_item;
  if (units >= want || num_items >= want) return chunk;
  // Items too large to split (SplitItems kept them whole) can make more bytes than 64 bits hold:
  // they stay whole anyway.
  const auto bytes_per_item = static_cast<uint64_t>(item_bytes);
  if (bytes_per_item > std::numeric_limits<uint64_t>::max() / num_items) return chunk;
  const uint64_t bytes = num_items * bytes_per_item;
  const uint64_t per_unit = CeilDiv(bytes, want);
  // want >= 16, so per_unit <= 2^60 and its power of two fits int64_t.
  const auto pow2 = static_cast<int64_t>(std::bit_ceil(std::max<uint64_t>(per_unit, 16)));
  return std::clamp(pow2, static_cast<int64_t>(t.min_chunk_bytes), chunk);
}

uint64_t GridBlocks(const PageCopyTuning& t, uint64_t num_units, uint64_t groups_per_block, int sms,
                    int fit_per_sm) {
  constexpr uint64_t kMaxGridBlocks = 0x7FFFFFFFull;  // gridDim.x
  const uint64_t per_block = std::max<uint64_t>(groups_per_block, 1);
  const uint64_t wanted = CeilDiv(num_units, per_block);
  uint64_t cap = kMaxGridBlocks;
  if (t.blocks_per_sm > 0) {
    cap = static_cast<uint64_t>(std::max(sms, 1)) * static_cast<uint64_t>(t.blocks_per_sm);
  } else if (t.persistent) {
    cap = static_cast<uint64_t>(std::max(sms, 1)) * static_cast<uint64_t>(std::max(fit_per_sm, 1));
  }
  return std::max<uint64_t>(std::min({wanted, cap, kMaxGridBlocks}), 1);
}

}  // namespace internal

int32_t EffectiveUnroll(const PageCopyTuning& t, int64_t item_bytes) {
  if (t.unroll != 0) return t.unroll;
  const int64_t group = t.threads_per_item > 0 ? t.threads_per_item : 32;
  return internal::SplitItems(t, item_bytes).chunk_bytes >= group * 8 * 16 ? 8 : 4;
}

namespace internal {
CopyDesc DescFromPageCopy(const PageCopyArgs& a) {
  CopyDesc d;
  d.src.bases = a.src_bases;
  d.src.pages = a.src_pages;
  d.src.page_stride = a.src_page_stride;
  d.src.offset = a.src_offset;
  d.dst.bases = a.dst_bases;
  d.dst.pages = a.dst_pages;
  d.dst.page_stride = a.dst_page_stride;
  d.dst.offset = a.dst_offset;
  d.num_buffers = a.num_buffers;
  d.num_pages = a.num_pages;
  d.bytes = a.bytes;
  return d;
}

namespace {

CopySide PoolSide(const PackArgs& a) {
  CopySide s;
  s.bases = a.bases;
  s.pages = a.pages;
  s.page_stride = a.page_stride;
  s.offset = a.offset;
  return s;
}

// The staging side: buffer b's pages are contiguous at staging + b * num_pages * bytes.
CopySide StagingSide(const PackArgs& a) {
  CopySide s;
  s.base = reinterpret_cast<uint64_t>(a.staging);
  s.buffer_stride = static_cast<uint64_t>(a.num_pages) * static_cast<uint64_t>(a.bytes);
  s.page_stride = a.bytes;
  return s;
}

}  // namespace

CopyDesc DescFromPack(const PackArgs& a) {
  CopyDesc d;
  d.src = PoolSide(a);
  d.dst = StagingSide(a);
  d.num_buffers = a.num_buffers;
  d.num_pages = a.num_pages;
  d.bytes = a.bytes;
  return d;
}

CopyDesc DescFromUnpack(const PackArgs& a) {
  CopyDesc d = DescFromPack(a);
  std::swap(d.src, d.dst);
  return d;
}

void CopyHost(const CopyDesc& d) {
  if (d.num_buffers <= 0 || d.num_pages <= 0 || d.bytes <= 0) return;
  for (int32_t b = 0; b < d.num_buffers; ++b) {
    uint64_t src_base = d.src.bases ? d.src.bases[b] : d.src.base + b * d.src.buffer_stride;
    uint64_t dst_base = d.dst.bases ? d.dst.bases[b] : d.dst.base + b * d.dst.buffer_stride;
    for (int64_t i = 0; i < d.num_pages; ++i) {
      int64_t sp = d.src.pages ? d.src.pages[i] : i;
      int64_t dp = d.dst.pages ? d.dst.pages[i] : i;
      uint64_t s = src_base + static_cast<uint64_t>(sp * d.src.page_stride + d.src.offset);
      uint64_t t = dst_base + static_cast<uint64_t>(dp * d.dst.page_stride + d.dst.offset);
      std::memcpy(reinterpret_cast<void*>(t), reinterpret_cast<const void*>(s),
                  static_cast<size_t>(d.bytes));
    }
  }
}

}  // namespace internal

Status PageCopyCpu(const PageCopyArgs& args) {
  KVT_RETURN_IF_ERROR(internal::ValidatePageCopy(args, "PageCopyCpu"));
  internal::CopyHost(internal::DescFromPageCopy(args));
  return OkStatus();
}

Status PackCpu(const PackArgs& args) {
  KVT_RETURN_IF_ERROR(internal::ValidatePack(args, "PackCpu"));
  internal::CopyHost(internal::DescFromPack(args));
  return OkStatus();
}

Status UnpackCpu(const PackArgs& args) {
  KVT_RETURN_IF_ERROR(internal::ValidatePack(args, "UnpackCpu"));
  internal::CopyHost(internal::DescFromUnpack(args));
  return OkStatus();
}

}  // namespace kvt::kernels

#include "backends/common/stream_copy.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>  // SSE2: part of every x86-64 CPU
#define KVT_STREAM_COPY_X86 1
#else
#define KVT_STREAM_COPY_X86 0
#endif

namespace kvt::transfer {
namespace {

#if KVT_STREAM_COPY_X86

constexpr uint64_t kLine = 64;
// Runs shorter than this are copied with memcpy (a few lines: the stores' head and tail would
// be most of the run).
constexpr uint64_t kMinStreamBytes = 256;

// Walks the source bytes of the runs ahead of the copy, one prefetch per 64-byte line; the
// copy advances it by as many bytes as it copies, so it stays kStreamPrefetchBytes ahead.
class PrefetchCursor {
 public:
  PrefetchCursor(std::span<const CopyRun> runs, std::span<const uint8_t* const> src)
      : runs_(runs), src_(src) {}

  void Advance(uint64_t bytes) {
    while (bytes > 0 && run_ < runs_.size()) {
      const CopyRun& r = runs_[run_];
      _mm_prefetch(reinterpret_cast<const char*>(src_[r.buffer] + r.src_offset + offset_),
                   _MM_HINT_NTA);
      offset_ += kLine;
      bytes = bytes > kLine ? bytes - kLine : 0;
      if (offset_ >= r.bytes) {
        ++run_;
        offset_ = 0;
      }
    }
  }

 private:
  std::span<const CopyRun> runs_;
  std::span<const uint8_t* const> src_;
  size_t run_ = 0;
  uint64_t offset_ = 0;
};

// One run: the bytes up to the destination's next line boundary and the tail with memcpy,
// whole lines with non-temporal stores (no read for ownership, no cache pollution).
void CopyStreaming(uint8_t* d, const uint8_t* s, uint64_t n, PrefetchCursor& prefetch) {
  const uint64_t head = (kLine - (reinterpret_cast<uintptr_t>(d) & (kLine - 1))) & (kLine - 1);
  std::memcpy(d, s, head);
  prefetch.Advance(head);
  d += head;
  s += head;
  n -= head;
  for (uint64_t lines = n / kLine; lines > 0; --lines, d += kLine, s += kLine) {
    prefetch.Advance(kLine);
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
  }
  const uint64_t tail = n % kLine;
  std::memcpy(d, s, tail);
  prefetch.Advance(tail);
}

#endif  // KVT_STREAM_COPY_X86

}  // namespace

size_t StreamCopyRuns(std::span<const CopyRun> runs, std::span<const uint8_t* const> src,
                      std::span<uint8_t* const> dst, const std::atomic<bool>* stop) {
  size_t done = 0;
#if KVT_STREAM_COPY_X86
  PrefetchCursor prefetch(runs, src);
  prefetch.Advance(kStreamPrefetchBytes);
  for (const CopyRun& r : runs) {
    if (stop != nullptr && stop->load(std::memory_order_relaxed)) break;
    uint8_t* d = dst[r.DstBuffer()] + r.dst_offset;
    const uint8_t* s = src[r.buffer] + r.src_offset;
    if (r.bytes < kMinStreamBytes) {
      std::memcpy(d, s, r.bytes);
      prefetch.Advance(r.bytes);
    } else {
      CopyStreaming(d, s, r.bytes, prefetch);
    }
    ++done;
  }
  _mm_sfence();  // non-temporal stores are weakly ordered: drain them before any later store
#else
  for (const CopyRun& r : runs) {
    if (stop != nullptr && stop->load(std::memory_order_relaxed)) break;
    std::memcpy(dst[r.DstBuffer()] + r.dst_offset, src[r.buffer] + r.src_offset, r.bytes);
    ++done;
  }
#endif
  return done;
}

std::vector<size_t> SplitRuns(std::vector<CopyRun>& runs, int parts, uint64_t min_slice_bytes) {
  uint64_t total = 0;
  for (const CopyRun& r : runs) total += r.bytes;
  const uint64_t most = std::max<uint64_t>(1, total / std::max<uint64_t>(1, min_slice_bytes));
  const uint64_t n = std::min<uint64_t>(static_cast<uint64_t>(std::max(parts, 1)), most);
  if (n <= 1 || runs.empty()) return {0, runs.size()};
  constexpr uint64_t kCutAlign = 4096;
  const uint64_t target = (total + n - 1) / n;
  std::vector<CopyRun> out;
  out.reserve(runs.size() + n);
  std::vector<size_t> bounds{0};
  uint64_t in_slice = 0;  // bytes in the slice being filled (always < target between runs)
  for (CopyRun r : runs) {
    // A boundary inside this run: cut it (the cut rounded up to kCutAlign into the run).
    while (bounds.size() < n && in_slice + r.bytes > target) {
      const uint64_t take =
          std::min(r.bytes, (target - in_slice + kCutAlign - 1) & ~(kCutAlign - 1));
      if (take >= r.bytes) break;  // after rounding the whole run fits: no cut
      out.push_back({r.buffer, r.src_offset, r.dst_offset, take, r.dst_buffer});
      bounds.push_back(out.size());
      in_slice = 0;
      r.src_offset += take;
      r.dst_offset += take;
      r.bytes -= take;
    }
    out.push_back(r);
    in_slice += r.bytes;
    if (bounds.size() < n && in_slice >= target) {
      bounds.push_back(out.size());
      in_slice = 0;
    }
  }
  if (bounds.back() != out.size()) bounds.push_back(out.size());
  runs = std::move(out);
  return bounds;
}

}  // namespace kvt::transfer

// kvt's data-movement kernels. Each operation has a CUDA version (suffix Cuda: pointers are
// device-accessible, the launch is asynchronous on `stream`) and a CPU reference (suffix Cpu:
// pointers are host memory, runs synchronously) that computes exactly the same function. The CPU
// versions serve host pools and are the oracle in tests.
//
// Addresses are always `base + index * stride`: callers pass base tables and index lists, never
// per-page pointers. For the CUDA versions the tables (`*_bases`, `*_pages`, `loc`, ...) must be
// device-resident; for the CPU versions host-resident.
//
// Validation: the functions check what they can see without reading device memory (counts,
// strides, alignment, null pointers) and return InvalidArgument naming the value. Index ranges
// are the caller's (the pool's) to check, since only it knows the buffer sizes.
//
// Thread safety: all functions are reentrant; concurrent calls on distinct outputs are safe.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kvt/common/dtype.h"
#include "kvt/common/status.h"

namespace kvt::kernels {

// ---------------------------------------------------------------------------------------------
// Page gather / scatter. One launch copies, for every buffer b < num_buffers and every i <
// num_pages, `bytes` bytes
//   from src_bases[b] + src_page(i) * src_page_stride + src_offset
//   to   dst_bases[b] + dst_page(i) * dst_page_stride + dst_offset
// where src_page(i) = src_pages ? src_pages[i] : i (likewise dst). With a null index list and a
// stride equal to `bytes` the side is contiguous, which makes pack (gather into staging) and
// unpack (scatter from staging) special cases. 16-byte vector accesses are used when every
// base, stride, offset and `bytes` allow it; narrower accesses otherwise (and for tails).
// Source and destination ranges must not overlap.
struct PageCopyArgs {
  const uint64_t* src_bases = nullptr;  // [num_buffers] byte addresses
  const uint64_t* dst_bases = nullptr;  // [num_buffers]
  int32_t num_buffers = 0;
  const int32_t* src_pages = nullptr;  // [num_pages] or null for identity
  const int32_t* dst_pages = nullptr;  // [num_pages] or null for identity
  int64_t num_pages = 0;
  int64_t src_page_stride = 0;  // bytes from one page to the next
  int64_t dst_page_stride = 0;
  int64_t src_offset = 0;  // byte offset inside a page
  int64_t dst_offset = 0;
  int64_t bytes = 0;  // bytes copied per (buffer, page)
};
Status PageCopyCuda(const PageCopyArgs& args, cudaStream_t stream);
Status PageCopyCpu(const PageCopyArgs& args);

// The same copy for small tables, without uploading them: the base tables and page lists travel
// in the launch's own parameters, so nothing has to reach device memory before the kernel can
// start (a table upload, an event and a stream wait less before a one-page write's kernel).
// `tables` (`num_words` words of host memory) holds every table `args` names, and args' *_bases
// and *_pages point into it (host pointers, as for PageCopyCpu); at most
// kPageCopyInlineTableWords words. The launch copies the tables, so they may be reused as soon
// as this returns. Default tuning. InvalidArgument, naming the value, when `tables` is too large
// or a table of `args` does not lie inside it (or is misaligned there).
inline constexpr size_t kPageCopyInlineTableWords = 480;  // the launch's parameters stay < 4 KiB
Status PageCopyCudaInline(const PageCopyArgs& args, const uint64_t* tables, size_t num_words,
                          cudaStream_t stream);

// Staging layout used by pack/unpack: buffer-major, i.e. staging + (b * num_pages + i) * bytes.
// Pack gathers pages of every buffer into `staging`; unpack scatters them back.
struct PackArgs {
  const uint64_t* bases = nullptr;  // [num_buffers] pool buffer addresses
  int32_t num_buffers = 0;
  const int32_t* pages = nullptr;  // [num_pages] page (or row) indices in the pool buffers
  int64_t num_pages = 0;
  int64_t page_stride = 0;  // bytes between pages (rows) of a pool buffer
  int64_t offset = 0;       // byte offset within a page
  int64_t bytes = 0;        // bytes per (buffer, page)
  void* staging = nullptr;  // num_buffers * num_pages * bytes bytes
};
Status PackCuda(const PackArgs& args, cudaStream_t stream);
Status PackCpu(const PackArgs& args);
Status UnpackCuda(const PackArgs& args, cudaStream_t stream);
Status UnpackCpu(const PackArgs& args);

// ---------------------------------------------------------------------------------------------
// Store: scatter rows of K and V into one layer's buffers at token locations (set_kv_buffer).
//   k_dst row loc[i] <- convert(k_src row i), likewise V, for i < num_rows.
// A row is `row_elems` elements (head_num * head_dim). When src_dtype == dst_dtype the bytes
// are copied. Otherwise each element is converted as tokenspeed does: if a scale is given the
// value is first divided by it *in the source dtype* (the result rounded to src_dtype), then
// converted to dst_dtype with round-to-nearest-even and no saturation, as torch's .to() does
// (fp8 e4m3 overflow becomes NaN, fp8 e5m2 overflow becomes inf).
// dst_dtype is the pool's element dtype (fp8 types are stored as their uint8 bytes).
struct StoreArgs {
  const void* k_src = nullptr;  // [num_rows, row_elems] of src_dtype
  const void* v_src = nullptr;
  DType src_dtype = DType::kBF16;
  void* k_dst = nullptr;  // pool buffer, rows of row_elems elements of dst_dtype
  void* v_dst = nullptr;
  DType dst_dtype = DType::kBF16;
  const int32_t* loc = nullptr;  // [num_rows] destination rows
  int64_t num_rows = 0;
  int64_t row_elems = 0;
  bool has_k_scale = false;
  float k_scale = 1.0f;
  bool has_v_scale = false;
  float v_scale = 1.0f;
};
Status StoreCuda(const StoreArgs& args, cudaStream_t stream);
Status StoreCpu(const StoreArgs& args);

// ---------------------------------------------------------------------------------------------
// Tiled all-layer copy (move_kv_cache): for every buffer b and every i < num_locs, copy row
// src_loc[i] to row tgt_loc[i] of buffer b, where a row of buffer b is row_bytes[b] bytes.
// One launch, grid (num_buffers, ceil(max row bytes / bytes_per_tile)). Rows may be within the
// same buffer; tgt rows must be distinct and disjoint from src rows.
struct TiledCopyArgs {
  const uint64_t* bases = nullptr;     // [num_buffers]
  const int64_t* row_bytes = nullptr;  // [num_buffers]
  int32_t num_buffers = 0;
  const int32_t* tgt_loc = nullptr;  // [num_locs]
  const int32_t* src_loc = nullptr;  // [num_locs]
  int64_t num_locs = 0;
  int64_t max_row_bytes = 0;     // max over row_bytes (sizes the grid without reading them)
  int32_t bytes_per_tile = 128;  // from TileBytesForStride
};
// The reference's rule: stride >= 8192 -> 512 B tiles, >= 4096 -> 256 B, else 128 B.
int32_t TileBytesForStride(int64_t stride_bytes);
Status TiledCopyCuda(const TiledCopyArgs& args, cudaStream_t stream);
Status TiledCopyCpu(const TiledCopyArgs& args);

// ---------------------------------------------------------------------------------------------
// Deterministic test pattern: the byte of (request, layer, K or V, token, byte-in-row) is a pure
// function, so a receiver can verify pages without the sender's data.
// Token t of a request lives in row pages[t / page_size] * page_size + t % page_size.
// kv: 0 for K, 1 for V.
uint8_t PatternByteHost(uint64_t request, int32_t layer, int32_t kv, int64_t token, int64_t byte);

struct PatternArgs {
  uint64_t request = 0;
  const uint64_t* k_bases = nullptr;  // [num_layers]: K buffer of layer first_layer + j
  const uint64_t* v_bases = nullptr;  // [num_layers]
  int32_t first_layer = 0;            // layer id of k_bases[0] (enters the pattern)
  int32_t num_layers = 0;
  const int32_t* pages = nullptr;  // [ceil(num_tokens / page_size)] the request's pages, in order
  int64_t num_tokens = 0;
  int64_t page_size = 0;  // tokens per page
  int64_t row_bytes = 0;  // bytes per token row (head_num * head_dim * itemsize)
};
Status FillPatternCuda(const PatternArgs& args, cudaStream_t stream);
Status FillPatternCpu(const PatternArgs& args);

struct PatternCheck {
  uint64_t mismatches = 0;  // bytes that differ from the pattern
  // The first mismatch in (layer, kv, token, byte) order, valid when mismatches > 0.
  int32_t layer = -1;
  int32_t kv = -1;
  int64_t token = -1;
  int64_t byte = -1;
  uint8_t expected = 0;
  uint8_t actual = 0;
};
// Synchronises `stream` before returning.
StatusOr<PatternCheck> VerifyPatternCuda(const PatternArgs& args, cudaStream_t stream);
StatusOr<PatternCheck> VerifyPatternCpu(const PatternArgs& args);

}  // namespace kvt::kernels

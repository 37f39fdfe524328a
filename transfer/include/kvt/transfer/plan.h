// Transfer plans: which bytes of which pool buffers go where for one request.
//
// A layout registered for transfer exposes its buffers (for one model: 2L, K of layers 0..L-1
// then V; with draft models or latent buffers, PlanSpec::buffers says which layer each belongs
// to), and page p of buffer b starts at base[b] + p * item_len[b] (the contiguous-buffer infos).
// A plan turns
// a request's source and destination page lists into copy runs (buffer, src offset, dst offset,
// bytes), coalescing pages that are consecutive on BOTH sides into one run, ordered layer by
// layer so that the runs of a layer batch [a, b) are one contiguous slice.
//
// The unit of transfer is (buffer, page, byte offset, bytes) rather than whole pages so that
// pools of different tensor-parallel sizes (a page holding a subset of the heads) can be served
// by the same machinery; whole-page units are the common case and the only ones coalesced.
//
// Pure functions and plain values: thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvt/common/status.h"

namespace kvt::transfer {

// CopyRun::dst_buffer's default: the peer's buffer of the source's index (what the engine's
// plans use: both sides registered the same buffer list).
inline constexpr uint32_t kSameBuffer = 0xFFFFFFFFu;

// One contiguous copy from a local buffer into a peer's buffer.
struct CopyRun {
  uint32_t buffer = 0;      // index into this side's registered buffers
  uint64_t src_offset = 0;  // bytes from the source buffer's base
  uint64_t dst_offset = 0;  // bytes from the destination buffer's base
  uint64_t bytes = 0;
  // Index into the peer's registered buffers; kSameBuffer: `buffer`. Writers of raw memory
  // regions (the Python package's Mooncake-style engine) pair any local buffer with any of the
  // peer's, whose lists may differ in length.
  uint32_t dst_buffer = kSameBuffer;

  uint32_t DstBuffer() const { return dst_buffer == kSameBuffer ? buffer : dst_buffer; }

  friend bool operator==(const CopyRun&, const CopyRun&) = default;
};

// A piece of every page: bytes [src_offset, src_offset + bytes) of a source page go to
// [dst_offset, dst_offset + bytes) of the destination page.
struct PageUnit {
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t bytes = 0;
};

// One buffer of both sides (the same index in both layouts) for plans of layouts that are not
// the uniform 2L K-then-V case: the transfer layer it belongs to and its page bytes and length
// on each side.
struct PlanBuffer {
  int32_t layer = 0;
  uint64_t src_item_len = 0;
  uint64_t dst_item_len = 0;
  uint64_t src_len = 0;
  uint64_t dst_len = 0;
};

struct PlanSpec {
  std::span<const int32_t> src_pages;  // the request's pages in the source pool, token order
  std::span<const int32_t> dst_pages;  // the same count, in the destination pool
  int32_t num_layers = 0;              // L of both pools
  int32_t layer_begin = 0;             // layers [layer_begin, layer_end) are planned
  int32_t layer_end = 0;
  uint64_t src_item_len = 0;    // bytes of one page of one buffer, source pool
  uint64_t dst_item_len = 0;    // destination pool
  uint64_t src_buffer_len = 0;  // bytes of one buffer (pages beyond it are out of range)
  uint64_t dst_buffer_len = 0;
  // Parts of each page to move: empty means the whole page (then both item lengths must be
  // equal); otherwise each unit's bytes at src_offset of every source page go to dst_offset of
  // the matching destination page (pools of different TP sizes: a head range of each token).
  std::span<const PageUnit> units;
  // Every buffer, by index, when the layouts are not 2L buffers of one page size (draft
  // models, latent buffers): then each buffer's own item lengths and lengths hold, and
  // src/dst_item_len and src/dst_buffer_len are ignored. Empty: buffers l (K) and
  // num_layers + l (V) of layer l, with the item and buffer lengths above.
  std::span<const PlanBuffer> buffers;
};

struct Plan {
  std::vector<CopyRun> runs;
  // runs of layer l (K then V) are runs[layer_begin_index[l - layer_begin] ..
  // layer_begin_index[l - layer_begin + 1]).
  std::vector<size_t> layer_begin_index;
  int32_t layer_begin = 0;
  int32_t layer_end = 0;
  uint64_t total_bytes = 0;

  // The runs of layers [a, b), a contiguous slice; a and b must lie in the planned range.
  std::span<const CopyRun> Layers(int32_t a, int32_t b) const;
};

// Validates the spec: page counts equal, pages >= 1 (page 0 is the dummy page) and inside the
// buffers, layer range inside [0, L], units inside the items (whole pages need equal items).
Status ValidatePlanSpec(const PlanSpec& spec);

// Bytes the spec moves: pages x the bytes per page (or per units) of every buffer of the layers.
uint64_t PlanBytes(const PlanSpec& spec);

// Validates the spec (ValidatePlanSpec) and builds the plan. The runs are written into
// `storage` (cleared first; its capacity is kept): pass the runs of a finished plan so that
// steady-state planning allocates nothing (a fresh multi-megabyte vector costs page faults on
// every request: 7-8 ms for the 65536 runs of a 1024-page request on a 2-core VM).
StatusOr<Plan> BuildPlan(const PlanSpec& spec, std::vector<CopyRun> storage = {});

}  // namespace kvt::transfer

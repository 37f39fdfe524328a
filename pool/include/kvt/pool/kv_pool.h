// KvPool: a paged token-to-KV pool, the C++ port of tokenspeed's MHATokenToKVPool.
//
// The pool holds `size` token slots of `layer_num` layers; each layer has one K and one V buffer
// of [size + page_size, head_num, head_dim] elements (token-major; page p is rows
// [p*page_size, (p+1)*page_size); page 0 is a zeroed dummy page). Buffers live in host memory
// (page-aligned, pinned when a CUDA device is present) or CUDA device memory, chosen by
// PoolOptions::memory; the API is the same. Layout rules (hybrid slab aliasing, state layers,
// guards) are PoolLayout's; see pool_layout.h.
//
// Index lists (locations, indices) are host arrays of int32 token rows in [0, size + page_size);
// the pool validates them and copies them to the device itself for CUDA pools. Data operations
// run the kvt::kernels CUDA kernels (CUDA pools, on the pool's own stream) or their CPU
// references (host pools), and have completed when they return.
//
// Ownership: Create returns the sole owner; buffer pointers and views stay valid until the pool
// is destroyed.
// Thread safety: const methods that only read the layout (buffer infos, sizes, views) are safe
// from any thread. Data operations (SetKvBuffer, MoveKvCache, LoadCpuCopy, Transfer,
// ClearKvBuffers, and the reads GetCpuCopy / GetFlatData) are not synchronised with each other:
// call them from one thread (the engine's scheduler), or serialise them.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "kvt/common/status.h"
#include "kvt/pool/buffer_infos.h"
#include "kvt/pool/buffer_view.h"
#include "kvt/pool/kv_cpu_copy.h"
#include "kvt/pool/kv_rows.h"
#include "kvt/pool/layer_done_waiter.h"
#include "kvt/pool/pool_layout.h"
#include "kvt/pool/pool_options.h"

namespace kvt::pool {

class KvPool {
 public:
  // Computes the layout (every validation and construction guard runs before any allocation),
  // then allocates zeroed buffers. InvalidArgument / FailedPrecondition from PoolLayout;
  // ResourceExhausted when memory cannot be had; Unavailable for a CUDA pool without a device.
  static StatusOr<std::unique_ptr<KvPool>> Create(const PoolOptions& options);

  ~KvPool();
  KvPool(const KvPool&) = delete;
  KvPool& operator=(const KvPool&) = delete;

  const PoolLayout& layout() const { return layout_; }
  const PoolOptions& options() const { return layout_.options(); }
  MemoryKind memory_kind() const { return layout_.options().memory; }
  // True when host buffers are pinned (page-locked and registered with CUDA).
  bool host_memory_pinned() const;

  bool SupportsHierarchicalKvCache() const { return layout_.supports_hierarchical_kv_cache(); }
  bool SupportsPdTransfer() const { return true; }  // the base pool's default

  // --- Sizes and buffer infos (reference: get_kv_size_bytes, get_contiguous_buf_*) -----------
  std::pair<int64_t, int64_t> GetKvSizeBytes() const { return layout_.KvSizeBytes(); }
  // FailedPrecondition for pools with state layers (they carry no per-layer KV).
  StatusOr<ContiguousBufInfos> GetContiguousBufInfos() const;
  StatusOr<std::vector<int64_t>> GetContiguousBufUnitLens() const { return layout_.UnitLens(); }
  std::vector<std::array<int64_t, 2>> GetLayerwiseBufInfoOffsets(int64_t start_idx = 0) const {
    return layout_.LayerwiseBufInfoOffsets(start_idx);
  }

  // --- Buffer access --------------------------------------------------------------------------
  // The layer's K / V buffer, viewed as the pool dtype. Waits on the registered LayerDoneWaiter
  // first. InvalidArgument naming the layer for a state layer; OutOfRange for a bad id.
  StatusOr<BufferView> GetKeyBuffer(int64_t layer_id) const;
  StatusOr<BufferView> GetValueBuffer(int64_t layer_id) const;
  StatusOr<std::pair<BufferView, BufferView>> GetKvBuffer(int64_t layer_id) const;
  // (conv, ssm) state slab pair of a state layer; errors for other layers (see
  // PoolLayout::CheckStateLayer).
  StatusOr<std::pair<BufferView, BufferView>> GetStateBuffers(int64_t layer_id) const;
  // Every (conv, ssm) pair; empty when no state slabs are active.
  std::vector<std::pair<BufferView, BufferView>> StateSlabs() const;

  // Registers the layer-wise loading hook (not owned; must outlive the pool or be replaced by
  // nullptr first). Call before the pool is shared between threads.
  void RegisterLayerTransferCounter(LayerDoneWaiter* waiter) { layer_waiter_ = waiter; }

  // --- Data operations ------------------------------------------------------------------------
  // Writes rows i of rows.k / rows.v into rows loc[i] of layer `layer_id`'s K / V buffers. When
  // rows.dtype differs from the pool's dtype each value is first divided by k_scale / v_scale
  // (if given) and converted (kernels::Store*); same dtype copies the bytes and ignores scales.
  // Unlike the reference, the caller's rows are never modified in place.
  Status SetKvBuffer(int64_t layer_id, std::span<const int32_t> loc, const KvRows& rows,
                     std::optional<float> k_scale = std::nullopt,
                     std::optional<float> v_scale = std::nullopt);

  // Copies rows src_loc[i] -> tgt_loc[i] in every K and V buffer. With enable_kv_cache_copy one
  // tiled-copy launch covers all buffers (targets must be distinct and disjoint from sources);
  // otherwise each buffer is gathered then scattered (overlap allowed, as the reference's
  // `k[tgt] = k[src]`). Duplicate targets are refused in both modes.
  Status MoveKvCache(std::span<const int32_t> tgt_loc, std::span<const int32_t> src_loc);

  // Host copy of rows `indices` of every layer, in chunks of offload_chunk_page_num indices.
  StatusOr<KvCpuCopy> GetCpuCopy(std::span<const int32_t> indices) const;
  // Writes a GetCpuCopy result back to rows `indices`; InvalidArgument when its chunk shapes do
  // not match `indices` and this pool.
  Status LoadCpuCopy(const KvCpuCopy& copy, std::span<const int32_t> indices);

  // Bytes of the flat [2, L, n, H, D] block for n indices.
  int64_t FlatDataBytes(int64_t num_indices) const;
  // Packs rows `indices` of every layer as [2, L, n, H, D] (K then V) into host memory.
  StatusOr<std::vector<uint8_t>> GetFlatData(std::span<const int32_t> indices) const;
  // Same, into caller memory of at least FlatDataBytes(n) bytes on host or CUDA.
  Status GetFlatDataInto(std::span<const int32_t> indices, void* dst, int64_t dst_bytes,
                         MemoryKind dst_memory) const;
  // Unpacks a [2, L, n, H, D] block (host or CUDA memory) into rows `indices` of every layer.
  Status Transfer(std::span<const int32_t> indices, const void* flat, int64_t flat_bytes,
                  MemoryKind flat_memory);

  // Zeroes every K/V buffer (the base pool's clear_kv_buffers; state slabs are left alone).
  Status ClearKvBuffers();

 private:
  class Impl;
  KvPool(PoolLayout layout, std::unique_ptr<Impl> impl);

  const PoolLayout layout_;
  std::unique_ptr<Impl> impl_;
  LayerDoneWaiter* layer_waiter_ = nullptr;
};

}  // namespace kvt::pool

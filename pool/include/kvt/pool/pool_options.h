// PoolOptions: everything that defines a KV pool's layout and where its memory lives.
//
// The fields mirror tokenspeed's MHATokenToKVPool constructor arguments (names in C++ style).
// A plain value type: copy it, fill it, hand it to PoolLayout::Compute or KvPool::Create, which
// validate it (nothing here is checked on assignment). Thread-safe as any value.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "kvt/common/dtype.h"
#include "kvt/pool/host_allocator.h"
#include "kvt/pool/layer_type.h"

namespace kvt::pool {

// Where a pool's buffers (or a caller's input) live.
enum class MemoryKind : int {
  kHost = 0,  // page-aligned host memory (pinned when a CUDA device is present and asked for)
  kCuda = 1,  // CUDA device memory of PoolOptions::device
};

// "host" or "cuda".
const char* MemoryKindName(MemoryKind kind);

struct PoolOptions {
  // --- Geometry -------------------------------------------------------------------------------
  int64_t size = 0;       // token slots; each K/V buffer has size + page_size rows (page 0 dummy)
  int64_t page_size = 1;  // tokens per page
  int64_t head_num = 0;   // KV heads (of this rank)
  int64_t head_dim = 0;   // elements per head
  int64_t layer_num = 0;
  DType dtype = DType::kBF16;  // element type; fp8 types are stored as uint8 and viewed back

  // --- Layer types (empty = no types given, as the reference's default) -----------------------
  std::vector<LayerType> layer_types;  // empty, or exactly layer_num entries

  // Sliding window in tokens: one value for every sliding layer, or one entry per layer
  // (std::nullopt for layers without a window). At most one of the two may be set. Only the
  // hybrid slab predicate reads them (multi-window models keep the per-layer layout).
  std::optional<int64_t> sliding_window_tokens;
  std::vector<std::optional<int64_t>> sliding_window_tokens_per_layer;

  // --- Feature switches -----------------------------------------------------------------------
  // Ask for the hybrid slab layout: the i-th full and the i-th sliding layer alias one buffer.
  // Applied only when the layer types allow it (see PoolLayout); quietly ignored otherwise.
  bool enable_hybrid_slab = false;
  // The pool's buffers will be registered for PD (prefill/decode) transfer. Slab-aliased
  // layouts are refused with it (FailedPrecondition at Create).
  bool pd_disaggregation_enabled = false;
  // true: MoveKvCache copies every buffer in ONE tiled-copy launch (the reference's
  // enable_kv_cache_copy). false (the reference's default): one gather + scatter per buffer.
  bool enable_kv_cache_copy = false;

  // --- Recurrent state (linear_attention layers) ----------------------------------------------
  // Per-layer conv and temporal (ssm) state shapes. State layers drop their K/V buffers and get
  // state slabs only when BOTH shapes are given; otherwise they keep ordinary K/V buffers.
  std::vector<int64_t> conv_state_shape;
  std::vector<int64_t> ssm_state_shape;
  std::optional<DType> conv_dtype;  // default: dtype
  std::optional<DType> ssm_dtype;   // default: dtype

  // --- Scheduling limits (kept for the engine; they do not change the layout) ----------------
  int64_t max_batch_size = 0;
  int64_t max_context_len = 0;
  int32_t rank = 0;  // only used in log lines

  // --- Offload --------------------------------------------------------------------------------
  // Rows per chunk in GetCpuCopy / LoadCpuCopy (the reference's offload_chunk_page_num).
  int64_t offload_chunk_page_num = 1024;

  // --- Memory ---------------------------------------------------------------------------------
  MemoryKind memory = MemoryKind::kHost;
  int device = 0;  // CUDA device index for kCuda pools
  // Host pools: pin the buffers with cudaHostRegister when a CUDA device is present. Turn off
  // for pools that are only inspected (kvt-info), where pinning would commit all the memory.
  bool pin_host_memory = true;
  // Host pools: fault every page in at creation (as torch.zeros does by writing the zeros), so
  // the first transfers into or out of the pool do not pay page faults. Off by default because
  // pools that are only inspected (kvt-info) would commit all their memory; agents turn it on.
  bool prefault_host_memory = false;
  // Host pools: take the K/V buffers from this allocator instead of mmap (e.g. a transfer
  // backend's, so that it can reach them directly). Null: mmap. The pool zeroes the memory.
  std::shared_ptr<HostAllocator> host_allocator;
};

}  // namespace kvt::pool

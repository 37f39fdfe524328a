// PoolLayout: the pure layout computation of a KV pool — which layers own which buffer, how big
// every buffer is, the hybrid slab aliasing, the state layers and their slabs, the buffer infos a
// transfer engine registers, and every guard of tokenspeed's MHATokenToKVPool that does not need
// memory. No memory is allocated, so layouts can be validated cheaply (kvt-info, peers checking
// compatibility); KvPool::Create runs exactly this computation before allocating anything.
//
// Semantics (DESIGN.md "What the seed fixes"):
//  * every layer has one K and one V buffer of [size + page_size, head_num, head_dim] store-dtype
//    elements (row p*page_size.. is page p; page 0 is the zeroed dummy page);
//  * hybrid slab: when asked for, and every layer type is a KV label, there are >= 2 distinct
//    labels, no state label and at most one distinct sliding window, layer i uses slab
//    occurrence_index(i) (the i-th full and the i-th sliding layer alias one buffer); every
//    label must have the same count. Otherwise the per-layer layout is kept, quietly;
//  * state layers (linear_attention, only when both state shapes are given) have no K/V buffer;
//    the n-th state layer binds conv/ssm slab pair n of size/page_size + 1 rows (row 0 null).
//
// Thread safety: an immutable value after Compute; all methods are const and thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kvt/common/dtype.h"
#include "kvt/common/status.h"
#include "kvt/pool/layer_type.h"
#include "kvt/pool/pool_options.h"

namespace kvt::pool {

// How one layer maps onto the pool's buffers.
struct LayerLayout {
  std::optional<LayerType> type;  // nullopt when the pool was given no layer types
  bool has_kv = true;             // false for state layers of an active state layout
  // Index of the layer's K buffer among the pool's distinct K buffers (its V buffer has the same
  // index among the V buffers); -1 when the layer has no K/V buffer.
  int32_t kv_buffer = -1;
  // Hybrid slab index (the layer's occurrence index within its label); -1 in per-layer layouts.
  int32_t slab_index = -1;
  // n for the n-th linear_attention layer (assigned even when no state slabs are allocated, as
  // the reference does); -1 for other layers.
  int32_t state_pair = -1;
};

class PoolLayout {
 public:
  // Validates `options` and computes the layout. InvalidArgument names any bad value;
  // FailedPrecondition for a slab-aliased layout with PD disaggregation enabled.
  static StatusOr<PoolLayout> Compute(const PoolOptions& options);

  const PoolOptions& options() const { return options_; }
  int64_t layer_num() const { return options_.layer_num; }
  DType dtype() const { return options_.dtype; }
  DType store_dtype() const { return StoreDType(options_.dtype); }

  // Rows of every K/V buffer: size + page_size.
  int64_t rows_per_buffer() const { return rows_per_buffer_; }
  // Bytes of one token row of one buffer: head_num * head_dim * itemsize.
  int64_t row_bytes() const { return row_bytes_; }
  // Bytes of one K or V buffer.
  int64_t buffer_bytes() const { return rows_per_buffer_ * row_bytes_; }
  // Bytes of one page of one buffer (the buffer infos' item_len).
  int64_t item_len() const { return options_.page_size * row_bytes_; }
  // Bytes of one head of one token (the buffer infos' unit length).
  int64_t unit_len() const { return options_.head_dim * ItemSize(store_dtype()); }
  // Usable page ids are 1..num_pages() (page 0 is the dummy page): size / page_size.
  int64_t num_pages() const { return options_.size / options_.page_size; }

  const std::vector<LayerLayout>& layers() const { return layers_; }
  // Distinct K buffers (the same number of V buffers) the pool allocates.
  int32_t num_kv_buffers() const { return num_kv_buffers_; }

  bool hybrid_slab_active() const { return slab_count_ > 0; }
  int32_t slab_count() const { return slab_count_; }  // 0 when the slab layout is off

  // True when state layers drop their K/V buffers and state slabs are allocated.
  bool state_active() const { return state_active_; }
  // Layers without K/V (empty unless state_active()).
  std::vector<int32_t> state_layer_ids() const;
  // Layers labelled linear_attention, whether or not state slabs are active.
  const std::vector<int32_t>& state_labelled_layers() const { return state_labelled_layers_; }
  int32_t num_state_slab_pairs() const {
    return state_active_ ? static_cast<int32_t>(state_labelled_layers_.size()) : 0;
  }
  // Rows of every state slab: size / page_size + 1 (row 0 the null row); 0 when inactive.
  int64_t state_rows() const { return state_active_ ? num_pages() + 1 : 0; }
  DType conv_dtype() const { return options_.conv_dtype.value_or(options_.dtype); }
  DType ssm_dtype() const { return options_.ssm_dtype.value_or(options_.dtype); }
  // Bytes of one conv / ssm state row (one page id of one state layer).
  int64_t conv_row_bytes() const { return conv_row_bytes_; }
  int64_t ssm_row_bytes() const { return ssm_row_bytes_; }
  // Full slab shapes including the row dimension. The ssm slab is allocated with the last two
  // dims of ssm_state_shape swapped ([.., K, V] -> [.., V, K]), as the reference does for
  // flashinfer's GDN state layout; shapes shorter than 2 dims are kept as given.
  std::vector<int64_t> conv_slab_shape() const;
  std::vector<int64_t> ssm_slab_shape() const;

  // tokenspeed's supports_hierarchical_kv_cache: false for slab or state layouts, whose
  // per-layer host copies would alias shared slabs or miss state layers.
  bool supports_hierarchical_kv_cache() const { return !hybrid_slab_active() && !state_active_; }

  // (k bytes, v bytes), each distinct buffer counted once; state layers have none.
  std::pair<int64_t, int64_t> KvSizeBytes() const;

  // The guard of get_contiguous_buf_infos: FailedPrecondition for a pool with state layers.
  Status CheckContiguousBufInfos() const;
  // 2L entries, K of layers 0..L-1 then V: whole buffer bytes / bytes of one page.
  StatusOr<std::vector<int64_t>> DataLens() const;
  StatusOr<std::vector<int64_t>> ItemLens() const;
  // 2L entries of head_dim * itemsize; the first state layer's K/V error for state pools.
  StatusOr<std::vector<int64_t>> UnitLens() const;
  // For each layer l: {start_idx + l, start_idx + L + l}. Never fails.
  std::vector<std::array<int64_t, 2>> LayerwiseBufInfoOffsets(int64_t start_idx = 0) const;

  // OK when `layer_id` is in range and has K/V buffers; OutOfRange / InvalidArgument (a state
  // layer: "layer N is a state layer ...") otherwise.
  Status CheckKvLayer(int64_t layer_id) const;
  // OK when `layer_id` has state slabs; OutOfRange, InvalidArgument (not a state layer) or
  // FailedPrecondition (a state layer without slabs) otherwise.
  Status CheckStateLayer(int64_t layer_id) const;
  // OK when every index is in [0, rows_per_buffer()); OutOfRange naming the first bad value and
  // its position. `what` names the list in the message ("loc", "indices").
  Status CheckRows(const int32_t* rows, int64_t count, const char* what) const;

  // One line for logs: "L layers x [rows, H, D] bf16 (per-layer|hybrid slab N|state M)".
  std::string Summary() const;

 private:
  PoolLayout() = default;

  PoolOptions options_;
  int64_t rows_per_buffer_ = 0;
  int64_t row_bytes_ = 0;
  std::vector<LayerLayout> layers_;
  int32_t num_kv_buffers_ = 0;
  int32_t slab_count_ = 0;
  bool state_active_ = false;
  std::vector<int32_t> state_labelled_layers_;
  int64_t conv_row_bytes_ = 0;
  int64_t ssm_row_bytes_ = 0;
};

}  // namespace kvt::pool

#include "kvt/pool/pool_layout.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>

namespace kvt::pool {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += Str(shape[i]);
  }
  return s + "]";
}

std::string IdList(const std::vector<int32_t>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i > 0) s += ", ";
    s += Str(ids[i]);
  }
  return s + "]";
}

// a * b, or nullopt on int64 overflow (sizes come from users; never let them wrap).
std::optional<int64_t> Mul(int64_t a, int64_t b) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

Status CheckPositive(const char* name, int64_t value) {
  if (value > 0) return OkStatus();
  return InvalidArgument(std::string(name) + " must be > 0 (got " + Str(value) + ")");
}

Status CheckNonNegative(const char* name, int64_t value) {
  if (value >= 0) return OkStatus();
  return InvalidArgument(std::string(name) + " must be >= 0 (got " + Str(value) + ")");
}

bool IsKnownDType(DType d) {
  switch (d) {
    case DType::kBF16:
    case DType::kFP16:
    case DType::kFP32:
    case DType::kFP8E4M3:
    case DType::kFP8E5M2:
    case DType::kUInt8:
      return true;
  }
  return false;
}

// Product of a state shape times the item size; InvalidArgument for empty dims or overflow.
StatusOr<int64_t> StateRowBytes(const char* name, const std::vector<int64_t>& shape, DType dtype) {
  int64_t elems = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] <= 0) {
      return InvalidArgument(std::string(name) + "[" + Str(static_cast<int64_t>(i)) +
                             "] must be > 0 (got " + Str(shape[i]) + " in " + ShapeString(shape) +
                             ")");
    }
    auto next = Mul(elems, shape[i]);
    if (!next)
      return InvalidArgument(std::string(name) + " " + ShapeString(shape) + " is too large");
    elems = *next;
  }
  auto bytes = Mul(elems, ItemSize(dtype));
  if (!bytes)
    return InvalidArgument(std::string(name) + " " + ShapeString(shape) + " is too large");
  return *bytes;
}

// tokenspeed's hybrid_slab_group_size predicate minus the count check: true when the slab
// layout may be used. It gates an optimisation, so it never fails (bad inputs were rejected
// before it runs).
bool HybridSlabPredicate(const PoolOptions& o) {
  if (!o.enable_hybrid_slab || o.layer_types.empty()) return false;
  std::set<LayerType> labels;
  for (LayerType t : o.layer_types) {
    // State rows are not byte-equal with KV rows, so no slab pairing.
    if (!IsKvLayerType(t)) return false;
    labels.insert(t);
  }
  if (labels.size() < 2) return false;
  if (!o.sliding_window_tokens_per_layer.empty()) {
    // Multi-window models: the slab pairing is per raw label, not per (label, window).
    std::set<int64_t> windows;
    for (size_t i = 0; i < o.layer_types.size(); ++i) {
      const auto& w = o.sliding_window_tokens_per_layer[i];
      if (o.layer_types[i] == LayerType::kSlidingAttention && w.has_value() && *w > 0) {
        windows.insert(*w);
      }
    }
    if (windows.size() > 1) return false;
  }
  return true;
}

Status ValidateOptions(const PoolOptions& o) {
  KVT_RETURN_IF_ERROR(CheckPositive("size", o.size));
  KVT_RETURN_IF_ERROR(CheckPositive("page_size", o.page_size));
  KVT_RETURN_IF_ERROR(CheckPositive("head_num", o.head_num));
  KVT_RETURN_IF_ERROR(CheckPositive("head_dim", o.head_dim));
  KVT_RETURN_IF_ERROR(CheckPositive("layer_num", o.layer_num));
  KVT_RETURN_IF_ERROR(CheckNonNegative("max_batch_size", o.max_batch_size));
  KVT_RETURN_IF_ERROR(CheckNonNegative("max_context_len", o.max_context_len));
  KVT_RETURN_IF_ERROR(CheckPositive("offload_chunk_page_num", o.offload_chunk_page_num));
  if (!IsKnownDType(o.dtype) || !IsPoolDType(o.dtype)) {
    return InvalidArgument("dtype " + std::string(DTypeName(o.dtype)) +
                           " is not a pool element type; use one of bf16, fp16, fp32, "
                           "fp8_e4m3, fp8_e5m2 (fp8 is stored as uint8 by the pool itself)");
  }
  for (const auto& [name, d] :
       {std::pair{"conv_dtype", o.conv_dtype}, std::pair{"ssm_dtype", o.ssm_dtype}}) {
    if (d.has_value() && !IsKnownDType(*d)) {
      return InvalidArgument(std::string(name) + " is not a known dtype (value " +
                             Str(static_cast<int>(*d)) + ")");
    }
  }
  if (o.memory != MemoryKind::kHost && o.memory != MemoryKind::kCuda) {
    return InvalidArgument("memory kind " + Str(static_cast<int>(o.memory)) +
                           " is unknown; use host or cuda");
  }
  if (o.device < 0) return InvalidArgument("device must be >= 0 (got " + Str(o.device) + ")");

  if (!o.layer_types.empty() && static_cast<int64_t>(o.layer_types.size()) != o.layer_num) {
    return InvalidArgument("layer_types has " + Str(static_cast<int64_t>(o.layer_types.size())) +
                           " entries but layer_num=" + Str(o.layer_num) +
                           "; give one type per layer, or none");
  }
  for (size_t i = 0; i < o.layer_types.size(); ++i) {
    const int v = static_cast<int>(o.layer_types[i]);
    if (v < 0 || v > static_cast<int>(LayerType::kLinearAttention)) {
      return InvalidArgument("layer_types[" + Str(static_cast<int64_t>(i)) +
                             "] is not a known layer type (value " + Str(v) +
                             "); use full_attention, sliding_attention or linear_attention");
    }
  }

  if (o.sliding_window_tokens.has_value() && !o.sliding_window_tokens_per_layer.empty()) {
    return InvalidArgument(
        "give the sliding window either as one value (sliding_window_tokens) or per layer "
        "(sliding_window_tokens_per_layer), not both");
  }
  if (o.sliding_window_tokens.has_value() && *o.sliding_window_tokens <= 0) {
    return InvalidArgument("sliding_window_tokens must be > 0 (got " +
                           Str(*o.sliding_window_tokens) + "); leave it unset for no window");
  }
  if (!o.sliding_window_tokens_per_layer.empty()) {
    const auto n = static_cast<int64_t>(o.sliding_window_tokens_per_layer.size());
    if (n != o.layer_num) {
      return InvalidArgument("sliding_window_tokens_per_layer has " + Str(n) +
                             " entries but layer_num=" + Str(o.layer_num) +
                             "; give one entry per layer (nullopt for layers without a window)");
    }
    for (int64_t i = 0; i < n; ++i) {
      const auto& w = o.sliding_window_tokens_per_layer[i];
      if (w.has_value() && *w <= 0) {
        return InvalidArgument("sliding_window_tokens_per_layer[" + Str(i) + "] must be > 0 (got " +
                               Str(*w) + "); use nullopt for a layer without a window");
      }
    }
  }
  return OkStatus();
}

}  // namespace

StatusOr<PoolLayout> PoolLayout::Compute(const PoolOptions& options) {
  KVT_RETURN_IF_ERROR(ValidateOptions(options));
  const PoolOptions& o = options;
  PoolLayout layout;
  layout.options_ = options;

  // Rows are addressed by int32 locations (kernels and the wire use int32 index lists).
  const int64_t rows = o.size + o.page_size;
  if (o.size > INT32_MAX || o.page_size > INT32_MAX || rows > INT32_MAX) {
    return InvalidArgument("size + page_size = " + Str(o.size) + " + " + Str(o.page_size) +
                           " rows exceeds the int32 row index range (" + Str(INT32_MAX) +
                           "); use a smaller pool");
  }
  layout.rows_per_buffer_ = rows;
  const auto row_elems = Mul(o.head_num, o.head_dim);
  const auto row_bytes = row_elems ? Mul(*row_elems, ItemSize(StoreDType(o.dtype))) : std::nullopt;
  const auto buffer_bytes = row_bytes ? Mul(*row_bytes, rows) : std::nullopt;
  const auto all_bytes = buffer_bytes ? Mul(*buffer_bytes, 2 * o.layer_num) : std::nullopt;
  if (!all_bytes) {
    return InvalidArgument("pool of " + Str(o.layer_num) + " layers x [" + Str(rows) + ", " +
                           Str(o.head_num) + ", " + Str(o.head_dim) +
                           "] overflows 64-bit byte counts; use smaller dimensions");
  }
  layout.row_bytes_ = *row_bytes;

  layout.layers_.resize(o.layer_num);
  for (int64_t i = 0; i < static_cast<int64_t>(o.layer_types.size()); ++i) {
    layout.layers_[i].type = o.layer_types[i];
    if (IsStateLayerType(o.layer_types[i])) {
      // The n-th state layer binds pair n (within-state-label occurrence order).
      layout.layers_[i].state_pair = static_cast<int32_t>(layout.state_labelled_layers_.size());
      layout.state_labelled_layers_.push_back(static_cast<int32_t>(i));
    }
  }

  // --- State layers: pre-check before anything else, as the reference does ------------------
  const bool shapes_given = !o.conv_state_shape.empty() && !o.ssm_state_shape.empty();
  if (shapes_given) {
    KVT_ASSIGN_OR_RETURN(
        layout.conv_row_bytes_,
        StateRowBytes("conv_state_shape", o.conv_state_shape, layout.conv_dtype()));
    KVT_ASSIGN_OR_RETURN(layout.ssm_row_bytes_,
                         StateRowBytes("ssm_state_shape", o.ssm_state_shape, layout.ssm_dtype()));
  }
  layout.state_active_ = shapes_given && !layout.state_labelled_layers_.empty();
  if (layout.state_active_) {
    if (static_cast<int64_t>(layout.state_labelled_layers_.size()) == o.layer_num) {
      // The reference's equalizer sizes the page against the widest KV row; with no KV layer
      // there is nothing to size it against.
      return InvalidArgument(
          "every layer is a state layer (linear_attention): state rows need at least one KV "
          "layer (full_attention or sliding_attention) to size the page against");
    }
    // KV pages and state rows share one page-id space, so one page of KV for one layer must
    // cover the widest state row.
    const int64_t kv_bytes_per_slot = 2 * layout.row_bytes_;
    const int64_t widest = std::max(layout.conv_row_bytes_, layout.ssm_row_bytes_);
    const auto kv_page_bytes = Mul(o.page_size, kv_bytes_per_slot);
    if (!kv_page_bytes || *kv_page_bytes < widest) {
      const int64_t needed_tokens = (widest + kv_bytes_per_slot - 1) / kv_bytes_per_slot;
      const int64_t fits = (needed_tokens + o.page_size - 1) / o.page_size * o.page_size;
      return InvalidArgument(
          "page_size " + Str(o.page_size) +
          " is too small for the state layers: one page of KV "
          "for one layer is " +
          Str(o.page_size) + " x 2 x " + Str(o.head_num) + " x " + Str(o.head_dim) + " x " +
          Str(ItemSize(StoreDType(o.dtype))) + " = " + Str(kv_page_bytes.value_or(0)) +
          " bytes, but the widest state row is " + Str(widest) + " bytes (conv " +
          Str(layout.conv_row_bytes_) + ", ssm " + Str(layout.ssm_row_bytes_) +
          "); KV pages and state rows share one page-id space, so use page_size >= " + Str(fits) +
          " (the smallest multiple of " + Str(o.page_size) + " that fits)");
    }
    if (o.size % o.page_size != 0) {
      return InvalidArgument("size " + Str(o.size) + " is not a whole number of pages (page_size " +
                             Str(o.page_size) +
                             "); state slabs are row-indexed by page id, so use size " +
                             Str(o.size / o.page_size * o.page_size) + " or " +
                             Str((o.size / o.page_size + 1) * o.page_size));
    }
    if (!Mul(layout.conv_row_bytes_, layout.num_pages() + 1) ||
        !Mul(layout.ssm_row_bytes_, layout.num_pages() + 1)) {
      return InvalidArgument("state slabs of " + Str(layout.num_pages() + 1) +
                             " rows overflow 64-bit byte counts; use smaller state shapes");
    }
    for (int32_t id : layout.state_labelled_layers_) layout.layers_[id].has_kv = false;
  }

  // --- Hybrid slab aliasing -------------------------------------------------------------------
  if (HybridSlabPredicate(o)) {
    if (o.pd_disaggregation_enabled) {
      return FailedPrecondition(
          "hybrid slab KV layout is incompatible with PD disaggregation: KV transfer registers "
          "per-layer buffer pointers (GetContiguousBufInfos), and paired layers alias the same "
          "slab, so per-layer transfers would send the same bytes twice and clobber the peer's "
          "pairing. Turn off pd_disaggregation_enabled for this pool, or turn off "
          "enable_hybrid_slab (kvt-info: drop --pd or --hybrid-slab), which keeps the per-layer "
          "layout");
    }
    std::map<LayerType, int64_t> counts;
    for (LayerType t : o.layer_types) ++counts[t];
    const int64_t group = counts.begin()->second;
    bool even = true;
    for (const auto& [t, c] : counts) even = even && (c == group);
    if (!even) {
      std::string groups = "{";
      for (const auto& [t, c] : counts) {
        if (groups.size() > 1) groups += ", ";
        groups += "'" + std::string(LayerTypeName(t)) + "': " + Str(c);
      }
      groups += "}";
      return InvalidArgument("hybrid slab layout: uneven groups " + groups +
                             "; every layer type needs the same number of layers to pair them "
                             "into slabs. Turn off enable_hybrid_slab for this model");
    }
    layout.slab_count_ = static_cast<int32_t>(group);
    std::map<LayerType, int32_t> seen;
    for (int64_t i = 0; i < o.layer_num; ++i) {
      const int32_t occurrence = seen[o.layer_types[i]]++;
      layout.layers_[i].slab_index = occurrence;
      layout.layers_[i].kv_buffer = occurrence;
    }
    layout.num_kv_buffers_ = layout.slab_count_;
  } else {
    int32_t next = 0;
    for (auto& layer : layout.layers_) {
      if (layer.has_kv) layer.kv_buffer = next++;
    }
    layout.num_kv_buffers_ = next;
  }
  return layout;
}

std::vector<int32_t> PoolLayout::state_layer_ids() const {
  return state_active_ ? state_labelled_layers_ : std::vector<int32_t>{};
}

std::vector<int64_t> PoolLayout::conv_slab_shape() const {
  if (!state_active_) return {};
  std::vector<int64_t> shape = {state_rows()};
  shape.insert(shape.end(), options_.conv_state_shape.begin(), options_.conv_state_shape.end());
  return shape;
}

std::vector<int64_t> PoolLayout::ssm_slab_shape() const {
  if (!state_active_) return {};
  std::vector<int64_t> shape = {state_rows()};
  shape.insert(shape.end(), options_.ssm_state_shape.begin(), options_.ssm_state_shape.end());
  if (options_.ssm_state_shape.size() >= 2)
    std::swap(shape[shape.size() - 1], shape[shape.size() - 2]);
  return shape;
}

std::pair<int64_t, int64_t> PoolLayout::KvSizeBytes() const {
  const int64_t bytes = static_cast<int64_t>(num_kv_buffers_) * buffer_bytes();
  return {bytes, bytes};
}

Status PoolLayout::CheckContiguousBufInfos() const {
  if (!state_active_) return OkStatus();
  return FailedPrecondition(
      "the pool has state layers " + IdList(state_labelled_layers_) +
      " (linear_attention) with no per-layer KV; PD disaggregation is unsupported: KV transfer "
      "registers per-layer buffer pointers, and state layers carry only state slabs. Turn off "
      "PD disaggregation for this model, or build the pool without state shapes "
      "(conv_state_shape / ssm_state_shape), which keeps full per-layer K/V buffers");
}

StatusOr<std::vector<int64_t>> PoolLayout::DataLens() const {
  KVT_RETURN_IF_ERROR(CheckContiguousBufInfos());
  return std::vector<int64_t>(2 * options_.layer_num, buffer_bytes());
}

StatusOr<std::vector<int64_t>> PoolLayout::ItemLens() const {
  KVT_RETURN_IF_ERROR(CheckContiguousBufInfos());
  return std::vector<int64_t>(2 * options_.layer_num, item_len());
}

StatusOr<std::vector<int64_t>> PoolLayout::UnitLens() const {
  // The reference asks every layer for its K buffer, so the first state layer fails it.
  for (int64_t l = 0; l < options_.layer_num; ++l) KVT_RETURN_IF_ERROR(CheckKvLayer(l));
  return std::vector<int64_t>(2 * options_.layer_num, unit_len());
}

std::vector<std::array<int64_t, 2>> PoolLayout::LayerwiseBufInfoOffsets(int64_t start_idx) const {
  std::vector<std::array<int64_t, 2>> out;
  out.reserve(options_.layer_num);
  for (int64_t l = 0; l < options_.layer_num; ++l) {
    out.push_back({start_idx + l, start_idx + options_.layer_num + l});
  }
  return out;
}

Status PoolLayout::CheckKvLayer(int64_t layer_id) const {
  if (layer_id < 0 || layer_id >= options_.layer_num) {
    return OutOfRange("layer " + Str(layer_id) + " is outside [0, " + Str(options_.layer_num) +
                      ")");
  }
  if (!layers_[layer_id].has_kv) {
    return InvalidArgument("layer " + Str(layer_id) +
                           " is a state layer (linear_attention); it has no KV buffer. Use "
                           "GetStateBuffers(" +
                           Str(layer_id) + ") for its conv/ssm state");
  }
  return OkStatus();
}

Status PoolLayout::CheckStateLayer(int64_t layer_id) const {
  if (layer_id < 0 || layer_id >= options_.layer_num) {
    return OutOfRange("layer " + Str(layer_id) + " is outside [0, " + Str(options_.layer_num) +
                      ")");
  }
  const LayerLayout& layer = layers_[layer_id];
  if (layer.state_pair < 0) {
    const std::string type =
        layer.type.has_value() ? std::string(LayerTypeName(*layer.type)) : "untyped";
    return InvalidArgument("layer " + Str(layer_id) + " is not a state layer (it is " + type +
                           "; state layers: " + IdList(state_labelled_layers_) +
                           "); use GetKeyBuffer/GetValueBuffer for its K/V");
  }
  if (!state_active_) {
    return FailedPrecondition(
        "layer " + Str(layer_id) +
        " is a state layer but no state slabs were allocated (conv_state_shape and "
        "ssm_state_shape must both be given); it carries ordinary K/V buffers instead");
  }
  return OkStatus();
}

Status PoolLayout::CheckRows(const int32_t* rows, int64_t count, const char* what) const {
  for (int64_t i = 0; i < count; ++i) {
    if (rows[i] < 0 || rows[i] >= rows_per_buffer_) {
      return OutOfRange(std::string(what) + "[" + Str(i) + "] = " + Str(rows[i]) +
                        " is outside the pool's rows [0, " + Str(rows_per_buffer_) +
                        ") (size + page_size)");
    }
  }
  return OkStatus();
}

std::string PoolLayout::Summary() const {
  std::string s = Str(options_.layer_num) + " layers x [" + Str(rows_per_buffer_) + ", " +
                  Str(options_.head_num) + ", " + Str(options_.head_dim) + "] " +
                  std::string(DTypeName(options_.dtype));
  if (hybrid_slab_active()) {
    s += ", hybrid slab (" + Str(slab_count_) + " slabs)";
  } else if (state_active_) {
    s += ", per-layer (" +
         Str(options_.layer_num - static_cast<int64_t>(state_labelled_layers_.size())) +
         " KV layers, " + Str(static_cast<int64_t>(state_labelled_layers_.size())) +
         " state layers, slabs " + ShapeString(conv_slab_shape()) + " + " +
         ShapeString(ssm_slab_shape()) + ")";
  } else {
    s += ", per-layer";
  }
  return s;
}

}  // namespace kvt::pool

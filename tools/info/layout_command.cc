#include "layout_command.h"

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "kvt/common/dtype.h"
#include "kvt/common/status.h"
#include "kvt/pool/kv_pool.h"
#include "kvt/pool/layer_type.h"
#include "kvt/pool/pool_options.h"

namespace kvt::tools {
namespace {

using nlohmann::json;

int Fail(const Status& status) {
  std::cerr << "kvt-info layout: " << status.ToString() << "\n";
  return 1;
}

// Flag values become PoolOptions; PoolLayout validates the rest (its messages name the
// values). CLI flag names are added here so a message points at the flag to fix.
StatusOr<pool::PoolOptions> ToOptions(const LayoutFlags& f) {
  pool::PoolOptions o;
  o.layer_num = f.layers;
  o.head_num = f.heads;
  o.head_dim = f.head_dim;
  o.page_size = f.page_size;
  o.size = f.tokens;
  KVT_ASSIGN_OR_RETURN(o.dtype, ParseDType(f.dtype));
  if (!IsPoolDType(o.dtype)) {
    return InvalidArgument("--dtype " + f.dtype +
                           " is not a pool element type; use bf16, fp16, fp32, fp8_e4m3 or "
                           "fp8_e5m2");
  }
  StatusOr<std::vector<pool::LayerType>> types = pool::ParseLayerTypes(f.layer_types);
  if (!types.ok()) return types.status().WithContext("--layer-types");
  o.layer_types = *types;
  if (f.sliding_window_set) o.sliding_window_tokens = f.sliding_window;
  o.enable_hybrid_slab = f.hybrid_slab;
  o.pd_disaggregation_enabled = f.pd;
  o.conv_state_shape = f.conv_state_shape;
  o.ssm_state_shape = f.ssm_state_shape;
  if (!f.conv_dtype.empty()) {
    StatusOr<DType> d = ParseDType(f.conv_dtype);
    if (!d.ok()) return d.status().WithContext("--conv-dtype");
    o.conv_dtype = *d;
  }
  if (!f.ssm_dtype.empty()) {
    StatusOr<DType> d = ParseDType(f.ssm_dtype);
    if (!d.ok()) return d.status().WithContext("--ssm-dtype");
    o.ssm_dtype = *d;
  }
  o.memory = pool::MemoryKind::kHost;
  // Inspection only: lazily mapped memory that is never touched costs nothing; pinning would
  // commit all of it.
  o.pin_host_memory = false;
  return o;
}

template <typename T>
json OrNull(const StatusOr<T>& v) {
  return v.ok() ? json(*v) : json(nullptr);
}

std::string Join(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s;
}

}  // namespace

void AddLayoutFlags(CLI::App* sub, LayoutFlags* f) {
  sub->add_option("--layers", f->layers, "number of layers")->required();
  sub->add_option("--heads", f->heads, "KV heads")->required();
  sub->add_option("--head-dim", f->head_dim, "elements per head")->required();
  sub->add_option("--dtype", f->dtype, "bf16, fp16, fp32, fp8_e4m3, fp8_e5m2")->required();
  sub->add_option("--page-size", f->page_size, "tokens per page")->required();
  sub->add_option("--tokens", f->tokens, "token slots (the pool's size)")->required();
  sub->add_option("--layer-types", f->layer_types,
                  "comma-separated: full_attention, sliding_attention, linear_attention");
  sub->add_option_function<int64_t>(
      "--sliding-window",
      [f](const int64_t& v) {
        f->sliding_window = v;
        f->sliding_window_set = true;
      },
      "sliding window in tokens");
  sub->add_flag("--hybrid-slab", f->hybrid_slab, "ask for the hybrid slab layout");
  sub->add_flag("--pd", f->pd,
                "build the pool for PD transfer and ask for its buffer infos as the transfer "
                "engine does (refused layouts exit 1)");
  sub->add_option("--conv-state-shape", f->conv_state_shape, "conv state shape, e.g. 4,8")
      ->delimiter(',');
  sub->add_option("--ssm-state-shape", f->ssm_state_shape, "ssm state shape, e.g. 2,64,64")
      ->delimiter(',');
  sub->add_option("--conv-dtype", f->conv_dtype, "conv state dtype (default: --dtype)");
  sub->add_option("--ssm-dtype", f->ssm_dtype, "ssm state dtype (default: --dtype)");
}

int RunLayout(const LayoutFlags& flags, bool as_json) {
  StatusOr<pool::PoolOptions> options = ToOptions(flags);
  if (!options.ok()) return Fail(options.status());
  StatusOr<std::unique_ptr<pool::KvPool>> created = pool::KvPool::Create(*options);
  if (!created.ok()) return Fail(created.status());
  const pool::KvPool& kv = **created;
  const pool::PoolLayout& layout = kv.layout();

  // With --pd, ask for the buffer infos exactly as the transfer engine registers them.
  StatusOr<pool::ContiguousBufInfos> infos = kv.GetContiguousBufInfos();
  if (flags.pd && !infos.ok()) return Fail(infos.status());
  const StatusOr<std::vector<int64_t>> units = kv.GetContiguousBufUnitLens();
  if (flags.pd && !units.ok()) return Fail(units.status());

  json out;
  out["layers"] = layout.layer_num();
  out["dtype"] = std::string(DTypeName(layout.dtype()));
  out["store_dtype"] = std::string(DTypeName(layout.store_dtype()));
  out["tokens"] = options->size;
  out["page_size"] = options->page_size;
  out["rows_per_buffer"] = layout.rows_per_buffer();
  out["row_bytes"] = layout.row_bytes();
  out["num_pages"] = layout.num_pages();
  out["num_kv_buffers"] = layout.num_kv_buffers();
  out["hybrid_slab"] = layout.hybrid_slab_active();
  out["pd"] = flags.pd;
  out["data_lens"] = infos.ok() ? json(infos->data_lens) : json(nullptr);
  out["item_lens"] = infos.ok() ? json(infos->item_lens) : json(nullptr);
  out["unit_lens"] = OrNull(units);
  json offsets = json::array();
  for (const auto& o : kv.GetLayerwiseBufInfoOffsets()) offsets.push_back({o[0], o[1]});
  out["layerwise_offsets"] = offsets;
  const auto [k_bytes, v_bytes] = kv.GetKvSizeBytes();
  out["k_size_bytes"] = k_bytes;
  out["v_size_bytes"] = v_bytes;
  out["state_layers"] = layout.state_layer_ids();
  json slab = json::array();
  json types = json::array();
  for (const pool::LayerLayout& l : layout.layers()) {
    slab.push_back(l.slab_index >= 0 ? json(l.slab_index) : json(nullptr));
    types.push_back(l.type ? json(std::string(pool::LayerTypeName(*l.type))) : json(nullptr));
  }
  out["slab_index"] = slab;
  out["layer_types"] = types;
  if (layout.state_active()) {
    out["state_slabs"] = {{"pairs", layout.num_state_slab_pairs()},
                          {"conv_shape", layout.conv_slab_shape()},
                          {"ssm_shape", layout.ssm_slab_shape()},
                          {"conv_dtype", std::string(DTypeName(layout.conv_dtype()))},
                          {"ssm_dtype", std::string(DTypeName(layout.ssm_dtype()))}};
  } else {
    out["state_slabs"] = nullptr;
  }
  if (!infos.ok()) out["buf_infos_refused"] = infos.status().message();

  if (as_json) {
    std::cout << out.dump(2) << "\n";
    return 0;
  }

  std::printf("pool: %s\n", layout.Summary().c_str());
  std::printf("  tokens %lld, page_size %lld, pages %lld (+ dummy page 0), row %lld bytes\n",
              static_cast<long long>(options->size), static_cast<long long>(options->page_size),
              static_cast<long long>(layout.num_pages()),
              static_cast<long long>(layout.row_bytes()));
  std::printf("  K size %lld bytes, V size %lld bytes (%d distinct buffers a side)\n",
              static_cast<long long>(k_bytes), static_cast<long long>(v_bytes),
              layout.num_kv_buffers());
  if (layout.state_active()) {
    std::printf(
        "  state slabs: %d pairs, conv [%s] %s, ssm [%s] %s\n", layout.num_state_slab_pairs(),
        Join(layout.conv_slab_shape()).c_str(), std::string(DTypeName(layout.conv_dtype())).c_str(),
        Join(layout.ssm_slab_shape()).c_str(), std::string(DTypeName(layout.ssm_dtype())).c_str());
  }
  if (!infos.ok()) std::printf("  buffer infos refused: %s\n", infos.status().message().c_str());
  std::printf("\n%-6s %-18s %-8s %-8s %-6s %-6s %-14s %-10s\n", "layer", "type", "K entry",
              "V entry", "slab", "state", "buffer bytes", "item_len");
  const auto all_offsets = kv.GetLayerwiseBufInfoOffsets();
  for (int64_t i = 0; i < layout.layer_num(); ++i) {
    const pool::LayerLayout& l = layout.layers()[i];
    const std::string type = l.type ? std::string(pool::LayerTypeName(*l.type)) : "-";
    const std::string slab_s = l.slab_index >= 0 ? std::to_string(l.slab_index) : "-";
    const std::string state_s = (!l.has_kv) ? std::to_string(l.state_pair) : "-";
    const std::string bytes = l.has_kv ? std::to_string(layout.buffer_bytes()) : "-";
    const std::string item = l.has_kv ? std::to_string(layout.item_len()) : "-";
    std::printf("%-6lld %-18s %-8lld %-8lld %-6s %-6s %-14s %-10s\n", static_cast<long long>(i),
                type.c_str(), static_cast<long long>(all_offsets[i][0]),
                static_cast<long long>(all_offsets[i][1]), slab_s.c_str(), state_s.c_str(),
                bytes.c_str(), item.c_str());
  }
  return 0;
}

}  // namespace kvt::tools

#include "kvt/pool/layer_type.h"

#include <string>

namespace kvt::pool {

std::string_view LayerTypeName(LayerType type) {
  switch (type) {
    case LayerType::kFullAttention:
      return "full_attention";
    case LayerType::kSlidingAttention:
      return "sliding_attention";
    case LayerType::kLinearAttention:
      return "linear_attention";
  }
  return "unknown";
}

bool IsKvLayerType(LayerType type) {
  return type == LayerType::kFullAttention || type == LayerType::kSlidingAttention;
}

bool IsStateLayerType(LayerType type) { return type == LayerType::kLinearAttention; }

StatusOr<LayerType> ParseLayerType(std::string_view name) {
  for (LayerType type :
       {LayerType::kFullAttention, LayerType::kSlidingAttention, LayerType::kLinearAttention}) {
    if (LayerTypeName(type) == name) return type;
  }
  return InvalidArgument("unknown layer type '" + std::string(name) +
                         "'; use one of full_attention, sliding_attention, linear_attention");
}

StatusOr<std::vector<LayerType>> ParseLayerTypes(std::string_view comma_separated) {
  std::vector<LayerType> types;
  if (comma_separated.empty()) return types;
  size_t start = 0;
  while (true) {
    const size_t comma = comma_separated.find(',', start);
    const std::string_view item = comma_separated.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    StatusOr<LayerType> type = ParseLayerType(item);
    if (!type.ok()) {
      return type.status().WithContext("layer type at position " + std::to_string(types.size()));
    }
    types.push_back(*type);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return types;
}

}  // namespace kvt::pool

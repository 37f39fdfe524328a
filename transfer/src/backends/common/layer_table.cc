#include "backends/common/layer_table.h"

#include <limits>
#include <string>

namespace kvt::transfer {

StatusOr<LayerTable> LayerTable::Create(std::span<const LocalRegion> regions) {
  std::vector<int32_t> layers;
  layers.reserve(regions.size());
  for (const LocalRegion& r : regions) layers.push_back(r.layer);
  return FromLayers(layers);
}

StatusOr<LayerTable> LayerTable::FromLayers(std::span<const int32_t> layers) {
  if (layers.size() > std::numeric_limits<uint32_t>::max()) {
    return InvalidArgument(std::to_string(layers.size()) + " buffers registered; at most 2^32 - 1");
  }
  // Counting pass: layers first appear in ascending order, so the highest so far is the count.
  std::vector<size_t> count;
  for (size_t i = 0; i < layers.size(); ++i) {
    const int32_t layer = layers[i];
    if (layer < 0 || static_cast<size_t>(layer) > count.size()) {
      const std::string expected = count.empty()
                                       ? "0"
                                       : "at most " + std::to_string(count.size()) +
                                             " (the highest layer "
                                             "so far, " +
                                             std::to_string(count.size() - 1) + ", plus one)";
      return InvalidArgument(
          "buffer " + std::to_string(i) + " has transfer layer " + std::to_string(layer) +
          "; expected " + expected +
          ": register buffers in the layout's order, whose layers run 0..n-1 group by group "
          "with no layer skipped (LocalRegion::layer)");
    }
    if (static_cast<size_t>(layer) == count.size()) count.push_back(0);
    ++count[static_cast<size_t>(layer)];
  }
  LayerTable table;
  table.first_.assign(count.size() + 1, 0);
  for (size_t l = 0; l < count.size(); ++l) table.first_[l + 1] = table.first_[l] + count[l];
  table.order_.resize(layers.size());
  std::vector<size_t> next(table.first_.begin(), table.first_.end() - 1);
  for (size_t i = 0; i < layers.size(); ++i) {
    table.order_[next[static_cast<size_t>(layers[i])]++] = static_cast<uint32_t>(i);
  }
  return table;
}

Status LayerTable::CheckRange(int32_t num_layers, int32_t begin, int32_t end) const {
  const std::string n = std::to_string(this->num_layers());
  if (num_layers != this->num_layers()) {
    return InvalidArgument("page write names num_layers = " + std::to_string(num_layers) +
                           " but the registered buffers have " + n +
                           " transfer layers (the highest LocalRegion::layer + 1); pass that");
  }
  if (begin < 0 || begin > end || end > this->num_layers()) {
    return InvalidArgument("page write layer range [" + std::to_string(begin) + ", " +
                           std::to_string(end) + ") is not inside the registered layers [0, " + n +
                           "]; pass a range of 0 <= begin <= end <= " + n);
  }
  return OkStatus();
}

}  // namespace kvt::transfer

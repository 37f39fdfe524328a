// Which registered buffers a page write moves. A PageWrite of transfer layers [begin, end)
// moves every buffer whose LocalRegion::layer lies in that range: layers ascending, the buffers
// of one layer in registration order. A LayerTable is built once per registration and answers
// that list as one slice, so no backend computes buffer indices from a layer count.
//
// Registration order is the layout's buffer order (group by group; K of every layer then V, or
// one buffer per layer for latent groups), so layers repeat (K0 K1 V0 V1 has layers 0 1 0 1).
// What the table requires: every layer is >= 0, each buffer's layer is at most one above the
// highest layer of the buffers before it (layers first appear in ascending order, none skipped),
// so the layers are 0..n-1, each with at least one buffer.
//
// A value type; thread-safe as any value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "kvt/common/status.h"
#include "kvt/transfer/backend.h"

namespace kvt::transfer {

class LayerTable {
 public:
  LayerTable() = default;  // no buffers, no layers

  // From the registered regions' layers; InvalidArgument naming the first buffer whose layer
  // breaks the rules above, with its layer.
  static StatusOr<LayerTable> Create(std::span<const LocalRegion> regions);
  // The same from the layers alone, in buffer order.
  static StatusOr<LayerTable> FromLayers(std::span<const int32_t> layers);

  int32_t num_layers() const { return static_cast<int32_t>(first_.size()) - 1; }
  size_t num_buffers() const { return order_.size(); }

  // OK when a write names this table's layer count and its range [begin, end) lies inside
  // [0, num_layers] with begin <= end; InvalidArgument naming both otherwise.
  Status CheckRange(int32_t num_layers, int32_t begin, int32_t end) const;

  // The buffers of layers [begin, end) in move order; the range must pass CheckRange.
  std::span<const uint32_t> Buffers(int32_t begin, int32_t end) const {
    return std::span<const uint32_t>(order_).subspan(
        first_[static_cast<size_t>(begin)],
        first_[static_cast<size_t>(end)] - first_[static_cast<size_t>(begin)]);
  }

 private:
  std::vector<uint32_t> order_;              // buffer indices by (layer, registration index)
  std::vector<size_t> first_ = {size_t{0}};  // first_[l]: where layer l starts in order_; n + 1
};

}  // namespace kvt::transfer

// LayerDoneWaiter: the hook behind tokenspeed's register_layer_transfer_counter. When one is
// registered, KvPool::GetKeyBuffer / GetValueBuffer / GetKvBuffer first wait until the layer's
// data has arrived (layer-wise KV loading), so attention never reads a half-loaded layer.
// Implementations must be thread-safe: the pool calls WaitUntil from whatever thread asks.
#pragma once

#include <cstdint>

namespace kvt::pool {

class LayerDoneWaiter {
 public:
  virtual ~LayerDoneWaiter() = default;
  // Blocks until layer `layer_id` is complete.
  virtual void WaitUntil(int64_t layer_id) = 0;
};

}  // namespace kvt::pool

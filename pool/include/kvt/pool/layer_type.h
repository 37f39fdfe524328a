// The per-layer type labels of a KV pool (tokenspeed's paged-cache label vocabulary).
//
//   full_attention      a KV layer keeping its whole history
//   sliding_attention   a KV layer keeping a sliding window (same K/V buffer shape as full)
//   linear_attention    a recurrent state layer (GDN / mamba2): conv + ssm state rows instead of
//                       K/V when the pool is given state shapes
//
// Pure functions; thread-safe.
#pragma once

#include <string_view>
#include <vector>

#include "kvt/common/status.h"

namespace kvt::pool {

enum class LayerType : int {
  kFullAttention = 0,
  kSlidingAttention = 1,
  kLinearAttention = 2,
};

// "full_attention", "sliding_attention", "linear_attention".
std::string_view LayerTypeName(LayerType type);

// True for the labels that carry K/V history (full and sliding attention).
bool IsKvLayerType(LayerType type);

// True for the labels whose layers hold recurrent state (linear attention).
bool IsStateLayerType(LayerType type);

// Parses one label; InvalidArgument naming it and listing the valid labels otherwise.
StatusOr<LayerType> ParseLayerType(std::string_view name);

// Parses a comma-separated list ("full_attention,sliding_attention"); an empty string gives an
// empty list. InvalidArgument names the bad label and its position.
StatusOr<std::vector<LayerType>> ParseLayerTypes(std::string_view comma_separated);

}  // namespace kvt::pool

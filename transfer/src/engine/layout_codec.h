// Conversions between the pool / backend view of an agent and its wire form (kvt.v1.Layout,
// PeerInfo), and the compatibility check two agents run at hello.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvt/common/status.h"
#include "kvt/transfer/backend.h"
#include "kvt/transfer/layout.h"
#include "kvt/v1/peer.pb.h"

namespace kvt::transfer {

// The wire form of a layout: its model description (no pointers), groups always listed.
StatusOr<v1::Layout> LayoutToProto(const TransferLayout& layout);

// The regions a backend registers for the layout's buffers (`buffers`: layout.Flatten()), in
// that order: host or CUDA memory of the layout's device, with each buffer's layer.
std::vector<LocalRegion> LocalRegionsOf(const TransferLayout& layout,
                                        std::span<const TransferLayout::FlatBuffer> buffers);

v1::PeerInfo MakePeerInfo(const std::string& name, bool prefill, const v1::Layout& layout,
                          const PeerDescriptor& descriptor, std::span<const LocalRegion> regions);

// The peer's descriptor for `backend` out of its PeerInfo. NotFound when the peer offers no
// such backend; InvalidArgument when a buffer has no key for it.
StatusOr<PeerDescriptor> DescriptorFromPeerInfo(const v1::PeerInfo& info, std::string_view backend);

// OK when pages can move between the two layouts; FailedPrecondition naming every field that
// differs with both values otherwise, e.g. "layout mismatch: page_size prefill=16 decode=32".
// Compared: page size, dtype, head_dim, the KV groups one by one (shape, layers, heads, head_dim,
// dtype, page bytes; a layout without groups is one key_value group of its top-level fields),
// the aux slot bytes, and the TP placement.
// With equal TP sizes the ranks must be equal too (decode rank r holds the shard of prefill
// rank r); a pair of other ranks is refused naming both ranks and sizes.
Status CheckCompatible(const v1::Layout& ours, const v1::Layout& theirs, std::string_view our_role,
                       std::string_view their_role);

}  // namespace kvt::transfer

// Validation of every received control message before any of it is used.
//
// Validate() checks one Envelope against fixed bounds (ValidationLimits) and, where the peer has
// already described its pool (PeerContext, filled from its Hello / HelloAck), against that pool:
// page ids in 1..num_pages-1 (page 0 is the dummy page), layer ranges begin < end <= num_layers,
// slices inside one item. Every error is InvalidArgument naming the field path and the value,
// e.g. "transfer_request.dst_page_ids[3] = 0: page 0 is the dummy page; valid pages are 1..1023".
//
// Validate() does not compare protocol versions: CheckProtocolVersion() does, and the control
// plane calls it on Hello / HelloAck before Validate() (a newer peer's Hello may be otherwise
// unreadable, and the version error is the one that explains it).
//
// Thread safety: pure functions; call from any thread.
#pragma once

#include <cstdint>

#include "kvt/common/status.h"
#include "kvt/transfer/control_options.h"
#include "kvt/v1/control.pb.h"

namespace kvt::control {

// The most reports a QueryRequestsReply may hold (its validation refuses more).
inline constexpr int kMaxReportsPerReply = 65536;

// What is known about the peer on this connection. Zero means "not known yet" (before Hello);
// checks that need the value are skipped then.
struct PeerContext {
  uint32_t num_layers = 0;    // the peer's Layout.num_layers
  uint64_t num_pages = 0;     // the peer's Layout.num_pages (including the dummy page 0)
  uint64_t min_item_len = 0;  // the smallest item_len among the peer's buffers
};

// InvalidArgument naming the field and value when `envelope` breaks a rule; OK otherwise.
// An envelope without a body (or with one this build does not know) is invalid.
Status Validate(const v1::Envelope& envelope, const PeerContext& peer = {},
                const ValidationLimits& limits = {});

// OK when peer_version == kProtocolVersion; otherwise FailedPrecondition naming both versions
// ("protocol version mismatch: peer speaks 2, this side speaks 1; ...").
Status CheckProtocolVersion(uint32_t peer_version);

// Buffers a layout describes, the length of PeerInfo.buffers when every buffer is registered:
// over its groups, 2 per KEY_VALUE layer and 1 per LATENT layer; without groups 2 * num_layers
// (one KEY_VALUE group). A shape this build does not know counts as KEY_VALUE (the bound stays
// generous; Validate refuses such a layout anyway).
uint64_t LayoutBufferCount(const v1::Layout& layout);

// The PeerContext a (valid) PeerInfo describes.
PeerContext PeerContextFrom(const v1::PeerInfo& peer);

}  // namespace kvt::control

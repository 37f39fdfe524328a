// The control protocol's constants and the conversions between kvt::Status and the wire's
// kvt.v1 types (StatusCode, Error, DType).
//
// Thread safety: every function here is pure; call from any thread.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "kvt/common/dtype.h"
#include "kvt/common/status.h"
#include "kvt/v1/control.pb.h"

namespace kvt::control {

// The version of the wire contract in proto/kvt/v1. Bump it only for a change an older peer
// cannot ignore safely; peers with different versions refuse each other at Hello.
// 2: TransferRequest carries its page list in dst_page_ids_le32.
// 3: Layout carries KV groups (draft models, latent buffers) and aux slots; TransferRequest
//    names an aux slot and TransferDone carries its bytes.
// 4: lanes: co-located peers move a connection's frames through shared memory (LaneOffer,
//    LaneReply, LaneSwitch, LaneDoorbell).
inline constexpr uint32_t kProtocolVersion = 4;

// kvt::StatusCode <-> kvt.v1.StatusCode. Wire-only codes (UNAUTHENTICATED, ...) map to the
// closest kvt code; UNSPECIFIED and unknown values map to kInternal.
v1::StatusCode ToProtoCode(StatusCode code);
StatusCode FromProtoCode(v1::StatusCode code);

// kvt::DType <-> kvt.v1.DType. kUInt8 (a store type, never a pool type) and UNSPECIFIED have no
// counterpart: InvalidArgument.
StatusOr<v1::DType> ToProtoDType(DType dtype);
StatusOr<DType> FromProtoDType(v1::DType dtype);

// An Envelope carrying Error{code, message (truncated to the wire limit), room_id}.
v1::Envelope MakeErrorEnvelope(v1::StatusCode code, std::string_view message,
                               std::string_view room_id = {});
// The same from a non-OK Status (its code mapped by ToProtoCode).
v1::Envelope MakeErrorEnvelope(const Status& status, std::string_view room_id = {});

// The Status a received Error stands for: "<peer said>: <message>" with the mapped code.
Status StatusFromError(const v1::Error& error);

// A TransferRequest's destination page list: SetDstPages writes it as dst_page_ids_le32 (and
// clears dst_page_ids); DstPages reads whichever of the two is set, DstPageCount counts it
// (validated requests have exactly one; an le32 field of a length that is not a multiple of 4
// counts its whole entries).
void SetDstPages(v1::TransferRequest& request, std::span<const int32_t> pages);
std::vector<int32_t> DstPages(const v1::TransferRequest& request);
size_t DstPageCount(const v1::TransferRequest& request);

// Entry i of a little-endian int32 list in `bytes` (i < bytes.size() / 4).
inline int32_t Le32At(std::string_view bytes, size_t i) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data()) + 4 * i;
  return static_cast<int32_t>(uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) |
                              (uint32_t{p[3]} << 24));
}

// `text` cut to at most `limit` bytes (>= 4), ending in "..." when cut, never inside a UTF-8
// sequence: what a proto3 string field of a frame may carry (it must stay valid UTF-8, or the
// peer cannot parse the frame).
std::string Truncate(std::string_view text, size_t limit);

// The oneof field name of the envelope's body ("transfer_request", ...), or "<empty>" when no
// body is set (an unknown message from a newer peer looks like that too). For logs and errors.
std::string_view BodyName(const v1::Envelope& envelope);

}  // namespace kvt::control

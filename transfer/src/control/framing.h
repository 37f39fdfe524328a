// Frame encoding and incremental decoding for control connections, with no sockets involved.
//
// A frame is a 4-byte big-endian payload length followed by one serialized kvt.v1.Envelope.
// Lengths of 0 and above max_frame_bytes are refused from the 4 header bytes alone, before any
// payload buffer exists; the payload buffer then grows only with bytes that actually arrived, so
// a peer that announces 16 MiB and sends 10 bytes costs 10 bytes.
//
// Thread safety: EncodeFrame is pure. A FrameDecoder is not thread-safe; confine each one to one
// thread or strand (one decoder per connection).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "kvt/common/status.h"
#include "kvt/transfer/control_options.h"
#include "kvt/v1/control.pb.h"

namespace kvt::control {

inline constexpr size_t kFrameHeaderBytes = 4;

// Appends one frame holding `envelope` to *out. InvalidArgument when the envelope serializes to
// 0 bytes (no body) or to more than max_frame_bytes; *out is unchanged then.
Status AppendFrame(const v1::Envelope& envelope, uint32_t max_frame_bytes, std::string* out);

// One frame as a new string (see AppendFrame).
StatusOr<std::string> EncodeFrame(const v1::Envelope& envelope,
                                  uint32_t max_frame_bytes = kDefaultMaxFrameBytes);

// Reassembles frames from bytes that may arrive split anywhere.
//
//   FrameDecoder decoder(limits.max_frame_bytes);
//   while (!data.empty()) {
//     KVT_ASSIGN_OR_RETURN(size_t used, decoder.Feed(data));
//     data.remove_prefix(used);
//     if (decoder.frame_ready()) { v1::Envelope e; KVT_RETURN_IF_ERROR(decoder.Take(&e)); ... }
//   }
//
// Errors are final: once Feed or Take failed, every later call returns the same Status (the
// stream has lost its framing; the connection must be closed).
class FrameDecoder {
 public:
  explicit FrameDecoder(uint32_t max_frame_bytes = kDefaultMaxFrameBytes);

  FrameDecoder(const FrameDecoder&) = delete;
  FrameDecoder& operator=(const FrameDecoder&) = delete;

  // Consumes bytes from the front of `data` until one frame is complete or `data` is used up;
  // returns how many were consumed. Consumes nothing while a frame is ready and not yet taken.
  // InvalidArgument for a zero or oversized length prefix (the message names the length and
  // the limit).
  StatusOr<size_t> Feed(std::string_view data);

  // True when a whole payload is buffered and waits for Take.
  bool frame_ready() const { return state_ == State::kReady; }

  // Parses the ready payload into *out and starts on the next frame. FailedPrecondition when no
  // frame is ready; DataLoss when the payload is not a valid Envelope.
  Status Take(v1::Envelope* out);

  // Changes the limit for the frames whose length prefix has not been read yet (a connection
  // lowers it until its peer has authenticated). `limit_name` names the limit in the error.
  void set_max_frame_bytes(uint32_t max_frame_bytes, const char* limit_name = "max_frame_bytes") {
    max_frame_bytes_ = max_frame_bytes;
    limit_name_ = limit_name;
  }

  // Bytes buffered toward the current frame (header and payload); for tests and metrics.
  size_t buffered_bytes() const;
  // Capacity of the payload buffer; lets tests prove that a refused frame allocated nothing.
  size_t payload_capacity() const { return payload_.capacity(); }

 private:
  enum class State { kHeader, kPayload, kReady, kFailed };

  Status Fail(Status status);

  uint32_t max_frame_bytes_;
  const char* limit_name_ = "max_frame_bytes";  // a string literal
  State state_ = State::kHeader;
  unsigned char header_[kFrameHeaderBytes] = {};
  size_t header_filled_ = 0;
  uint32_t payload_length_ = 0;
  std::string payload_;
  Status error_;
};

}  // namespace kvt::control

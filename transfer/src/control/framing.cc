#include "control/framing.h"

#include <fmt/format.h>

#include <algorithm>
#include <exception>

namespace kvt::control {
namespace {

// A payload buffer that once held a big frame is released after it, so that one large Hello
// does not pin megabytes per connection for the connection's life.
constexpr size_t kKeepPayloadCapacity = 1u << 20;

Status CheckFrameLength(uint64_t length, uint32_t max_frame_bytes,
                        const char* limit_name = "max_frame_bytes") {
  if (length == 0) {
    return InvalidArgument(
        "zero-length frame: every frame carries one Envelope with a message body");
  }
  if (length > max_frame_bytes) {
    return InvalidArgument(
        fmt::format("frame of {} bytes exceeds {} = {}; refused before reading it", length,
                    limit_name, max_frame_bytes));
  }
  return OkStatus();
}

}  // namespace

Status AppendFrame(const v1::Envelope& envelope, uint32_t max_frame_bytes, std::string* out) {
  const size_t size = envelope.ByteSizeLong();
  if (Status s = CheckFrameLength(size, max_frame_bytes); !s.ok()) {
    return s.WithContext(
        fmt::format("cannot send {}", size == 0 ? "an Envelope with no body" : "this Envelope"));
  }
  const size_t old_size = out->size();
  try {
    out->resize(old_size + kFrameHeaderBytes + size);
  } catch (const std::exception& e) {
    out->resize(old_size);
    return ResourceExhausted(fmt::format("cannot allocate a {} byte frame: {}", size, e.what()));
  }
  auto* header = reinterpret_cast<unsigned char*>(out->data() + old_size);
  const auto length = static_cast<uint32_t>(size);
  header[0] = static_cast<unsigned char>(length >> 24);
  header[1] = static_cast<unsigned char>(length >> 16);
  header[2] = static_cast<unsigned char>(length >> 8);
  header[3] = static_cast<unsigned char>(length);
  if (!envelope.SerializeToArray(out->data() + old_size + kFrameHeaderBytes,
                                 static_cast<int>(size))) {
    out->resize(old_size);
    return Internal(
        "Envelope serialization failed (a required field or a size changed "
        "while serializing)");
  }
  return OkStatus();
}

StatusOr<std::string> EncodeFrame(const v1::Envelope& envelope, uint32_t max_frame_bytes) {
  std::string frame;
  KVT_RETURN_IF_ERROR(AppendFrame(envelope, max_frame_bytes, &frame));
  return frame;
}

FrameDecoder::FrameDecoder(uint32_t max_frame_bytes) : max_frame_bytes_(max_frame_bytes) {}

Status FrameDecoder::Fail(Status status) {
  state_ = State::kFailed;
  error_ = status;
  payload_.clear();
  payload_.shrink_to_fit();
  return status;
}

StatusOr<size_t> FrameDecoder::Feed(std::string_view data) {
  if (state_ == State::kFailed) return error_;
  size_t used = 0;
  while (used < data.size() && state_ != State::kReady) {
    if (state_ == State::kHeader) {
      while (header_filled_ < kFrameHeaderBytes && used < data.size()) {
        header_[header_filled_++] = static_cast<unsigned char>(data[used++]);
      }
      if (header_filled_ < kFrameHeaderBytes) break;
      payload_length_ = (uint32_t{header_[0]} << 24) | (uint32_t{header_[1]} << 16) |
                        (uint32_t{header_[2]} << 8) | uint32_t{header_[3]};
      // The length is checked here, before the payload buffer is touched.
      if (Status s = CheckFrameLength(payload_length_, max_frame_bytes_, limit_name_); !s.ok()) {
        return Fail(s);
      }
      state_ = State::kPayload;
    }
    if (state_ == State::kPayload) {
      const size_t take = std::min<size_t>(payload_length_ - payload_.size(), data.size() - used);
      try {
        payload_.append(data.data() + used, take);
      } catch (const std::exception& e) {
        return Fail(ResourceExhausted(
            fmt::format("cannot buffer a {} byte frame: {}", payload_length_, e.what())));
      }
      used += take;
      if (payload_.size() == payload_length_) state_ = State::kReady;
    }
  }
  return used;
}

Status FrameDecoder::Take(v1::Envelope* out) {
  if (state_ == State::kFailed) return error_;
  if (state_ != State::kReady) return FailedPrecondition("FrameDecoder::Take: no frame is ready");
  bool parsed = false;
  try {
    parsed = out->ParseFromArray(payload_.data(), static_cast<int>(payload_.size()));
  } catch (const std::exception& e) {
    return Fail(DataLoss(
        fmt::format("frame of {} bytes could not be parsed: {}", payload_.size(), e.what())));
  }
  if (!parsed) {
    return Fail(DataLoss(fmt::format(
        "frame of {} bytes is not a kvt.v1.Envelope (garbage, or a peer that does not speak "
        "the kvt control protocol)",
        payload_.size())));
  }
  payload_.clear();
  if (payload_.capacity() > kKeepPayloadCapacity) payload_.shrink_to_fit();
  header_filled_ = 0;
  payload_length_ = 0;
  state_ = State::kHeader;
  return OkStatus();
}

size_t FrameDecoder::buffered_bytes() const {
  if (state_ == State::kHeader) return header_filled_;
  if (state_ == State::kFailed) return 0;
  return kFrameHeaderBytes + payload_.size();
}

}  // namespace kvt::control

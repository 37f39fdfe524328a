#include "control/protocol.h"

#include <bit>
#include <cstring>
#include <string>

namespace kvt::control {
namespace {

// Error.message is limited on the wire (ValidationLimits::max_message_bytes); messages we send
// are cut to fit so that a long Status never makes our own Error frame invalid.
constexpr size_t kMaxErrorMessageBytes = 4096;

}  // namespace

std::string Truncate(std::string_view text, size_t limit) {
  if (text.size() <= limit) return std::string(text);
  constexpr std::string_view kEllipsis = "...";
  size_t keep = limit - kEllipsis.size();
  // Do not cut a UTF-8 sequence in half: proto3 strings must stay valid UTF-8.
  while (keep > 0 && (static_cast<unsigned char>(text[keep]) & 0xC0) == 0x80) --keep;
  std::string out(text.substr(0, keep));
  out += kEllipsis;
  return out;
}

v1::StatusCode ToProtoCode(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return v1::STATUS_CODE_OK;
    case StatusCode::kInvalidArgument:
      return v1::STATUS_CODE_INVALID_ARGUMENT;
    case StatusCode::kFailedPrecondition:
      return v1::STATUS_CODE_FAILED_PRECONDITION;
    case StatusCode::kOutOfRange:
      return v1::STATUS_CODE_OUT_OF_RANGE;
    case StatusCode::kNotFound:
      return v1::STATUS_CODE_NOT_FOUND;
    case StatusCode::kAlreadyExists:
      return v1::STATUS_CODE_ALREADY_EXISTS;
    case StatusCode::kResourceExhausted:
      return v1::STATUS_CODE_RESOURCE_EXHAUSTED;
    case StatusCode::kUnavailable:
      return v1::STATUS_CODE_UNAVAILABLE;
    case StatusCode::kAborted:
      return v1::STATUS_CODE_ABORTED;
    case StatusCode::kDeadlineExceeded:
      return v1::STATUS_CODE_DEADLINE_EXCEEDED;
    case StatusCode::kUnimplemented:
      return v1::STATUS_CODE_UNIMPLEMENTED;
    case StatusCode::kDataLoss:
      return v1::STATUS_CODE_DATA_LOSS;
    case StatusCode::kInternal:
      return v1::STATUS_CODE_INTERNAL;
    case StatusCode::kInProgress:
      return v1::STATUS_CODE_IN_PROGRESS;
  }
  return v1::STATUS_CODE_INTERNAL;
}

StatusCode FromProtoCode(v1::StatusCode code) {
  switch (code) {
    case v1::STATUS_CODE_OK:
      return StatusCode::kOk;
    case v1::STATUS_CODE_INVALID_ARGUMENT:
      return StatusCode::kInvalidArgument;
    case v1::STATUS_CODE_FAILED_PRECONDITION:
      return StatusCode::kFailedPrecondition;
    case v1::STATUS_CODE_OUT_OF_RANGE:
      return StatusCode::kOutOfRange;
    case v1::STATUS_CODE_NOT_FOUND:
      return StatusCode::kNotFound;
    case v1::STATUS_CODE_ALREADY_EXISTS:
      return StatusCode::kAlreadyExists;
    case v1::STATUS_CODE_RESOURCE_EXHAUSTED:
      return StatusCode::kResourceExhausted;
    case v1::STATUS_CODE_UNAVAILABLE:
      return StatusCode::kUnavailable;
    case v1::STATUS_CODE_ABORTED:
      return StatusCode::kAborted;
    case v1::STATUS_CODE_DEADLINE_EXCEEDED:
      return StatusCode::kDeadlineExceeded;
    case v1::STATUS_CODE_UNIMPLEMENTED:
      return StatusCode::kUnimplemented;
    case v1::STATUS_CODE_DATA_LOSS:
      return StatusCode::kDataLoss;
    case v1::STATUS_CODE_INTERNAL:
      return StatusCode::kInternal;
    case v1::STATUS_CODE_IN_PROGRESS:
      return StatusCode::kInProgress;
    // Both mean "fix the configuration first" (the token, the build): retrying cannot help.
    case v1::STATUS_CODE_UNAUTHENTICATED:
      return StatusCode::kFailedPrecondition;
    case v1::STATUS_CODE_PROTOCOL_VERSION_MISMATCH:
      return StatusCode::kFailedPrecondition;
    case v1::STATUS_CODE_MALFORMED_FRAME:
      return StatusCode::kInvalidArgument;
    default:
      return StatusCode::kInternal;
  }
}

StatusOr<v1::DType> ToProtoDType(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return v1::DTYPE_BF16;
    case DType::kFP16:
      return v1::DTYPE_FP16;
    case DType::kFP32:
      return v1::DTYPE_FP32;
    case DType::kFP8E4M3:
      return v1::DTYPE_FP8_E4M3;
    case DType::kFP8E5M2:
      return v1::DTYPE_FP8_E5M2;
    case DType::kUInt8:
      break;
  }
  return InvalidArgument("dtype " + std::string(DTypeName(dtype)) +
                         " is a store type, not a pool element type; it has no wire value");
}

StatusOr<DType> FromProtoDType(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16:
      return DType::kBF16;
    case v1::DTYPE_FP16:
      return DType::kFP16;
    case v1::DTYPE_FP32:
      return DType::kFP32;
    case v1::DTYPE_FP8_E4M3:
      return DType::kFP8E4M3;
    case v1::DTYPE_FP8_E5M2:
      return DType::kFP8E5M2;
    default:
      break;
  }
  return InvalidArgument("wire dtype " + std::to_string(static_cast<int>(dtype)) +
                         " is not a pool element type (expected bf16, fp16, fp32, fp8_e4m3 or "
                         "fp8_e5m2)");
}

v1::Envelope MakeErrorEnvelope(v1::StatusCode code, std::string_view message,
                               std::string_view room_id) {
  v1::Envelope envelope;
  v1::Error* error = envelope.mutable_error();
  error->set_code(code);
  error->set_message(Truncate(message, kMaxErrorMessageBytes));
  error->set_room_id(std::string(room_id));
  return envelope;
}

v1::Envelope MakeErrorEnvelope(const Status& status, std::string_view room_id) {
  return MakeErrorEnvelope(ToProtoCode(status.code()), status.message(), room_id);
}

Status StatusFromError(const v1::Error& error) {
  StatusCode code = FromProtoCode(error.code());
  // An Error frame that claims success is itself a protocol error; never turn it into OK.
  if (code == StatusCode::kOk) code = StatusCode::kInternal;
  std::string message =
      "peer reported " + v1::StatusCode_Name(error.code()) + ": " + error.message();
  if (!error.room_id().empty()) message += " (room " + error.room_id() + ")";
  return Status(code, std::move(message));
}

std::string_view BodyName(const v1::Envelope& envelope) {
  if (envelope.body_case() == v1::Envelope::BODY_NOT_SET) return "<empty>";
  const auto* field = v1::Envelope::descriptor()->FindFieldByNumber(envelope.body_case());
  if (field == nullptr) return "<unknown>";
  return field->name();
}

void SetDstPages(v1::TransferRequest& request, std::span<const int32_t> pages) {
  request.clear_dst_page_ids();
  std::string* out = request.mutable_dst_page_ids_le32();
  out->resize(4 * pages.size());
  if constexpr (std::endian::native == std::endian::little) {
    if (!pages.empty()) std::memcpy(out->data(), pages.data(), out->size());
  } else {
    for (size_t i = 0; i < pages.size(); ++i) {
      const auto v = static_cast<uint32_t>(pages[i]);
      for (int b = 0; b < 4; ++b) (*out)[4 * i + b] = static_cast<char>((v >> (8 * b)) & 0xFF);
    }
  }
}

size_t DstPageCount(const v1::TransferRequest& request) {
  return request.dst_page_ids_le32().empty() ? static_cast<size_t>(request.dst_page_ids_size())
                                             : request.dst_page_ids_le32().size() / 4;
}

std::vector<int32_t> DstPages(const v1::TransferRequest& request) {
  const std::string& le32 = request.dst_page_ids_le32();
  if (le32.empty()) return {request.dst_page_ids().begin(), request.dst_page_ids().end()};
  std::vector<int32_t> pages(le32.size() / 4);
  if constexpr (std::endian::native == std::endian::little) {
    if (!pages.empty()) std::memcpy(pages.data(), le32.data(), 4 * pages.size());
  } else {
    for (size_t i = 0; i < pages.size(); ++i) pages[i] = Le32At(le32, i);
  }
  return pages;
}

}  // namespace kvt::control

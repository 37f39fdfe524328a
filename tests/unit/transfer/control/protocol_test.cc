#include "kvt/transfer/control/protocol.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "test_messages.h"

namespace kvt::control {
namespace {

using ::testing::HasSubstr;

TEST(ProtocolTest, StatusCodesRoundTrip) {
  for (int c = static_cast<int>(StatusCode::kOk); c <= static_cast<int>(StatusCode::kInProgress);
       ++c) {
    const auto code = static_cast<StatusCode>(c);
    const v1::StatusCode wire = ToProtoCode(code);
    EXPECT_NE(wire, v1::STATUS_CODE_UNSPECIFIED) << StatusCodeName(code);
    EXPECT_EQ(FromProtoCode(wire), code) << StatusCodeName(code);
  }
}

TEST(ProtocolTest, WireOnlyCodesMapToFixFirstCodes) {
  EXPECT_EQ(FromProtoCode(v1::STATUS_CODE_UNAUTHENTICATED), StatusCode::kFailedPrecondition);
  EXPECT_EQ(FromProtoCode(v1::STATUS_CODE_PROTOCOL_VERSION_MISMATCH),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(FromProtoCode(v1::STATUS_CODE_UNSPECIFIED), StatusCode::kInternal);
  EXPECT_EQ(FromProtoCode(static_cast<v1::StatusCode>(999)), StatusCode::kInternal);
}

TEST(ProtocolTest, DTypesRoundTrip) {
  for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32, DType::kFP8E4M3, DType::kFP8E5M2}) {
    StatusOr<v1::DType> wire = ToProtoDType(dtype);
    ASSERT_TRUE(wire.ok());
    StatusOr<DType> back = FromProtoDType(*wire);
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, dtype);
  }
  EXPECT_FALSE(ToProtoDType(DType::kUInt8).ok());
  EXPECT_FALSE(FromProtoDType(v1::DTYPE_UNSPECIFIED).ok());
}

TEST(ProtocolTest, ErrorEnvelopeTruncatesLongMessagesToTheWireLimit) {
  v1::Envelope envelope = MakeErrorEnvelope(v1::STATUS_CODE_INTERNAL, std::string(10000, 'x'));
  EXPECT_LE(envelope.error().message().size(), 4096u);
  EXPECT_THAT(envelope.error().message(), ::testing::EndsWith("..."));
}

TEST(ProtocolTest, ErrorEnvelopeFromStatus) {
  v1::Envelope envelope = MakeErrorEnvelope(NotFound("room gone"), "room-3");
  EXPECT_EQ(envelope.error().code(), v1::STATUS_CODE_NOT_FOUND);
  EXPECT_EQ(envelope.error().message(), "room gone");
  EXPECT_EQ(envelope.error().room_id(), "room-3");
}

TEST(ProtocolTest, StatusFromErrorIsNeverOk) {
  v1::Error error;
  error.set_code(v1::STATUS_CODE_OK);
  error.set_message("fine");
  Status status = StatusFromError(error);
  EXPECT_FALSE(status.ok());
  error.set_code(v1::STATUS_CODE_UNAUTHENTICATED);
  error.set_message("authentication failed");
  status = StatusFromError(error);
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("STATUS_CODE_UNAUTHENTICATED: authentication failed"));
}

TEST(ProtocolTest, BodyNames) {
  EXPECT_EQ(BodyName(testing::MakeHello()), "hello");
  EXPECT_EQ(BodyName(testing::MakeTransferRequest()), "transfer_request");
  EXPECT_EQ(BodyName(v1::Envelope()), "<empty>");
}

}  // namespace
}  // namespace kvt::control

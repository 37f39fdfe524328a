#include "control/protocol.h"

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

// A message cut for a frame (a failed TransferDone's reason, an agent's reply) ends on a whole
// UTF-8 character: a proto3 string that is not valid UTF-8 makes the peer's parse fail.
TEST(ProtocolTest, TruncateNeverCutsAUtf8Character) {
  const std::string text = std::string(3996, 'a') + "\xC3\xA9" + std::string(100, 'b');
  const std::string cut = Truncate(text, 4000);
  EXPECT_EQ(cut, std::string(3996, 'a') + "...");
  EXPECT_EQ(Truncate("short \xC3\xA9", 4000), "short \xC3\xA9");
  v1::Envelope done;
  done.mutable_transfer_done()->set_room_id("r");
  done.mutable_transfer_done()->set_message(cut);
  v1::Envelope parsed;
  ASSERT_TRUE(parsed.ParseFromString(done.SerializeAsString()));
  EXPECT_EQ(parsed.transfer_done().message(), cut);
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

TEST(ProtocolTest, DstPagesRoundTripThroughTheLe32Field) {
  const std::vector<int32_t> pages = {1, 2, 255, 256, 65536, 0x12345678, 7};
  v1::TransferRequest request;
  request.add_dst_page_ids(9);  // replaced
  SetDstPages(request, pages);
  EXPECT_EQ(request.dst_page_ids_size(), 0);
  ASSERT_EQ(request.dst_page_ids_le32().size(), 4 * pages.size());
  // Little-endian on the wire whatever the host.
  EXPECT_EQ(request.dst_page_ids_le32().substr(20, 4), std::string("\x78\x56\x34\x12", 4));
  EXPECT_EQ(DstPages(request), pages);
  EXPECT_EQ(DstPageCount(request), pages.size());
  for (size_t i = 0; i < pages.size(); ++i) {
    EXPECT_EQ(Le32At(request.dst_page_ids_le32(), i), pages[i]);
  }
  // Through the wire and back.
  v1::TransferRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(request.SerializeAsString()));
  EXPECT_EQ(DstPages(parsed), pages);
  // A version-1 style request (the repeated field) reads the same way.
  v1::TransferRequest old;
  for (int32_t p : pages) old.add_dst_page_ids(p);
  EXPECT_EQ(DstPages(old), pages);
  EXPECT_EQ(DstPageCount(old), pages.size());
  SetDstPages(request, {});
  EXPECT_TRUE(DstPages(request).empty());
}

TEST(ProtocolTest, BodyNames) {
  EXPECT_EQ(BodyName(testing::MakeHello()), "hello");
  EXPECT_EQ(BodyName(testing::MakeTransferRequest()), "transfer_request");
  EXPECT_EQ(BodyName(v1::Envelope()), "<empty>");
}

}  // namespace
}  // namespace kvt::control

#include "control/framing.h"

#include <gmock/gmock.h>
#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "test_messages.h"

namespace kvt::control {
namespace {

using ::testing::HasSubstr;

bool Same(const v1::Envelope& a, const v1::Envelope& b) {
  return google::protobuf::util::MessageDifferencer::Equals(a, b);
}

std::string Header(uint32_t length) {
  return std::string{static_cast<char>(length >> 24), static_cast<char>(length >> 16),
                     static_cast<char>(length >> 8), static_cast<char>(length)};
}

// Feeds `bytes` in chunks of the given sizes (cycled) and collects every frame.
StatusOr<std::vector<v1::Envelope>> DecodeAll(FrameDecoder& decoder, std::string_view bytes,
                                              const std::vector<size_t>& chunks) {
  std::vector<v1::Envelope> frames;
  size_t chunk_index = 0;
  while (!bytes.empty() || decoder.frame_ready()) {
    if (decoder.frame_ready()) {
      v1::Envelope envelope;
      KVT_RETURN_IF_ERROR(decoder.Take(&envelope));
      frames.push_back(std::move(envelope));
      continue;
    }
    const size_t chunk = std::min(chunks[chunk_index++ % chunks.size()], bytes.size());
    std::string_view piece = bytes.substr(0, chunk);
    while (!piece.empty()) {
      KVT_ASSIGN_OR_RETURN(size_t used, decoder.Feed(piece));
      piece.remove_prefix(used);
      bytes.remove_prefix(used);
      if (decoder.frame_ready()) break;
    }
  }
  return frames;
}

std::vector<v1::Envelope> SampleEnvelopes() {
  return {testing::MakeHello(), testing::MakeTransferRequest(), testing::MakeHeartbeat(),
          testing::MakeAgentRegistration(),
          MakeErrorEnvelope(v1::STATUS_CODE_NOT_FOUND, "no such room", "room-9")};
}

std::string EncodeAll(const std::vector<v1::Envelope>& envelopes) {
  std::string bytes;
  for (const auto& envelope : envelopes) {
    EXPECT_TRUE(AppendFrame(envelope, kDefaultMaxFrameBytes, &bytes).ok());
  }
  return bytes;
}

TEST(FramingTest, EncodesBigEndianLengthThenPayload) {
  const v1::Envelope heartbeat = testing::MakeHeartbeat(300);
  StatusOr<std::string> frame = EncodeFrame(heartbeat);
  ASSERT_TRUE(frame.ok()) << frame.status();
  const std::string payload = heartbeat.SerializeAsString();
  EXPECT_EQ(*frame, Header(static_cast<uint32_t>(payload.size())) + payload);
}

TEST(FramingTest, RoundTripsOneFrame) {
  const v1::Envelope hello = testing::MakeHello();
  StatusOr<std::string> frame = EncodeFrame(hello);
  ASSERT_TRUE(frame.ok()) << frame.status();
  FrameDecoder decoder;
  StatusOr<size_t> used = decoder.Feed(*frame);
  ASSERT_TRUE(used.ok()) << used.status();
  EXPECT_EQ(*used, frame->size());
  ASSERT_TRUE(decoder.frame_ready());
  v1::Envelope out;
  ASSERT_TRUE(decoder.Take(&out).ok());
  EXPECT_TRUE(Same(out, hello));
  EXPECT_FALSE(decoder.frame_ready());
  EXPECT_EQ(decoder.buffered_bytes(), 0u);
}

TEST(FramingTest, RoundTripsSeveralFramesInOneBuffer) {
  const auto envelopes = SampleEnvelopes();
  const std::string bytes = EncodeAll(envelopes);
  FrameDecoder decoder;
  auto frames = DecodeAll(decoder, bytes, {bytes.size()});
  ASSERT_TRUE(frames.ok()) << frames.status();
  ASSERT_EQ(frames->size(), envelopes.size());
  for (size_t i = 0; i < envelopes.size(); ++i) EXPECT_TRUE(Same((*frames)[i], envelopes[i])) << i;
}

TEST(FramingTest, RoundTripsWhenDeliveredByteByByte) {
  const auto envelopes = SampleEnvelopes();
  const std::string bytes = EncodeAll(envelopes);
  FrameDecoder decoder;
  auto frames = DecodeAll(decoder, bytes, {1});
  ASSERT_TRUE(frames.ok()) << frames.status();
  ASSERT_EQ(frames->size(), envelopes.size());
  for (size_t i = 0; i < envelopes.size(); ++i) EXPECT_TRUE(Same((*frames)[i], envelopes[i])) << i;
}

TEST(FramingTest, RoundTripsAtRandomSplitPoints) {
  const auto envelopes = SampleEnvelopes();
  const std::string bytes = EncodeAll(envelopes);
  std::mt19937 rng(42);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<size_t> chunks;
    for (int i = 0; i < 16; ++i) chunks.push_back(1 + rng() % 37);
    FrameDecoder decoder;
    auto frames = DecodeAll(decoder, bytes, chunks);
    ASSERT_TRUE(frames.ok()) << frames.status();
    ASSERT_EQ(frames->size(), envelopes.size()) << "trial " << trial;
    for (size_t i = 0; i < envelopes.size(); ++i) EXPECT_TRUE(Same((*frames)[i], envelopes[i]));
  }
}

TEST(FramingTest, ConsumesNothingWhileAFrameWaitsToBeTaken) {
  const std::string bytes = EncodeAll({testing::MakeHeartbeat(1), testing::MakeHeartbeat(2)});
  FrameDecoder decoder;
  StatusOr<size_t> first = decoder.Feed(bytes);
  ASSERT_TRUE(first.ok());
  EXPECT_LT(*first, bytes.size());  // stopped at the end of frame 1
  StatusOr<size_t> again = decoder.Feed(std::string_view(bytes).substr(*first));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, 0u);
  v1::Envelope out;
  ASSERT_TRUE(decoder.Take(&out).ok());
  EXPECT_EQ(out.heartbeat().sequence(), 1u);
}

TEST(FramingTest, RefusesOversizedLengthBeforeAllocating) {
  FrameDecoder decoder(1024);
  // Only the header arrives: the refusal must come from the 4 bytes alone.
  StatusOr<size_t> used = decoder.Feed(Header(1025));
  ASSERT_FALSE(used.ok());
  EXPECT_EQ(used.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(used.status().message(), HasSubstr("1025"));
  EXPECT_THAT(used.status().message(), HasSubstr("max_frame_bytes = 1024"));
  EXPECT_LT(decoder.payload_capacity(), 64u);  // nothing beyond the empty string's own buffer
}

TEST(FramingTest, RefusesHugeLengthBeforeAllocating) {
  FrameDecoder decoder;  // 16 MiB limit
  StatusOr<size_t> used = decoder.Feed(Header(0xFFFFFFFFu) + std::string(100, 'x'));
  ASSERT_FALSE(used.ok());
  EXPECT_THAT(used.status().message(), HasSubstr("4294967295"));
  EXPECT_LT(decoder.payload_capacity(), 64u);
}

TEST(FramingTest, AcceptsFrameOfExactlyTheLimit) {
  v1::Envelope envelope = MakeErrorEnvelope(v1::STATUS_CODE_INTERNAL, std::string(100, 'e'));
  const auto size = static_cast<uint32_t>(envelope.ByteSizeLong());
  StatusOr<std::string> frame = EncodeFrame(envelope, size);
  ASSERT_TRUE(frame.ok()) << frame.status();
  FrameDecoder decoder(size);
  ASSERT_TRUE(decoder.Feed(*frame).ok());
  EXPECT_TRUE(decoder.frame_ready());
  EXPECT_FALSE(EncodeFrame(envelope, size - 1).ok());
}

TEST(FramingTest, PayloadGrowsOnlyWithArrivedBytes) {
  FrameDecoder decoder;
  // Announce 8 MiB (allowed) but send 10 bytes: only about 10 bytes may be held.
  ASSERT_TRUE(decoder.Feed(Header(8u << 20) + std::string(10, 'x')).ok());
  EXPECT_FALSE(decoder.frame_ready());
  EXPECT_EQ(decoder.buffered_bytes(), 4u + 10u);
  EXPECT_LT(decoder.payload_capacity(), 4096u);
}

TEST(FramingTest, RefusesZeroLength) {
  FrameDecoder decoder;
  StatusOr<size_t> used = decoder.Feed(Header(0));
  ASSERT_FALSE(used.ok());
  EXPECT_THAT(used.status().message(), HasSubstr("zero-length frame"));
  EXPECT_LT(decoder.payload_capacity(), 64u);
}

TEST(FramingTest, GarbagePayloadIsDataLoss) {
  FrameDecoder decoder;
  ASSERT_TRUE(decoder.Feed(Header(8) + std::string(8, '\xff')).ok());
  ASSERT_TRUE(decoder.frame_ready());
  v1::Envelope out;
  Status status = decoder.Take(&out);
  EXPECT_EQ(status.code(), StatusCode::kDataLoss);
  EXPECT_THAT(status.message(), HasSubstr("not a kvt.v1.Envelope"));
}

TEST(FramingTest, ErrorsAreSticky) {
  FrameDecoder decoder(100);
  ASSERT_FALSE(decoder.Feed(Header(101)).ok());
  const std::string good = *EncodeFrame(testing::MakeHeartbeat());
  StatusOr<size_t> later = decoder.Feed(good);
  ASSERT_FALSE(later.ok());
  EXPECT_THAT(later.status().message(), HasSubstr("101"));
  v1::Envelope out;
  EXPECT_FALSE(decoder.Take(&out).ok());
}

TEST(FramingTest, TakeWithoutFrameIsFailedPrecondition) {
  FrameDecoder decoder;
  v1::Envelope out;
  EXPECT_EQ(decoder.Take(&out).code(), StatusCode::kFailedPrecondition);
}

TEST(FramingTest, EncoderRefusesEmptyAndOversizedEnvelopes) {
  StatusOr<std::string> empty = EncodeFrame(v1::Envelope());
  ASSERT_FALSE(empty.ok());
  EXPECT_THAT(empty.status().message(), HasSubstr("no body"));

  std::string out = "keep";
  Status big = AppendFrame(testing::MakeHello(), 64, &out);
  EXPECT_EQ(big.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(big.message(), HasSubstr("max_frame_bytes = 64"));
  EXPECT_EQ(out, "keep");  // unchanged on failure
}

TEST(FramingTest, ReleasesBigPayloadBufferAfterTheFrame) {
  v1::Envelope big = MakeErrorEnvelope(v1::STATUS_CODE_INTERNAL, "x");
  big.mutable_error()->set_message(std::string(3u << 20, 'm'));  // past the wire limit, fine here
  StatusOr<std::string> frame = EncodeFrame(big);
  ASSERT_TRUE(frame.ok());
  FrameDecoder decoder;
  ASSERT_TRUE(decoder.Feed(*frame).ok());
  v1::Envelope out;
  ASSERT_TRUE(decoder.Take(&out).ok());
  EXPECT_LE(decoder.payload_capacity(), 1u << 20);
}

}  // namespace
}  // namespace kvt::control

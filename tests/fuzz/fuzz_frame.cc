// A control connection's byte stream: frames reassembled from pieces of sizes the input chooses,
// each frame that comes out validated as the connection does (the Hello's PeerContext applied to
// the messages after it).
//
// Input: byte 0 picks the piece size (its low 7 bits, 0: the whole stream at once) and the frame
// limit (high bit set: 256 bytes, else the default); the rest is the stream.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "control/framing.h"
#include "control/protocol.h"
#include "control/validate.h"
#include "fuzz_common.h"

using namespace kvt;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t piece = data[0] & 0x7f;
  const uint32_t max_frame = (data[0] & 0x80) ? 256 : control::kDefaultMaxFrameBytes;
  std::string_view stream(reinterpret_cast<const char*>(data + 1), size - 1);

  control::FrameDecoder decoder(max_frame);
  control::PeerContext peer;
  while (!stream.empty()) {
    const std::string_view chunk = stream.substr(0, piece == 0 ? stream.size() : piece);
    StatusOr<size_t> used = decoder.Feed(chunk);
    if (!used.ok()) {
      // Errors are final.
      KVT_FUZZ_CHECK(!decoder.Feed("x").ok());
      return 0;
    }
    KVT_FUZZ_CHECK(*used <= chunk.size());
    stream.remove_prefix(*used);
    if (!decoder.frame_ready()) {
      // A decoder that is not ready and consumed nothing would stall the connection forever.
      KVT_FUZZ_CHECK(*used > 0 || chunk.empty());
      continue;
    }
    KVT_FUZZ_CHECK(decoder.buffered_bytes() <= control::kFrameHeaderBytes + max_frame);
    v1::Envelope envelope;
    if (!decoder.Take(&envelope).ok()) return 0;
    (void)control::BodyName(envelope);
    if (envelope.has_hello() &&
        !control::CheckProtocolVersion(envelope.hello().protocol_version()).ok()) {
      continue;
    }
    if (!control::Validate(envelope, peer).ok()) continue;
    if (envelope.has_hello()) peer = control::PeerContextFrom(envelope.hello().peer());
    if (envelope.has_hello_ack()) peer = control::PeerContextFrom(envelope.hello_ack().peer());
  }
  return 0;
}

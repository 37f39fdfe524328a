// One received Envelope (a frame's payload) through Validate, with and without a known peer
// pool, and what the receiver then reads out of a valid message checked against the rules
// Validate promises (pages inside the pool, layer ranges inside it, slices inside an item).
//
// Input: the serialized kvt.v1.Envelope.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "control/auth.h"
#include "control/protocol.h"
#include "control/validate.h"
#include "fuzz_common.h"

using namespace kvt;

namespace {

// The promises a valid TransferRequest makes to the prefill side, which writes into the pages.
void CheckTransferRequest(const v1::TransferRequest& request, const control::PeerContext& peer) {
  const std::vector<int32_t> pages = control::DstPages(request);
  KVT_FUZZ_CHECK(!pages.empty());
  KVT_FUZZ_CHECK(pages.size() == control::DstPageCount(request));
  for (int32_t page : pages) {
    KVT_FUZZ_CHECK(page >= 1 && static_cast<uint64_t>(page) < peer.num_pages);
  }
  if (request.has_layers()) {
    KVT_FUZZ_CHECK(request.layers().begin() < request.layers().end());
    KVT_FUZZ_CHECK(request.layers().end() <= peer.num_layers);
  }
  for (const v1::PageSlice& slice : request.slices()) {
    KVT_FUZZ_CHECK(slice.bytes() > 0);
    KVT_FUZZ_CHECK(slice.dst_offset() <= peer.min_item_len &&
                   slice.bytes() <= peer.min_item_len - slice.dst_offset());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  v1::Envelope envelope;
  if (!envelope.ParseFromArray(data, static_cast<int>(size))) return 0;
  (void)control::BodyName(envelope);

  // Before the hello: the checks that need the peer's pool are skipped.
  if (control::Validate(envelope).ok() && envelope.has_transfer_request()) {
    (void)control::DstPages(envelope.transfer_request());
  }
  const control::PeerContext peer = fuzz::LocalPeerContext();
  if (!control::Validate(envelope, peer).ok()) return 0;
  switch (envelope.body_case()) {
    case v1::Envelope::kTransferRequest:
      CheckTransferRequest(envelope.transfer_request(), peer);
      break;
    case v1::Envelope::kLayerProgress:
      for (int32_t page : envelope.layer_progress().src_page_ids()) KVT_FUZZ_CHECK(page >= 1);
      break;
    case v1::Envelope::kAuthResponse: {
      // The server's check of the client's proof, with a token and nonce of the right sizes.
      const v1::AuthResponse& response = envelope.auth_response();
      StatusOr<std::string> expected = control::ClientAuthMac(
          "fuzz-cluster-token-0123456789", std::string(control::kAuthNonceBytes, 'n'),
          response.client_id(), response.role());
      if (expected.ok()) (void)control::MacEquals(*expected, response.mac());
      break;
    }
    case v1::Envelope::kError:
      KVT_FUZZ_CHECK(!control::StatusFromError(envelope.error()).ok());
      break;
    case v1::Envelope::kHello:
      (void)control::PeerContextFrom(envelope.hello().peer());
      break;
    case v1::Envelope::kHelloAck:
      (void)control::PeerContextFrom(envelope.hello_ack().peer());
      break;
    default:
      break;
  }
  return 0;
}

// The driver RPC of kvt-agent: Validate, then the parsing AgentRpc does before it acts (the
// prefill address of a SubmitRequest), without an agent or an engine behind it.
//
// Input: the serialized kvt.v1.Envelope.
#include <cstddef>
#include <cstdint>

#include "control/validate.h"
#include "fuzz_common.h"
#include "tool_util.h"

using namespace kvt;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  v1::Envelope envelope;
  if (!envelope.ParseFromArray(data, static_cast<int>(size))) return 0;
  if (!control::Validate(envelope).ok()) return 0;
  if (envelope.has_submit_request() && !envelope.submit_request().prefill_address().empty()) {
    StatusOr<tools::HostPort> address =
        tools::ParseHostPort(envelope.submit_request().prefill_address());
    if (address.ok()) KVT_FUZZ_CHECK(!address->host.empty());
  }
  return 0;
}

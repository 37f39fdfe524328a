// The bootstrap registry's side of RegisterAgent / UnregisterAgent / LookupAgents (and a registry
// client's of the replies): Validate, then what the server reads before it stores an entry: the
// role and the layout's dtype, which must convert for every registration Validate accepts (an
// unregistration carries the same AgentInfo, checked the same way). The server's handler itself
// answers over its socket, so it is not called here.
//
// Input: the serialized kvt.v1.Envelope.
#include <cstddef>
#include <cstdint>

#include "control/protocol.h"
#include "control/validate.h"
#include "fuzz_common.h"

using namespace kvt;

namespace {

void CheckAgent(const v1::AgentInfo& agent) {
  if (agent.has_layout()) {
    // registry.cc turns the layout into an AgentLayout relying on Validate for a known dtype.
    KVT_FUZZ_CHECK(control::FromProtoDType(agent.layout().dtype()).ok());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  v1::Envelope envelope;
  if (!envelope.ParseFromArray(data, static_cast<int>(size))) return 0;
  if (!control::Validate(envelope).ok()) return 0;
  switch (envelope.body_case()) {
    case v1::Envelope::kRegisterAgent:
      CheckAgent(envelope.register_agent().agent());
      break;
    case v1::Envelope::kUnregisterAgent:
      CheckAgent(envelope.unregister_agent().agent());
      break;
    case v1::Envelope::kLookupAgentsReply:
      for (const v1::AgentInfo& agent : envelope.lookup_agents_reply().agents()) CheckAgent(agent);
      break;
    case v1::Envelope::kRegisterAgentReply:
      (void)control::FromProtoCode(envelope.register_agent_reply().status());
      break;
    default:
      break;
  }
  return 0;
}

// Valid control messages for tests, to be broken one field at a time.
#pragma once

#include <cstdint>
#include <string>

#include "control/protocol.h"
#include "kvt/v1/control.pb.h"

namespace kvt::control::testing {

// A layout of `num_layers` layers and `num_pages` pages (dummy page included), bf16, 8 heads of
// 128, page_size 16, TP 1.
inline v1::Layout MakeLayout(uint32_t num_layers = 4, uint64_t num_pages = 65) {
  v1::Layout layout;
  layout.set_num_layers(num_layers);
  layout.set_page_size(16);
  layout.set_dtype(v1::DTYPE_BF16);
  layout.set_head_num(8);
  layout.set_head_dim(128);
  layout.set_tp_rank(0);
  layout.set_tp_size(1);
  layout.set_num_pages(num_pages);
  layout.set_num_tokens((num_pages - 1) * 16);
  layout.set_total_kv_heads(8);
  return layout;
}

inline constexpr uint64_t kItemLen = 16 * 8 * 128 * 2;  // page_size * heads * head_dim * bf16

inline v1::PeerInfo MakePeerInfo(const std::string& name = "decode-0", uint32_t num_layers = 4,
                                 uint64_t num_pages = 65) {
  v1::PeerInfo peer;
  peer.set_name(name);
  peer.set_role(v1::ROLE_DECODE);
  *peer.mutable_layout() = MakeLayout(num_layers, num_pages);
  for (uint32_t i = 0; i < 2 * num_layers; ++i) {
    v1::MemoryDescriptor* buffer = peer.add_buffers();
    buffer->set_buffer_index(i);
    buffer->set_base(0x7f0000000000ull + i * num_pages * kItemLen);
    buffer->set_length(num_pages * kItemLen);
    buffer->set_item_len(kItemLen);
    buffer->set_kind(v1::MEMORY_KIND_HOST);
    v1::BackendKey* key = buffer->add_keys();
    key->set_backend("ucx");
    key->set_blob(std::string(64, '\x5a'));
  }
  v1::BackendEndpoint* endpoint = peer.add_endpoints();
  endpoint->set_backend("ucx");
  endpoint->set_address(std::string(200, '\x01'));
  peer.set_host_id("host-a");
  return peer;
}

inline v1::Envelope MakeHello(uint32_t version = kProtocolVersion) {
  v1::Envelope envelope;
  envelope.set_id(1);
  envelope.mutable_hello()->set_protocol_version(version);
  *envelope.mutable_hello()->mutable_peer() = MakePeerInfo();
  return envelope;
}

inline v1::Envelope MakeTransferRequest(const std::string& room = "room-1") {
  v1::Envelope envelope;
  envelope.set_id(2);
  v1::TransferRequest* request = envelope.mutable_transfer_request();
  request->set_room_id(room);
  request->set_mode(v1::TRANSFER_MODE_PUSH);
  for (int page : {1, 2, 3, 64}) request->add_dst_page_ids(page);
  request->mutable_layers()->set_begin(0);
  request->mutable_layers()->set_end(4);
  request->set_deadline_ms(30000);
  return envelope;
}

inline v1::Envelope MakeAgentRegistration() {
  v1::Envelope envelope;
  v1::AgentInfo* agent = envelope.mutable_register_agent()->mutable_agent();
  agent->set_name("prefill-a");
  agent->set_role(v1::ROLE_PREFILL);
  agent->set_tp_rank(1);
  agent->set_tp_size(2);
  agent->set_control_address("10.0.0.5:7001");
  *agent->mutable_layout() = MakeLayout();
  agent->mutable_layout()->set_tp_rank(1);
  agent->mutable_layout()->set_tp_size(2);
  return envelope;
}

// The agent of MakeAgentRegistration ending its registration.
inline v1::Envelope MakeAgentUnregistration() {
  v1::Envelope envelope;
  *envelope.mutable_unregister_agent()->mutable_agent() =
      MakeAgentRegistration().register_agent().agent();
  return envelope;
}

inline v1::Envelope MakeHeartbeat(uint64_t sequence = 7) {
  v1::Envelope envelope;
  envelope.mutable_heartbeat()->set_sequence(sequence);
  return envelope;
}

}  // namespace kvt::control::testing

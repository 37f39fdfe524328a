#include "control/validate.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "control/auth.h"
#include "test_messages.h"

namespace kvt::control {
namespace {

using ::testing::HasSubstr;

// The peer on the other side of the connection: 4 layers, 65 pages (1..64 valid).
PeerContext KnownPeer() { return PeerContextFrom(testing::MakePeerInfo()); }

v1::Envelope AuthChallenge() {
  v1::Envelope e;
  e.mutable_auth_challenge()->set_nonce(std::string(kAuthNonceBytes, 'n'));
  e.mutable_auth_challenge()->set_auth_required(true);
  e.mutable_auth_challenge()->set_server_id("registry");
  e.mutable_auth_challenge()->set_protocol_version(kProtocolVersion);
  return e;
}

v1::Envelope AuthResponse() {
  v1::Envelope e;
  e.mutable_auth_response()->set_client_id("decode-0");
  e.mutable_auth_response()->set_role(v1::ROLE_DECODE);
  e.mutable_auth_response()->set_mac(std::string(kAuthMacBytes, 'm'));
  return e;
}

v1::Envelope HelloAck() {
  v1::Envelope e;
  e.mutable_hello_ack()->set_protocol_version(kProtocolVersion);
  *e.mutable_hello_ack()->mutable_peer() = testing::MakePeerInfo("prefill-0");
  e.mutable_hello_ack()->mutable_peer()->set_role(v1::ROLE_PREFILL);
  return e;
}

v1::Envelope LayerProgress() {
  v1::Envelope e;
  e.mutable_layer_progress()->set_room_id("room-1");
  e.mutable_layer_progress()->set_layers_done(2);
  e.mutable_layer_progress()->set_bytes_done(1 << 20);
  return e;
}

v1::Envelope TransferDone() {
  v1::Envelope e;
  e.mutable_transfer_done()->set_room_id("room-1");
  e.mutable_transfer_done()->set_status(v1::STATUS_CODE_OK);
  e.mutable_transfer_done()->set_bytes(4 * testing::kItemLen * 8);
  e.mutable_transfer_done()->mutable_checksum()->set_algorithm(v1::CHECKSUM_ALGORITHM_XXH3_64);
  e.mutable_transfer_done()->mutable_checksum()->set_value(0x1234);
  return e;
}

v1::Envelope Abort() {
  v1::Envelope e;
  e.mutable_abort()->set_room_id("room-1");
  e.mutable_abort()->set_code(v1::STATUS_CODE_DEADLINE_EXCEEDED);
  e.mutable_abort()->set_reason("deadline passed");
  return e;
}

v1::Envelope AbortAck() {
  v1::Envelope e;
  e.mutable_abort_ack()->set_room_id("room-1");
  e.mutable_abort_ack()->set_writes_quiesced(true);
  return e;
}

v1::Envelope Lookup() {
  v1::Envelope e;
  e.mutable_lookup_agents()->set_name("prefill-a");
  e.mutable_lookup_agents()->set_role(v1::ROLE_PREFILL);
  e.mutable_lookup_agents()->set_tp_rank(1);
  return e;
}

v1::Envelope LookupReply() {
  v1::Envelope e;
  *e.mutable_lookup_agents_reply()->add_agents() =
      testing::MakeAgentRegistration().register_agent().agent();
  return e;
}

v1::Envelope RegisterReply() {
  v1::Envelope e;
  e.mutable_register_agent_reply()->set_status(v1::STATUS_CODE_OK);
  e.mutable_register_agent_reply()->set_heartbeat_interval_ms(1000);
  return e;
}

constexpr v1::KvShape KV = v1::KV_SHAPE_KEY_VALUE;
constexpr v1::KvShape LATENT = v1::KV_SHAPE_LATENT;

v1::PeerInfo* PeerInfoOf(v1::Envelope& e) { return e.mutable_hello()->mutable_peer(); }
v1::Layout* PeerLayout(v1::Envelope& e) { return PeerInfoOf(e)->mutable_layout(); }

// Replaces the hello's layout groups by valid groups of these shapes and layer counts (bf16,
// 8 heads of 128, page_size 16; a latent group holds one head).
void SetGroups(v1::Envelope& e, const std::vector<std::pair<v1::KvShape, uint32_t>>& groups) {
  v1::Layout* layout = PeerLayout(e);
  layout->clear_groups();
  for (const auto& [shape, layers] : groups) {
    v1::KvGroup* group = layout->add_groups();
    group->set_shape(shape);
    group->set_num_layers(layers);
    group->set_head_num(shape == v1::KV_SHAPE_LATENT ? 1 : 8);
    group->set_head_dim(128);
    group->set_dtype(v1::DTYPE_BF16);
    group->set_page_bytes(16ull * group->head_num() * 128 * 2);
  }
}

void SetAux(v1::Envelope& e, const std::vector<uint64_t>& slot_bytes, uint64_t slots) {
  v1::Layout* layout = PeerLayout(e);
  layout->clear_aux_slot_bytes();
  for (uint64_t bytes : slot_bytes) layout->add_aux_slot_bytes(bytes);
  layout->set_aux_slots(slots);
}

struct Case {
  std::string name;
  std::function<v1::Envelope()> make;
  std::function<void(v1::Envelope&)> mutate;  // null: the valid message
  std::string expect;                         // substring of the error; empty: must be OK
  bool known_peer = true;
};

class ValidateTest : public ::testing::TestWithParam<Case> {};

TEST_P(ValidateTest, Checks) {
  const Case& c = GetParam();
  v1::Envelope envelope = c.make();
  if (c.mutate) c.mutate(envelope);
  Status status = Validate(envelope, c.known_peer ? KnownPeer() : PeerContext{});
  if (c.expect.empty()) {
    EXPECT_TRUE(status.ok()) << status;
  } else {
    ASSERT_FALSE(status.ok());
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr(c.expect));
  }
}

auto TR = [] { return testing::MakeTransferRequest(); };
auto HELLO = [] { return testing::MakeHello(); };
auto REG = [] { return testing::MakeAgentRegistration(); };

INSTANTIATE_TEST_SUITE_P(
    Messages, ValidateTest,
    ::testing::Values(
        // Envelope.
        Case{"EmptyEnvelope", [] { v1::Envelope e; e.set_id(5); return e; }, nullptr,
             "no message body"},
        // Auth.
        Case{"ChallengeOk", AuthChallenge, nullptr, ""},
        Case{"ChallengeShortNonce", AuthChallenge,
             [](v1::Envelope& e) { e.mutable_auth_challenge()->set_nonce("abc"); },
             "auth_challenge.nonce is 3 bytes; expected 32"},
        Case{"ChallengeNonceWithoutAuth", AuthChallenge,
             [](v1::Envelope& e) { e.mutable_auth_challenge()->set_auth_required(false); },
             "auth_challenge.nonce"},
        Case{"ResponseOk", AuthResponse, nullptr, ""},
        Case{"ResponseNoClientId", AuthResponse,
             [](v1::Envelope& e) { e.mutable_auth_response()->clear_client_id(); },
             "auth_response.client_id is empty"},
        Case{"ResponseControlCharInId", AuthResponse,
             [](v1::Envelope& e) { e.mutable_auth_response()->set_client_id("bad\nname"); },
             "auth_response.client_id = \"bad\\x0aname\": byte 0x0a at offset 3"},
        Case{"ResponseShortMac", AuthResponse,
             [](v1::Envelope& e) { e.mutable_auth_response()->set_mac("x"); },
             "auth_response.mac is 1 bytes; expected 32"},
        Case{"ResponseNoRole", AuthResponse,
             [](v1::Envelope& e) { e.mutable_auth_response()->clear_role(); },
             "auth_response.role = UNSPECIFIED"},
        Case{"ResponseUnknownRole", AuthResponse,
             [](v1::Envelope& e) { e.mutable_auth_response()->set_role(static_cast<v1::Role>(77)); },
             "auth_response.role = 77: not a known value"},
        // Registry.
        Case{"RegisterOk", REG, nullptr, ""},
        Case{"RegisterNoAgent", REG,
             [](v1::Envelope& e) { e.mutable_register_agent()->clear_agent(); },
             "register_agent.agent is missing"},
        Case{"RegisterRankTooBig", REG,
             [](v1::Envelope& e) { e.mutable_register_agent()->mutable_agent()->set_tp_rank(2); },
             "register_agent.agent.tp_rank = 2: must be < tp_size = 2"},
        Case{"RegisterBadAddress", REG,
             [](v1::Envelope& e) {
               e.mutable_register_agent()->mutable_agent()->set_control_address("10.0.0.5");
             },
             "register_agent.agent.control_address = \"10.0.0.5\": expected \"host:port\""},
        Case{"RegisterLongName", REG,
             [](v1::Envelope& e) {
               e.mutable_register_agent()->mutable_agent()->set_name(std::string(200, 'a'));
             },
             "register_agent.agent.name is 200 bytes long; the limit is 128"},
        Case{"RegisterLayoutNoDtype", REG,
             [](v1::Envelope& e) {
               e.mutable_register_agent()->mutable_agent()->mutable_layout()->clear_dtype();
             },
             "register_agent.agent.layout.dtype = UNSPECIFIED"},
        Case{"RegisterLayoutTpDiffers", REG,
             [](v1::Envelope& e) {
               e.mutable_register_agent()->mutable_agent()->mutable_layout()->set_tp_rank(0);
             },
             "register_agent.agent.layout.tp_rank/tp_size = 0/2"},
        Case{"UnregisterOk", testing::MakeAgentUnregistration, nullptr, ""},
        Case{"UnregisterNoAgent", testing::MakeAgentUnregistration,
             [](v1::Envelope& e) { e.mutable_unregister_agent()->clear_agent(); },
             "unregister_agent.agent is missing; send the entry as it was registered"},
        Case{"UnregisterNoName", testing::MakeAgentUnregistration,
             [](v1::Envelope& e) { e.mutable_unregister_agent()->mutable_agent()->clear_name(); },
             "unregister_agent.agent.name"},
        Case{"UnregisterBadAddress", testing::MakeAgentUnregistration,
             [](v1::Envelope& e) {
               e.mutable_unregister_agent()->mutable_agent()->set_control_address("10.0.0.5");
             },
             "unregister_agent.agent.control_address = \"10.0.0.5\": expected \"host:port\""},
        Case{"RegisterReplyOk", RegisterReply, nullptr, ""},
        Case{"RegisterReplyNoStatus", RegisterReply,
             [](v1::Envelope& e) { e.mutable_register_agent_reply()->clear_status(); },
             "register_agent_reply.status = UNSPECIFIED"},
        Case{"LookupOk", Lookup, nullptr, ""},
        Case{"LookupAnyOk", [] { v1::Envelope e; e.mutable_lookup_agents(); return e; }, nullptr,
             ""},
        Case{"LookupBadName", Lookup,
             [](v1::Envelope& e) { e.mutable_lookup_agents()->set_name(std::string(1, '\0')); },
             "lookup_agents.name"},
        Case{"LookupReplyOk", LookupReply, nullptr, ""},
        Case{"LookupReplyBadAgent", LookupReply,
             [](v1::Envelope& e) {
               e.mutable_lookup_agents_reply()->mutable_agents(0)->set_tp_size(0);
             },
             "lookup_agents_reply.agents[0].tp_size = 0: must be in 1..65536"},
        // Hello / HelloAck.
        Case{"HelloOk", HELLO, nullptr, ""},
        Case{"HelloAckOk", HelloAck, nullptr, ""},
        Case{"HelloNoVersion", HELLO,
             [](v1::Envelope& e) { e.mutable_hello()->set_protocol_version(0); },
             "hello.protocol_version = 0: must be set"},
        Case{"HelloNoPeer", HELLO, [](v1::Envelope& e) { e.mutable_hello()->clear_peer(); },
             "hello.peer is missing"},
        Case{"HelloNoLayout", HELLO,
             [](v1::Envelope& e) { e.mutable_hello()->mutable_peer()->clear_layout(); },
             "hello.peer.layout is missing"},
        Case{"HelloZeroLayers", HELLO,
             [](v1::Envelope& e) {
               e.mutable_hello()->mutable_peer()->mutable_layout()->set_num_layers(0);
             },
             "hello.peer.layout.num_layers = 0: must be in 1..4096"},
        Case{"HelloOnlyDummyPage", HELLO,
             [](v1::Envelope& e) {
               e.mutable_hello()->mutable_peer()->mutable_layout()->set_num_pages(1);
             },
             "hello.peer.layout.num_pages = 1"},
        Case{"HelloTokensDisagree", HELLO,
             [](v1::Envelope& e) {
               e.mutable_hello()->mutable_peer()->mutable_layout()->set_num_tokens(17);
             },
             "hello.peer.layout.num_tokens = 17: 17 tokens make 2 pages of 16"},
        Case{"HelloTooManyBuffers", HELLO,
             [](v1::Envelope& e) { *e.mutable_hello()->mutable_peer()->add_buffers() =
                                       e.hello().peer().buffers(0); },
             "hello.peer.buffers has 9 entries; the limit is 8"},
        Case{"HelloBufferIndexTwice", HELLO,
             [](v1::Envelope& e) {
               e.mutable_hello()->mutable_peer()->mutable_buffers(1)->set_buffer_index(0);
             },
             "hello.peer.buffers[1].buffer_index = 0: appears twice"},
        Case{"HelloBufferIndexTooBig", HELLO,
             [](v1::Envelope& e) {
               e.mutable_hello()->mutable_peer()->mutable_buffers(1)->set_buffer_index(8);
             },
             "hello.peer.buffers[1].buffer_index = 8: must be < 2 * num_layers = 8"},
        // Layout groups and aux slots (protocol 3). HELLO's peer has 4 layers and 8 buffers.
        Case{"HelloGroupsOk", HELLO, [](v1::Envelope& e) { SetGroups(e, {{KV, 3}, {KV, 1}}); },
             ""},
        Case{"HelloTooManyGroups", HELLO,
             [](v1::Envelope& e) {
               SetGroups(e, std::vector<std::pair<v1::KvShape, uint32_t>>(17, {KV, 1}));
               PeerLayout(e)->set_num_layers(17);
             },
             "hello.peer.layout.groups has 17 entries; the limit is 16"},
        Case{"HelloGroupNoShape", HELLO,
             [](v1::Envelope& e) { SetGroups(e, {{v1::KV_SHAPE_UNSPECIFIED, 4}}); },
             "hello.peer.layout.groups[0].shape = UNSPECIFIED: must be set"},
        Case{"HelloGroupUnknownShape", HELLO,
             [](v1::Envelope& e) { SetGroups(e, {{static_cast<v1::KvShape>(9), 4}}); },
             "hello.peer.layout.groups[0].shape = 9: not a known value"},
        Case{"HelloGroupZeroLayers", HELLO,
             [](v1::Envelope& e) { SetGroups(e, {{KV, 4}, {KV, 0}}); },
             "hello.peer.layout.groups[1].num_layers = 0: must be in 1..4096"},
        Case{"HelloGroupTooManyLayers", HELLO,
             [](v1::Envelope& e) { SetGroups(e, {{KV, 5000}}); },
             "hello.peer.layout.groups[0].num_layers = 5000: must be in 1..4096"},
        Case{"HelloGroupZeroHeads", HELLO,
             [](v1::Envelope& e) {
               SetGroups(e, {{KV, 4}});
               PeerLayout(e)->mutable_groups(0)->set_head_num(0);
             },
             "hello.peer.layout.groups[0].head_num = 0: must be in 1..65536"},
        Case{"HelloGroupHeadDimTooBig", HELLO,
             [](v1::Envelope& e) {
               SetGroups(e, {{KV, 4}});
               PeerLayout(e)->mutable_groups(0)->set_head_dim(70000);
             },
             "hello.peer.layout.groups[0].head_dim = 70000: must be in 1..65536"},
        Case{"HelloGroupNoDtype", HELLO,
             [](v1::Envelope& e) {
               SetGroups(e, {{KV, 4}});
               PeerLayout(e)->mutable_groups(0)->clear_dtype();
             },
             "hello.peer.layout.groups[0].dtype = UNSPECIFIED: must be set"},
        Case{"HelloGroupUnknownDtype", HELLO,
             [](v1::Envelope& e) {
               SetGroups(e, {{KV, 4}});
               PeerLayout(e)->mutable_groups(0)->set_dtype(static_cast<v1::DType>(42));
             },
             "hello.peer.layout.groups[0].dtype = 42: not a known value"},
        Case{"HelloGroupNoPageBytes", HELLO,
             [](v1::Envelope& e) {
               SetGroups(e, {{KV, 4}});
               PeerLayout(e)->mutable_groups(0)->set_page_bytes(0);
             },
             "hello.peer.layout.groups[0].page_bytes = 0: must be > 0"},
        Case{"HelloGroupLayersDisagree", HELLO,
             [](v1::Envelope& e) { SetGroups(e, {{KV, 3}, {KV, 2}}); },
             "hello.peer.layout.num_layers = 4: the 2 groups hold 5 layers in all; num_layers "
             "must be their sum"},
        // Buffers: 2 per KEY_VALUE layer, 1 per LATENT layer.
        Case{"HelloLatentGroupFewerBuffers", HELLO,
             [](v1::Envelope& e) {
               SetGroups(e, {{KV, 2}, {LATENT, 2}});  // 4 + 2 = 6 buffers, HELLO lists 8
             },
             "hello.peer.buffers has 8 entries; the limit is 6"},
        Case{"HelloLatentGroupBuffersOk", HELLO,
             [](v1::Envelope& e) {
               SetGroups(e, {{KV, 2}, {LATENT, 2}});
               PeerInfoOf(e)->mutable_buffers()->DeleteSubrange(6, 2);
             },
             ""},
        Case{"HelloLatentGroupBufferIndexPastCount", HELLO,
             [](v1::Envelope& e) {
               SetGroups(e, {{LATENT, 4}});  // 4 buffers
               PeerInfoOf(e)->mutable_buffers()->DeleteSubrange(4, 4);
               PeerInfoOf(e)->mutable_buffers(3)->set_buffer_index(5);
             },
             "hello.peer.buffers[3].buffer_index = 5: must be < the layout's buffer count 4"},
        Case{"HelloAuxOk", HELLO, [](v1::Envelope& e) { SetAux(e, {64, 4096}, 128); }, ""},
        Case{"HelloTooManyAuxBuffers", HELLO,
             [](v1::Envelope& e) { SetAux(e, std::vector<uint64_t>(65, 8), 16); },
             "hello.peer.layout.aux_slot_bytes has 65 entries; the limit is 64"},
        Case{"HelloAuxSlotEmpty", HELLO, [](v1::Envelope& e) { SetAux(e, {64, 0}, 16); },
             "hello.peer.layout.aux_slot_bytes[1] = 0: must be in 1..16777216"},
        Case{"HelloAuxSlotTooBig", HELLO,
             [](v1::Envelope& e) { SetAux(e, {(16u << 20) + 1}, 16); },
             "hello.peer.layout.aux_slot_bytes[0] = 16777217: must be in 1..16777216"},
        Case{"HelloAuxBuffersWithoutSlots", HELLO, [](v1::Envelope& e) { SetAux(e, {64}, 0); },
             "hello.peer.layout.aux_slots = 0: must be > 0: aux_slot_bytes lists 1 aux buffers"},
        Case{"HelloAuxSlotsWithoutBuffers", HELLO, [](v1::Envelope& e) { SetAux(e, {}, 16); },
             "hello.peer.layout.aux_slots = 16: must be 0 when aux_slot_bytes is empty"},
        Case{"RegisterLayoutGroupsChecked", REG,
             [](v1::Envelope& e) {
               v1::Layout* layout = e.mutable_register_agent()->mutable_agent()->mutable_layout();
               layout->add_groups()->set_shape(v1::KV_SHAPE_KEY_VALUE);
             },
             "register_agent.agent.layout.groups[0].num_layers = 0"},
        Case{"HelloBufferTooShort", HELLO,
             [](v1::Envelope& e) {
               e.mutable_hello()->mutable_peer()->mutable_buffers(2)->set_length(100);
             },
             "hello.peer.buffers[2].length = 100: too short for num_pages = 65"},
        Case{"HelloBufferZeroItem", HELLO,
             [](v1::Envelope& e) {
               e.mutable_hello()->mutable_peer()->mutable_buffers(0)->set_item_len(0);
             },
             "hello.peer.buffers[0].item_len = 0"},
        Case{"HelloBufferWraps", HELLO,
             [](v1::Envelope& e) {
               e.mutable_hello()->mutable_peer()->mutable_buffers(0)->set_base(~0ull - 10);
             },
             "hello.peer.buffers[0].base"},
        Case{"HelloBufferNoKind", HELLO,
             [](v1::Envelope& e) {
               e.mutable_hello()->mutable_peer()->mutable_buffers(0)->clear_kind();
             },
             "hello.peer.buffers[0].kind = UNSPECIFIED"},
        Case{"HelloBlobTooBig", HELLO,
             [](v1::Envelope& e) {
               e.mutable_hello()->mutable_peer()->mutable_buffers(3)->mutable_keys(0)->set_blob(
                   std::string(70000, 'k'));
             },
             "hello.peer.buffers[3].keys[0].blob is 70000 bytes long; the limit is 65536"},
        Case{"HelloEndpointNoBackend", HELLO,
             [](v1::Envelope& e) {
               e.mutable_hello()->mutable_peer()->mutable_endpoints(0)->clear_backend();
             },
             "hello.peer.endpoints[0].backend is empty"},
        Case{"HelloAckBadRank", HelloAck,
             [](v1::Envelope& e) {
               e.mutable_hello_ack()->mutable_peer()->mutable_layout()->set_tp_rank(1);
             },
             "hello_ack.peer.layout.tp_rank = 1: must be < tp_size = 1"},
        // TransferRequest.
        Case{"RequestOk", TR, nullptr, ""},
        Case{"RequestOkUnknownPeer", TR, nullptr, "", false},
        Case{"RequestNoRoom", TR,
             [](v1::Envelope& e) { e.mutable_transfer_request()->clear_room_id(); },
             "transfer_request.room_id is empty"},
        Case{"RequestLongRoom", TR,
             [](v1::Envelope& e) {
               e.mutable_transfer_request()->set_room_id(std::string(300, 'r'));
             },
             "transfer_request.room_id is 300 bytes long; the limit is 256"},
        Case{"RequestNoMode", TR,
             [](v1::Envelope& e) { e.mutable_transfer_request()->clear_mode(); },
             "transfer_request.mode = UNSPECIFIED"},
        Case{"RequestNoPages", TR,
             [](v1::Envelope& e) { e.mutable_transfer_request()->clear_dst_page_ids(); },
             "dst_page_ids_le32 and dst_page_ids are both empty"},
        Case{"RequestDummyPage", TR,
             [](v1::Envelope& e) { e.mutable_transfer_request()->set_dst_page_ids(2, 0); },
             "transfer_request.dst_page_ids[2] = 0: page 0 is the dummy page"},
        Case{"RequestNegativePage", TR,
             [](v1::Envelope& e) { e.mutable_transfer_request()->set_dst_page_ids(0, -3); },
             "transfer_request.dst_page_ids[0] = -3: page ids are >= 1"},
        Case{"RequestPagePastPool", TR,
             [](v1::Envelope& e) { e.mutable_transfer_request()->set_dst_page_ids(3, 65); },
             "transfer_request.dst_page_ids[3] = 65: the pool has pages 1..64"},
        Case{"RequestPagePastPoolUnknownPeer", TR,
             [](v1::Envelope& e) { e.mutable_transfer_request()->set_dst_page_ids(3, 65); }, "",
             false},
        Case{"RequestTooManyPages", TR,
             [](v1::Envelope& e) {
               auto* pages = e.mutable_transfer_request()->mutable_dst_page_ids();
               pages->Resize((1 << 20) + 1, 1);
             },
             "transfer_request.dst_page_ids has 1048577 entries; the limit is 1048576"},
        // The page list as little-endian int32s (protocol version 2 senders).
        Case{"RequestLe32Ok", TR,
             [](v1::Envelope& e) {
               SetDstPages(*e.mutable_transfer_request(), std::vector<int32_t>{1, 2, 64});
             },
             ""},
        Case{"RequestLe32AndRepeatedBoth", TR,
             [](v1::Envelope& e) {
               e.mutable_transfer_request()->set_dst_page_ids_le32(std::string("\x01\0\0\0", 4));
             },
             "transfer_request has both dst_page_ids (4 entries) and dst_page_ids_le32 (4 bytes)"},
        Case{"RequestLe32PartialId", TR,
             [](v1::Envelope& e) {
               e.mutable_transfer_request()->clear_dst_page_ids();
               e.mutable_transfer_request()->set_dst_page_ids_le32(std::string("\x01\0\0\0\x02", 5));
             },
             "transfer_request.dst_page_ids_le32 is 5 bytes, not a whole number of 4-byte page ids"},
        Case{"RequestLe32DummyPage", TR,
             [](v1::Envelope& e) {
               SetDstPages(*e.mutable_transfer_request(), std::vector<int32_t>{3, 0});
             },
             "transfer_request.dst_page_ids_le32[1] = 0: page 0 is the dummy page"},
        Case{"RequestLe32NegativePage", TR,
             [](v1::Envelope& e) {
               SetDstPages(*e.mutable_transfer_request(), std::vector<int32_t>{-2});
             },
             "transfer_request.dst_page_ids_le32[0] = -2: page ids are >= 1"},
        Case{"RequestLe32PagePastPool", TR,
             [](v1::Envelope& e) {
               SetDstPages(*e.mutable_transfer_request(), std::vector<int32_t>{5, 6, 65});
             },
             "transfer_request.dst_page_ids_le32[2] = 65: the pool has pages 1..64"},
        Case{"RequestLe32TooManyPages", TR,
             [](v1::Envelope& e) {
               SetDstPages(*e.mutable_transfer_request(),
                           std::vector<int32_t>((1 << 20) + 1, 1));
             },
             "transfer_request.dst_page_ids_le32 has 1048577 entries; the limit is 1048576"},
        Case{"RequestEmptyLayerRange", TR,
             [](v1::Envelope& e) {
               e.mutable_transfer_request()->mutable_layers()->set_begin(2);
               e.mutable_transfer_request()->mutable_layers()->set_end(2);
             },
             "transfer_request.layers = [2, 2): need begin < end <= 4"},
        Case{"RequestLayersPastPool", TR,
             [](v1::Envelope& e) { e.mutable_transfer_request()->mutable_layers()->set_end(5); },
             "transfer_request.layers = [0, 5): need begin < end <= 4 (the pool's layer count)"},
        Case{"RequestNoDeadline", TR,
             [](v1::Envelope& e) { e.mutable_transfer_request()->clear_deadline_ms(); },
             "transfer_request.deadline_ms = 0: must be in 1..3600000"},
        Case{"RequestDeadlineTooFar", TR,
             [](v1::Envelope& e) { e.mutable_transfer_request()->set_deadline_ms(4000000); },
             "transfer_request.deadline_ms = 4000000"},
        Case{"RequestSliceOk", TR,
             [](v1::Envelope& e) {
               auto* slice = e.mutable_transfer_request()->add_slices();
               slice->set_src_offset(256);
               slice->set_dst_offset(0);
               slice->set_bytes(256);
             },
             ""},
        Case{"RequestSliceZeroBytes", TR,
             [](v1::Envelope& e) { e.mutable_transfer_request()->add_slices(); },
             "transfer_request.slices[0].bytes = 0"},
        Case{"RequestSlicePastItem", TR,
             [](v1::Envelope& e) {
               auto* slice = e.mutable_transfer_request()->add_slices();
               slice->set_dst_offset(testing::kItemLen - 10);
               slice->set_bytes(11);
             },
             "transfer_request.slices[0] = {dst_offset 32758, bytes 11}: ends past the "
             "destination item (32768 bytes)"},
        Case{"RequestSliceOverflow", TR,
             [](v1::Envelope& e) {
               auto* slice = e.mutable_transfer_request()->add_slices();
               slice->set_src_offset(~0ull);
               slice->set_bytes(2);
             },
             "offset + bytes overflows"},
        Case{"RequestBadBackend", TR,
             [](v1::Envelope& e) { e.mutable_transfer_request()->set_backend("u c x\t"); },
             "transfer_request.backend"},
        // Progress, done, abort.
        Case{"ProgressOk", LayerProgress, nullptr, ""},
        Case{"ProgressTooManyLayers", LayerProgress,
             [](v1::Envelope& e) { e.mutable_layer_progress()->set_layers_done(5); },
             "layer_progress.layers_done = 5: must be in 0..4"},
        Case{"ProgressDummySourcePage", LayerProgress,
             [](v1::Envelope& e) { e.mutable_layer_progress()->add_src_page_ids(0); },
             "layer_progress.src_page_ids[0] = 0: page 0 is the dummy page"},
        Case{"ProgressNoRoom", LayerProgress,
             [](v1::Envelope& e) { e.mutable_layer_progress()->clear_room_id(); },
             "layer_progress.room_id is empty"},
        Case{"DoneOk", TransferDone, nullptr, ""},
        Case{"DoneNoStatus", TransferDone,
             [](v1::Envelope& e) { e.mutable_transfer_done()->clear_status(); },
             "transfer_done.status = UNSPECIFIED"},
        Case{"DoneChecksumNoAlgorithm", TransferDone,
             [](v1::Envelope& e) {
               e.mutable_transfer_done()->mutable_checksum()->clear_algorithm();
             },
             "transfer_done.checksum.algorithm = UNSPECIFIED"},
        Case{"DoneLongMessage", TransferDone,
             [](v1::Envelope& e) {
               e.mutable_transfer_done()->set_message(std::string(5000, 'm'));
             },
             "transfer_done.message is 5000 bytes long; the limit is 4096"},
        Case{"AbortOk", Abort, nullptr, ""},
        Case{"AbortUnknownCode", Abort,
             [](v1::Envelope& e) { e.mutable_abort()->set_code(static_cast<v1::StatusCode>(55)); },
             "abort.code = 55"},
        Case{"AbortAckOk", AbortAck, nullptr, ""},
        Case{"AbortAckNoRoom", AbortAck,
             [](v1::Envelope& e) { e.mutable_abort_ack()->clear_room_id(); },
             "abort_ack.room_id is empty"},
        // Heartbeat and error.
        Case{"HeartbeatOk", [] { return testing::MakeHeartbeat(); }, nullptr, ""},
        Case{"ErrorOk",
             [] { return MakeErrorEnvelope(v1::STATUS_CODE_NOT_FOUND, "no room", "room-1"); },
             nullptr, ""},
        Case{"ErrorSaysOk",
             [] { return MakeErrorEnvelope(v1::STATUS_CODE_NOT_FOUND, "no room"); },
             [](v1::Envelope& e) { e.mutable_error()->set_code(v1::STATUS_CODE_OK); },
             "error.code = OK"},
        Case{"ErrorNoCode",
             [] { return MakeErrorEnvelope(v1::STATUS_CODE_NOT_FOUND, "no room"); },
             [](v1::Envelope& e) { e.mutable_error()->clear_code(); },
             "error.code = UNSPECIFIED"}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

TEST(CheckProtocolVersionTest, NamesBothVersions) {
  EXPECT_TRUE(CheckProtocolVersion(kProtocolVersion).ok());
  Status status = CheckProtocolVersion(kProtocolVersion + 1);
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition);
  const std::string ours = std::to_string(kProtocolVersion);
  EXPECT_THAT(status.message(), HasSubstr("peer speaks " + std::to_string(kProtocolVersion + 1) +
                                          ", this side speaks " + ours));
  // Older peers (version 1: page lists as repeated varints only; version 2: no layout groups or
  // aux slots) are refused at hello.
  EXPECT_THAT(CheckProtocolVersion(1).message(),
              HasSubstr("peer speaks 1, this side speaks " + ours));
  EXPECT_THAT(CheckProtocolVersion(2).message(),
              HasSubstr("peer speaks 2, this side speaks " + ours));
}

TEST(LayoutBufferCountTest, TwoPerKeyValueLayerOnePerLatentLayer) {
  v1::Layout layout = testing::MakeLayout(4);
  EXPECT_EQ(LayoutBufferCount(layout), 8u);  // no groups: one KEY_VALUE group
  layout.set_num_layers(64);
  v1::KvGroup* target = layout.add_groups();
  target->set_shape(v1::KV_SHAPE_LATENT);
  target->set_num_layers(61);
  v1::KvGroup* draft = layout.add_groups();
  draft->set_shape(v1::KV_SHAPE_KEY_VALUE);
  draft->set_num_layers(3);
  EXPECT_EQ(LayoutBufferCount(layout), 61u + 2u * 3u);
}

TEST(PeerContextTest, ComesFromTheHello) {
  PeerContext context = PeerContextFrom(testing::MakePeerInfo("d", 6, 129));
  EXPECT_EQ(context.num_layers, 6u);
  EXPECT_EQ(context.num_pages, 129u);
  EXPECT_EQ(context.min_item_len, testing::kItemLen);
}

TEST(ValidationLimitsTest, AreAdjustable) {
  ValidationLimits limits;
  limits.max_pages_per_request = 2;
  Status status = Validate(testing::MakeTransferRequest(), {}, limits);
  EXPECT_THAT(status.message(), HasSubstr("dst_page_ids has 4 entries; the limit is 2"));
}

}  // namespace
}  // namespace kvt::control

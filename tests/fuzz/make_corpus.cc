// Writes the seed corpora under tests/fuzz/corpus/<target>/: valid messages built the way the
// senders build them, and near-valid ones a field away from a rule, so that each fuzzer starts
// deep inside its decoder. Run it after a wire format changes:
//   build-fuzz/tests/fuzz/fuzz_make_corpus tests/fuzz/corpus
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "backends/cuda_ipc/cuda_ipc_codec.h"
#include "backends/nccl/nccl_protocol.h"
#include "backends/ucx/ucx_staged_protocol.h"
#include "control/framing.h"
#include "control/protocol.h"
#include "fuzz_common.h"
#include "test_messages.h"

using namespace kvt;
namespace ct = kvt::control::testing;
namespace fs = std::filesystem;

namespace {

fs::path root;

void Write(const std::string& target, const std::string& name, const std::string& bytes) {
  const fs::path dir = root / target;
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary) << bytes;
}

std::string Bytes(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

v1::Envelope WithPeer(v1::Envelope hello, const std::string& backend, const std::string& address,
                      const std::string& key) {
  v1::PeerInfo* peer = hello.mutable_hello()->mutable_peer();
  for (v1::MemoryDescriptor& buffer : *peer->mutable_buffers()) {
    buffer.mutable_keys(0)->set_backend(backend);
    buffer.mutable_keys(0)->set_blob(key);
  }
  peer->mutable_endpoints(0)->set_backend(backend);
  peer->mutable_endpoints(0)->set_address(address);
  return hello;
}

std::vector<std::pair<std::string, v1::Envelope>> Messages() {
  std::vector<std::pair<std::string, v1::Envelope>> out;
  out.emplace_back("hello", ct::MakeHello());
  out.emplace_back("transfer_request", ct::MakeTransferRequest());
  v1::Envelope le32 = ct::MakeTransferRequest();
  control::SetDstPages(*le32.mutable_transfer_request(), std::vector<int32_t>{1, 2, 63, 64});
  out.emplace_back("transfer_request_le32", le32);
  v1::Envelope sliced = ct::MakeTransferRequest();
  v1::PageSlice* slice = sliced.mutable_transfer_request()->add_slices();
  slice->set_src_offset(0);
  slice->set_dst_offset(fuzz::kLocalItemLen / 2);
  slice->set_bytes(fuzz::kLocalItemLen / 2);
  out.emplace_back("transfer_request_slices", sliced);
  v1::Envelope dummy = ct::MakeTransferRequest();
  dummy.mutable_transfer_request()->set_dst_page_ids(0, 0);
  out.emplace_back("near_dummy_page", dummy);
  v1::Envelope past = ct::MakeTransferRequest();
  past.mutable_transfer_request()->set_dst_page_ids(3, 65);
  out.emplace_back("near_page_past_pool", past);
  v1::Envelope layers = ct::MakeTransferRequest();
  layers.mutable_transfer_request()->mutable_layers()->set_end(5);
  out.emplace_back("near_layer_past_pool", layers);
  out.emplace_back("register_agent", ct::MakeAgentRegistration());
  out.emplace_back("heartbeat", ct::MakeHeartbeat());
  v1::Envelope offer;
  offer.mutable_lane_offer()->set_name("/kvt-lane-0123456789abcdef0123456789abcdef");
  offer.mutable_lane_offer()->set_nonce(std::string(16, '\x5a'));
  offer.mutable_lane_offer()->set_ring_bytes(256u << 10);
  out.emplace_back("lane_offer", offer);
  v1::Envelope short_nonce = offer;
  short_nonce.mutable_lane_offer()->set_nonce("abc");
  out.emplace_back("near_lane_offer_short_nonce", short_nonce);
  v1::Envelope lane_reply;
  lane_reply.mutable_lane_reply()->set_reason("this endpoint does not poll");
  out.emplace_back("lane_reply", lane_reply);
  v1::Envelope lane_switch;
  lane_switch.mutable_lane_switch();
  out.emplace_back("lane_switch", lane_switch);
  v1::Envelope doorbell;
  doorbell.mutable_lane_doorbell();
  out.emplace_back("lane_doorbell", doorbell);
  v1::Envelope progress;
  progress.mutable_layer_progress()->set_room_id("room-1");
  progress.mutable_layer_progress()->set_layers_done(2);
  progress.mutable_layer_progress()->add_src_page_ids(5);
  out.emplace_back("layer_progress", progress);
  v1::Envelope done;
  done.mutable_transfer_done()->set_room_id("room-1");
  done.mutable_transfer_done()->set_status(v1::STATUS_CODE_OK);
  done.mutable_transfer_done()->mutable_checksum()->set_algorithm(v1::CHECKSUM_ALGORITHM_XXH3_64);
  out.emplace_back("transfer_done", done);
  out.emplace_back("error", control::MakeErrorEnvelope(v1::STATUS_CODE_INVALID_ARGUMENT,
                                                       "pages out of range", "room-1"));
  v1::Envelope abort;
  abort.mutable_abort()->set_room_id("room-1");
  out.emplace_back("abort", abort);
  v1::Envelope auth;
  auth.mutable_auth_response()->set_client_id("decode-0");
  auth.mutable_auth_response()->set_role(v1::ROLE_DECODE);
  auth.mutable_auth_response()->set_mac(std::string(32, '\x11'));
  out.emplace_back("auth_response", auth);
  v1::Envelope ack;
  ack.set_id(1);
  ack.mutable_hello_ack()->set_protocol_version(control::kProtocolVersion);
  *ack.mutable_hello_ack()->mutable_peer() = ct::MakePeerInfo("prefill-0");
  ack.mutable_hello_ack()->mutable_peer()->set_role(v1::ROLE_PREFILL);
  out.emplace_back("hello_ack", ack);
  return out;
}

std::vector<std::pair<std::string, v1::Envelope>> RegistryMessages() {
  std::vector<std::pair<std::string, v1::Envelope>> out;
  out.emplace_back("register_agent", ct::MakeAgentRegistration());
  v1::Envelope lookup;
  lookup.mutable_lookup_agents()->set_name("prefill-a");
  lookup.mutable_lookup_agents()->set_role(v1::ROLE_PREFILL);
  lookup.mutable_lookup_agents()->set_tp_rank(1);
  out.emplace_back("lookup_agents", lookup);
  v1::Envelope reply;
  *reply.mutable_lookup_agents_reply()->add_agents() =
      ct::MakeAgentRegistration().register_agent().agent();
  out.emplace_back("lookup_agents_reply", reply);
  v1::Envelope registered;
  registered.mutable_register_agent_reply()->set_status(v1::STATUS_CODE_OK);
  registered.mutable_register_agent_reply()->set_heartbeat_interval_ms(1000);
  out.emplace_back("register_agent_reply", registered);
  v1::Envelope no_dtype = ct::MakeAgentRegistration();
  no_dtype.mutable_register_agent()->mutable_agent()->mutable_layout()->set_dtype(
      v1::DTYPE_UNSPECIFIED);
  out.emplace_back("near_no_dtype", no_dtype);
  out.emplace_back("unregister_agent", ct::MakeAgentUnregistration());
  v1::Envelope unregister_no_address = ct::MakeAgentUnregistration();
  unregister_no_address.mutable_unregister_agent()->mutable_agent()->set_control_address(
      "10.0.0.5");
  out.emplace_back("near_unregister_no_port", unregister_no_address);
  v1::Envelope unregistered;
  unregistered.mutable_register_agent_reply()->set_status(v1::STATUS_CODE_NOT_FOUND);
  unregistered.mutable_register_agent_reply()->set_message(
      "prefill 'prefill-a' rank 1 is not registered");
  out.emplace_back("unregister_agent_reply", unregistered);
  return out;
}

std::vector<std::pair<std::string, v1::Envelope>> RpcMessages() {
  std::vector<std::pair<std::string, v1::Envelope>> out;
  v1::Envelope by_address;
  by_address.mutable_submit_request()->set_room_id("room-1");
  by_address.mutable_submit_request()->set_num_tokens(64);
  by_address.mutable_submit_request()->set_prefill_address("[::1]:7001");
  out.emplace_back("submit_by_address", by_address);
  v1::Envelope by_name;
  by_name.mutable_submit_request()->set_room_id("room-2");
  by_name.mutable_submit_request()->set_num_tokens(16);
  by_name.mutable_submit_request()->set_prefill_name("prefill-a");
  by_name.mutable_submit_request()->set_deadline_ms(5000);
  out.emplace_back("submit_by_name", by_name);
  v1::Envelope abort;
  abort.mutable_abort_room()->set_room_id("room-1");
  abort.mutable_abort_room()->set_reason("driver gave up");
  out.emplace_back("abort_room", abort);
  v1::Envelope query;
  query.mutable_query_requests()->add_room_ids("room-1");
  query.mutable_query_requests()->add_room_ids("room-2");
  out.emplace_back("query_requests", query);
  v1::Envelope stats;
  stats.mutable_query_stats();
  out.emplace_back("query_stats", stats);
  return out;
}

void WriteEnvelopes(const std::string& target,
                    const std::vector<std::pair<std::string, v1::Envelope>>& messages) {
  for (const auto& [name, envelope] : messages) Write(target, name, envelope.SerializeAsString());
}

void WriteFrames() {
  std::string stream;
  for (const auto& [name, envelope] : Messages()) {
    if (name.starts_with("near_")) continue;
    stream += control::EncodeFrame(envelope).value();
  }
  const std::string hello = control::EncodeFrame(ct::MakeHello()).value();
  Write("frame", "stream_whole", std::string(1, '\0') + stream);
  Write("frame", "stream_pieces_of_7", std::string(1, '\x07') + stream);
  Write("frame", "hello_byte_by_byte", std::string(1, '\x01') + hello);
  Write("frame", "hello_over_small_limit", std::string(1, '\x80') + hello);
  Write("frame", "near_zero_length", std::string(1, '\0') + std::string(4, '\0'));
  Write("frame", "near_huge_length", std::string(1, '\0') + "\xff\xff\xff\xff" + "abc");
  Write("frame", "near_truncated", std::string(1, '\x03') + hello.substr(0, hello.size() / 2));
}

void WriteHellos() {
  using namespace kvt::transfer;
  Write("hello", "ucx", ct::MakeHello().SerializeAsString());
  Write("hello", "ucx_trailer",
        WithPeer(ct::MakeHello(), "ucx",
                 ucx_staging::AppendTrailer(
                     std::string(120, '\x02'),
                     {.instance = 7, .staged = true, .slots = 4, .slot_bytes = 1 << 20}),
                 std::string(64, '\x5a'))
            .SerializeAsString());
  cuda_ipc::ProcessAddress ipc{.boot_id = "boot-a",
                               .pid = 42,
                               .process = 0x1234,
                               .device = 0,
                               .pci_bus_id = "0000:01:00.0",
                               .instance = 9};
  cuda_ipc::RegionKey key;
  key.allocation = 0;
  key.allocations = 1;
  key.offset = 0;
  key.allocation_bytes = uint64_t{65} * ct::kItemLen;
  Write("hello", "cuda_ipc",
        WithPeer(ct::MakeHello(), "cuda_ipc", cuda_ipc::EncodeAddress(ipc),
                 cuda_ipc::EncodeRegionKey(key))
            .SerializeAsString());
  nccl::ProcessAddress nccl_address{
      .boot_id = "boot-b", .pid = 43, .device = 1, .pci_bus_id = "0000:02:00.0"};
  Write("hello", "nccl",
        WithPeer(ct::MakeHello(), "nccl", nccl::EncodeAddress(nccl_address), "n")
            .SerializeAsString());
  Write("hello", "loopback",
        WithPeer(ct::MakeHello(), "loopback", "loopback", "k").SerializeAsString());
  v1::Envelope ack;
  ack.mutable_hello_ack()->set_protocol_version(control::kProtocolVersion);
  *ack.mutable_hello_ack()->mutable_peer() = ct::MakePeerInfo("prefill-0");
  Write("hello", "hello_ack", ack.SerializeAsString());
}

// The seeds of the UCX worker address and packed key decoders (ucx_worker_address_*,
// ucx_packed_key) are not written here: they are what UCX 1.13.1's ucp_worker_get_address and
// ucp_rkey_pack produced (tcp, shm, and v2 with debug information), and this program links no UCX.
void WriteBackendCodecs() {
  using namespace kvt::transfer;
  auto write = [](int decoder, const std::string& name, const std::string& bytes) {
    Write("backend_codec", name, std::string(1, static_cast<char>(decoder)) + bytes);
  };
  cuda_ipc::ProcessAddress ipc{.boot_id = "boot-a",
                               .pid = 42,
                               .process = 0x1234,
                               .device = 0,
                               .pci_bus_id = "0000:01:00.0",
                               .instance = 9};
  write(0, "cuda_ipc_address", cuda_ipc::EncodeAddress(ipc));
  cuda_ipc::RegionKey key;
  key.allocation = 1;
  key.allocations = 3;
  key.offset = 4096;
  key.allocation_bytes = 1 << 20;
  std::string length(8, '\0');
  length[1] = 0x10;  // 4096, little-endian
  write(1, "cuda_ipc_region_key", length + cuda_ipc::EncodeRegionKey(key));
  write(2, "nccl_address",
        nccl::EncodeAddress(
            {.boot_id = "boot-b", .pid = 43, .device = 1, .pci_bus_id = "0000:02:00.0"}));
  nccl::PairToken token;
  token.slot_bytes = nccl::kMinSlotBytes;
  token.idle_tick_ms = 50;
  token.nonce = 0xabc;
  write(3, "nccl_token", nccl::EncodeToken(token));
  // nccl chunk headers for fuzz_backend_codec's receiving pool (K/V of layers 0..3, latent
  // layers 4 and 5 with 256-byte pages): one unit of layer 0's K and V, and whole pages of the
  // latent layers [4, 6).
  auto write_header = [&](const char* name, int32_t begin, int32_t end,
                          std::vector<nccl::UnitSpan> units, uint64_t payload_bytes) {
    nccl::ChunkHeader header;
    header.kind = nccl::HeaderKind::kChunk;
    header.step = 1;
    header.write_id = 5;
    header.chunk_count = 1;
    header.num_layers = 6;
    header.layer_begin = begin;
    header.layer_end = end;
    header.num_buffers = 2;
    header.whole_pages = units.empty();
    header.units = std::move(units);
    header.dst_pages = {1, 2};
    header.payload_bytes = payload_bytes;
    std::vector<uint8_t> header_bytes(nccl::kHeaderBytes);
    nccl::EncodeChunkHeader(header, header_bytes);
    // The header's zero tail is left out: libFuzzer keeps inputs short, the decoder sees a short
    // buffer, and the mutator has to grow it back.
    write(4, name, Bytes(header_bytes).substr(0, 256));
  };
  write_header("nccl_chunk_header", 0, 1, {{.offset = 0, .bytes = 256}}, 256 * 2 * 2);
  write_header("nccl_chunk_header_whole_latent", 4, 6, {}, (256 + 256) * 2);
  std::vector<uint8_t> ack_bytes(nccl::kAckBytes);
  nccl::EncodeAck({.step = 1, .code = StatusCode::kDataLoss, .write_id = 5, .message = "bad"},
                  ack_bytes);
  write(5, "nccl_ack", Bytes(ack_bytes));

  // Staged chunks for fuzz_backend_codec's receiving pool (K/V of layers 0..3, latent layers 4
  // and 5 with 256-byte pages): one unit of layer 1's K and V, and whole pages of the latent
  // layers [4, 6).
  const PageUnit unit{.src_offset = 0, .dst_offset = 64, .bytes = 64};
  const std::vector<int32_t> pages = {3, 64};
  auto write_chunk = [&](const char* name, std::span<const PageUnit> units, int32_t begin,
                         int32_t end, std::vector<uint64_t> page_bytes) {
    const ucx_staging::PayloadLayout layout = ucx_staging::LayoutPayload(2, units, page_bytes);
    std::vector<uint8_t> payload(layout.payload_bytes);
    ucx_staging::ChunkHeader chunk{.sender = 1,
                                   .link = 2,
                                   .write = 3,
                                   .chunk = 0,
                                   .chunk_count = 1,
                                   .num_layers = 6,
                                   .layer_begin = begin,
                                   .layer_end = end,
                                   .num_pages = 2,
                                   .num_units = static_cast<uint32_t>(units.size()),
                                   .num_buffers = static_cast<uint32_t>(page_bytes.size()),
                                   .payload_bytes = layout.payload_bytes};
    if (ucx_staging::EncodeChunkPrefix(chunk, pages, units, page_bytes, payload).ok()) {
      write(6, name, Bytes(payload));
    }
  };
  const uint64_t item = 16 * 8 * 128 * 2;  // fuzz::kLocalItemLen (fuzz_common.h)
  write_chunk("ucx_chunk", {&unit, 1}, 1, 2, {item, item});
  write_chunk("ucx_chunk_whole_latent", {}, 4, 6, {256, 256});
  write(7, "ucx_hello",
        Bytes(ucx_staging::Encode(ucx_staging::Hello{.sender = 1, .link = 2, .token = 9})));
  write(7, "ucx_hello_offer",
        Bytes(ucx_staging::Encode(ucx_staging::Hello{.sender = 1,
                                                     .link = 2,
                                                     .slots_base = uint64_t{1} << 40,
                                                     .slot_bytes = 1 << 20,
                                                     .slots = 8,
                                                     .key_bytes = 96,
                                                     .token = 9})));
  write(7, "ucx_slot_notice",
        Bytes(ucx_staging::Encode(ucx_staging::SlotNotice{
            .notice = {.sender = 1, .link = 2, .write = 3, .chunk = 1, .token = 9},
            .slot = 5,
            .payload_bytes = 4096})));
  write(7, "ucx_hello_ack",
        Bytes(ucx_staging::Encode(ucx_staging::HelloAck{.receiver = 1,
                                                        .link = 2,
                                                        .slots = 4,
                                                        .slot_bytes = 1 << 20,
                                                        .in_place = true,
                                                        .token = 9})));
  write(7, "ucx_chunk_ack",
        Bytes(ucx_staging::Encode(
            ucx_staging::ChunkAck{.link = 2, .write = 3, .chunk = 1, .token = 9})));
  write(7, "ucx_bye",
        Bytes(ucx_staging::Encode(ucx_staging::Bye{.sender = 1, .link = 2, .token = 9})));
  {
    // A run message: the data length (8 bytes), then the AM header of two segments.
    const std::vector<ucx_staging::RunSegment> segments = {{0, 64, 1000}, {1, 4096, 24}};
    const uint64_t data = 1024;
    std::string record(reinterpret_cast<const char*>(&data), sizeof(data));
    record +=
        Bytes(ucx_staging::EncodeRuns(
                  {.sender = 1, .link = 2, .write = 3, .num_segments = 2, .token = 9}, segments)
                  .value());
    write(7, "ucx_runs", record);
  }
  write(8, "ucx_address_runs",
        ucx_staging::AppendTrailer(std::string(40, '\x03'), {.instance = 7},
                                   std::string(30, '\x04')));
  write(8, "ucx_address_trailer",
        ucx_staging::AppendTrailer(
            std::string(40, '\x03'),
            {.instance = 7, .staged = true, .slots = 4, .slot_bytes = 1 << 20}));
  write(8, "ucx_address_bare", std::string(40, '\x03'));
  write(9, "text_record", "fuzz/1 a=1 b=two c=");
  write(9, "text_record_other_version", "fuzz/2 a=1");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus folder>\n", argv[0]);
    return 2;
  }
  root = argv[1];
  WriteEnvelopes("message", Messages());
  WriteEnvelopes("registry", RegistryMessages());
  WriteEnvelopes("agent_rpc", RpcMessages());
  WriteFrames();
  WriteHellos();
  WriteBackendCodecs();
  return 0;
}

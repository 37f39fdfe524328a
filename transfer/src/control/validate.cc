#include "control/validate.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "backends/common/page_bounds.h"
#include "control/auth.h"
#include "control/lane.h"
#include "control/protocol.h"

namespace kvt::control {
namespace {

constexpr size_t kMaxBackendTokenBytes = 4096;      // HelloAck.backend_token
constexpr size_t kMaxKvGroups = 16;                 // Layout.groups
constexpr size_t kMaxAuxBuffers = 64;               // Layout.aux_slot_bytes
constexpr uint64_t kMaxAuxSlotBytes = 16ull << 20;  // each Layout.aux_slot_bytes entry

// Strings from the peer go into our error messages and logs: show a bounded, escaped prefix.
std::string Shown(std::string_view value) {
  constexpr size_t kShow = 64;
  std::string out = "\"";
  for (size_t i = 0; i < value.size() && i < kShow; ++i) {
    const auto c = static_cast<unsigned char>(value[i]);
    if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
      out += static_cast<char>(c);
    } else {
      out += fmt::format("\\x{:02x}", c);
    }
  }
  if (value.size() > kShow) out += "...";
  out += '"';
  return out;
}

Status Invalid(std::string_view field, std::string_view value, std::string_view why) {
  return InvalidArgument(fmt::format("{} = {}: {}", field, value, why));
}

// An identifier (name, room id, backend name): printable ASCII so that it is safe in logs and
// file names, bounded in size.
Status CheckId(std::string_view field, std::string_view value, size_t max_bytes, bool required) {
  if (value.empty()) {
    if (!required) return OkStatus();
    return InvalidArgument(fmt::format("{} is empty; it is required", field));
  }
  if (value.size() > max_bytes) {
    return InvalidArgument(
        fmt::format("{} is {} bytes long; the limit is {}", field, value.size(), max_bytes));
  }
  for (size_t i = 0; i < value.size(); ++i) {
    const auto c = static_cast<unsigned char>(value[i]);
    if (c < 0x20 || c >= 0x7f) {
      return Invalid(field, Shown(value),
                     fmt::format("byte 0x{:02x} at offset {}; ids must be printable ASCII", c, i));
    }
  }
  return OkStatus();
}

Status CheckSize(std::string_view field, size_t size, size_t max_bytes) {
  if (size <= max_bytes) return OkStatus();
  return InvalidArgument(
      fmt::format("{} is {} bytes long; the limit is {}", field, size, max_bytes));
}

Status CheckCount(std::string_view field, size_t count, size_t max_count) {
  if (count <= max_count) return OkStatus();
  return InvalidArgument(
      fmt::format("{} has {} entries; the limit is {}", field, count, max_count));
}

Status CheckRange(std::string_view field, uint64_t value, uint64_t min, uint64_t max) {
  if (value >= min && value <= max) return OkStatus();
  return Invalid(field, std::to_string(value), fmt::format("must be in {}..{}", min, max));
}

template <typename IsValid>
Status CheckEnum(std::string_view field, int value, IsValid is_valid, bool allow_unspecified) {
  if (!is_valid(value)) {
    return Invalid(field, std::to_string(value), "not a known value (a newer peer?)");
  }
  if (value == 0 && !allow_unspecified) {
    return Invalid(field, "UNSPECIFIED", "must be set");
  }
  return OkStatus();
}

// A little-endian int32 list in a bytes field, indexed like a repeated field.
struct Le32Pages {
  std::string_view bytes;
  int size() const { return static_cast<int>(bytes.size() / 4); }
  int32_t operator[](int i) const { return Le32At(bytes, static_cast<size_t>(i)); }
};

Status CheckFixedBlob(std::string_view field, std::string_view value, size_t want,
                      bool allow_empty) {
  if (value.size() == want || (allow_empty && value.empty())) return OkStatus();
  return InvalidArgument(fmt::format("{} is {} bytes; expected {}{}", field, value.size(), want,
                                     allow_empty ? " or none" : ""));
}

// Page ids of a pool whose page count may be known (0 = unknown). `pages` has size() and
// operator[] (a repeated int32 field, or Le32Pages).
template <typename Pages>
Status CheckPageIds(std::string_view field, const Pages& pages, uint64_t num_pages, bool required,
                    const ValidationLimits& limits) {
  if (pages.size() == 0 && required) {
    return InvalidArgument(fmt::format("{} is empty; a transfer needs at least one page", field));
  }
  KVT_RETURN_IF_ERROR(CheckCount(field, pages.size(), limits.max_pages_per_request));
  if (transfer::PagesInside(pages, 1,
                            num_pages != 0 ? num_pages : std::numeric_limits<uint64_t>::max())) {
    return OkStatus();
  }
  for (int i = 0; i < pages.size(); ++i) {
    const int32_t page = pages[i];
    if (page < 1) {
      return Invalid(
          fmt::format("{}[{}]", field, i), std::to_string(page),
          page == 0 ? "page 0 is the dummy page and is never transferred" : "page ids are >= 1");
    }
    if (num_pages != 0 && static_cast<uint64_t>(page) >= num_pages) {
      return Invalid(fmt::format("{}[{}]", field, i), std::to_string(page),
                     fmt::format("the pool has pages 1..{} (num_pages = {} with the dummy page)",
                                 num_pages - 1, num_pages));
    }
  }
  return OkStatus();
}

Status ValidateLayout(const v1::Layout& layout, std::string_view path,
                      const ValidationLimits& limits) {
  auto f = [&](std::string_view name) { return fmt::format("{}.{}", path, name); };
  KVT_RETURN_IF_ERROR(CheckRange(f("num_layers"), layout.num_layers(), 1, limits.max_layers));
  KVT_RETURN_IF_ERROR(CheckRange(f("page_size"), layout.page_size(), 1, limits.max_page_size));
  KVT_RETURN_IF_ERROR(CheckEnum(f("dtype"), layout.dtype(), v1::DType_IsValid, false));
  KVT_RETURN_IF_ERROR(CheckRange(f("head_num"), layout.head_num(), 1, limits.max_heads));
  KVT_RETURN_IF_ERROR(CheckRange(f("head_dim"), layout.head_dim(), 1, limits.max_head_dim));
  KVT_RETURN_IF_ERROR(CheckRange(f("tp_size"), layout.tp_size(), 1, limits.max_tp_size));
  if (layout.tp_rank() >= layout.tp_size()) {
    return Invalid(f("tp_rank"), std::to_string(layout.tp_rank()),
                   fmt::format("must be < tp_size = {}", layout.tp_size()));
  }
  if (layout.num_pages() < 2) {
    return Invalid(f("num_pages"), std::to_string(layout.num_pages()),
                   "a pool has the dummy page 0 and at least one real page");
  }
  if (layout.num_tokens() != 0) {
    const uint64_t pages_for_tokens =
        layout.num_tokens() / layout.page_size() + (layout.num_tokens() % layout.page_size() != 0);
    if (pages_for_tokens != layout.num_pages() - 1) {
      return Invalid(
          f("num_tokens"), std::to_string(layout.num_tokens()),
          fmt::format("{} tokens make {} pages of {}, but num_pages - 1 = {}", layout.num_tokens(),
                      pages_for_tokens, layout.page_size(), layout.num_pages() - 1));
    }
  }
  KVT_RETURN_IF_ERROR(
      CheckRange(f("total_kv_heads"), layout.total_kv_heads(), 0, limits.max_heads));

  KVT_RETURN_IF_ERROR(CheckCount(f("groups"), layout.groups_size(), kMaxKvGroups));
  uint64_t group_layers = 0;
  for (int i = 0; i < layout.groups_size(); ++i) {
    const v1::KvGroup& group = layout.groups(i);
    auto g = [&](std::string_view name) { return fmt::format("{}.groups[{}].{}", path, i, name); };
    KVT_RETURN_IF_ERROR(CheckEnum(g("shape"), group.shape(), v1::KvShape_IsValid, false));
    KVT_RETURN_IF_ERROR(CheckRange(g("num_layers"), group.num_layers(), 1, limits.max_layers));
    KVT_RETURN_IF_ERROR(CheckRange(g("head_num"), group.head_num(), 1, limits.max_heads));
    KVT_RETURN_IF_ERROR(CheckRange(g("head_dim"), group.head_dim(), 1, limits.max_head_dim));
    KVT_RETURN_IF_ERROR(CheckEnum(g("dtype"), group.dtype(), v1::DType_IsValid, false));
    if (group.page_bytes() == 0) return Invalid(g("page_bytes"), "0", "must be > 0");
    group_layers += group.num_layers();
  }
  if (layout.groups_size() > 0 && group_layers != layout.num_layers()) {
    return Invalid(f("num_layers"), std::to_string(layout.num_layers()),
                   fmt::format("the {} groups hold {} layers in all; num_layers must be their sum",
                               layout.groups_size(), group_layers));
  }

  KVT_RETURN_IF_ERROR(
      CheckCount(f("aux_slot_bytes"), layout.aux_slot_bytes_size(), kMaxAuxBuffers));
  for (int i = 0; i < layout.aux_slot_bytes_size(); ++i) {
    KVT_RETURN_IF_ERROR(CheckRange(fmt::format("{}.aux_slot_bytes[{}]", path, i),
                                   layout.aux_slot_bytes(i), 1, kMaxAuxSlotBytes));
  }
  if (layout.aux_slot_bytes_size() == 0 && layout.aux_slots() != 0) {
    return Invalid(f("aux_slots"), std::to_string(layout.aux_slots()),
                   "must be 0 when aux_slot_bytes is empty (a layout without aux buffers has no "
                   "aux slots)");
  }
  if (layout.aux_slot_bytes_size() != 0 && layout.aux_slots() == 0) {
    return Invalid(f("aux_slots"), "0",
                   fmt::format("must be > 0: aux_slot_bytes lists {} aux buffers, and each holds "
                               "aux_slots slots",
                               layout.aux_slot_bytes_size()));
  }
  return OkStatus();
}

Status ValidateAgentInfo(const v1::AgentInfo& agent, std::string_view path,
                         const ValidationLimits& limits) {
  auto f = [&](std::string_view name) { return fmt::format("{}.{}", path, name); };
  KVT_RETURN_IF_ERROR(CheckId(f("name"), agent.name(), limits.max_name_bytes, true));
  KVT_RETURN_IF_ERROR(CheckEnum(f("role"), agent.role(), v1::Role_IsValid, false));
  KVT_RETURN_IF_ERROR(CheckRange(f("tp_size"), agent.tp_size(), 1, limits.max_tp_size));
  if (agent.tp_rank() >= agent.tp_size()) {
    return Invalid(f("tp_rank"), std::to_string(agent.tp_rank()),
                   fmt::format("must be < tp_size = {}", agent.tp_size()));
  }
  KVT_RETURN_IF_ERROR(
      CheckId(f("control_address"), agent.control_address(), limits.max_address_bytes, true));
  const size_t colon = agent.control_address().rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == agent.control_address().size()) {
    return Invalid(f("control_address"), Shown(agent.control_address()), "expected \"host:port\"");
  }
  KVT_RETURN_IF_ERROR(CheckId(f("host_id"), agent.host_id(), limits.max_name_bytes, false));
  if (agent.has_layout()) {
    KVT_RETURN_IF_ERROR(ValidateLayout(agent.layout(), f("layout"), limits));
    if (agent.layout().tp_rank() != agent.tp_rank() ||
        agent.layout().tp_size() != agent.tp_size()) {
      return Invalid(f("layout.tp_rank/tp_size"),
                     fmt::format("{}/{}", agent.layout().tp_rank(), agent.layout().tp_size()),
                     fmt::format("differs from the agent's tp_rank/tp_size {}/{}", agent.tp_rank(),
                                 agent.tp_size()));
    }
  }
  return OkStatus();
}

Status ValidatePeerInfo(const v1::PeerInfo& peer, std::string_view path,
                        const ValidationLimits& limits) {
  auto f = [&](std::string_view name) { return fmt::format("{}.{}", path, name); };
  KVT_RETURN_IF_ERROR(CheckId(f("name"), peer.name(), limits.max_name_bytes, true));
  KVT_RETURN_IF_ERROR(CheckEnum(f("role"), peer.role(), v1::Role_IsValid, false));
  if (!peer.has_layout()) return InvalidArgument(fmt::format("{} is missing", f("layout")));
  KVT_RETURN_IF_ERROR(ValidateLayout(peer.layout(), f("layout"), limits));
  KVT_RETURN_IF_ERROR(CheckId(f("host_id"), peer.host_id(), limits.max_name_bytes, false));
  constexpr uint32_t kMaxFenceMs = 86'400'000;  // a day: anything longer is no promise at all
  if (peer.fence_ms() > kMaxFenceMs) {
    return Invalid(f("fence_ms"), std::to_string(peer.fence_ms()),
                   fmt::format("must be <= {} (a day)", kMaxFenceMs));
  }

  const uint64_t max_buffers = LayoutBufferCount(peer.layout());
  const uint64_t num_pages = peer.layout().num_pages();
  KVT_RETURN_IF_ERROR(CheckCount(f("buffers"), peer.buffers_size(), max_buffers));
  std::vector<bool> seen(max_buffers, false);
  for (int i = 0; i < peer.buffers_size(); ++i) {
    const v1::MemoryDescriptor& buffer = peer.buffers(i);
    const std::string b = fmt::format("{}.buffers[{}]", path, i);
    if (buffer.buffer_index() >= max_buffers) {
      return Invalid(b + ".buffer_index", std::to_string(buffer.buffer_index()),
                     peer.layout().groups_size() == 0
                         ? fmt::format("must be < 2 * num_layers = {}", max_buffers)
                         : fmt::format("must be < the layout's buffer count {} (2 per "
                                       "KEY_VALUE layer, 1 per LATENT layer, over its groups)",
                                       max_buffers));
    }
    if (seen[buffer.buffer_index()]) {
      return Invalid(b + ".buffer_index", std::to_string(buffer.buffer_index()), "appears twice");
    }
    seen[buffer.buffer_index()] = true;
    if (buffer.item_len() == 0) return Invalid(b + ".item_len", "0", "must be > 0");
    // length >= num_pages * item_len, written so that it cannot overflow.
    if (buffer.item_len() > buffer.length() / num_pages) {
      return Invalid(b + ".length", std::to_string(buffer.length()),
                     fmt::format("too short for num_pages = {} items of item_len = {}", num_pages,
                                 buffer.item_len()));
    }
    if (buffer.base() > std::numeric_limits<uint64_t>::max() - buffer.length()) {
      return Invalid(b + ".base", fmt::format("0x{:x}", buffer.base()),
                     fmt::format("base + length ({}) wraps around", buffer.length()));
    }
    KVT_RETURN_IF_ERROR(CheckEnum(b + ".kind", buffer.kind(), v1::MemoryKind_IsValid, false));
    KVT_RETURN_IF_ERROR(CheckCount(b + ".keys", buffer.keys_size(), limits.max_backends));
    for (int k = 0; k < buffer.keys_size(); ++k) {
      const std::string key = fmt::format("{}.keys[{}]", b, k);
      KVT_RETURN_IF_ERROR(
          CheckId(key + ".backend", buffer.keys(k).backend(), limits.max_backend_name_bytes, true));
      KVT_RETURN_IF_ERROR(
          CheckSize(key + ".blob", buffer.keys(k).blob().size(), limits.max_blob_bytes));
    }
  }
  KVT_RETURN_IF_ERROR(CheckCount(f("endpoints"), peer.endpoints_size(), limits.max_backends));
  for (int i = 0; i < peer.endpoints_size(); ++i) {
    const std::string e = fmt::format("{}.endpoints[{}]", path, i);
    KVT_RETURN_IF_ERROR(
        CheckId(e + ".backend", peer.endpoints(i).backend(), limits.max_backend_name_bytes, true));
    KVT_RETURN_IF_ERROR(
        CheckSize(e + ".address", peer.endpoints(i).address().size(), limits.max_blob_bytes));
  }
  return OkStatus();
}

Status ValidateTransferRequest(const v1::TransferRequest& request, const PeerContext& peer,
                               const ValidationLimits& limits) {
  KVT_RETURN_IF_ERROR(
      CheckId("transfer_request.room_id", request.room_id(), limits.max_room_id_bytes, true));
  KVT_RETURN_IF_ERROR(
      CheckEnum("transfer_request.mode", request.mode(), v1::TransferMode_IsValid, false));
  // The destination pages are in the requester's pool, which it described in its Hello.
  if (request.dst_page_ids_le32().empty()) {
    if (request.dst_page_ids_size() == 0) {
      return InvalidArgument(
          "transfer_request has no pages: dst_page_ids_le32 and dst_page_ids are both empty; a "
          "transfer needs at least one page");
    }
    KVT_RETURN_IF_ERROR(CheckPageIds("transfer_request.dst_page_ids", request.dst_page_ids(),
                                     peer.num_pages, true, limits));
  } else {
    if (request.dst_page_ids_size() != 0) {
      return InvalidArgument(fmt::format(
          "transfer_request has both dst_page_ids ({} entries) and dst_page_ids_le32 ({} bytes); "
          "send the page list in one of them",
          request.dst_page_ids_size(), request.dst_page_ids_le32().size()));
    }
    if (request.dst_page_ids_le32().size() % 4 != 0) {
      return InvalidArgument(fmt::format(
          "transfer_request.dst_page_ids_le32 is {} bytes, not a whole number of 4-byte page ids",
          request.dst_page_ids_le32().size()));
    }
    KVT_RETURN_IF_ERROR(CheckPageIds("transfer_request.dst_page_ids_le32",
                                     Le32Pages{request.dst_page_ids_le32()}, peer.num_pages, true,
                                     limits));
  }
  if (request.has_layers()) {
    const uint32_t begin = request.layers().begin();
    const uint32_t end = request.layers().end();
    const uint32_t num_layers = peer.num_layers != 0 ? peer.num_layers : limits.max_layers;
    if (begin >= end || end > num_layers) {
      return Invalid(
          "transfer_request.layers", fmt::format("[{}, {})", begin, end),
          fmt::format("need begin < end <= {}{}", num_layers,
                      peer.num_layers != 0 ? " (the pool's layer count)" : " (the layer limit)"));
    }
  }
  KVT_RETURN_IF_ERROR(
      CheckRange("transfer_request.deadline_ms", request.deadline_ms(), 1, limits.max_deadline_ms));
  KVT_RETURN_IF_ERROR(
      CheckCount("transfer_request.slices", request.slices_size(), limits.max_slices));
  for (int i = 0; i < request.slices_size(); ++i) {
    const v1::PageSlice& slice = request.slices(i);
    const std::string s = fmt::format("transfer_request.slices[{}]", i);
    if (slice.bytes() == 0) return Invalid(s + ".bytes", "0", "must be > 0");
    constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
    if (slice.src_offset() > kMax - slice.bytes() || slice.dst_offset() > kMax - slice.bytes()) {
      return Invalid(s,
                     fmt::format("{{src {}, dst {}, bytes {}}}", slice.src_offset(),
                                 slice.dst_offset(), slice.bytes()),
                     "offset + bytes overflows");
    }
    if (peer.min_item_len != 0 && slice.dst_offset() + slice.bytes() > peer.min_item_len) {
      return Invalid(s,
                     fmt::format("{{dst_offset {}, bytes {}}}", slice.dst_offset(), slice.bytes()),
                     fmt::format("ends past the destination item ({} bytes)", peer.min_item_len));
    }
  }
  KVT_RETURN_IF_ERROR(
      CheckId("transfer_request.backend", request.backend(), limits.max_backend_name_bytes, false));
  return OkStatus();
}

}  // namespace

Status Validate(const v1::Envelope& envelope, const PeerContext& peer,
                const ValidationLimits& limits) {
  switch (envelope.body_case()) {
    case v1::Envelope::kAuthChallenge: {
      const v1::AuthChallenge& m = envelope.auth_challenge();
      KVT_RETURN_IF_ERROR(
          CheckFixedBlob("auth_challenge.nonce", m.nonce(), kAuthNonceBytes, !m.auth_required()));
      if (!m.auth_required() && !m.nonce().empty()) {
        return InvalidArgument("auth_challenge.nonce is set but auth_required is false");
      }
      return CheckId("auth_challenge.server_id", m.server_id(), limits.max_name_bytes, false);
    }
    case v1::Envelope::kAuthResponse: {
      const v1::AuthResponse& m = envelope.auth_response();
      KVT_RETURN_IF_ERROR(
          CheckId("auth_response.client_id", m.client_id(), limits.max_name_bytes, true));
      KVT_RETURN_IF_ERROR(CheckEnum("auth_response.role", m.role(), v1::Role_IsValid, false));
      KVT_RETURN_IF_ERROR(CheckFixedBlob("auth_response.mac", m.mac(), kAuthMacBytes, false));
      return CheckFixedBlob("auth_response.client_nonce", m.client_nonce(), kAuthNonceBytes, true);
    }
    case v1::Envelope::kAuthResult:
      return CheckFixedBlob("auth_result.server_mac", envelope.auth_result().server_mac(),
                            kAuthMacBytes, true);
    case v1::Envelope::kRegisterAgent:
      if (!envelope.register_agent().has_agent()) {
        return InvalidArgument("register_agent.agent is missing");
      }
      return ValidateAgentInfo(envelope.register_agent().agent(), "register_agent.agent", limits);
    case v1::Envelope::kUnregisterAgent:
      if (!envelope.unregister_agent().has_agent()) {
        return InvalidArgument(
            "unregister_agent.agent is missing; send the entry as it was registered");
      }
      return ValidateAgentInfo(envelope.unregister_agent().agent(), "unregister_agent.agent",
                               limits);
    case v1::Envelope::kRegisterAgentReply: {
      const v1::RegisterAgentReply& m = envelope.register_agent_reply();
      KVT_RETURN_IF_ERROR(
          CheckEnum("register_agent_reply.status", m.status(), v1::StatusCode_IsValid, false));
      return CheckSize("register_agent_reply.message", m.message().size(),
                       limits.max_message_bytes);
    }
    case v1::Envelope::kLookupAgents: {
      const v1::LookupAgents& m = envelope.lookup_agents();
      KVT_RETURN_IF_ERROR(CheckId("lookup_agents.name", m.name(), limits.max_name_bytes, false));
      KVT_RETURN_IF_ERROR(CheckEnum("lookup_agents.role", m.role(), v1::Role_IsValid, true));
      if (m.has_tp_rank()) {
        KVT_RETURN_IF_ERROR(
            CheckRange("lookup_agents.tp_rank", m.tp_rank(), 0, limits.max_tp_size - 1));
      }
      return OkStatus();
    }
    case v1::Envelope::kLookupAgentsReply: {
      const v1::LookupAgentsReply& m = envelope.lookup_agents_reply();
      KVT_RETURN_IF_ERROR(
          CheckCount("lookup_agents_reply.agents", m.agents_size(), limits.max_agents_per_reply));
      for (int i = 0; i < m.agents_size(); ++i) {
        KVT_RETURN_IF_ERROR(ValidateAgentInfo(
            m.agents(i), fmt::format("lookup_agents_reply.agents[{}]", i), limits));
      }
      return OkStatus();
    }
    case v1::Envelope::kHello:
    case v1::Envelope::kHelloAck: {
      const bool is_hello = envelope.has_hello();
      const std::string_view name = is_hello ? "hello" : "hello_ack";
      const uint32_t version =
          is_hello ? envelope.hello().protocol_version() : envelope.hello_ack().protocol_version();
      const bool has_peer =
          is_hello ? envelope.hello().has_peer() : envelope.hello_ack().has_peer();
      if (version == 0)
        return Invalid(fmt::format("{}.protocol_version", name), "0", "must be set");
      if (!has_peer) return InvalidArgument(fmt::format("{}.peer is missing", name));
      if (!is_hello && envelope.hello_ack().backend_token().size() > kMaxBackendTokenBytes) {
        return Invalid("hello_ack.backend_token",
                       std::to_string(envelope.hello_ack().backend_token().size()) + " bytes",
                       "must be at most " + std::to_string(kMaxBackendTokenBytes) + " bytes");
      }
      return ValidatePeerInfo(is_hello ? envelope.hello().peer() : envelope.hello_ack().peer(),
                              fmt::format("{}.peer", name), limits);
    }
    case v1::Envelope::kTransferRequest:
      return ValidateTransferRequest(envelope.transfer_request(), peer, limits);
    case v1::Envelope::kLayerProgress: {
      const v1::LayerProgress& m = envelope.layer_progress();
      KVT_RETURN_IF_ERROR(
          CheckId("layer_progress.room_id", m.room_id(), limits.max_room_id_bytes, true));
      const uint32_t num_layers = peer.num_layers != 0 ? peer.num_layers : limits.max_layers;
      KVT_RETURN_IF_ERROR(CheckRange("layer_progress.layers_done", m.layers_done(), 0, num_layers));
      // Source pages (pull mode) are in the sender's pool, described by its Hello / HelloAck.
      return CheckPageIds("layer_progress.src_page_ids", m.src_page_ids(), peer.num_pages, false,
                          limits);
    }
    case v1::Envelope::kTransferDone: {
      const v1::TransferDone& m = envelope.transfer_done();
      KVT_RETURN_IF_ERROR(
          CheckId("transfer_done.room_id", m.room_id(), limits.max_room_id_bytes, true));
      KVT_RETURN_IF_ERROR(
          CheckEnum("transfer_done.status", m.status(), v1::StatusCode_IsValid, false));
      KVT_RETURN_IF_ERROR(
          CheckSize("transfer_done.message", m.message().size(), limits.max_message_bytes));
      if (m.has_checksum()) {
        KVT_RETURN_IF_ERROR(CheckEnum("transfer_done.checksum.algorithm", m.checksum().algorithm(),
                                      v1::ChecksumAlgorithm_IsValid, false));
      }
      return OkStatus();
    }
    case v1::Envelope::kAbort: {
      const v1::Abort& m = envelope.abort();
      KVT_RETURN_IF_ERROR(CheckId("abort.room_id", m.room_id(), limits.max_room_id_bytes, true));
      KVT_RETURN_IF_ERROR(CheckEnum("abort.code", m.code(), v1::StatusCode_IsValid, true));
      return CheckSize("abort.reason", m.reason().size(), limits.max_message_bytes);
    }
    case v1::Envelope::kAbortAck:
      return CheckId("abort_ack.room_id", envelope.abort_ack().room_id(), limits.max_room_id_bytes,
                     true);
    case v1::Envelope::kGoodbye:
      return CheckSize("goodbye.reason", envelope.goodbye().reason().size(),
                       limits.max_message_bytes);
    case v1::Envelope::kHeartbeat:
    case v1::Envelope::kHeartbeatAck:
    case v1::Envelope::kLaneSwitch:
    case v1::Envelope::kLaneDoorbell:
      return OkStatus();
    case v1::Envelope::kLaneOffer: {
      // Lane::Open checks the name's form and the ring size, naming them.
      const v1::LaneOffer& m = envelope.lane_offer();
      KVT_RETURN_IF_ERROR(CheckSize("lane_offer.name", m.name().size(), 64));
      if (m.nonce().size() != internal::kLaneNonceBytes) {
        return Invalid("lane_offer.nonce", std::to_string(m.nonce().size()) + " bytes",
                       fmt::format("must be {} bytes", internal::kLaneNonceBytes));
      }
      return OkStatus();
    }
    case v1::Envelope::kLaneReply:
      return CheckSize("lane_reply.reason", envelope.lane_reply().reason().size(),
                       limits.max_message_bytes);
    case v1::Envelope::kError: {
      const v1::Error& m = envelope.error();
      KVT_RETURN_IF_ERROR(CheckEnum("error.code", m.code(), v1::StatusCode_IsValid, false));
      if (m.code() == v1::STATUS_CODE_OK) return Invalid("error.code", "OK", "an error is not OK");
      KVT_RETURN_IF_ERROR(CheckSize("error.message", m.message().size(), limits.max_message_bytes));
      return CheckId("error.room_id", m.room_id(), limits.max_room_id_bytes, false);
    }
    case v1::Envelope::kSubmitRequest: {
      const v1::SubmitRequest& m = envelope.submit_request();
      KVT_RETURN_IF_ERROR(
          CheckId("submit_request.room_id", m.room_id(), limits.max_room_id_bytes, true));
      KVT_RETURN_IF_ERROR(CheckRange("submit_request.num_tokens", m.num_tokens(), 1, 1u << 24));
      KVT_RETURN_IF_ERROR(CheckId("submit_request.prefill_address", m.prefill_address(),
                                  limits.max_address_bytes, false));
      KVT_RETURN_IF_ERROR(
          CheckId("submit_request.prefill_name", m.prefill_name(), limits.max_name_bytes, false));
      return CheckRange("submit_request.deadline_ms", m.deadline_ms(), 0, limits.max_deadline_ms);
    }
    case v1::Envelope::kSubmitReply: {
      const v1::SubmitReply& m = envelope.submit_reply();
      KVT_RETURN_IF_ERROR(
          CheckEnum("submit_reply.status", m.status(), v1::StatusCode_IsValid, false));
      return CheckSize("submit_reply.message", m.message().size(), limits.max_message_bytes);
    }
    case v1::Envelope::kQueryRequests: {
      const v1::QueryRequests& m = envelope.query_requests();
      KVT_RETURN_IF_ERROR(CheckCount("query_requests.room_ids", m.room_ids_size(), 65536));
      for (int i = 0; i < m.room_ids_size(); ++i) {
        KVT_RETURN_IF_ERROR(CheckId(fmt::format("query_requests.room_ids[{}]", i), m.room_ids(i),
                                    limits.max_room_id_bytes, true));
      }
      return OkStatus();
    }
    case v1::Envelope::kQueryRequestsReply:
      return CheckCount("query_requests_reply.reports",
                        envelope.query_requests_reply().reports_size(), kMaxReportsPerReply);
    case v1::Envelope::kQueryStats:
    case v1::Envelope::kAgentStatsReply:
      return OkStatus();
    case v1::Envelope::kAbortRoom: {
      const v1::AbortRoom& m = envelope.abort_room();
      KVT_RETURN_IF_ERROR(
          CheckId("abort_room.room_id", m.room_id(), limits.max_room_id_bytes, true));
      return CheckSize("abort_room.reason", m.reason().size(), limits.max_message_bytes);
    }
    case v1::Envelope::BODY_NOT_SET:
      break;
  }
  return InvalidArgument(fmt::format(
      "envelope has no message body (or one this build does not know: a peer newer than "
      "protocol version {}?)",
      kProtocolVersion));
}

Status CheckProtocolVersion(uint32_t peer_version) {
  if (peer_version == kProtocolVersion) return OkStatus();
  return FailedPrecondition(fmt::format(
      "protocol version mismatch: peer speaks {}, this side speaks {}; run the same kvt "
      "release on both sides",
      peer_version, kProtocolVersion));
}

uint64_t LayoutBufferCount(const v1::Layout& layout) {
  if (layout.groups_size() == 0) return 2ull * layout.num_layers();
  uint64_t buffers = 0;
  for (const v1::KvGroup& group : layout.groups()) {
    buffers += (group.shape() == v1::KV_SHAPE_LATENT ? 1ull : 2ull) * group.num_layers();
  }
  return buffers;
}

PeerContext PeerContextFrom(const v1::PeerInfo& peer) {
  PeerContext context;
  context.num_layers = peer.layout().num_layers();
  context.num_pages = peer.layout().num_pages();
  for (const v1::MemoryDescriptor& buffer : peer.buffers()) {
    if (context.min_item_len == 0 || buffer.item_len() < context.min_item_len) {
      context.min_item_len = buffer.item_len();
    }
  }
  return context;
}

}  // namespace kvt::control

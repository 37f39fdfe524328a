#include "kvt/transfer/registry.h"

#include <arpa/inet.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <stop_token>
#include <system_error>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>

#include "control/control_client.h"
#include "control/control_server.h"
#include "control/protocol.h"
#include "engine/layout_codec.h"
#include "kvt/common/log.h"

namespace kvt::transfer {
namespace {

using Clock = std::chrono::steady_clock;
using Key = std::tuple<std::string, int, uint32_t>;  // name, role, tp_rank

v1::Role ToProto(AgentRole role) {
  switch (role) {
    case AgentRole::kAny:
      return v1::ROLE_UNSPECIFIED;
    case AgentRole::kPrefill:
      return v1::ROLE_PREFILL;
    case AgentRole::kDecode:
      return v1::ROLE_DECODE;
    case AgentRole::kTool:
      return v1::ROLE_TOOL;
  }
  return v1::ROLE_UNSPECIFIED;
}

// ROLE_BOOTSTRAP never registers and is no role a user asks for: it reads as kAny.
AgentRole FromProto(v1::Role role) {
  switch (role) {
    case v1::ROLE_PREFILL:
      return AgentRole::kPrefill;
    case v1::ROLE_DECODE:
      return AgentRole::kDecode;
    case v1::ROLE_TOOL:
      return AgentRole::kTool;
    default:
      return AgentRole::kAny;
  }
}

std::string DescribeRole(v1::Role role) {
  if (role == v1::ROLE_PREFILL || role == v1::ROLE_DECODE || role == v1::ROLE_TOOL) {
    return AgentRoleName(FromProto(role));
  }
  return v1::Role_Name(role).empty() ? std::to_string(static_cast<int>(role)) : v1::Role_Name(role);
}

// A layout dtype the wire can carry (the pool dtypes), or InvalidArgument naming `field`.
StatusOr<v1::DType> WireDType(DType dtype, const std::string& field) {
  StatusOr<v1::DType> wire = control::ToProtoDType(dtype);
  if (wire.ok()) return wire;
  return InvalidArgument(field + " = " + std::string(DTypeName(dtype)) +
                         " is no pool dtype; give the pool's element type (bf16, fp16, fp32, "
                         "fp8_e4m3 or fp8_e5m2)");
}

StatusOr<v1::Layout> ToProto(const AgentLayout& l) {
  v1::Layout out;
  KVT_ASSIGN_OR_RETURN(v1::DType dtype, WireDType(l.dtype, "layout.dtype"));
  out.set_num_layers(l.num_layers);
  out.set_page_size(l.page_size);
  out.set_dtype(dtype);
  out.set_head_num(l.head_num);
  out.set_head_dim(l.head_dim);
  out.set_tp_rank(l.tp_rank);
  out.set_tp_size(l.tp_size);
  out.set_num_pages(l.num_pages);
  out.set_num_tokens(l.num_tokens);
  out.set_total_kv_heads(l.total_kv_heads);
  for (size_t i = 0; i < l.groups.size(); ++i) {
    const AgentKvGroup& g = l.groups[i];
    v1::KvGroup* group = out.add_groups();
    group->set_shape(g.shape == KvShape::kLatent ? v1::KV_SHAPE_LATENT : v1::KV_SHAPE_KEY_VALUE);
    group->set_num_layers(g.num_layers);
    group->set_head_num(g.head_num);
    group->set_head_dim(g.head_dim);
    KVT_ASSIGN_OR_RETURN(v1::DType group_dtype,
                         WireDType(g.dtype, "layout.groups[" + std::to_string(i) + "].dtype"));
    group->set_dtype(group_dtype);
    group->set_page_bytes(g.page_bytes);
  }
  for (uint64_t bytes : l.aux_slot_bytes) out.add_aux_slot_bytes(bytes);
  out.set_aux_slots(l.aux_slots);
  return out;
}

// Layouts reaching this have passed the control plane's validation (valid dtypes and shapes).
StatusOr<AgentLayout> FromProto(const v1::Layout& l) {
  KVT_ASSIGN_OR_RETURN(DType dtype, control::FromProtoDType(l.dtype()));
  AgentLayout layout{.num_layers = l.num_layers(),
                     .page_size = l.page_size(),
                     .dtype = dtype,
                     .head_num = l.head_num(),
                     .head_dim = l.head_dim(),
                     .tp_rank = l.tp_rank(),
                     .tp_size = l.tp_size(),
                     .num_pages = l.num_pages(),
                     .num_tokens = l.num_tokens(),
                     .total_kv_heads = l.total_kv_heads()};
  for (const v1::KvGroup& g : l.groups()) {
    KVT_ASSIGN_OR_RETURN(DType group_dtype, control::FromProtoDType(g.dtype()));
    layout.groups.push_back(AgentKvGroup{
        .shape = g.shape() == v1::KV_SHAPE_LATENT ? KvShape::kLatent : KvShape::kKeyValue,
        .num_layers = g.num_layers(),
        .head_num = g.head_num(),
        .head_dim = g.head_dim(),
        .dtype = group_dtype,
        .page_bytes = g.page_bytes()});
  }
  layout.aux_slot_bytes.assign(l.aux_slot_bytes().begin(), l.aux_slot_bytes().end());
  layout.aux_slots = l.aux_slots();
  return layout;
}

// ---- control addresses other hosts can reach ----
//
// The registry hands entries to agents on other hosts, which connect to control_address: an
// address that means "this host" only to the agent itself would send them to their own host or
// nowhere. Refused: a wildcard host (what a server binds to, no destination), an empty host,
// port 0 on a prefill entry (a decode engine accepts no connections, so its entries say port 0),
// and a loopback host unless the registrant reached the registry over loopback (then the
// registry, and every peer that finds the entry through it, run on the agent's host). Host
// names other than "localhost" are taken as given: resolving them here could block.

struct SplitAddress {
  std::string host;  // brackets of "[v6]" removed
  std::string port;
};

SplitAddress Split(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return {address, ""};
  SplitAddress out{address.substr(0, colon), address.substr(colon + 1)};
  if (out.host.size() >= 2 && out.host.front() == '[' && out.host.back() == ']') {
    out.host = out.host.substr(1, out.host.size() - 2);
  }
  return out;
}

bool IsWildcardHost(const std::string& host) {
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return v4.s_addr == htonl(INADDR_ANY);
  in6_addr v6{};
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) return IN6_IS_ADDR_UNSPECIFIED(&v6);
  return false;
}

bool IsLoopbackHost(const std::string& host) {
  if (host == "localhost") return true;
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    // ::ffff:127.x.y.z, as a dual-stack socket reports an IPv4 loopback peer.
    return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
  }
  return false;
}

constexpr const char* kAdvertiseHint =
    "start kvt-agent with --advertise HOST[:PORT] naming an address its peers on other hosts "
    "reach (or give AgentEntry::control_address such an address)";

// OK when peers can connect to `agent`'s control address. `registrant` is where the agent
// reached the registry from ("ip:port"); empty on the agent's own side, where the loopback rule
// cannot be judged.
Status CheckReachable(const v1::AgentInfo& agent, const std::string& registrant) {
  const std::string& address = agent.control_address();
  const std::string who = "agent '" + agent.name() + "' (" + DescribeRole(agent.role()) + ")";
  const SplitAddress split = Split(address);
  if (split.host.empty()) {
    return InvalidArgument(who + " registers control_address '" + address + "' with no host; " +
                           kAdvertiseHint);
  }
  if (IsWildcardHost(split.host)) {
    return InvalidArgument(who + " registers control_address " + address + ": " + split.host +
                           " is the wildcard a server listens on, not an address a peer can "
                           "connect to; " +
                           kAdvertiseHint);
  }
  char* end = nullptr;
  const unsigned long port = std::strtoul(split.port.c_str(), &end, 10);
  if (split.port.empty() || *end != '\0' || port > 65535) {
    return InvalidArgument(who + " registers control_address '" + address + "': port '" +
                           split.port + "' is not a number in 1..65535; " + kAdvertiseHint);
  }
  if (port == 0 && agent.role() != v1::ROLE_DECODE) {
    return InvalidArgument(who + " registers control_address " + address +
                           ": port 0 is no port a peer can connect to; register the port its "
                           "engine's control server is bound to (kvt-agent: --advertise "
                           "HOST[:PORT], PORT defaulting to the bound port)");
  }
  if (!registrant.empty() && IsLoopbackHost(split.host) &&
      !IsLoopbackHost(Split(registrant).host)) {
    return InvalidArgument(who + " registers control_address " + address +
                           ", a loopback address, but reached this registry from " + registrant +
                           ": peers on other hosts cannot connect to it; " + kAdvertiseHint +
                           ", or --listen on such an address");
  }
  return OkStatus();
}

StatusOr<v1::AgentInfo> ToProto(const AgentEntry& entry) {
  v1::AgentInfo info;
  info.set_name(entry.name);
  info.set_role(ToProto(entry.role));
  info.set_tp_rank(entry.tp_rank);
  info.set_tp_size(entry.tp_size);
  info.set_control_address(entry.control_address);
  info.set_host_id(entry.host_id);
  if (entry.layout) {
    StatusOr<v1::Layout> layout = ToProto(*entry.layout);
    if (!layout.ok()) return layout.status().WithContext("agent '" + entry.name + "'");
    *info.mutable_layout() = std::move(layout).value();
  }
  return info;
}

// Entries reaching this have passed the control plane's validation (a valid dtype among them).
StatusOr<AgentEntry> FromProto(const v1::AgentInfo& info) {
  AgentEntry entry;
  entry.name = info.name();
  entry.role = FromProto(info.role());
  entry.tp_rank = info.tp_rank();
  entry.tp_size = info.tp_size();
  entry.control_address = info.control_address();
  entry.host_id = info.host_id();
  if (info.has_layout()) {
    KVT_ASSIGN_OR_RETURN(entry.layout, FromProto(info.layout()));
  }
  return entry;
}

}  // namespace

const char* AgentRoleName(AgentRole role) {
  switch (role) {
    case AgentRole::kAny:
      return "any";
    case AgentRole::kPrefill:
      return "prefill";
    case AgentRole::kDecode:
      return "decode";
    case AgentRole::kTool:
      return "tool";
  }
  return "unknown";
}

Status CheckLayoutCompatible(const AgentLayout& ours, const AgentLayout& theirs,
                             std::string_view our_role, std::string_view their_role) {
  StatusOr<v1::Layout> our_wire = ToProto(ours);
  if (!our_wire.ok()) return our_wire.status().WithContext(std::string(our_role) + " agent");
  StatusOr<v1::Layout> their_wire = ToProto(theirs);
  if (!their_wire.ok()) return their_wire.status().WithContext(std::string(their_role) + " agent");
  return CheckCompatible(*our_wire, *their_wire, our_role, their_role);
}

// ------------------------------------------------------------------------------- server ----
class RegistryServer::Impl : public control::ControlHandler {
 public:
  explicit Impl(const RegistryServerOptions& options) : options_(options) {}
  ~Impl() override {
    if (server_) server_->Stop();
  }

  Status Init() {
    if (options_.heartbeat_interval.count() <= 0) {
      return InvalidArgument(
          "heartbeat_interval=" + std::to_string(options_.heartbeat_interval.count()) +
          " ms: must be positive");
    }
    if (options_.missed_heartbeats < 2) {
      // A client refreshes every interval plus a round trip: an entry that lives one interval
      // would be gone between two refreshes.
      return InvalidArgument("missed_heartbeats=" + std::to_string(options_.missed_heartbeats) +
                             ": must be >= 2 (entries live that many heartbeat intervals, and a "
                             "client refreshes every interval plus a round trip)");
    }
    if (options_.max_entries < 1) {
      return InvalidArgument(
          "max_entries=0: must be >= 1 (the live entries the registry holds, one per agent TP "
          "rank; kvt-bootstrap --max-entries)");
    }
    control::ControlServerOptions server = options_.server;
    if (server.server_id == "kvt") server.server_id = "kvt-bootstrap";
    // Connections come once server_ is stored: replies go through it.
    KVT_ASSIGN_OR_RETURN(server_, control::ControlServer::Create(
                                      server, this, control::AcceptStart::kOnStartAccepting));
    server_->StartAccepting();
    return OkStatus();
  }

  uint16_t port() const { return server_->port(); }

  // The matching entries as they travel (Entry::info) or as the C++ API gives them
  // (Entry::entry).
  template <typename T>
  std::vector<T> Lookup(const std::string& name, v1::Role role,
                        std::optional<uint32_t> rank) const {
    std::lock_guard<std::mutex> lock(mu_);
    ExpireLocked(Clock::now());
    std::vector<T> out;
    for (const auto& [key, entry] : entries_) {
      if (!name.empty() && entry.info.name() != name) continue;
      if (role != v1::ROLE_UNSPECIFIED && entry.info.role() != role) continue;
      if (rank && entry.info.tp_rank() != *rank) continue;
      if constexpr (std::is_same_v<T, AgentEntry>) {
        out.push_back(entry.entry);
      } else {
        out.push_back(entry.info);
      }
    }
    return out;
  }

  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    ExpireLocked(Clock::now());
    return entries_.size();
  }

  void OnMessage(control::ConnectionId conn, const v1::Envelope& envelope) override {
    v1::Envelope reply;
    reply.set_reply_to(envelope.id());
    if (envelope.has_register_agent()) {
      const v1::AgentInfo& agent = envelope.register_agent().agent();
      auto* r = reply.mutable_register_agent_reply();
      StatusOr<AgentEntry> converted = FromProto(agent);
      Status reachable;
      if (agent.role() != v1::ROLE_PREFILL && agent.role() != v1::ROLE_DECODE) {
        r->set_status(v1::STATUS_CODE_INVALID_ARGUMENT);
        r->set_message("agent '" + agent.name() + "' registers with role " +
                       DescribeRole(agent.role()) + "; only prefill and decode agents register");
      } else if (!converted.ok()) {
        r->set_status(v1::STATUS_CODE_INVALID_ARGUMENT);
        r->set_message("agent '" + agent.name() + "': " + converted.status().message());
      } else if (reachable = CheckReachable(agent, RemoteAddress(conn)); !reachable.ok()) {
        KVT_LOG_WARN("ctl", "refused a registration: {}", reachable.message());
        r->set_status(control::ToProtoCode(reachable.code()));
        r->set_message(reachable.message());
      } else if (Status stored = Store(conn, agent, std::move(converted).value()); !stored.ok()) {
        r->set_status(control::ToProtoCode(stored.code()));
        r->set_message(stored.message());
      } else {
        r->set_status(v1::STATUS_CODE_OK);
        r->set_heartbeat_interval_ms(static_cast<uint32_t>(options_.heartbeat_interval.count()));
      }
    } else if (envelope.has_unregister_agent()) {
      const Status removed = Remove(conn, envelope.unregister_agent().agent());
      auto* r = reply.mutable_register_agent_reply();
      r->set_status(control::ToProtoCode(removed.code()));
      r->set_message(removed.message());
    } else if (envelope.has_lookup_agents()) {
      const v1::LookupAgents& q = envelope.lookup_agents();
      auto agents = Lookup<v1::AgentInfo>(
          q.name(), q.role(),
          q.has_tp_rank() ? std::optional<uint32_t>(q.tp_rank()) : std::nullopt);
      // What a client takes (its validation limits; the server's own are the same by default).
      const size_t limit = options_.server.validation.max_agents_per_reply;
      if (agents.size() > limit) {
        // More than a client takes in one reply: an error saying how to narrow the lookup,
        // rather than a reply the client would refuse.
        reply = control::MakeErrorEnvelope(v1::STATUS_CODE_RESOURCE_EXHAUSTED,
                                           "the lookup matches " + std::to_string(agents.size()) +
                                               " agents; one reply holds " + std::to_string(limit) +
                                               ": look up by name, role or tp_rank");
      } else {
        for (auto& a : agents) *reply.mutable_lookup_agents_reply()->add_agents() = std::move(a);
        reply.mutable_lookup_agents_reply();  // an empty answer is still an answer
      }
    } else {
      reply = control::MakeErrorEnvelope(
          v1::STATUS_CODE_INVALID_ARGUMENT,
          "the bootstrap registry answers RegisterAgent, UnregisterAgent and LookupAgents, not " +
              std::string(control::BodyName(envelope)));
    }
    if (Status sent = server_->Send(conn, reply); !sent.ok()) {
      KVT_LOG_WARN("ctl", "bootstrap registry: reply to connection {} not sent: {}", conn,
                   sent.ToString());
    }
  }

  void OnConnect(control::ConnectionId conn, const control::ConnectionInfo& info) override {
    std::lock_guard<std::mutex> lock(mu_);
    remote_addresses_[conn] = info.remote_address;
  }

  void OnDisconnect(control::ConnectionId conn, const Status&) override {
    std::lock_guard<std::mutex> lock(mu_);
    remote_addresses_.erase(conn);
  }

 private:
  // Where connection `conn` comes from, "ip:port" ("<unknown>" when the socket could not say:
  // then a loopback control address is refused, as from any other host).
  std::string RemoteAddress(control::ConnectionId conn) const {
    std::lock_guard<std::mutex> lock(mu_);
    return RemoteAddressLocked(conn);
  }

  struct Entry {
    v1::AgentInfo info;  // as registered, for look-ups over the wire
    AgentEntry entry;    // the same, for RegistryServer::Lookup
    Clock::time_point refreshed;
    control::ConnectionId conn = 0;  // the connection of the latest registration
    std::string registrant;          // where that connection comes from, "ip:port"
  };

  std::chrono::milliseconds Ttl() const {
    return options_.heartbeat_interval * options_.missed_heartbeats;
  }

  static std::string DescribeKey(const v1::AgentInfo& agent) {
    return DescribeRole(agent.role()) + " '" + agent.name() + "' rank " +
           std::to_string(agent.tp_rank());
  }

  // "host:port (host_id H, <extra>)", the parts present.
  static std::string DescribeAgent(const v1::AgentInfo& agent, const std::string& extra = "") {
    std::string details = agent.host_id().empty() ? "" : "host_id " + agent.host_id();
    if (!extra.empty()) details += (details.empty() ? "" : ", ") + extra;
    return agent.control_address() + (details.empty() ? "" : " (" + details + ")");
  }

  // Adds or refreshes `agent`'s entry, registered over `conn`; AlreadyExists / Unavailable when
  // another agent holds its key (see registry.h), ResourceExhausted when the registry is full.
  Status Store(control::ConnectionId conn, const v1::AgentInfo& agent, AgentEntry converted) {
    std::lock_guard<std::mutex> lock(mu_);
    const Clock::time_point now = Clock::now();
    ExpireLocked(now);
    Key key{agent.name(), agent.role(), agent.tp_rank()};
    auto it = entries_.find(key);
    const bool fresh = it == entries_.end();
    if (!fresh) {
      const Entry& held = it->second;
      const bool holder_connected = remote_addresses_.count(held.conn) != 0;
      if (!IsHolder(held, agent, conn, holder_connected)) {
        Status refused = RefuseTaken(held, agent, conn, holder_connected, now);
        KVT_LOG_WARN("ctl", "refused a registration: {}", refused.message());
        return refused;
      }
      by_refresh_.erase({held.refreshed, key});
    } else if (entries_.size() >= options_.max_entries) {
      Status full = ResourceExhausted(
          "the registry holds " + std::to_string(entries_.size()) +
          " live entries, its limit (max_entries; kvt-bootstrap --max-entries " +
          std::to_string(options_.max_entries) + "): the registration of " + DescribeKey(agent) +
          " at " + agent.control_address() +
          " is refused; raise --max-entries, or stop agents that no longer serve (an entry "
          "expires " +
          std::to_string(Ttl().count()) + " ms after its last heartbeat)");
      KVT_LOG_WARN("ctl", "refused a registration: {}", full.message());
      return full;
    }
    Entry& entry = fresh ? entries_[key] : it->second;
    entry.info = agent;
    entry.entry = std::move(converted);
    entry.refreshed = now;
    entry.conn = conn;
    entry.registrant = RemoteAddressLocked(conn);
    by_refresh_.insert({now, std::move(key)});
    if (fresh) {
      KVT_LOG_INFO("ctl", "registered {} '{}' rank {}/{} at {}", DescribeRole(agent.role()),
                   agent.name(), agent.tp_rank(), agent.tp_size(), agent.control_address());
    }
    return OkStatus();
  }

  // Removes `agent`'s entry, asked over `conn`: NotFound when its key has no live entry,
  // FailedPrecondition when another agent holds the key (the holder rule of Store).
  Status Remove(control::ConnectionId conn, const v1::AgentInfo& agent) {
    std::lock_guard<std::mutex> lock(mu_);
    const Clock::time_point now = Clock::now();
    ExpireLocked(now);
    const Key key{agent.name(), agent.role(), agent.tp_rank()};
    auto it = entries_.find(key);
    if (it == entries_.end()) {
      return NotFound(DescribeKey(agent) + " has no live entry in this registry (it expired, or " +
                      "was registered with a registry that has restarted since); nothing to " +
                      "unregister for " + agent.control_address() + ": the key is free");
    }
    const Entry& held = it->second;
    const bool holder_connected = remote_addresses_.count(held.conn) != 0;
    if (!IsHolder(held, agent, conn, holder_connected)) {
      Status refused = RefuseRemoval(held, agent, conn, holder_connected, now);
      KVT_LOG_WARN("ctl", "refused an unregistration: {}", refused.message());
      return refused;
    }
    KVT_LOG_INFO("ctl", "unregistered {} at {}", DescribeKey(agent), held.info.control_address());
    by_refresh_.erase({held.refreshed, key});
    entries_.erase(it);
    return OkStatus();
  }

  // Whether `agent`, arriving over `conn`, is the agent holding `held` (registry.h): the same
  // control_address and host_id, over the holder's connection or a new one once that has closed.
  static bool IsHolder(const Entry& held, const v1::AgentInfo& agent, control::ConnectionId conn,
                       bool holder_connected) {
    const bool same_address = held.info.control_address() == agent.control_address() &&
                              held.info.host_id() == agent.host_id();
    return same_address && (held.conn == conn || !holder_connected);
  }

  // Why `agent`, arriving over `conn`, may not remove the entry `held`.
  Status RefuseRemoval(const Entry& held, const v1::AgentInfo& agent, control::ConnectionId conn,
                       bool holder_connected, Clock::time_point now) const {
    const auto since = std::chrono::duration_cast<std::chrono::milliseconds>(now - held.refreshed);
    const auto left = std::max<int64_t>((Ttl() - since).count(), 0);
    return FailedPrecondition(
        DescribeKey(agent) + " is held by the agent at " + DescribeAgent(held.info) +
        (holder_connected ? " over its open connection from " + held.registrant
                          : ", whose connection has closed") +
        "; the unregistration from " +
        DescribeAgent(agent, "connection from " + RemoteAddressLocked(conn)) +
        " is refused: only the holder removes its entry (over the connection it registered over, "
        "or a new one once that has closed, giving the same control_address and host_id). The "
        "entry stays until that agent stops, or expires " +
        std::to_string(left) + " ms from now without its heartbeats");
  }

  // Why `agent`, arriving over `conn`, may not take the key `held` has.
  Status RefuseTaken(const Entry& held, const v1::AgentInfo& agent, control::ConnectionId conn,
                     bool holder_connected, Clock::time_point now) const {
    const auto since = std::chrono::duration_cast<std::chrono::milliseconds>(now - held.refreshed);
    const auto left = Ttl() - since;
    const std::string what = DescribeKey(agent) + " is held by the agent at " +
                             DescribeAgent(held.info) + ", last refreshed " +
                             std::to_string(since.count()) + " ms ago";
    const std::string refused =
        "; the registration of " +
        DescribeAgent(agent, "connection from " + RemoteAddressLocked(conn)) + " is refused: ";
    const std::string other_name =
        "give this agent another name or tp_rank (kvt-agent --name / --tp-rank)";
    if (holder_connected) {
      const std::string over = "over its open connection from " + held.registrant;
      return AlreadyExists(what + " " + over + refused +
                           (held.info.control_address() == agent.control_address()
                                ? "two agents register the same control address; give each its own "
                                  "(kvt-agent --advertise HOST[:PORT]), or "
                                : "") +
                           other_name + ", or stop the agent at " + held.info.control_address() +
                           " and register again once its entry expired (" +
                           std::to_string(Ttl().count()) + " ms after its last heartbeat)");
    }
    return Unavailable(what + ", and its connection has closed" + refused +
                       "retry once its entry expired (in at most " +
                       std::to_string(std::max<int64_t>(left.count(), 0)) +
                       " ms unless that agent reconnects), or " + other_name);
  }

  // Drops the entries not refreshed for the TTL. Oldest first from by_refresh_: the work is one
  // step per entry dropped, each entry dropped once.
  void ExpireLocked(Clock::time_point now) const {
    const auto ttl = Ttl();
    while (!by_refresh_.empty() && now - by_refresh_.begin()->first > ttl) {
      auto oldest = by_refresh_.begin();
      auto it = entries_.find(oldest->second);
      if (it != entries_.end()) {
        KVT_LOG_INFO("ctl", "expired {} at {} ({} ms without a heartbeat)",
                     DescribeKey(it->second.info), it->second.info.control_address(), ttl.count());
        entries_.erase(it);
      }
      by_refresh_.erase(oldest);
    }
  }

  std::string RemoteAddressLocked(control::ConnectionId conn) const {
    auto it = remote_addresses_.find(conn);
    return it == remote_addresses_.end() ? std::string("<unknown>") : it->second;
  }

  const RegistryServerOptions options_;
  std::unique_ptr<control::ControlServer> server_;
  mutable std::mutex mu_;  // guards entries_, by_refresh_ and remote_addresses_
  mutable std::map<Key, Entry> entries_;
  // (refreshed, key) of every entry, oldest first: what ExpireLocked walks.
  mutable std::set<std::pair<Clock::time_point, Key>> by_refresh_;
  std::map<control::ConnectionId, std::string> remote_addresses_;  // of open connections
};

RegistryServer::RegistryServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RegistryServer::~RegistryServer() = default;
StatusOr<std::unique_ptr<RegistryServer>> RegistryServer::Create(
    const RegistryServerOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  KVT_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<RegistryServer>(new RegistryServer(std::move(impl)));
}
uint16_t RegistryServer::port() const { return impl_->port(); }
std::vector<AgentEntry> RegistryServer::Lookup(const std::string& name, AgentRole role,
                                               std::optional<uint32_t> tp_rank) const {
  return impl_->Lookup<AgentEntry>(name, ToProto(role), tp_rank);
}
size_t RegistryServer::size() const { return impl_->size(); }

// ------------------------------------------------------------------------------- client ----
namespace {

control::ControlClientOptions ClientOptions(const RegistryClientOptions& o) {
  control::ControlClientOptions c;
  c.host = o.host;
  c.port = o.port;
  c.client_id = o.client_id;
  c.role = ToProto(o.role);
  c.cluster_token = o.cluster_token;
  c.connect_timeout = o.timeout;
  // A registry connection closes once its request was answered, or once waiting for the
  // answer was given up: nothing is left to send, and waiting for the registry's goodbye (which
  // a silent or stopped registry never says) would only hold up the caller.
  c.limits.close_linger = std::chrono::milliseconds(20);
  return c;
}

std::chrono::milliseconds Until(Clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(0),
                  std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
}

// Sends `request` and waits for its answer, at most `timeout` and until a stop is requested on
// `stop`. Answers to earlier requests (a refresh whose wait was cut short) are skipped; an Error
// frame becomes its Status.
StatusOr<v1::Envelope> Call(control::ControlClient& client, const v1::Envelope& request,
                            std::chrono::milliseconds timeout, std::stop_token stop = {}) {
  KVT_RETURN_IF_ERROR(client.Send(request));
  const Clock::time_point deadline = Clock::now() + timeout;
  while (true) {
    StatusOr<v1::Envelope> reply = client.Receive(Until(deadline), stop);
    if (!reply.ok()) {
      if (reply.status().code() != StatusCode::kDeadlineExceeded) return reply.status();
      return DeadlineExceeded("no answer within " + std::to_string(timeout.count()) + " ms");
    }
    if (reply->reply_to() != 0 && reply->reply_to() != request.id()) continue;
    if (reply->has_error()) return control::StatusFromError(reply->error());
    return reply;
  }
}

// Requests a stop on its token at `deadline`, unless destroyed first: bounds a call that takes a
// stop_token but counts its timeouts step by step (a connect, then a handshake).
class StopAt {
 public:
  explicit StopAt(Clock::time_point deadline) {
    try {
      thread_ = std::jthread([this, deadline](std::stop_token cancelled) {
        std::mutex mu;
        std::condition_variable_any cv;
        std::unique_lock<std::mutex> lock(mu);
        cv.wait_until(lock, cancelled, deadline, [] { return false; });
        if (!cancelled.stop_requested()) source_.request_stop();
      });
    } catch (const std::system_error&) {
      // No thread to spare: the call's own timeouts still bound each of its steps.
    }
  }
  std::stop_token token() const { return source_.get_token(); }

 private:
  std::stop_source source_;
  std::jthread thread_;  // declared last: stopped and joined before source_ goes
};

}  // namespace

class RegistryClient::Impl {
 public:
  Impl(const RegistryClientOptions& options, v1::AgentInfo self)
      : options_(options),
        self_(std::move(self)),
        where_("the bootstrap at " + options_.host + ":" + std::to_string(options_.port)) {}

  // Unregisters unless Unregister did (or registering failed); a failure is logged: the entry
  // then expires.
  ~Impl() {
    std::lock_guard<std::mutex> lock(end_mu_);
    if (!registered_) return;
    registered_ = false;
    if (Status removed = End(options_.unregister_timeout); !removed.ok()) {
      KVT_LOG_WARN("ctl", "{}", removed.ToString());
    }
  }

  Status Init() {
    KVT_RETURN_IF_ERROR(RegisterOnce({}).WithContext("registering with " + where_));
    refresher_ = std::jthread([this](std::stop_token stop) { RefreshLoop(stop); });
    std::lock_guard<std::mutex> lock(end_mu_);
    registered_ = true;
    return OkStatus();
  }

  uint64_t refreshes() const { return refreshes_.load(); }

  Status Unregister(std::chrono::milliseconds timeout) {
    std::lock_guard<std::mutex> lock(end_mu_);
    if (!registered_) {
      return FailedPrecondition("the registration of " + DescribeSelf() + " with " + where_ +
                                " has already ended (by an earlier Unregister); start a new "
                                "RegistryClient to register again");
    }
    registered_ = false;
    return End(timeout);
  }

 private:
  std::string DescribeSelf() const {
    return DescribeRole(self_.role()) + " '" + self_.name() + "' rank " +
           std::to_string(self_.tp_rank()) + " at " + self_.control_address();
  }

  Status RegisterOnce(std::stop_token stop) {
    if (!client_ || !client_->connected()) {
      client_.reset();
      KVT_ASSIGN_OR_RETURN(client_,
                           control::ControlClient::Connect(ClientOptions(options_), nullptr, stop));
    }
    v1::Envelope request;
    request.set_id(++next_id_);
    *request.mutable_register_agent()->mutable_agent() = self_;
    StatusOr<v1::Envelope> reply = Call(*client_, request, options_.timeout, stop);
    if (!reply.ok()) {
      // A wait cut short by a stop keeps the connection: the unregistration goes over it.
      if (!stop.stop_requested()) client_.reset();
      return reply.status();
    }
    KVT_RETURN_IF_ERROR(ReplyStatus(*reply, "RegisterAgent"));
    const v1::RegisterAgentReply& r = reply->register_agent_reply();
    if (r.heartbeat_interval_ms() > 0) {
      interval_ = std::chrono::milliseconds(r.heartbeat_interval_ms());
    }
    ++refreshes_;
    return OkStatus();
  }

  void RefreshLoop(std::stop_token stop) {
    std::mutex mu;  // only for the wait: a stop request is what wakes it early
    std::condition_variable_any cv;
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait_for(lock, stop, interval_, [] { return false; });
      }
      if (stop.stop_requested()) return;
      Status st = RegisterOnce(stop);
      if (!st.ok() && !stop.stop_requested()) {
        KVT_LOG_WARN("ctl", "bootstrap refresh failed ({}); retrying", st.ToString());
      }
    }
  }

  // Stops the refreshes, then asks the registry to remove the entry, all by `timeout` from now.
  Status End(std::chrono::milliseconds timeout) {
    const Clock::time_point deadline = Clock::now() + timeout;
    // A refresh waiting on the registry gives up at the stop request.
    refresher_.request_stop();
    if (refresher_.joinable()) refresher_.join();
    Status removed = RemoveEntry(deadline, timeout);
    client_.reset();
    return removed;
  }

  // The registry's answer (which names the key), or why there was none.
  Status RemoveEntry(Clock::time_point deadline, std::chrono::milliseconds timeout) {
    auto unanswered = [&](const Status& why) {
      return why.WithContext("unregistering " + DescribeSelf() + " from " + where_ + " within " +
                             std::to_string(timeout.count()) +
                             " ms failed; its entry expires once its heartbeats are missed");
    };
    if (!client_ || !client_->connected()) {
      client_.reset();
      // A new connection, which the registry takes from the holder once the old one has closed.
      const std::chrono::milliseconds left = Until(deadline);
      if (left.count() == 0) return unanswered(DeadlineExceeded("no time left to connect"));
      control::ControlClientOptions c = ClientOptions(options_);
      c.connect_timeout = std::min(c.connect_timeout, left);
      c.limits.handshake_timeout = std::min(c.limits.handshake_timeout, left);
      const StopAt give_up(deadline);
      auto connected = control::ControlClient::Connect(c, nullptr, give_up.token());
      if (!connected.ok()) {
        return unanswered(connected.status().code() == StatusCode::kAborted
                              ? DeadlineExceeded("connecting did not finish in time")
                              : connected.status());
      }
      client_ = std::move(connected).value();
    }
    v1::Envelope request;
    request.set_id(++next_id_);
    *request.mutable_unregister_agent()->mutable_agent() = self_;
    StatusOr<v1::Envelope> reply = Call(*client_, request, Until(deadline));
    if (!reply.ok()) return unanswered(reply.status());
    return ReplyStatus(*reply, "UnregisterAgent");
  }

  // The status a RegisterAgentReply to `request` carries (both calls are answered with one).
  static Status ReplyStatus(const v1::Envelope& reply, const char* request) {
    if (!reply.has_register_agent_reply()) {
      return Internal(std::string("the bootstrap answered ") + request + " with " +
                      std::string(control::BodyName(reply)));
    }
    const v1::RegisterAgentReply& r = reply.register_agent_reply();
    if (r.status() != v1::STATUS_CODE_OK) {
      return Status(control::FromProtoCode(r.status()), r.message());
    }
    return OkStatus();
  }

  const RegistryClientOptions options_;
  const v1::AgentInfo self_;
  const std::string where_;  // "the bootstrap at host:port"
  // Used by Init, then the refresh thread, then End (after joining it): one thread at a time.
  std::unique_ptr<control::ControlClient> client_;
  uint64_t next_id_ = 0;
  std::chrono::milliseconds interval_{1000};
  std::atomic<uint64_t> refreshes_{0};
  std::mutex end_mu_;        // guards registered_; held while the registration ends
  bool registered_ = false;  // Init succeeded, and the registration has not ended
  std::jthread refresher_;   // declared last: stopped and joined before the members it uses go
};

RegistryClient::RegistryClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RegistryClient::~RegistryClient() = default;
StatusOr<std::unique_ptr<RegistryClient>> RegistryClient::Start(
    const RegistryClientOptions& options, const AgentEntry& self) {
  KVT_ASSIGN_OR_RETURN(v1::AgentInfo info, ToProto(self));
  // What can be judged here is refused before connecting; the registry judges loopback.
  KVT_RETURN_IF_ERROR(CheckReachable(info, /*registrant=*/""));
  auto impl = std::make_unique<Impl>(options, std::move(info));
  KVT_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<RegistryClient>(new RegistryClient(std::move(impl)));
}
uint64_t RegistryClient::refreshes() const { return impl_->refreshes(); }
Status RegistryClient::Unregister(std::chrono::milliseconds timeout) {
  return impl_->Unregister(timeout);
}

StatusOr<std::vector<AgentEntry>> RegistryClient::Lookup(const RegistryClientOptions& options,
                                                         const std::string& name, AgentRole role,
                                                         std::optional<uint32_t> tp_rank) {
  KVT_ASSIGN_OR_RETURN(auto client, control::ControlClient::Connect(ClientOptions(options)));
  v1::Envelope request;
  request.set_id(1);
  request.mutable_lookup_agents()->set_name(name);
  request.mutable_lookup_agents()->set_role(ToProto(role));
  if (tp_rank) request.mutable_lookup_agents()->set_tp_rank(*tp_rank);
  KVT_ASSIGN_OR_RETURN(v1::Envelope reply, Call(*client, request, options.timeout));
  if (!reply.has_lookup_agents_reply()) {
    return Internal("the bootstrap answered LookupAgents with " +
                    std::string(control::BodyName(reply)));
  }
  std::vector<AgentEntry> agents;
  agents.reserve(reply.lookup_agents_reply().agents_size());
  for (const v1::AgentInfo& info : reply.lookup_agents_reply().agents()) {
    StatusOr<AgentEntry> entry = FromProto(info);
    if (!entry.ok()) {
      return entry.status().WithContext("the bootstrap's entry for '" + info.name() + "'");
    }
    agents.push_back(std::move(entry).value());
  }
  return agents;
}

}  // namespace kvt::transfer

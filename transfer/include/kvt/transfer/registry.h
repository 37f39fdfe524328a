// The bootstrap registry: where agents announce themselves and find each other.
//
// RegistryServer keeps one entry per (name, role, tp_rank), the entry's key. Agents register
// with RegisterAgent and refresh their entry by registering again every heartbeat interval (the
// interval is in the reply); an agent that stops cleanly removes its entry (UnregisterAgent),
// and the entry of one that does not (killed, or cut off) expires once it has not been
// refreshed for `missed_heartbeats` intervals.
// Expired entries are dropped whenever the registry handles a message or answers Lookup/size,
// so a registry that is only registered to holds no more than the live entries, and at most
// `max_entries` of them. Because refreshes carry the whole entry, a restarted registry is
// re-filled by the agents' next heartbeats. Look-ups filter by name, role and rank.
//
// A key belongs to the agent holding its live entry. A registration of that key is the
// holder's own (a refresh, or the same agent registering again) when it names the same
// control_address and host_id and arrives over the holder's connection, or over a new one once
// the holder's has closed (a client reconnects only after its connection failed; a restarted
// agent bound to the same port). Any other registration of a live key is refused, naming the
// key and the holder's address: AlreadyExists while the holder's connection is open (another
// agent is live under that key), Unavailable once it has closed (the holder may be gone: its
// entry expires within `missed_heartbeats` intervals, after which the key is free). Only the
// holder removes its entry, by the same rule: an unregistration from anyone else is refused
// (FailedPrecondition naming the key and the holder), one for a key without a live entry is
// NotFound naming the key; once removed, the key is free at once.
//
// RegistryClient is the agent's side: it registers once (failing if the registry cannot be
// reached), then refreshes from a background thread, reconnecting after connection loss, until
// it unregisters (Unregister, or its destructor).
//
// The API speaks plain C++ (AgentRole, AgentEntry); the wire messages stay inside the library.
//
// Thread safety: both classes may be used from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvt/common/dtype.h"
#include "kvt/common/status.h"
#include "kvt/transfer/control_options.h"
#include "kvt/transfer/layout.h"

namespace kvt::transfer {

// What an agent is. Only prefill and decode agents register; kTool is the role of clients that
// only look up (the default of RegistryClientOptions); kAny matches every role in a look-up.
enum class AgentRole : uint8_t {
  kAny = 0,
  kPrefill = 1,
  kDecode = 2,
  kTool = 4,
};

// "any", "prefill", "decode", "tool".
const char* AgentRoleName(AgentRole role);

// One model's KV in an agent's layout: KvGroup without its buffers.
struct AgentKvGroup {
  KvShape shape = KvShape::kKeyValue;
  uint32_t num_layers = 0;
  uint32_t head_num = 0;  // KV heads held by this rank (kLatent: 1)
  uint32_t head_dim = 0;  // elements per head (kLatent: the latent width)
  DType dtype = DType::kBF16;
  uint64_t page_bytes = 0;  // bytes of one page of one buffer

  bool operator==(const AgentKvGroup&) const = default;
};

// A summary of an agent's layout (no memory descriptors: those travel in the engines' hello).
// Registered entries carry it so that a peer can check compatibility before connecting
// (CheckLayoutCompatible).
struct AgentLayout {
  uint32_t num_layers = 0;  // layers with K/V buffers
  uint32_t page_size = 0;   // tokens per page
  DType dtype = DType::kBF16;
  uint32_t head_num = 0;        // KV heads held by this rank
  uint32_t head_dim = 0;        // elements per head
  uint32_t tp_rank = 0;         // equal to AgentEntry::tp_rank
  uint32_t tp_size = 1;         // equal to AgentEntry::tp_size
  uint64_t num_pages = 0;       // pages including the dummy page 0
  uint64_t num_tokens = 0;      // token slots (the pool's size)
  uint32_t total_kv_heads = 0;  // KV heads of the whole model before TP sharding; 0: not given
  // The models whose KV moves, in buffer order (the target, then draft models); num_layers is
  // the sum of their layers. Empty: one kKeyValue group of num_layers layers with head_num,
  // head_dim and dtype (kvt's own pool). At most 16.
  std::vector<AgentKvGroup> groups = {};
  std::vector<uint64_t> aux_slot_bytes = {};  // bytes of one slot of each aux buffer; at most 64
  uint64_t aux_slots = 0;  // slots in each aux buffer; > 0 iff aux_slot_bytes is set

  bool operator==(const AgentLayout&) const = default;
};

// OK when pages can move between an agent with layout `ours` and a peer with `theirs` (the
// engines' own hello check, run early: a decode agent calls it on the registry entry of the
// prefill agent it is about to ask, so that an incompatible peer is refused before any request).
// FailedPrecondition naming every differing field with both values otherwise, labelled by the
// roles ("page_size decode=16 prefill=32"); InvalidArgument when a layout's dtype is no pool
// dtype. `our_role` and `their_role` are "prefill" or "decode".
Status CheckLayoutCompatible(const AgentLayout& ours, const AgentLayout& theirs,
                             std::string_view our_role, std::string_view their_role);

// One agent (one TP rank of a prefill or decode instance) as the registry knows it.
struct AgentEntry {
  std::string name;  // instance name shared by its TP ranks; printable ASCII, 1..128 bytes
  AgentRole role = AgentRole::kAny;  // kPrefill or kDecode to register
  uint32_t tp_rank = 0;              // < tp_size
  uint32_t tp_size = 1;
  // "host:port" ("[v6]:port") where other hosts reach its engine's control server. The
  // registry refuses an address no peer can connect to, naming it and kvt-agent's --advertise:
  // a wildcard host (0.0.0.0, ::), an empty host, port 0 on a prefill entry (a decode engine
  // accepts no connections: its entries carry port 0), and a loopback host (127.0.0.0/8, ::1,
  // localhost) unless the agent itself reached the registry over loopback (then every peer that
  // finds the entry runs on that host). Host names are taken as given.
  std::string control_address;
  std::optional<AgentLayout> layout;  // its pool's layout, when it has one
  std::string host_id;                // identifies the machine; empty: not given
};

struct RegistryServerOptions {
  control::ControlServerOptions server;  // bind address, port, cluster token, limits
  std::chrono::milliseconds heartbeat_interval{1000};
  // Entries expire after this many intervals without a refresh; >= 2 (a client refreshes every
  // interval plus a round trip).
  int missed_heartbeats = 3;
  // Live entries held at most (one per agent TP rank); >= 1. A registration of a new key beyond
  // it is refused with ResourceExhausted naming the limit; refreshes of held keys are not.
  size_t max_entries = 16384;
};

class RegistryServer {
 public:
  static StatusOr<std::unique_ptr<RegistryServer>> Create(const RegistryServerOptions& options);
  ~RegistryServer();
  RegistryServer(const RegistryServer&) = delete;
  RegistryServer& operator=(const RegistryServer&) = delete;

  uint16_t port() const;
  // Live entries matching the filter (empty name / AgentRole::kAny / nullopt match all), in
  // (name, role, tp_rank) order.
  std::vector<AgentEntry> Lookup(const std::string& name, AgentRole role,
                                 std::optional<uint32_t> tp_rank) const;
  size_t size() const;

 private:
  class Impl;
  explicit RegistryServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct RegistryClientOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  std::string client_id = "kvt-agent";
  AgentRole role = AgentRole::kTool;  // this client's role in the connection greeting
  std::string cluster_token;
  std::chrono::milliseconds timeout{5000};  // connect + each reply
  // How long RegistryClient's destructor waits for the registry to remove the entry (when
  // Unregister was not called).
  std::chrono::milliseconds unregister_timeout{1000};
};

class RegistryClient {
 public:
  // Registers `self` and keeps it registered until Unregister or destruction. InvalidArgument
  // when `self` cannot be sent (a layout dtype that is no pool dtype) or names an address no
  // peer can reach (a wildcard or empty host, port 0 on a prefill entry: see
  // AgentEntry::control_address); the registry refuses those too, a loopback address reached
  // from another host, roles other than kPrefill and kDecode and entries out of its limits,
  // naming the field and value. A key held by another live agent is AlreadyExists (Unavailable
  // while that agent's connection is closed: retry once its entry expired), a registry full of
  // live entries ResourceExhausted; both name the key. A refresh refused later is logged and
  // tried again next interval.
  static StatusOr<std::unique_ptr<RegistryClient>> Start(const RegistryClientOptions& options,
                                                         const AgentEntry& self);
  // Unregisters as Unregister(options.unregister_timeout) does, unless Unregister was called
  // (or Start failed); a failure is logged at warn (the entry then expires). So a registration
  // ends with its RegistryClient, and only a process that is killed (or cannot reach the
  // registry as it stops) leaves an entry behind to expire.
  ~RegistryClient();
  RegistryClient(const RegistryClient&) = delete;
  RegistryClient& operator=(const RegistryClient&) = delete;

  // Ends the registration: stops the refreshes, then asks the registry to remove the entry,
  // over the registration's connection (a new one when that has closed), waiting at most
  // `timeout` for it whatever the registry does: a refresh still waiting on the registry is
  // given up at once, and a registry that is gone or does not answer costs `timeout` (plus a
  // few milliseconds to close the connection). OK once the entry is gone and its key free for
  // any agent. The registry's refusals name the key: NotFound when it holds no live entry for
  // it (the entry expired, or the registry restarted and was not refreshed yet),
  // FailedPrecondition when another agent holds it. Unavailable or DeadlineExceeded when the
  // registry could not be reached or did not answer in time: the entry then expires after the
  // registry's missed heartbeats. The client refreshes no more, whatever the result; a second
  // call is FailedPrecondition.
  Status Unregister(std::chrono::milliseconds timeout);

  // Refreshes that reached the registry so far (registration included).
  uint64_t refreshes() const;

  // One look-up over its own connection.
  static StatusOr<std::vector<AgentEntry>> Lookup(const RegistryClientOptions& options,
                                                  const std::string& name, AgentRole role,
                                                  std::optional<uint32_t> tp_rank);

 private:
  class Impl;
  explicit RegistryClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvt::transfer

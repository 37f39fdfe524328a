// The bootstrap registry: where agents announce themselves and find each other.
//
// RegistryServer keeps one entry per (name, role, tp_rank). Agents register with RegisterAgent
// and refresh their entry by registering again every heartbeat interval (the interval is in the
// reply); an entry not refreshed for `missed_heartbeats` intervals expires. Because refreshes
// carry the whole entry, a restarted registry is re-filled by the agents' next heartbeats.
// Look-ups filter by name, role and rank.
//
// RegistryClient is the agent's side: it registers once (failing if the registry cannot be
// reached), then refreshes from a background thread, reconnecting after connection loss.
//
// Thread safety: both classes may be used from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvt/common/status.h"
#include "kvt/transfer/control_options.h"
#include "kvt/v1/registry.pb.h"

namespace kvt::transfer {

struct RegistryServerOptions {
  control::ControlServerOptions server;  // bind address, port, cluster token, limits
  std::chrono::milliseconds heartbeat_interval{1000};
  int missed_heartbeats = 3;  // entries expire after this many intervals without a refresh
};

class RegistryServer {
 public:
  static StatusOr<std::unique_ptr<RegistryServer>> Create(const RegistryServerOptions& options);
  ~RegistryServer();
  RegistryServer(const RegistryServer&) = delete;
  RegistryServer& operator=(const RegistryServer&) = delete;

  uint16_t port() const;
  // Live entries matching the filter (empty name / ROLE_UNSPECIFIED / nullopt match all), in
  // (name, role, tp_rank) order.
  std::vector<v1::AgentInfo> Lookup(const std::string& name, v1::Role role,
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
  v1::Role role = v1::ROLE_TOOL;
  std::string cluster_token;
  std::chrono::milliseconds timeout{5000};  // connect + each reply
};

class RegistryClient {
 public:
  // Registers `self` and keeps it registered until destroyed.
  static StatusOr<std::unique_ptr<RegistryClient>> Start(const RegistryClientOptions& options,
                                                         const v1::AgentInfo& self);
  ~RegistryClient();
  RegistryClient(const RegistryClient&) = delete;
  RegistryClient& operator=(const RegistryClient&) = delete;

  // Refreshes that reached the registry so far (registration included).
  uint64_t refreshes() const;

  // One look-up over its own connection.
  static StatusOr<std::vector<v1::AgentInfo>> Lookup(const RegistryClientOptions& options,
                                                     const std::string& name, v1::Role role,
                                                     std::optional<uint32_t> tp_rank);

 private:
  class Impl;
  explicit RegistryClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvt::transfer

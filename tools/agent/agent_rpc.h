// AgentRpc: the driver-facing RPC of kvt-agent (SubmitRequest, QueryRequests, QueryStats over a
// control connection). Decode agents resolve SubmitRequest.prefill_name through the bootstrap
// registry (cached briefly): decode rank r reaches prefill rank r when the TP sizes match.
//
// Thread safety: the server calls OnMessage from its I/O threads; the handler is thread-safe.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "agent.h"
#include "control/control_server.h"
#include "kvt/transfer/registry.h"
#include "tool_util.h"

namespace kvt::tools {

class AgentRpc : public control::ControlHandler {
 public:
  // `registry` is where prefill names are looked up (nullopt: only prefill_address works);
  // `tp_rank` of `tp_size` is this agent's tensor-parallel shard.
  AgentRpc(Agent* agent, std::string name, bool prefill, uint32_t tp_rank, uint32_t tp_size,
           std::optional<transfer::RegistryClientOptions> registry);

  // Starts listening. The handler must outlive the returned server.
  StatusOr<std::unique_ptr<control::ControlServer>> Serve(
      const control::ControlServerOptions& options);

  void OnMessage(control::ConnectionId id, const v1::Envelope& envelope) override;
  void OnDisconnect(control::ConnectionId id, const Status& why) override {}

 private:
  v1::Envelope Submit(const v1::SubmitRequest& request);
  StatusOr<HostPort> ResolvePrefill(const std::string& name);

  Agent* const agent_;
  const std::string name_;
  const bool prefill_;
  const uint32_t tp_rank_;
  const uint32_t tp_size_;
  const std::optional<transfer::RegistryClientOptions> registry_;
  control::ControlServer* server_ = nullptr;  // set by Serve before any message arrives

  std::mutex mu_;  // guards resolved_
  struct Resolved {
    HostPort address;
    std::chrono::steady_clock::time_point at;
  };
  std::map<std::string, Resolved> resolved_;
};

}  // namespace kvt::tools

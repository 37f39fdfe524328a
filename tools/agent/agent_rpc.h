// AgentRpc: the driver-facing RPC of kvt-agent (SubmitRequest, QueryRequests, QueryStats over a
// control connection). Decode agents resolve SubmitRequest.prefill_name through the bootstrap
// registry (cached briefly): decode rank r reaches prefill rank r when the TP sizes match, and
// only when the prefill entry's layout is compatible with the decode agent's own.
//
// Submits run on a small pool of worker threads, never on the server's io thread: a decode
// submit may block for seconds (a registry lookup, connecting to a prefill peer and waiting for
// its hello), and the io thread must keep answering the other calls (stats, queries, aborts)
// within milliseconds. A submit's reply goes out when it is done, tied to its request by
// reply_to; a submit that finds every worker busy and kMaxQueuedSubmits waiting is answered
// RESOURCE_EXHAUSTED at once. A submit's room is claimed on the agent from the moment it is
// queued (Agent::Claim), so AbortRoom stops it wherever it is: still queued (the submit is
// answered ABORTED at once), looking up or connecting to its prefill agent (answered ABORTED
// when that ends; nothing reaches the peer), or started (the engines abort it). A driver whose
// connection closes has its queued submits dropped; their reports say why. A looked-up prefill
// address that cannot be connected to is dropped from the cache.
//
// Thread safety: the server calls OnMessage from its I/O threads; the handler is thread-safe.
// Stop() (or the destructor) joins the workers; call it before the server and the agent are
// destroyed, since workers use both.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "agent.h"
#include "control/control_server.h"
#include "kvt/transfer/registry.h"
#include "tool_util.h"

namespace kvt::tools {

class AgentRpc : public control::ControlHandler {
 public:
  // `registry` is where prefill names are looked up (nullopt: only prefill_address works);
  // `tp_rank` of `tp_size` is this agent's tensor-parallel shard. `layout` is this agent's as
  // registered: a decode agent refuses a prefill entry whose layout is incompatible with it
  // (transfer::CheckLayoutCompatible) before any request goes to that prefill agent; nullopt or
  // an entry without a layout leave the check to the engines' hello.
  AgentRpc(Agent* agent, std::string name, bool prefill, uint32_t tp_rank, uint32_t tp_size,
           std::optional<transfer::RegistryClientOptions> registry,
           std::optional<transfer::AgentLayout> layout = std::nullopt);
  ~AgentRpc() override;

  AgentRpc(const AgentRpc&) = delete;
  AgentRpc& operator=(const AgentRpc&) = delete;

  // Submits that may run at once, and that may wait for a worker beyond those.
  static constexpr size_t kSubmitWorkers = 8;
  static constexpr size_t kMaxQueuedSubmits = 1024;

  // Starts listening. The handler must outlive the returned server.
  StatusOr<std::unique_ptr<control::ControlServer>> Serve(
      const control::ControlServerOptions& options);

  void OnMessage(control::ConnectionId id, const v1::Envelope& envelope) override;
  void OnDisconnect(control::ConnectionId id, const Status& why) override;

  // Stops taking submits, answers the queued ones UNAVAILABLE and joins the workers (a submit
  // in progress finishes first). Idempotent.
  void Stop();

 private:
  struct SubmitJob {
    control::ConnectionId connection = 0;
    v1::Envelope request;
  };

  // Queues a submit for the workers, or answers it at once when it cannot be queued.
  void QueueSubmit(control::ConnectionId id, const v1::Envelope& envelope);
  void WorkerLoop();
  void Reply(control::ConnectionId id, uint64_t reply_to, v1::Envelope reply);
  static v1::Envelope MakeSubmitReply(const std::string& room, const Status& status);
  // Runs one submit of a claimed room (the claim ends with it).
  Status Submit(const v1::SubmitRequest& request);
  v1::Envelope HandleAbort(control::ConnectionId id, const v1::AbortRoom& abort);
  // Removes the room's submit from the queue when it is still there.
  std::optional<SubmitJob> TakeQueued(const std::string& room);
  StatusOr<HostPort> ResolvePrefill(const std::string& name);
  // Drops `name` from the look-up cache while it still resolves to `address`.
  void ForgetResolved(const std::string& name, const HostPort& address);

  // The bytes a reply frame leaves for its envelope around the reports.
  static constexpr size_t kReplyHeadroom = 64;

  Agent* const agent_;
  uint32_t max_frame_bytes_ = control::kDefaultMaxFrameBytes;  // of the server Serve starts
  const std::string name_;
  const bool prefill_;
  const uint32_t tp_rank_;
  const uint32_t tp_size_;
  const std::optional<transfer::RegistryClientOptions> registry_;
  const std::optional<transfer::AgentLayout> layout_;
  control::ControlServer* server_ = nullptr;  // set by Serve before any message arrives

  std::mutex mu_;  // guards resolved_
  struct Resolved {
    HostPort address;
    std::chrono::steady_clock::time_point at;
  };
  std::map<std::string, Resolved> resolved_;

  std::mutex work_mu_;  // guards the members below
  std::condition_variable work_cv_;
  std::deque<SubmitJob> jobs_;  // their rooms are claimed on the agent
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace kvt::tools

#include "agent_rpc.h"

#include <fmt/format.h>

#include <algorithm>

#include "control/protocol.h"
#include "control/validate.h"
#include "kvt/common/log.h"

namespace kvt::tools {
namespace {

v1::RequestState ToProto(transfer::RequestState s) {
  switch (s) {
    case transfer::RequestState::kBootstrapping:
      return v1::REQUEST_STATE_BOOTSTRAPPING;
    case transfer::RequestState::kWaitingForInput:
      return v1::REQUEST_STATE_WAITING_FOR_INPUT;
    case transfer::RequestState::kTransferring:
      return v1::REQUEST_STATE_TRANSFERRING;
    case transfer::RequestState::kSuccess:
      return v1::REQUEST_STATE_SUCCESS;
    case transfer::RequestState::kFailed:
      return v1::REQUEST_STATE_FAILED;
  }
  return v1::REQUEST_STATE_UNSPECIFIED;
}

constexpr auto kResolveTtl = std::chrono::seconds(2);

}  // namespace

AgentRpc::AgentRpc(Agent* agent, std::string name, bool prefill, uint32_t tp_rank, uint32_t tp_size,
                   std::optional<transfer::RegistryClientOptions> registry,
                   std::optional<transfer::AgentLayout> layout)
    : agent_(agent),
      name_(std::move(name)),
      prefill_(prefill),
      tp_rank_(tp_rank),
      tp_size_(tp_size),
      registry_(std::move(registry)),
      layout_(std::move(layout)) {}

AgentRpc::~AgentRpc() { Stop(); }

StatusOr<std::unique_ptr<control::ControlServer>> AgentRpc::Serve(
    const control::ControlServerOptions& options) {
  {
    std::lock_guard<std::mutex> lock(work_mu_);
    if (workers_.empty()) {
      for (size_t i = 0; i < kSubmitWorkers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
    }
  }
  max_frame_bytes_ = options.limits.max_frame_bytes;
  // Connections come once server_ is stored: replies go through it.
  KVT_ASSIGN_OR_RETURN(auto server, control::ControlServer::Create(
                                        options, this, control::AcceptStart::kOnStartAccepting));
  server_ = server.get();
  server->StartAccepting();
  return server;
}

void AgentRpc::Stop() {
  std::vector<std::thread> workers;
  std::deque<SubmitJob> dropped;
  {
    std::lock_guard<std::mutex> lock(work_mu_);
    stopping_ = true;
    workers.swap(workers_);
    dropped.swap(jobs_);
  }
  work_cv_.notify_all();
  for (const SubmitJob& job : dropped) {
    const std::string& room = job.request.submit_request().room_id();
    (void)agent_->Release(room);  // never started: the room leaves no trace
    Reply(job.connection, job.request.id(),
          control::MakeErrorEnvelope(
              v1::STATUS_CODE_UNAVAILABLE,
              "the agent is stopping; submit room '" + room + "' to another agent"));
  }
  for (std::thread& worker : workers) {
    if (worker.joinable()) worker.join();
  }
}

void AgentRpc::QueueSubmit(control::ConnectionId id, const v1::Envelope& envelope) {
  const v1::SubmitRequest& request = envelope.submit_request();
  const std::string& room = request.room_id();
  Status refusal;
  {
    std::lock_guard<std::mutex> lock(work_mu_);
    if (stopping_) {
      refusal = Unavailable("the agent is stopping; submit room '" + room + "' to another agent");
    } else if (jobs_.size() >= kMaxQueuedSubmits) {
      refusal =
          ResourceExhausted("room '" + room + "': " + std::to_string(jobs_.size()) +
                            " submits are waiting for one of " + std::to_string(kSubmitWorkers) +
                            " workers (the limit is " + std::to_string(kMaxQueuedSubmits) +
                            "; some prefill peers may not answer); retry later");
    } else {
      // Claimed while queued: an abort finds the room from now on.
      refusal = agent_->Claim(room, static_cast<int64_t>(request.num_tokens()));
      if (refusal.ok()) jobs_.push_back(SubmitJob{id, envelope});
    }
  }
  if (refusal.ok()) {
    work_cv_.notify_one();
    return;
  }
  Reply(id, envelope.id(), MakeSubmitReply(room, refusal));
}

void AgentRpc::WorkerLoop() {
  while (true) {
    SubmitJob job;
    {
      std::unique_lock<std::mutex> lock(work_mu_);
      work_cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    const v1::SubmitRequest& request = job.request.submit_request();
    Reply(job.connection, job.request.id(), MakeSubmitReply(request.room_id(), Submit(request)));
  }
}

std::optional<AgentRpc::SubmitJob> AgentRpc::TakeQueued(const std::string& room) {
  std::lock_guard<std::mutex> lock(work_mu_);
  auto it = std::find_if(jobs_.begin(), jobs_.end(), [&](const SubmitJob& job) {
    return job.request.submit_request().room_id() == room;
  });
  if (it == jobs_.end()) return std::nullopt;
  SubmitJob job = std::move(*it);
  jobs_.erase(it);
  return job;
}

v1::Envelope AgentRpc::HandleAbort(control::ConnectionId id, const v1::AbortRoom& abort) {
  const std::string& room = abort.room_id();
  const std::string reason = abort.reason().empty() ? "aborted by the driver" : abort.reason();
  // A submit still waiting for a worker leaves the queue (and is answered now); one on a worker
  // stops before its room reaches the engine (Agent::Abort). Taken from the queue before the
  // abort, so that no worker starts it in between.
  std::optional<SubmitJob> queued = TakeQueued(room);
  const Status aborted = agent_->Abort(room, reason);
  if (queued) {
    const Status released = agent_->Release(room);
    Reply(queued->connection, queued->request.id(),
          MakeSubmitReply(room, released.ok() ? aborted : released));
  }
  if (aborted.ok()) {
    KVT_LOG_INFO("tool", "room '{}' aborted by driver connection {}: {}", room, id, reason);
  }
  return MakeSubmitReply(room, aborted);
}

void AgentRpc::OnDisconnect(control::ConnectionId id, const Status& why) {
  // The driver is gone and nobody waits for these replies: its submits that have not started
  // are dropped (they hold no pages yet). Submits already on a worker and started rooms go on
  // as any room does, to their end or their deadline.
  std::vector<SubmitJob> dropped;
  {
    std::lock_guard<std::mutex> lock(work_mu_);
    for (auto it = jobs_.begin(); it != jobs_.end();) {
      if (it->connection == id) {
        dropped.push_back(std::move(*it));
        it = jobs_.erase(it);
      } else {
        ++it;
      }
    }
  }
  if (dropped.empty()) return;
  const std::string reason = "the driver that submitted it disconnected (connection " +
                             std::to_string(id) + ": " + why.ToString() + ")";
  for (const SubmitJob& job : dropped) {
    const std::string& room = job.request.submit_request().room_id();
    (void)agent_->Abort(room, reason);  // its report says why it never ran
    (void)agent_->Release(room);
  }
  KVT_LOG_WARN("tool", "driver connection {} closed with {} submit(s) not started; dropped them",
               id, dropped.size());
}

void AgentRpc::Reply(control::ConnectionId id, uint64_t reply_to, v1::Envelope reply) {
  reply.set_reply_to(reply_to);
  control::ControlServer* server = server_;
  if (server == nullptr) return;
  // NotFound when the driver left meanwhile: nobody is waiting for the reply any more.
  Status sent = server->Send(id, reply);
  if (!sent.ok()) KVT_LOG_WARN("tool", "RPC reply not sent: {}", sent.ToString());
}

StatusOr<HostPort> AgentRpc::ResolvePrefill(const std::string& name) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = resolved_.find(name);
    if (it != resolved_.end() && std::chrono::steady_clock::now() - it->second.at < kResolveTtl) {
      return it->second.address;
    }
  }
  if (!registry_) {
    return FailedPrecondition("this agent runs without --bootstrap, so it cannot look up '" + name +
                              "'; give prefill_address instead");
  }
  KVT_ASSIGN_OR_RETURN(
      auto agents, transfer::RegistryClient::Lookup(*registry_, name, transfer::AgentRole::kPrefill,
                                                    std::nullopt));
  if (agents.empty()) {
    return NotFound("no prefill agent named '" + name +
                    "' is registered; check its --name and that it uses the same --bootstrap");
  }
  // Equal TP sizes: decode rank r takes its shard from prefill rank r. Other sizes: rank 0, and
  // the hello refuses the pair naming both sizes.
  const bool same_size =
      std::any_of(agents.begin(), agents.end(),
                  [&](const transfer::AgentEntry& a) { return a.tp_size == tp_size_; });
  const uint32_t rank = same_size ? tp_rank_ : 0;
  const transfer::AgentEntry* pick = nullptr;
  std::string registered;
  for (const transfer::AgentEntry& a : agents) {
    registered += (registered.empty() ? "" : ", ") + std::to_string(a.tp_rank) + " of " +
                  std::to_string(a.tp_size);
    if (a.tp_rank == rank && (!same_size || a.tp_size == tp_size_)) pick = &a;
  }
  if (pick == nullptr) {
    return NotFound("prefill agent '" + name + "' has no rank " + std::to_string(rank) +
                    " registered (ranks registered: " + registered +
                    "); this decode agent is rank " + std::to_string(tp_rank_) +
                    " of tp_size=" + std::to_string(tp_size_) +
                    "; start that prefill rank or retry once it has registered");
  }
  if (layout_ && pick->layout) {
    // Refused here, before a connection or a request reaches the prefill agent (and not
    // cached: a restarted prefill agent may come back with another layout).
    Status compatible =
        transfer::CheckLayoutCompatible(*layout_, *pick->layout, "decode", "prefill");
    if (!compatible.ok()) {
      return Status(compatible.code(),
                    "prefill agent '" + name + "' rank " + std::to_string(pick->tp_rank) + " at " +
                        pick->control_address +
                        " (as registered) cannot serve this decode agent: " + compatible.message());
    }
  }
  KVT_ASSIGN_OR_RETURN(HostPort address, ParseHostPort(pick->control_address));
  std::lock_guard<std::mutex> lock(mu_);
  resolved_[name] = Resolved{address, std::chrono::steady_clock::now()};
  return address;
}

v1::Envelope AgentRpc::MakeSubmitReply(const std::string& room, const Status& status) {
  v1::Envelope reply;
  auto* r = reply.mutable_submit_reply();
  r->set_room_id(room);
  r->set_status(control::ToProtoCode(status.code()));
  if (!status.ok()) r->set_message(control::Truncate(status.message(), 4000));
  return reply;
}

void AgentRpc::ForgetResolved(const std::string& name, const HostPort& address) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = resolved_.find(name);
  // Only this address: another submit may have looked up a new one meanwhile.
  if (it != resolved_.end() && it->second.address.host == address.host &&
      it->second.address.port == address.port) {
    resolved_.erase(it);
  }
}

Status AgentRpc::Submit(const v1::SubmitRequest& request) {
  const std::string& room = request.room_id();
  SubmitSpec spec;
  spec.room = room;
  spec.tokens = static_cast<int64_t>(request.num_tokens());
  spec.deadline = std::chrono::milliseconds(request.deadline_ms());
  if (!prefill_) {
    const bool by_name = request.prefill_address().empty() && !request.prefill_name().empty();
    StatusOr<HostPort> prefill =
        !request.prefill_address().empty() ? ParseHostPort(request.prefill_address())
        : by_name
            ? ResolvePrefill(request.prefill_name())
            : StatusOr<HostPort>(InvalidArgument(
                  "a decode agent needs prefill_address or prefill_name for room '" + room + "'"));
    // Connected before any page is taken, so that a peer that does not answer holds none, and
    // a failed connect is told from the other failures.
    Status connected = prefill.ok() ? agent_->ConnectPrefill(room, prefill->host, prefill->port)
                                    : prefill.status();
    if (!connected.ok()) {
      // A looked-up address that cannot be reached is looked up again by the next submit (the
      // prefill agent may have restarted elsewhere).
      if (by_name && prefill.ok() && connected.code() != StatusCode::kAborted) {
        ForgetResolved(request.prefill_name(), *prefill);
      }
      const Status released = agent_->Release(room);
      return released.ok() ? connected : released;
    }
    spec.prefill_host = prefill->host;
    spec.prefill_port = prefill->port;
  }
  return agent_->Submit(spec);
}

void AgentRpc::OnMessage(control::ConnectionId id, const v1::Envelope& envelope) {
  v1::Envelope reply;
  switch (envelope.body_case()) {
    case v1::Envelope::kSubmitRequest:
      QueueSubmit(id, envelope);  // answered by a worker, or at once when refused
      return;
    case v1::Envelope::kAbortRoom:
      reply = HandleAbort(id, envelope.abort_room());
      break;
    case v1::Envelope::kQueryRequests: {
      std::vector<std::string> rooms(envelope.query_requests().room_ids().begin(),
                                     envelope.query_requests().room_ids().end());
      auto* out = reply.mutable_query_requests_reply();
      for (const RequestReport& r : agent_->Reports(rooms)) {
        v1::RequestReport* p = out->add_reports();
        p->set_room_id(r.room);
        p->set_state(ToProto(r.state));
        p->set_status(control::ToProtoCode(r.status.code()));
        if (!r.status.ok()) p->set_message(control::Truncate(r.status.message(), 4000));
        p->set_num_tokens(static_cast<uint64_t>(r.tokens));
        p->set_bytes(r.bytes);
        p->set_latency_us(r.latency_us);
        p->set_verified(r.verified);
        p->set_mismatches(r.mismatches);
        p->set_pages_quarantined(r.pages_quarantined);
      }
      // A reply that cannot be sent (over the frame limit) or taken (over the reports a client
      // accepts) would leave the driver waiting for nothing: it gets an error saying what to
      // ask instead.
      const size_t bytes = reply.ByteSizeLong();
      const int reports = out->reports_size();
      if (reports > control::kMaxReportsPerReply || bytes + kReplyHeadroom > max_frame_bytes_) {
        const size_t per_report = std::max<size_t>(1, bytes / std::max(1, reports));
        const size_t fit = std::min<size_t>(control::kMaxReportsPerReply,
                                            (max_frame_bytes_ - kReplyHeadroom) / per_report);
        reply = control::MakeErrorEnvelope(ResourceExhausted(fmt::format(
            "QueryRequests {} {} rooms: the reply would hold {} reports in {} bytes, over what "
            "one reply carries ({} reports, {} bytes); name at most {} room_ids per call",
            envelope.query_requests().room_ids().empty() ? "without room_ids asks for all"
                                                         : "names",
            reports, reports, bytes, control::kMaxReportsPerReply, max_frame_bytes_,
            std::max<size_t>(1, fit / 2))));
      }
      break;
    }
    case v1::Envelope::kQueryStats: {
      const AgentStats s = agent_->Stats();
      auto* out = reply.mutable_agent_stats_reply();
      out->set_name(name_);
      out->set_role(prefill_ ? v1::ROLE_PREFILL : v1::ROLE_DECODE);
      out->set_backend(std::string(agent_->engine().backend_name()));
      out->set_memory(pool::MemoryKindName(agent_->pool().memory_kind()));
      out->set_engine_port(agent_->engine_port());
      out->set_submitted(s.submitted);
      out->set_succeeded(s.succeeded);
      out->set_failed(s.failed);
      out->set_verified(s.verified);
      out->set_corrupted(s.corrupted);
      out->set_bytes(s.bytes);
      out->set_free_pages(s.free_pages);
      out->set_total_pages(s.total_pages);
      break;
    }
    default:
      reply = control::MakeErrorEnvelope(
          v1::STATUS_CODE_INVALID_ARGUMENT,
          "kvt-agent's RPC answers SubmitRequest, AbortRoom, QueryRequests and QueryStats, not " +
              std::string(control::BodyName(envelope)));
  }
  Reply(id, envelope.id(), std::move(reply));
}

}  // namespace kvt::tools

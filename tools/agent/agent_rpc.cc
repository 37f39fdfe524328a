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
    for (const SubmitJob& job : dropped)
      rooms_in_flight_.erase(job.request.submit_request().room_id());
  }
  work_cv_.notify_all();
  for (const SubmitJob& job : dropped) {
    Reply(job.connection, job.request.id(),
          control::MakeErrorEnvelope(v1::STATUS_CODE_UNAVAILABLE,
                                     "the agent is stopping; submit room '" +
                                         job.request.submit_request().room_id() +
                                         "' to another agent"));
  }
  for (std::thread& worker : workers) {
    if (worker.joinable()) worker.join();
  }
}

void AgentRpc::QueueSubmit(control::ConnectionId id, const v1::Envelope& envelope) {
  const std::string& room = envelope.submit_request().room_id();
  std::string refusal;
  v1::StatusCode code = v1::STATUS_CODE_OK;
  {
    std::lock_guard<std::mutex> lock(work_mu_);
    if (stopping_) {
      code = v1::STATUS_CODE_UNAVAILABLE;
      refusal = "the agent is stopping; submit room '" + room + "' to another agent";
    } else if (rooms_in_flight_.count(room) != 0) {
      code = v1::STATUS_CODE_ALREADY_EXISTS;
      refusal = "room '" + room + "' is being submitted to this agent already; wait for that " +
                "submit's reply";
    } else if (jobs_.size() >= kMaxQueuedSubmits) {
      code = v1::STATUS_CODE_RESOURCE_EXHAUSTED;
      refusal = "room '" + room + "': " + std::to_string(jobs_.size()) +
                " submits are waiting for one of " + std::to_string(kSubmitWorkers) +
                " workers (the limit is " + std::to_string(kMaxQueuedSubmits) +
                "; some prefill peers may not answer); retry later";
    } else {
      rooms_in_flight_.insert(room);
      jobs_.push_back(SubmitJob{id, envelope});
    }
  }
  if (code == v1::STATUS_CODE_OK) {
    work_cv_.notify_one();
    return;
  }
  v1::Envelope reply;
  auto* r = reply.mutable_submit_reply();
  r->set_room_id(room);
  r->set_status(code);
  r->set_message(refusal);
  Reply(id, envelope.id(), std::move(reply));
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
    v1::Envelope reply = Submit(job.request.submit_request());
    {
      std::lock_guard<std::mutex> lock(work_mu_);
      rooms_in_flight_.erase(job.request.submit_request().room_id());
    }
    Reply(job.connection, job.request.id(), std::move(reply));
  }
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

v1::Envelope AgentRpc::Submit(const v1::SubmitRequest& request) {
  SubmitSpec spec;
  spec.room = request.room_id();
  spec.tokens = static_cast<int64_t>(request.num_tokens());
  spec.deadline = std::chrono::milliseconds(request.deadline_ms());
  Status status;
  if (!prefill_) {
    StatusOr<HostPort> prefill =
        !request.prefill_address().empty() ? ParseHostPort(request.prefill_address())
        : !request.prefill_name().empty()
            ? ResolvePrefill(request.prefill_name())
            : StatusOr<HostPort>(InvalidArgument(
                  "a decode agent needs prefill_address or prefill_name for room '" +
                  request.room_id() + "'"));
    if (prefill.ok()) {
      spec.prefill_host = prefill->host;
      spec.prefill_port = prefill->port;
    } else {
      status = prefill.status();
    }
  }
  if (status.ok()) status = agent_->Submit(spec);
  v1::Envelope reply;
  auto* r = reply.mutable_submit_reply();
  r->set_room_id(request.room_id());
  r->set_status(control::ToProtoCode(status.code()));
  if (!status.ok()) r->set_message(control::Truncate(status.message(), 4000));
  return reply;
}

void AgentRpc::OnMessage(control::ConnectionId id, const v1::Envelope& envelope) {
  v1::Envelope reply;
  switch (envelope.body_case()) {
    case v1::Envelope::kSubmitRequest:
      QueueSubmit(id, envelope);  // answered by a worker, or at once when refused
      return;
    case v1::Envelope::kAbortRoom: {
      const Status st =
          agent_->Abort(envelope.abort_room().room_id(), envelope.abort_room().reason().empty()
                                                             ? "aborted by the driver"
                                                             : envelope.abort_room().reason());
      auto* r = reply.mutable_submit_reply();
      r->set_room_id(envelope.abort_room().room_id());
      r->set_status(control::ToProtoCode(st.code()));
      if (!st.ok()) r->set_message(control::Truncate(st.message(), 4000));
      break;
    }
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

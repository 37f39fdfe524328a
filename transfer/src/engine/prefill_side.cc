#include "engine/prefill_side.h"

#include <algorithm>

#include "control/protocol.h"
#include "engine/layout_codec.h"
#include "kvt/common/log.h"
#include "kvt/kernels/cuda_util.h"

namespace kvt::transfer::engine {
namespace {

using control::ConnectionId;

// How often the poller looks at writes in flight when the backend does not say when they
// complete (it then polls), or does (the poll is only a safety net).
constexpr auto kBusyPoll = std::chrono::microseconds(20);
constexpr auto kNotifiedPoll = std::chrono::milliseconds(5);
// Backends that do not notify, while every write in flight waits for its producer's event.
constexpr auto kSourceWaitPoll = std::chrono::microseconds(200);
// How often a room whose producer event must complete before a CPU-copying backend may read its
// layers is looked at.
constexpr auto kEventPoll = std::chrono::microseconds(200);
constexpr auto kIdlePoll = std::chrono::milliseconds(10);
// A room one of whose writes completed this recently counts as producing (a forward layer by
// layer): its next write is watched without sleeping. Longer than a layer of any forward pass,
// far shorter than a stalled one.
constexpr auto kProducingWindow = std::chrono::milliseconds(5);

constexpr size_t kSpareRunVectors = 4;
constexpr size_t kMaxSpareRunBytes = size_t{32} << 20;

// True when `event` (null: none) has completed; NotReady while it runs; an error otherwise.
StatusOr<bool> EventDone(cudaEvent_t event) {
  if (event == nullptr) return true;
  const cudaError_t rc = cudaEventQuery(event);
  if (rc == cudaSuccess) return true;
  if (rc == cudaErrorNotReady) return false;
  (void)cudaGetLastError();
  return kvt::cuda::ToStatus(rc, "cudaEventQuery on the room's ready event");
}

}  // namespace

Status PrefillSide::SilenceStatus(const Session& session, Clock::time_point now) const {
  const auto quiet =
      std::chrono::duration_cast<std::chrono::milliseconds>(now - session.last_heard);
  return Unavailable("nothing heard from the decode peer '" + session.info.name() + "' for " +
                     std::to_string(quiet.count()) + " ms (peer_timeout " +
                     std::to_string(ctx_.options.peer_timeout.count()) +
                     " ms): its writes are fenced and its requests failed; it reconnects for new "
                     "requests");
}

PrefillSide::~PrefillSide() = default;

Status PrefillSide::Start() {
  control::ControlServerOptions server = ctx_.options.server;
  server.server_id = ctx_.options.name;
  server.limits.heartbeat_interval = ctx_.options.heartbeat_interval;
  server.limits.idle_timeout = ctx_.options.peer_timeout;
  // The server polls while any request of the engine is not final.
  server.busy_poll.window = ctx_.options.control_busy_poll;
  server.busy_poll.lanes = ctx_.options.control_lanes;
  server.busy_poll.hint = [this] { return ActiveRooms() > 0; };
  // Connections come once server_ is stored: every reply goes through it.
  KVT_ASSIGN_OR_RETURN(server_, control::ControlServer::Create(
                                    server, this, control::AcceptStart::kOnStartAccepting));
  server_->StartAccepting();
  return OkStatus();
}

// ------------------------------------------------------------------------------- user calls --
Status PrefillSide::Send(const std::string& room_id, std::vector<int32_t> src_pages,
                         const SendOptions& options) {
  const std::chrono::milliseconds deadline = options.deadline;
  AfterUnlock after;
  Clock::time_point poll_by;
  {
    MutexLock lock(ctx_.mu);
    PrefillRoom* room = table_.Find(room_id);
    if (src_pages.empty() && (room == nullptr || room->chunks.empty())) {
      return InvalidArgument("room '" + room_id +
                             "' names no pages; an empty Send may only close a chunked room "
                             "after its chunks");
    }
    if (room == nullptr) {
      room = &table_.Open(room_id, deadline.count() > 0 ? deadline : ctx_.options.default_deadline);
      if (table_.active_size() == 1 && server_) server_->Wake();
    } else {
      if (IsFinal(room->state)) {
        return AlreadyExists("room '" + room_id + "' is already " + RequestStateName(room->state) +
                             "; it takes no more pages");
      }
      if (room->last_chunk) {
        return AlreadyExists("room '" + room_id + "' already has all its source pages (" +
                             std::to_string(room->src_pages.size()) + "; its last chunk was sent)");
      }
      if (!room->chunks.empty() && !src_pages.empty()) {
        const SourceChunk& previous = room->chunks.back();
        if (previous.layers_ready < ctx_.num_layers()) {
          return FailedPrecondition(
              "room '" + room_id + "': chunk " + std::to_string(room->chunks.size() - 1) +
              " is ready up to layer " + std::to_string(previous.layers_ready) + " of " +
              std::to_string(ctx_.num_layers()) + "; call LayersReady(room, " +
              std::to_string(ctx_.num_layers()) + ") for it before sending the next chunk");
        }
      }
      if (room->have_request &&
          room->src_pages.size() + src_pages.size() > room->dst_pages.size()) {
        return OutOfRange("room '" + room_id + "': a chunk of " + std::to_string(src_pages.size()) +
                          " pages after " + std::to_string(room->src_pages.size()) +
                          " would make " +
                          std::to_string(room->src_pages.size() + src_pages.size()) +
                          " source pages, but the decode side asked for " +
                          std::to_string(room->dst_pages.size()) +
                          "; the chunk was not taken (abort the room or send fewer pages)");
      }
      if (options.aux_slot >= 0 && room->aux_slot >= 0 && options.aux_slot != room->aux_slot) {
        return InvalidArgument("room '" + room_id + "' has aux slot " +
                               std::to_string(room->aux_slot) + " already; a chunk named " +
                               std::to_string(options.aux_slot));
      }
      // The decode side's request came first; the earlier of the two deadlines holds.
      if (deadline.count() > 0) room->deadline = std::min(room->deadline, Clock::now() + deadline);
    }
    if (!src_pages.empty()) {
      SourceChunk chunk;
      chunk.offset = room->src_pages.size();
      chunk.count = src_pages.size();
      if (room->src_pages.empty()) {
        room->src_pages = std::move(src_pages);  // the caller's list, not a fresh copy of it
      } else {
        room->src_pages.insert(room->src_pages.end(), src_pages.begin(), src_pages.end());
      }
      room->chunks.push_back(chunk);
    }
    // An empty last Send adds no chunk: it says the chunks so far are all (LayersReady still
    // applies to the latest of them).
    room->last_chunk = options.last;
    if (options.aux_slot >= 0) room->aux_slot = options.aux_slot;
    AdvanceLocked(*room, after);
    poll_by = PollByLocked(*room);
  }
  Run(after);
  ctx_.wakeup.KickBefore(poll_by);
  return OkStatus();
}

Status PrefillSide::LayersReady(const std::string& room_id, int32_t layers_done,
                                cudaEvent_t ready) {
  AfterUnlock after;
  Clock::time_point poll_by;
  {
    MutexLock lock(ctx_.mu);
    PrefillRoom* room = table_.Find(room_id);
    if (room == nullptr) return NotFound("no room '" + room_id + "'; call Send first");
    if (room->chunks.empty()) {
      return FailedPrecondition("room '" + room_id +
                                "' has no source pages yet (only the decode side's request); "
                                "call Send first");
    }
    // The latest chunk's layers.
    SourceChunk& chunk = room->chunks.back();
    const int32_t clamped = std::clamp(layers_done, 0, ctx_.num_layers());
    if (clamped > chunk.layers_ready && ready != nullptr) chunk.ready = ready;
    chunk.layers_ready = std::max(chunk.layers_ready, clamped);
    AdvanceLocked(*room, after);
    poll_by = PollByLocked(*room);
  }
  Run(after);
  ctx_.wakeup.KickBefore(poll_by);
  return OkStatus();
}

Status PrefillSide::Abort(const std::string& room_id, const std::string& reason) {
  AfterUnlock after;
  {
    MutexLock lock(ctx_.mu);
    PrefillRoom* room = table_.Find(room_id);
    if (room == nullptr) return NotFound("no room '" + room_id + "' on this engine");
    if (IsFinal(room->state)) return OkStatus();
    // Quiesce before telling the decode side: the abort then proves no byte lands any more.
    TakeWritesLocked(*room, after);
    table_.Fail(*room, Aborted(reason));
    FinishLocked(*room);
    if (room->have_request) {
      v1::Envelope abort;
      abort.mutable_abort()->set_room_id(room_id);
      abort.mutable_abort()->set_code(v1::STATUS_CODE_ABORTED);
      abort.mutable_abort()->set_reason(reason);
      const ConnectionId conn = room->conn;
      after.messages.push_back(
          [this, conn, abort] { SendTo(conn, abort, control::QueueLimit::kExempt); });
    }
  }
  Run(after);
  return OkStatus();
}

// ------------------------------------------------------------------------------------ poller --
EngineSide::PollResult PrefillSide::PollPass(Clock::time_point now) {
  PollResult result;
  result.next = now + kIdlePoll;
  AfterUnlock after;
  {
    MutexLock lock(ctx_.mu);
    std::vector<ConnectionId> silent;
    for (const auto& [conn, session] : sessions_) {
      if (SilentLocked(session, now)) silent.push_back(conn);
    }
    for (ConnectionId conn : silent) {
      EndSessionLocked(conn, SilenceStatus(sessions_.at(conn), now), after);
    }
    bool writes_in_flight = false;
    bool running_write = false;  // a write in flight whose copy can run now
    for (const std::string& id : table_.ActiveIds()) {
      PrefillRoom* room = table_.Find(id);
      if (room == nullptr) continue;
      if (now >= room->deadline) {
        FailAndReportLocked(
            *room,
            DeadlineExceeded("room '" + room->id + "' missed its deadline in state " +
                             RequestStateName(room->state) +
                             (room->have_request ? ""
                                                 : " (the decode side never asked "
                                                   "for it)")),
            after);
        continue;
      }
      result.next = std::min(result.next, room->deadline);
      // Layers waiting for their producer's event before a CPU-copying backend may read them.
      if (!ctx_.waits_on_events && WaitsForEventLocked(*room)) {
        AdvanceLocked(*room, after);
        if (!IsFinal(room->state)) result.next = std::min(result.next, now + kEventPoll);
      }
      // Every layer written, the aux bytes waiting for the producer's last event.
      if (WaitsForAuxLocked(*room)) {
        CheckWritesLocked(*room, after);
        if (!IsFinal(room->state)) result.next = std::min(result.next, now + kEventPoll);
        continue;
      }
      if (!room->writes.empty()) {
        CheckWritesLocked(*room, after);
        if (room->writes.empty()) continue;
        // A write can complete only once its copy runs, i.e. once its producer's event has
        // completed: while the producer still computes (a whole forward pass), the poller
        // neither spins nor polls fast.
        // A layerwise forward that is still producing (one of the room's writes completed
        // lately) is watched too, so that its last layer's completion is seen at once.
        const PostedWrite& oldest = room->writes.front();
        StatusOr<bool> source_done = EventDone(oldest.ready);
        const bool runs = !source_done.ok() || *source_done;
        const bool producing = room->last_progress != Clock::time_point() &&
                               now - room->last_progress < kProducingWindow;
        running_write |= runs;
        if ((runs || producing) && result.spin_write == 0 && ctx_.page_writes) {
          result.spin_write = oldest.id;
        }
        writes_in_flight = true;
      }
    }
    if (writes_in_flight) {
      const Clock::duration poll =
          ctx_.notified
              ? Clock::duration(kNotifiedPoll)
              : (running_write ? Clock::duration(kBusyPoll) : Clock::duration(kSourceWaitPoll));
      result.next = std::min(result.next, now + poll);
    }
    if (now - last_sweep_ > std::chrono::seconds(1)) {
      last_sweep_ = now;
      table_.Sweep(now, ctx_.options.retention, [](const PrefillRoom&) { return true; });
    }
  }
  Run(after);
  return result;
}

void PrefillSide::Shutdown() {
  // Quiesce first, tell the peers, and only then close the sessions: a decode side that sees
  // the connection close has been told about every room, and no write of ours lands later.
  AfterUnlock after;
  {
    MutexLock lock(ctx_.mu);
    for (auto& [conn, session] : sessions_) session.closing = true;
    for (const std::string& id : table_.ActiveIds()) {
      PrefillRoom* room = table_.Find(id);
      if (room == nullptr) continue;
      FailAndReportLocked(
          *room,
          Unavailable("the prefill engine '" + ctx_.options.name + "' is shutting down (room '" +
                      room->id + "' was " + RequestStateName(room->state) +
                      "); send the room to a running prefill engine"),
          after);
    }
    // The releases and TransferDones go to the worker before the lock goes, and are waited for
    // below, before the connections close. A decode side's abort that comes meanwhile finds
    // these rooms over and queues its AbortAck ("writes quiesced") on the worker too: behind
    // these releases, never before them.
    if (ctx_.worker) {
      ctx_.worker->Post(std::move(after));
      after = AfterUnlock();
    }
  }
  after.Run(*ctx_.backend);  // without a worker: here
  if (ctx_.worker) ctx_.worker->Drain();
  // Every write is quiesced and no request is acted on any more: say so to every peer, which
  // may then reuse the pages of every room of the session (even one whose request is still on
  // the way). Rooms that ended on other threads just before have their TransferDones sent
  // first (bounded: sending only queues a frame).
  std::vector<ConnectionId> conns;
  {
    MutexLock lock(ctx_.mu);
    const Clock::time_point until = Clock::now() + std::chrono::seconds(2);
    while (pending_dones_ > 0 && Clock::now() < until) dones_cv_.WaitUntil(ctx_.mu, until);
    for (const auto& [conn, session] : sessions_) conns.push_back(conn);
  }
  v1::Envelope goodbye;
  goodbye.mutable_goodbye()->set_reason("the prefill engine '" + ctx_.options.name +
                                        "' is shutting down");
  goodbye.mutable_goodbye()->set_writes_quiesced(true);
  for (ConnectionId conn : conns) SendTo(conn, goodbye, control::QueueLimit::kExempt);
  // Connections flush what was queued (the TransferDones above) before they close; each close
  // comes back through OnDisconnect, which disconnects the session's backend peer.
  if (server_) server_->Stop();
  MutexLock lock(ctx_.mu);
  for (auto& [conn, session] : sessions_) {
    after.disconnects.push_back(session.backend_peer);
  }
  sessions_.clear();
  lock.Unlock();
  after.Run(*ctx_.backend);
  if (ctx_.worker) ctx_.worker->Drain();
}

// --------------------------------------------------------------------------- control server --
void PrefillSide::OnConnect(ConnectionId id, const control::ConnectionInfo& info) {
  KVT_LOG_DEBUG("xfer", "control connection {} from {}", id, info.remote_address);
}

void PrefillSide::OnMessage(ConnectionId conn, const v1::Envelope& envelope) {
  // Any frame says the peer is alive: the handlers of requests and aborts note it under the lock
  // they take anyway; the rarer frames below note it here.
  switch (envelope.body_case()) {
    case v1::Envelope::kHello:
      return OnHello(conn, envelope.hello());
    case v1::Envelope::kTransferRequest:
      return OnTransferRequest(conn, envelope);
    case v1::Envelope::kAbort:
      return OnAbort(conn, envelope.abort());
    case v1::Envelope::kAbortAck:
      OnHeartbeat(conn);
      // The decode side acknowledged an abort this engine sent; the room is already final here
      // and its writes were released before the abort went out.
      KVT_LOG_DEBUG("xfer", "abort of room '{}' acknowledged", envelope.abort_ack().room_id());
      return;
    case v1::Envelope::kError:
      OnHeartbeat(conn);
      KVT_LOG_WARN("xfer", "connection {} reported: {}", conn,
                   control::StatusFromError(envelope.error()).ToString());
      return;
    default:
      SendTo(conn, control::MakeErrorEnvelope(v1::STATUS_CODE_INVALID_ARGUMENT,
                                              "a prefill engine does not accept " +
                                                  std::string(control::BodyName(envelope)) +
                                                  " messages"));
  }
}

void PrefillSide::OnDisconnect(ConnectionId conn, const Status& why) {
  AfterUnlock after;
  {
    MutexLock lock(ctx_.mu);
    if (sessions_.count(conn) == 0) return;
    EndSessionLocked(
        conn, Unavailable("the decode peer's control connection was lost (" + why.ToString() + ")"),
        after);
  }
  Run(after);
}

void PrefillSide::OnHeartbeat(ConnectionId conn) {
  MutexLock lock(ctx_.mu);
  auto session = sessions_.find(conn);
  if (session != sessions_.end()) session->second.last_heard = Clock::now();
}

void PrefillSide::EndSessionLocked(ConnectionId conn, const Status& why, AfterUnlock& after) {
  auto session = sessions_.find(conn);
  if (session == sessions_.end()) return;
  // The endpoint closes first (forcibly): the writes released below then end at once, even
  // toward a peer or a network that does not answer.
  after.dead_peers.push_back(session->second.backend_peer);
  int failed = 0;
  for (const std::string& id : table_.ActiveIds()) {
    PrefillRoom* room = table_.Find(id);
    if (room == nullptr || !room->have_request || room->conn != conn) continue;
    TakeWritesLocked(*room, after);
    table_.Fail(*room, why);
    FinishLocked(*room);
    ++failed;
  }
  if (failed > 0) {
    KVT_LOG_WARN("xfer", "decode peer '{}': {}; {} requests failed", session->second.info.name(),
                 why.ToString(), failed);
  } else {
    KVT_LOG_INFO("xfer", "decode peer '{}': {}", session->second.info.name(), why.ToString());
  }
  sessions_.erase(session);
  // A session ended for silence still has its connection (a closed one: NotFound, ignored).
  after.messages.push_back([this, conn, why] {
    if (server_) (void)server_->Disconnect(conn, why);
  });
}

void PrefillSide::OnHello(ConnectionId conn, const v1::Hello& hello) {
  Status compatible =
      CheckCompatible(ctx_.local_layout, hello.peer().layout(), "prefill", "decode");
  if (compatible.ok() && hello.peer().buffers_size() != ctx_.local_info.buffers_size()) {
    compatible =
        FailedPrecondition("buffer count mismatch: prefill registers " +
                           std::to_string(ctx_.local_info.buffers_size()) + " buffers, decode " +
                           std::to_string(hello.peer().buffers_size()));
  }
  StatusOr<PeerDescriptor> descriptor =
      compatible.ok() ? DescriptorFromPeerInfo(hello.peer(), ctx_.backend->Name())
                      : StatusOr<PeerDescriptor>(compatible);
  StatusOr<PeerId> backend_peer =
      descriptor.ok() ? ctx_.backend->Connect(*descriptor) : StatusOr<PeerId>(descriptor.status());
  auto refuse = [&](const Status& why) {
    KVT_LOG_WARN("xfer", "refusing decode peer '{}': {}", hello.peer().name(), why.ToString());
    SendTo(conn, control::MakeErrorEnvelope(why));
    (void)server_->Disconnect(conn, why);
  };
  if (!backend_peer.ok()) return refuse(backend_peer.status());
  v1::Envelope ack;
  ack.mutable_hello_ack()->set_protocol_version(control::kProtocolVersion);
  *ack.mutable_hello_ack()->mutable_peer() = ctx_.local_info;
  if (ctx_.backend->Capabilities().two_sided) {
    StatusOr<std::string> token = ctx_.backend->ConnectToken(*backend_peer);
    if (!token.ok()) {
      (void)ctx_.backend->Disconnect(*backend_peer, Backend::DisconnectMode::kPeerDead);
      return refuse(token.status());
    }
    ack.mutable_hello_ack()->set_backend_token(*token);
  }
  // Both sides' buffers for the plans: the layouts matched, so buffer i is the same tensor of
  // the same layer on both sides.
  std::vector<PlanBuffer> buffers;
  buffers.reserve(ctx_.buffers.size());
  for (size_t i = 0; i < ctx_.buffers.size(); ++i) {
    const v1::MemoryDescriptor& remote = hello.peer().buffers(static_cast<int>(i));
    buffers.push_back(PlanBuffer{ctx_.buffers[i].layer, ctx_.buffers[i].info.item_len,
                                 remote.item_len(), ctx_.buffers[i].info.length, remote.length()});
  }
  {
    MutexLock lock(ctx_.mu);
    Session& session = sessions_[conn];
    session.backend_peer = *backend_peer;
    session.info = hello.peer();
    session.buffers = std::move(buffers);
  }
  SendTo(conn, ack);
  KVT_LOG_INFO("xfer", "decode peer '{}' connected", hello.peer().name());
}

void PrefillSide::OnTransferRequest(ConnectionId conn, const v1::Envelope& envelope) {
  const v1::TransferRequest& req = envelope.transfer_request();
  bool new_room = false;
  AfterUnlock after;
  Clock::time_point poll_by;
  {
    MutexLock lock(ctx_.mu);
    auto reject = [&](const Status& why) {
      SendTo(conn, control::MakeErrorEnvelope(why, req.room_id()));
    };
    auto session = sessions_.find(conn);
    if (session == sessions_.end()) {
      return reject(FailedPrecondition("send Hello before TransferRequest"));
    }
    session->second.last_heard = Clock::now();
    if (session->second.closing) {
      return reject(Unavailable("the prefill engine '" + ctx_.options.name +
                                "' is shutting down; send the room to another prefill engine"));
    }
    if (req.mode() != v1::TRANSFER_MODE_PUSH) {
      return reject(Unimplemented("room '" + req.room_id() +
                                  "': only push mode is implemented on this engine"));
    }
    if (!req.backend().empty() && req.backend() != ctx_.backend->Name()) {
      return reject(InvalidArgument("room '" + req.room_id() + "' asks for backend '" +
                                    req.backend() + "' but this engine runs '" +
                                    std::string(ctx_.backend->Name()) + "'"));
    }
    int32_t begin = 0, end = ctx_.num_layers();
    if (req.has_layers()) {
      begin = static_cast<int32_t>(req.layers().begin());
      end = static_cast<int32_t>(req.layers().end());
    }
    const auto deadline = req.deadline_ms() > 0 ? std::chrono::milliseconds(req.deadline_ms())
                                                : ctx_.options.default_deadline;
    PrefillRoom* room = table_.Find(req.room_id());
    if (room == nullptr) {
      room = &table_.Open(req.room_id(), deadline);
      new_room = true;
    } else {
      if (IsFinal(room->state) && !room->have_request) {
        // Ended here (aborted, failed, out of time) before the decode side asked: say why.
        const StatusCode code = room->status.ok() ? StatusCode::kAborted : room->status.code();
        return reject(Status(code, "room '" + req.room_id() +
                                       "' ended on the prefill side before this request "
                                       "arrived: " +
                                       room->status.message()));
      }
      if (room->have_request || IsFinal(room->state)) {
        return reject(AlreadyExists("room '" + req.room_id() + "' was already requested (" +
                                    RequestStateName(room->state) + ")"));
      }
      // Send came first; the earlier of the two deadlines holds.
      if (req.deadline_ms() > 0) room->deadline = std::min(room->deadline, Clock::now() + deadline);
    }
    room->have_request = true;
    room->request_seen = Clock::now();
    room->conn = conn;
    room->layer_begin = begin;
    room->layer_end = end;
    room->dst_pages = control::DstPages(req);
    for (const v1::PageSlice& s : req.slices()) {
      room->units.push_back(PageUnit{s.src_offset(), s.dst_offset(), s.bytes()});
    }
    if (req.has_aux_slot()) room->dst_aux_slot = req.aux_slot();
    AdvanceLocked(*room, after);
    poll_by = PollByLocked(*room);
  }
  Run(after);
  ctx_.wakeup.KickBefore(poll_by);
  if (new_room && ctx_.options.on_transfer_request) {
    ctx_.options.on_transfer_request(req.room_id(), control::DstPageCount(req));
  }
}

void PrefillSide::OnAbort(ConnectionId conn, const v1::Abort& abort) {
  AfterUnlock after;
  {
    MutexLock lock(ctx_.mu);
    if (auto session = sessions_.find(conn); session != sessions_.end()) {
      session->second.last_heard = Clock::now();
    }
    PrefillRoom* room = table_.Find(abort.room_id());
    const bool owned = room != nullptr && room->have_request && room->conn == conn;
    if (owned) {
      TakeWritesLocked(*room, after);
      table_.Fail(*room, Aborted("aborted by the decode side: " + abort.reason()));
      FinishLocked(*room);
    }
    // Acknowledged once the writes are released (or none were posted). A room that ended here
    // earlier (its own abort, deadline or failure) may still be releasing its writes on the
    // worker, and an unknown room may be one forgotten meanwhile: the ack then goes through
    // the worker's queue too (a task), behind those releases, never beside them.
    v1::Envelope ack;
    ack.mutable_abort_ack()->set_room_id(abort.room_id());
    ack.mutable_abort_ack()->set_writes_quiesced(true);
    // The first ack of one of this peer's rooms is never dropped for a full send queue (the
    // peer's pages wait for it); others are held to the queue's limits, so a peer that sends
    // aborts without reading cannot grow the queue.
    const bool exempt = owned && !std::exchange(room->abort_acked, true);
    const control::QueueLimit limit =
        exempt ? control::QueueLimit::kExempt : control::QueueLimit::kEnforced;
    after.tasks.push_back([this, conn, ack, limit] { SendTo(conn, ack, limit); });
  }
  Run(after);
}

// ----------------------------------------------------------------------- room state machine --
void PrefillSide::AdvanceLocked(PrefillRoom& room, AfterUnlock& after) {
  if (IsFinal(room.state) || !room.have_src() || !room.have_request) return;
  auto session = sessions_.find(room.conn);
  if (session == sessions_.end()) {
    TakeWritesLocked(room, after);
    table_.Fail(room, Unavailable("the decode peer's session is gone"));
    FinishLocked(room);
    return;
  }
  if (session->second.closing) return;  // Shutdown fails the room
  const size_t want = room.dst_pages.size();
  const size_t have = room.src_pages.size();
  if (have > want || (room.last_chunk && have != want)) {
    return FailAndReportLocked(
        room,
        InvalidArgument(
            "room '" + room.id + "': the decode side asked for " + std::to_string(want) +
            " pages but the prefill side has " + std::to_string(have) +
            (room.chunks.size() > 1 ? " in " + std::to_string(room.chunks.size()) + " chunks"
                                    : std::string()) +
            (room.last_chunk ? "" : " before its last chunk")),
        after);
  }
  table_.Advance(room, RequestState::kWaitingForInput);
  if (room.source_ready == Clock::time_point() && room.last_chunk &&
      std::all_of(room.chunks.begin(), room.chunks.end(),
                  [&](const SourceChunk& c) { return c.layers_ready >= room.layer_end; })) {
    room.source_ready = Clock::now();
  }
  bool posted = false;
  for (SourceChunk& chunk : room.chunks) {
    if (!chunk.planned) {
      Status planned = PlanChunkLocked(room, chunk, session->second);
      if (!planned.ok()) {
        return FailAndReportLocked(room, planned.WithContext("room '" + room.id + "'"), after);
      }
    }
    const int32_t ready_end = std::min(chunk.layers_ready, room.layer_end);
    if (ready_end <= chunk.posted_end) continue;
    // Checked right before every post: an engine that was paused (or starved) past its peer's
    // silence never posts to it on waking, whatever its io threads have noticed so far.
    const Clock::time_point now = Clock::now();
    if (SilentLocked(session->second, now)) {
      return EndSessionLocked(room.conn, SilenceStatus(session->second, now), after);
    }
    if (!ctx_.waits_on_events) {
      // A CPU copy cannot wait on the GPU: the producer's event must have completed before the
      // layers are read. Never waited for here (the lock is held): the poller looks again.
      StatusOr<bool> done = EventDone(chunk.ready);
      if (!done.ok()) {
        return FailAndReportLocked(room, done.status().WithContext("room '" + room.id + "'"),
                                   after);
      }
      if (!*done) continue;
    }
    uint64_t bytes = 0;
    size_t num_runs = 0;
    StatusOr<WriteId> write =
        PostLayersLocked(room, chunk, session->second, ready_end, &bytes, &num_runs);
    if (!write.ok()) {
      return FailAndReportLocked(
          room, write.status().WithContext("posting layers of room '" + room.id + "'"), after);
    }
    room.writes.push_back(PostedWrite{*write, ctx_.waits_on_events ? chunk.ready : nullptr});
    room.last_post = Clock::now();
    if (room.first_post == Clock::time_point()) room.first_post = room.last_post;
    room.bytes += bytes;
    chunk.posted_end = ready_end;
    ++ctx_.stats.writes_posted;
    ctx_.stats.runs_posted += num_runs;
    posted = true;
  }
  if (posted) {
    // Layers posted for every page declared so far.
    int32_t posted_end = room.layer_end;
    for (const SourceChunk& chunk : room.chunks)
      posted_end = std::min(posted_end, chunk.posted_end);
    room.layers_posted = posted_end - room.layer_begin;
    table_.Advance(room, RequestState::kTransferring);
    if (!AllPostedLocked(room)) {
      v1::Envelope progress;
      progress.mutable_layer_progress()->set_room_id(room.id);
      progress.mutable_layer_progress()->set_layers_done(static_cast<uint32_t>(room.layers_posted));
      progress.mutable_layer_progress()->set_bytes_done(room.bytes);
      SendTo(room.conn, progress);
    }
  }
  CheckWritesLocked(room, after);
}

Status PrefillSide::PlanChunkLocked(PrefillRoom& room, SourceChunk& chunk, const Session& session) {
  PlanSpec spec;
  spec.src_pages = std::span<const int32_t>(room.src_pages).subspan(chunk.offset, chunk.count);
  spec.dst_pages = std::span<const int32_t>(room.dst_pages).subspan(chunk.offset, chunk.count);
  spec.num_layers = ctx_.num_layers();
  spec.layer_begin = room.layer_begin;
  spec.layer_end = room.layer_end;
  spec.units = room.units;
  spec.buffers = session.buffers;
  if (ctx_.page_writes) {
    // The backend takes the page lists themselves; validate them as a plan would.
    KVT_RETURN_IF_ERROR(ValidatePlanSpec(spec));
  } else {
    KVT_ASSIGN_OR_RETURN(Plan plan, BuildPlan(spec, TakeSpareRunsLocked()));
    chunk.plan = std::move(plan);
  }
  chunk.planned = true;
  chunk.posted_end = room.layer_begin;
  return OkStatus();
}

StatusOr<WriteId> PrefillSide::PostLayersLocked(PrefillRoom& room, SourceChunk& chunk,
                                                const Session& session, int32_t ready_end,
                                                uint64_t* bytes, size_t* num_runs) {
  if (ctx_.page_writes) {
    PageWrite write;
    write.src_pages = std::span<const int32_t>(room.src_pages).subspan(chunk.offset, chunk.count);
    write.dst_pages = std::span<const int32_t>(room.dst_pages).subspan(chunk.offset, chunk.count);
    write.num_layers = ctx_.num_layers();
    write.layer_begin = chunk.posted_end;
    write.layer_end = ready_end;
    write.units = room.units;
    PlanSpec spec;
    spec.src_pages = write.src_pages;
    spec.num_layers = ctx_.num_layers();
    spec.layer_begin = chunk.posted_end;
    spec.layer_end = ready_end;
    spec.units = room.units;
    spec.buffers = session.buffers;
    write.bytes = PlanBytes(spec);
    // Backends that wait on the GPU take the event; for the others it has completed already.
    write.ready = ctx_.waits_on_events ? chunk.ready : nullptr;
    *bytes = write.bytes;
    *num_runs = 0;
    return ctx_.backend->PostPages(session.backend_peer, write);
  }
  std::span<const CopyRun> runs = chunk.plan->Layers(chunk.posted_end, ready_end);
  *bytes = 0;
  for (const CopyRun& r : runs) *bytes += r.bytes;
  *num_runs = runs.size();
  return ctx_.backend->PostWrite(session.backend_peer, runs);
}

Clock::time_point PrefillSide::PollByLocked(const PrefillRoom& room) const {
  if (IsFinal(room.state)) return Clock::time_point::max();
  if (!room.writes.empty()) return Clock::time_point::min();  // checked (or watched) now
  return WaitsForEventLocked(room) || WaitsForAuxLocked(room) ? Clock::time_point::min()
                                                              : room.deadline;
}

bool PrefillSide::WaitsForEventLocked(const PrefillRoom& room) const {
  return std::any_of(room.chunks.begin(), room.chunks.end(), [&](const SourceChunk& c) {
    return c.ready != nullptr && c.planned &&
           std::min(c.layers_ready, room.layer_end) > c.posted_end;
  });
}

bool PrefillSide::AllPostedLocked(const PrefillRoom& room) const {
  if (!room.last_chunk || room.src_pages.size() != room.dst_pages.size()) return false;
  return std::all_of(room.chunks.begin(), room.chunks.end(), [&](const SourceChunk& c) {
    return c.planned && c.posted_end == room.layer_end;
  });
}

StatusOr<bool> PrefillSide::AuxReadyLocked(const PrefillRoom& room) const {
  if (!room.dst_aux_slot) return true;
  if (room.aux_slot < 0) {
    return FailedPrecondition("room '" + room.id + "': the decode side asked for aux data (into " +
                              "its slot " + std::to_string(*room.dst_aux_slot) +
                              ") but the prefill side's Send named no aux slot; pass "
                              "SendOptions::aux_slot");
  }
  // Aux bytes come from the end of the forward pass: whatever layer range the decode side
  // asked for, they are read only once the last chunk is ready in every layer and the
  // producer's event of that call has completed (a CUDA pool's producer may still be writing
  // them on its stream).
  const SourceChunk& last = room.chunks.back();
  if (last.layers_ready < ctx_.num_layers()) return false;
  return EventDone(last.ready);
}

bool PrefillSide::WaitsForAuxLocked(const PrefillRoom& room) const {
  if (!room.dst_aux_slot || IsFinal(room.state) || !room.writes.empty() || !AllPostedLocked(room)) {
    return false;
  }
  const SourceChunk& last = room.chunks.back();
  return last.layers_ready >= ctx_.num_layers() && last.ready != nullptr;
}

Status PrefillSide::ReadAuxLocked(PrefillRoom& room) {
  if (!room.dst_aux_slot) return OkStatus();
  // Host memory the producer wrote before its final LayersReady call (the layout checked it).
  room.aux.clear();
  for (const BufferInfo& aux : ctx_.layout.aux) {
    const char* slot = reinterpret_cast<const char*>(
        aux.ptr + static_cast<uint64_t>(room.aux_slot) * aux.item_len);
    room.aux.emplace_back(slot, aux.item_len);
  }
  return OkStatus();
}

void PrefillSide::CheckWritesLocked(PrefillRoom& room, AfterUnlock& after) {
  if (IsFinal(room.state)) return;
  while (!room.writes.empty()) {
    const WriteId write = room.writes.front().id;
    Status st = ctx_.backend->Check(write);
    if (st.code() == StatusCode::kInProgress) return;  // later writes cannot be done sooner
    if (!st.ok()) {
      return FailAndReportLocked(room, st.WithContext("writing room '" + room.id + "'"), after);
    }
    after.frees.push_back(write);  // complete: releasing it only frees its handle
    room.writes.erase(room.writes.begin());
    room.last_progress = Clock::now();
  }
  if (AllPostedLocked(room)) {
    // The KV is visible at the peer; the aux bytes go with the done message once the producer
    // has written them (LayersReady or the poller comes back for them).
    StatusOr<bool> aux_ready = AuxReadyLocked(room);
    if (!aux_ready.ok()) return FailAndReportLocked(room, aux_ready.status(), after);
    if (!*aux_ready) return;
    Status aux = ReadAuxLocked(room);
    if (!aux.ok()) return FailAndReportLocked(room, aux, after);
    room.status = OkStatus();
    table_.Advance(room, RequestState::kSuccess);
    FinishLocked(room);
    QueueDoneLocked(room, after);
    KVT_LOG_DEBUG(
        "xfer", "room '{}' done: {} bytes, {} us after it was created", room.id, room.bytes,
        std::chrono::duration_cast<std::chrono::microseconds>(room.finished - room.created)
            .count());
  }
}

void PrefillSide::FailAndReportLocked(PrefillRoom& room, Status why, AfterUnlock& after) {
  TakeWritesLocked(room, after);
  const bool failed_now = table_.Fail(room, std::move(why));
  FinishLocked(room);
  if (!failed_now) return;
  KVT_LOG_WARN("xfer", "room '{}' failed: {}", room.id, room.status.ToString());
  QueueDoneLocked(room, after);
}

void PrefillSide::TakeWritesLocked(PrefillRoom& room, AfterUnlock& after) {
  for (const PostedWrite& w : room.writes) after.releases.push_back(w.id);
  room.writes.clear();
}

void PrefillSide::QueueDoneLocked(const PrefillRoom& room, AfterUnlock& after) {
  if (!room.have_request) return;
  v1::Envelope done;
  auto* d = done.mutable_transfer_done();
  d->set_room_id(room.id);
  d->set_status(control::ToProtoCode(room.status.code()));
  if (!room.status.ok()) d->set_message(control::Truncate(room.status.message(), 4000));
  d->set_bytes(room.bytes);
  if (room.status.ok()) {
    for (const std::string& bytes : room.aux) d->add_aux(bytes);
  }
  const ConnectionId conn = room.conn;
  ++pending_dones_;
  after.messages.push_back([this, conn, done = std::move(done)] {
    SendTo(conn, done, control::QueueLimit::kExempt);  // one per room: never dropped
    MutexLock lock(ctx_.mu);
    --pending_dones_;
    dones_cv_.NotifyAll();
  });
}

void PrefillSide::FinishLocked(PrefillRoom& room) {
  if (!IsFinal(room.state)) return;
  // The backend copied the runs when they were posted: the storage can serve the next plan.
  for (SourceChunk& chunk : room.chunks) {
    if (chunk.plan) {
      RecycleRunsLocked(std::move(chunk.plan->runs));
      chunk.plan.reset();
    }
  }
  // Nothing reads a final room's page lists: freed now, not when the room is forgotten minutes
  // later (retention), so that the next requests' lists reuse this memory instead of faulting in
  // new pages (tens of µs for the 8192 pages of a 1-token-per-page request).
  std::vector<int32_t>().swap(room.src_pages);
  std::vector<int32_t>().swap(room.dst_pages);
}

void PrefillSide::SendTo(ConnectionId conn, const v1::Envelope& envelope,
                         control::QueueLimit limit) {
  if (!server_) return;
  Status sent = server_->Send(conn, envelope, limit);
  if (!sent.ok()) {
    KVT_LOG_DEBUG("xfer", "could not send {} on connection {}: {}", control::BodyName(envelope),
                  conn, sent.ToString());
  }
}

void PrefillSide::RecycleRunsLocked(std::vector<CopyRun> runs) {
  if (runs.capacity() == 0 || runs.capacity() * sizeof(CopyRun) > kMaxSpareRunBytes) return;
  if (spare_runs_.size() < kSpareRunVectors) {
    spare_runs_.push_back(std::move(runs));
    return;
  }
  // Full: keep the larger vectors (they serve every smaller plan without regrowing).
  auto smallest =
      std::min_element(spare_runs_.begin(), spare_runs_.end(),
                       [](const auto& a, const auto& b) { return a.capacity() < b.capacity(); });
  if (smallest->capacity() < runs.capacity()) *smallest = std::move(runs);
}

std::vector<CopyRun> PrefillSide::TakeSpareRunsLocked() {
  if (spare_runs_.empty()) return {};
  auto largest =
      std::max_element(spare_runs_.begin(), spare_runs_.end(),
                       [](const auto& a, const auto& b) { return a.capacity() < b.capacity(); });
  std::vector<CopyRun> runs = std::move(*largest);
  spare_runs_.erase(largest);
  return runs;
}

uint64_t PrefillSide::ControlLanes() const {
  return server_ != nullptr ? server_->lane_count() : 0;
}

}  // namespace kvt::transfer::engine

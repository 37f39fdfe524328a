#include "engine/decode_side.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "control/protocol.h"
#include "engine/layout_codec.h"
#include "engine/process_identity.h"
#include "kvt/common/log.h"

namespace kvt::transfer::engine {
namespace {

constexpr auto kIdlePoll = std::chrono::milliseconds(10);
// How often the liveness worker looks at lost peers, and how long one port probe may take.
constexpr auto kLivenessPeriod = std::chrono::milliseconds(50);
constexpr int kPortProbeTimeoutMs = 200;
// How long a shutdown keeps the connections open for the prefill engines to confirm that their
// writes into the rooms it ended stopped: the time a prefill engine allows itself to stop its
// copies once it knows (kFenceTeardown), counted from its receipt of the Abort, plus a margin
// for the Abort's way there and the answer's way back.
constexpr auto kShutdownAnswerWait = kFenceTeardown + std::chrono::milliseconds(500);

// True when nothing listens at host:port (connection refused). False when it accepts, or when
// the answer is unclear (timeout, name not resolved).
bool PortRefuses(const std::string& host, uint16_t port) {
  addrinfo hints = {};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return false;
  bool refused = false;
  int fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    int rc = connect(fd, res->ai_addr, res->ai_addrlen);
    if (rc != 0 && errno == ECONNREFUSED) {
      refused = true;
    } else if (rc != 0 && errno == EINPROGRESS) {
      pollfd pfd = {fd, POLLOUT, 0};
      if (poll(&pfd, 1, kPortProbeTimeoutMs) == 1) {
        int err = 0;
        socklen_t len = sizeof(err);
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        refused = err == ECONNREFUSED;
      }
    }
    close(fd);
  }
  freeaddrinfo(res);
  return refused;
}

}  // namespace

DecodeSide::~DecodeSide() = default;

Status DecodeSide::Start() {
  liveness_ = std::thread([this] { LivenessLoop(); });
  return OkStatus();
}

// ------------------------------------------------------------------------------- connecting --
StatusOr<PeerHandle> DecodeSide::ConnectPeer(const std::string& host, uint16_t port) {
  const std::string address = host + ":" + std::to_string(port);
  std::promise<StatusOr<PeerHandle>> result;
  {
    MutexLock lock(ctx_.mu);
    if (ctx_.stop) return FailedPrecondition("the decode engine is shutting down");
    if (ctx_.interrupted) {
      return Aborted("ConnectPeer(" + address +
                     ") after TransferEngine::Interrupt: the engine is closing");
    }
    for (auto& [id, peer] : peers_) {
      if (peer->address == address && peer->alive) return id;
    }
    auto pending = connecting_.find(address);
    if (pending != connecting_.end()) {
      // Another caller is connecting to this address: share its connection.
      std::shared_future<StatusOr<PeerHandle>> shared = pending->second;
      lock.Unlock();
      return shared.get();
    }
    connecting_[address] = result.get_future().share();
  }
  StatusOr<PeerHandle> connected = Connect(host, port, address);
  {
    MutexLock lock(ctx_.mu);
    connecting_.erase(address);
  }
  result.set_value(connected);
  return connected;
}

StatusOr<PeerHandle> DecodeSide::Connect(const std::string& host, uint16_t port,
                                         const std::string& address) {
  auto peer = std::make_unique<DecodePeer>();
  peer->address = address;
  peer->host = host;
  peer->port = port;
  std::future<StatusOr<v1::HelloAck>> hello_reply = peer->hello_reply.get_future();
  PeerHandle id;
  DecodePeer* raw = peer.get();
  {
    MutexLock lock(ctx_.mu);
    // Checked again where the peer becomes visible to Interrupt: one that came after
    // ConnectPeer's check would not find this peer to end its wait for the hello's answer.
    if (ctx_.interrupted) {
      return Aborted("ConnectPeer(" + address +
                     ") after TransferEngine::Interrupt: the engine is closing");
    }
    id = next_peer_++;
    raw->id = id;
    raw->handler = std::make_unique<PeerClientHandler>(this, id);
    peers_[id] = std::move(peer);
  }
  control::ControlClientOptions copts;
  copts.host = host;
  copts.port = port;
  copts.client_id = ctx_.options.name;
  copts.role = v1::ROLE_DECODE;
  copts.cluster_token = ctx_.options.cluster_token;
  copts.limits.heartbeat_interval = ctx_.options.heartbeat_interval;
  copts.limits.idle_timeout = ctx_.options.peer_timeout;
  // A connection polls while its own peer has requests in flight (not the whole engine's: a
  // decode engine with many prefill peers would spin a core per peer).
  copts.busy_poll.window = ctx_.options.control_busy_poll;
  copts.busy_poll.lanes = ctx_.options.control_lanes;
  copts.busy_poll.hint = [raw] { return raw->in_flight.load(std::memory_order_relaxed) > 0; };
  auto client = control::ControlClient::Connect(copts, raw->handler.get());
  if (!client.ok()) {
    DropPeer(id);
    return client.status().WithContext("connecting to prefill engine at " + address);
  }
  control::ControlClient* client_raw = client->get();
  bool interrupted;
  {
    MutexLock lock(ctx_.mu);
    raw->client = std::move(client).value();
    interrupted = ctx_.interrupted;
  }
  if (interrupted) {
    // Interrupted while the connection was being made (that part is bounded by the connect
    // timeout, not ended by Interrupt): no hello goes out.
    DropPeer(id);
    return Aborted("ConnectPeer(" + address +
                   ") interrupted (TransferEngine::Interrupt: the engine is closing)");
  }
  v1::Envelope hello;
  hello.mutable_hello()->set_protocol_version(control::kProtocolVersion);
  *hello.mutable_hello()->mutable_peer() = ctx_.local_info;
  Status sent = client_raw->Send(hello);
  if (!sent.ok()) {
    DropPeer(id);
    return sent.WithContext("sending hello to " + address);
  }
  const auto hello_timeout = ctx_.options.hello_timeout;
  if (hello_reply.wait_for(hello_timeout) != std::future_status::ready) {
    DropPeer(id);
    return DeadlineExceeded("prefill engine at " + address + " did not answer hello in " +
                            std::to_string(hello_timeout.count()) +
                            " ms (EngineOptions::hello_timeout); is it a kvt prefill engine, "
                            "and is it overloaded?");
  }
  StatusOr<v1::HelloAck> ack = hello_reply.get();
  if (!ack.ok()) {
    DropPeer(id);
    return ack.status().WithContext("hello to " + address);
  }
  const v1::PeerInfo& reply = ack->peer();
  // The prefill side checked compatibility too; check here as well so the error names both
  // sides' values from this side's point of view.
  Status compatible = CheckCompatible(ctx_.local_layout, reply.layout(), "decode", "prefill");
  if (!compatible.ok()) {
    DropPeer(id);
    return compatible;
  }
  std::optional<PeerId> backend_peer;
  if (ctx_.backend->Capabilities().two_sided) {
    // The receiving side takes part in the transfers: join the connection the prefill side
    // made for us.
    StatusOr<PeerDescriptor> descriptor = DescriptorFromPeerInfo(reply, ctx_.backend->Name());
    StatusOr<PeerId> joined = descriptor.ok()
                                  ? ctx_.backend->Accept(*descriptor, ack->backend_token())
                                  : StatusOr<PeerId>(descriptor.status());
    if (!joined.ok()) {
      DropPeer(id);
      return joined.status().WithContext("joining the " + std::string(ctx_.backend->Name()) +
                                         " connection of prefill engine at " + address);
    }
    backend_peer = *joined;
  }
  Status why;
  {
    MutexLock lock(ctx_.mu);
    raw->info = reply;
    raw->backend_peer = backend_peer;
    if (!raw->closed_while_connecting) {
      raw->alive = true;
      KVT_LOG_INFO("xfer", "connected to prefill '{}' at {}", reply.name(), address);
      return id;
    }
    why = *raw->closed_while_connecting;
  }
  // The connection ended after the hello-ack (the prefill engine went away meanwhile): no
  // disconnect will come for it any more, so it is dropped here, with its backend peer.
  DropPeer(id);
  return Unavailable("prefill engine at " + address +
                     " closed the connection right after answering hello (" + why.ToString() +
                     "); is it shutting down? Connect again once it is back");
}

void DecodeSide::DropPeer(PeerHandle id) {
  std::unique_ptr<DecodePeer> peer;
  {
    MutexLock lock(ctx_.mu);
    auto it = peers_.find(id);
    if (it == peers_.end()) return;
    peer = std::move(it->second);
    peers_.erase(it);
  }
  if (peer->client) peer->client->Close();
  if (peer->backend_peer) {
    (void)ctx_.backend->Disconnect(*peer->backend_peer, Backend::DisconnectMode::kPeerDead);
  }
}

Status DecodeSide::StoreAuxLocked(const DecodeRoom& room, const v1::TransferDone& done) {
  if (room.aux_slot < 0) {
    if (done.aux_size() == 0) return OkStatus();
    return DataLoss("room '" + room.id + "': the prefill side sent aux data for " +
                    std::to_string(done.aux_size()) +
                    " buffers, but the request named no aux slot");
  }
  const std::vector<BufferInfo>& aux = ctx_.layout.aux;
  if (static_cast<size_t>(done.aux_size()) != aux.size()) {
    return DataLoss("room '" + room.id + "': the prefill side sent aux data for " +
                    std::to_string(done.aux_size()) + " buffers; this layout has " +
                    std::to_string(aux.size()) + " (the prefill Send gave no aux_slot?)");
  }
  for (size_t i = 0; i < aux.size(); ++i) {
    if (done.aux(static_cast<int>(i)).size() != aux[i].item_len) {
      return DataLoss("room '" + room.id + "': aux buffer " + std::to_string(i) + " came with " +
                      std::to_string(done.aux(static_cast<int>(i)).size()) +
                      " bytes; its slots hold " + std::to_string(aux[i].item_len));
    }
  }
  // Host memory (the layout checked it): written before the room is reported done.
  for (size_t i = 0; i < aux.size(); ++i) {
    const std::string& bytes = done.aux(static_cast<int>(i));
    std::memcpy(reinterpret_cast<void*>(aux[i].ptr +
                                        static_cast<uint64_t>(room.aux_slot) * aux[i].item_len),
                bytes.data(), bytes.size());
  }
  return OkStatus();
}

// --------------------------------------------------------------------------------- requests --
Status DecodeSide::Receive(const std::string& room_id, PeerHandle peer_id,
                           std::vector<int32_t> dst_pages, std::chrono::milliseconds deadline,
                           int32_t layer_begin, int32_t layer_end, int64_t aux_slot) {
  if (deadline.count() <= 0) deadline = ctx_.options.default_deadline;
  MutexLock lock(ctx_.mu);
  if (ctx_.stop) {
    return FailedPrecondition("Receive of room '" + room_id +
                              "': the decode engine is shutting down; receive on a running one");
  }
  auto peer = peers_.find(peer_id);
  if (peer == peers_.end() || !peer->second->alive) {
    return Unavailable("peer " + std::to_string(peer_id) +
                       " is not connected; call ConnectPeer first");
  }
  if (table_.Find(room_id) != nullptr) {
    return AlreadyExists("room '" + room_id + "' is already known to this engine");
  }
  v1::Envelope envelope;
  auto* req = envelope.mutable_transfer_request();
  req->set_room_id(room_id);
  req->set_mode(v1::TRANSFER_MODE_PUSH);
  control::SetDstPages(*req, dst_pages);
  req->mutable_layers()->set_begin(static_cast<uint32_t>(layer_begin));
  req->mutable_layers()->set_end(static_cast<uint32_t>(layer_end));
  req->set_deadline_ms(static_cast<uint32_t>(deadline.count()));
  req->set_backend(std::string(ctx_.backend->Name()));
  if (aux_slot >= 0) req->set_aux_slot(static_cast<uint32_t>(aux_slot));
  DecodeRoom& room = table_.Open(room_id, deadline);
  room.aux_slot = aux_slot;
  room.peer = peer_id;
  room.layer_begin = layer_begin;
  room.layer_end = layer_end;
  control::ControlClient* client = peer->second->client.get();
  // Sent under the lock so that the answer cannot overtake the room's state change (the send
  // only queues the frame). Stamped before: the send may write to the socket on this thread, and
  // the peer may act on it before this thread runs again.
  room.request_sent = Clock::now();
  Status sent = client->Send(envelope);
  if (!sent.ok()) {
    // Nothing was asked of the peer: the room leaves no trace, so the caller may retry it.
    table_.Erase(room_id);
    return sent.WithContext("sending the transfer request of room '" + room_id + "' to " +
                            peer->second->address);
  }
  peer->second->in_flight.fetch_add(1, std::memory_order_relaxed);  // until it is final
  table_.Advance(room, RequestState::kWaitingForInput);
  // With busy polling, the answer is expected now: have the io thread poll for it.
  client->Wake();
  return OkStatus();
}

Status DecodeSide::Abort(const std::string& room_id, const std::string& reason) {
  MutexLock lock(ctx_.mu);
  DecodeRoom* room = table_.Find(room_id);
  if (room == nullptr) return NotFound("no room '" + room_id + "' on this engine");
  if (IsFinal(room->state)) return OkStatus();
  AbortLocked(*room, v1::STATUS_CODE_ABORTED, Aborted(reason));
  return OkStatus();
}

size_t DecodeSide::lost_peers() const {
  MutexLock lock(ctx_.mu);
  return lost_.size();
}

EngineSide::PollResult DecodeSide::PollPass(Clock::time_point now) {
  PollResult result;
  result.next = now + kIdlePoll;
  MutexLock lock(ctx_.mu);
  for (const std::string& id : table_.ActiveIds()) {
    DecodeRoom* room = table_.Find(id);
    if (room == nullptr) continue;
    if (now >= room->deadline) {
      AbortLocked(*room, v1::STATUS_CODE_DEADLINE_EXCEEDED,
                  DeadlineExceeded("room '" + room->id + "' missed its deadline in state " +
                                   RequestStateName(room->state)));
      continue;
    }
    result.next = std::min(result.next, room->deadline);
  }
  if (now - last_sweep_ > std::chrono::seconds(1)) {
    last_sweep_ = now;
    // A failed room whose pages may still be written stays until it is reusable.
    table_.Sweep(now, ctx_.options.retention,
                 [](const DecodeRoom& room) { return room.pages_reusable; });
  }
  return result;
}

Status DecodeSide::Forget(const std::string& room_id) {
  MutexLock lock(ctx_.mu);
  const DecodeRoom* room = table_.Find(room_id);
  if (room != nullptr && IsFinal(room->state) && !room->pages_reusable) {
    return FailedPrecondition(
        "room '" + room_id +
        "' failed, but no write into its pages is known to have stopped yet (pages_reusable is "
        "false: the prefill side's acknowledgement or the lost peer's fencing is awaited); a "
        "new room of this id would take the late answers of this one for its own. Forget it "
        "once pages_reusable is true (the engine also drops it itself then, after retention)");
  }
  return table_.Forget(room_id);
}

void DecodeSide::Interrupt() {
  MutexLock lock(ctx_.mu);
  for (auto& [id, peer] : peers_) {
    if (peer->alive || peer->hello_answered) continue;
    peer->hello_answered = true;
    peer->hello_reply.set_value(
        Aborted("the engine was interrupted (TransferEngine::Interrupt: it is closing)"));
  }
}

void DecodeSide::Shutdown() {
  // Like the prefill side: every room that is not final ends first (its waiters return now) and
  // its prefill engine is asked to stop writing into the room's pages; the connections stay open
  // for a bounded while, so that the answers saying the writes stopped (AbortAck, TransferDone,
  // Goodbye) can come, and close only then. Without such an answer a room's pages become
  // reusable only once this side's end of a two-sided connection is disconnected.
  std::vector<std::string> ended;
  std::vector<std::unique_ptr<DecodePeer>> peers;
  std::vector<PeerId> lost_backend_peers;
  std::vector<PeerDescriptor> lost_senders;
  {
    MutexLock lock(ctx_.mu);
    for (const std::string& id : table_.ActiveIds()) {
      DecodeRoom* room = table_.Find(id);
      if (room == nullptr) continue;
      EndAtShutdownLocked(*room);
      ended.push_back(id);
    }
    const Clock::time_point until = Clock::now() + kShutdownAnswerWait;
    while (AwaitsAnswerLocked() && Clock::now() < until) {
      ctx_.final_cv.WaitUntil(ctx_.mu, std::min(until, Clock::now() + kIdlePoll));
    }
    for (auto& [id, peer] : peers_) peers.push_back(std::move(peer));
    peers_.clear();
    // Lost peers the liveness worker has not looked at yet: their ends are let go here.
    for (LostPeer& l : lost_) {
      if (l.backend_peer) lost_backend_peers.push_back(*l.backend_peer);
      if (l.fence_sender) lost_senders.push_back(std::move(*l.fence_sender));
    }
    lost_.clear();
  }
  lost_cv_.NotifyAll();
  if (liveness_.joinable()) liveness_.join();
  // Connections flush what is queued (the aborts above) before they close.
  for (auto& peer : peers) {
    if (peer->client) peer->client->Close();
  }
  // How each live peer's backend end was let go: for a two-sided one, the Disconnect's result.
  std::map<PeerHandle, Status> disconnected;
  for (auto& peer : peers) {
    if (peer->backend_peer) {
      Status done = ctx_.backend->Disconnect(*peer->backend_peer);
      if (peer->alive) disconnected.emplace(peer->id, std::move(done));
    } else if (peer->alive || peer->said_goodbye) {
      StatusOr<PeerDescriptor> sender = DescriptorFromPeerInfo(peer->info, ctx_.backend->Name());
      if (sender.ok()) ctx_.backend->FenceSender(*sender);
    }
  }
  for (PeerId b : lost_backend_peers) {
    (void)ctx_.backend->Disconnect(b, Backend::DisconnectMode::kPeerDead);
  }
  for (const PeerDescriptor& d : lost_senders) ctx_.backend->FenceSender(d);

  MutexLock lock(ctx_.mu);
  for (const std::string& id : table_.AllIds()) {
    DecodeRoom* room = table_.Find(id);
    if (room == nullptr || room->pages_reusable) continue;
    auto it = disconnected.find(room->peer);
    // This side's end of the connection is gone: nothing of it lands in the pages any more.
    if (it != disconnected.end() && it->second.ok()) MarkReusableLocked(*room);
  }
  for (const std::string& id : ended) {
    DecodeRoom* room = table_.Find(id);
    if (room == nullptr || room->pages_reusable) continue;
    auto peer = std::find_if(peers.begin(), peers.end(),
                             [&](const auto& p) { return p->id == room->peer; });
    if (peer == peers.end()) continue;
    const DecodePeer& p = **peer;
    auto it = disconnected.find(p.id);
    std::string why;
    if (it != disconnected.end()) {
      why = "disconnecting this side's end of the " + std::string(ctx_.backend->Name()) +
            " connection to the prefill engine at " + p.address + " failed (" +
            it->second.ToString() +
            "): a write into the room's pages may still land; keep them out of use until that "
            "engine is known to be gone";
    } else {
      why = "the prefill engine at " + p.address + " did not confirm within " +
            std::to_string(kShutdownAnswerWait.count()) +
            " ms that its writes into the room's pages stopped: keep them out of use until that "
            "engine is known to be gone" +
            (p.info.fence_ms() > 0 ? " or " + std::to_string(p.info.fence_ms()) +
                                         " ms (its fencing bound) have passed since this shutdown"
                                   : std::string(" (it promised no fencing bound)"));
    }
    room->status = Aborted(room->status.message() + "; " + why);
    KVT_LOG_WARN("xfer", "room '{}': {}", room->id, why);
  }
}

// ------------------------------------------------------------------------------ peer events --
DecodeRoom* DecodeSide::RoomOfLocked(PeerHandle peer, const std::string& id) {
  DecodeRoom* room = table_.Find(id);
  return room != nullptr && room->peer == peer ? room : nullptr;
}

void DecodeSide::OnFinalLocked(DecodeRoom& room) {
  auto peer = peers_.find(room.peer);
  if (peer != peers_.end()) peer->second->in_flight.fetch_sub(1, std::memory_order_relaxed);
}

bool DecodeSide::FailLocked(DecodeRoom& room, Status why) {
  const std::string reason = why.ToString();
  if (!table_.Fail(room, std::move(why))) return false;
  OnFinalLocked(room);
  KVT_LOG_WARN("xfer", "room '{}' failed: {}", room.id, reason);
  return true;
}

void DecodeSide::SucceedLocked(DecodeRoom& room) {
  if (IsFinal(room.state)) return;  // a late done changes nothing, nor the failure's reason
  room.status = OkStatus();
  if (table_.Advance(room, RequestState::kSuccess)) OnFinalLocked(room);
}

void DecodeSide::MarkReusableLocked(DecodeRoom& room) {
  if (room.pages_reusable) return;
  room.pages_reusable = true;
  ctx_.NotifyFinal();
}

void DecodeSide::AbortLocked(DecodeRoom& room, v1::StatusCode code, Status why,
                             const std::string& peer_reason) {
  room.pages_reusable = false;  // until the prefill side acknowledges
  v1::Envelope abort;
  abort.mutable_abort()->set_room_id(room.id);
  abort.mutable_abort()->set_code(code);
  abort.mutable_abort()->set_reason(peer_reason.empty() ? why.message() : peer_reason);
  // Once per room (it becomes final here); never dropped for a full send queue: the pages
  // stay held until the prefill side acknowledges.
  (void)SendToPeerLocked(room.peer, abort, control::QueueLimit::kExempt);
  FailLocked(room, std::move(why));
}

void DecodeSide::EndAtShutdownLocked(DecodeRoom& room) {
  AbortLocked(room, v1::STATUS_CODE_ABORTED,
              Aborted("the transfer engine '" + ctx_.options.name + "' shut down while room '" +
                      room.id + "' was " + RequestStateName(room.state) +
                      "; Receive the room again on a running engine"),
              "the decode engine '" + ctx_.options.name + "' is shutting down");
}

bool DecodeSide::AwaitsAnswerLocked() {
  for (const std::string& id : table_.AllIds()) {
    const DecodeRoom* room = table_.Find(id);
    if (room == nullptr || !IsFinal(room->state) || room->pages_reusable) continue;
    auto peer = peers_.find(room->peer);
    if (peer != peers_.end() && peer->second->alive) return true;
  }
  return false;
}

Status DecodeSide::SendToPeerLocked(PeerHandle peer, const v1::Envelope& envelope,
                                    control::QueueLimit limit) {
  auto it = peers_.find(peer);
  if (it == peers_.end() || !it->second->client) return Unavailable("peer is gone");
  return it->second->client->Send(envelope, limit);
}

void DecodeSide::OnPeerMessage(PeerHandle peer_id, const v1::Envelope& envelope) {
  MutexLock lock(ctx_.mu);
  auto peer = peers_.find(peer_id);
  if (peer == peers_.end()) return;
  DecodePeer& p = *peer->second;
  if (envelope.has_hello_ack() ||
      (envelope.has_error() && !p.hello_answered && envelope.error().room_id().empty())) {
    if (p.hello_answered) return;
    p.hello_answered = true;
    if (envelope.has_hello_ack()) {
      p.hello_reply.set_value(envelope.hello_ack());
    } else {
      p.hello_reply.set_value(control::StatusFromError(envelope.error()));
    }
    return;
  }
  switch (envelope.body_case()) {
    case v1::Envelope::kLayerProgress: {
      if (DecodeRoom* room = RoomOfLocked(peer_id, envelope.layer_progress().room_id())) {
        table_.Advance(*room, RequestState::kTransferring);
      }
      return;
    }
    case v1::Envelope::kTransferDone: {
      const v1::TransferDone& done = envelope.transfer_done();
      if (DecodeRoom* room = RoomOfLocked(peer_id, done.room_id())) {
        // The prefill side sends done only after its writes are visible or quiesced.
        if (IsFinal(room->state)) {
          // The room ended here first (aborted, its deadline, the session's end): its outcome
          // and its aux slot, which the caller may have handed to another request, stay as they
          // are; the done still proves that no write of it lands any more.
          MarkReusableLocked(*room);
          return;
        }
        room->bytes = done.bytes();
        Status aux = done.status() == v1::STATUS_CODE_OK ? StoreAuxLocked(*room, done) : OkStatus();
        if (!aux.ok()) {
          FailLocked(*room, aux);
        } else if (done.status() == v1::STATUS_CODE_OK) {
          SucceedLocked(*room);
        } else {
          FailLocked(*room, Status(control::FromProtoCode(done.status()),
                                   "prefill side: " + done.message()));
        }
        MarkReusableLocked(*room);
      }
      return;
    }
    case v1::Envelope::kAbort: {
      if (DecodeRoom* room = RoomOfLocked(peer_id, envelope.abort().room_id())) {
        FailLocked(*room, Aborted("aborted by the prefill side: " + envelope.abort().reason()));
        MarkReusableLocked(*room);  // the prefill side quiesced before aborting
      }
      v1::Envelope ack;
      ack.mutable_abort_ack()->set_room_id(envelope.abort().room_id());
      ack.mutable_abort_ack()->set_writes_quiesced(true);
      (void)p.client->Send(ack);
      return;
    }
    case v1::Envelope::kAbortAck: {
      if (DecodeRoom* room = RoomOfLocked(peer_id, envelope.abort_ack().room_id())) {
        if (envelope.abort_ack().writes_quiesced()) MarkReusableLocked(*room);
      }
      return;
    }
    case v1::Envelope::kGoodbye: {
      // The prefill engine is going away. With writes quiesced, nothing of it lands any more:
      // every room of the session ends and its pages are free, even a room whose request it
      // never saw.
      const v1::Goodbye& goodbye = envelope.goodbye();
      p.alive = false;
      p.said_goodbye = goodbye.writes_quiesced();
      for (const std::string& id : table_.AllIds()) {
        DecodeRoom* room = RoomOfLocked(peer_id, id);
        if (room == nullptr) continue;
        FailLocked(*room, Unavailable("the prefill peer " + p.address +
                                      " ended the session: " + goodbye.reason()));
        if (goodbye.writes_quiesced()) MarkReusableLocked(*room);
      }
      KVT_LOG_INFO("xfer", "prefill peer '{}' at {} ended the session: {}", p.info.name(),
                   p.address, goodbye.reason());
      return;
    }
    case v1::Envelope::kError: {
      const v1::Error& error = envelope.error();
      if (DecodeRoom* room = RoomOfLocked(peer_id, error.room_id())) {
        // The prefill side refused the request: it posted nothing for it.
        FailLocked(*room, control::StatusFromError(error).WithContext("prefill side"));
        MarkReusableLocked(*room);
      } else {
        KVT_LOG_WARN("xfer", "prefill peer {} reported: {}", p.address,
                     control::StatusFromError(error).ToString());
      }
      return;
    }
    default:
      KVT_LOG_WARN("xfer", "unexpected {} from prefill peer {}", control::BodyName(envelope),
                   p.address);
  }
}

void DecodeSide::OnPeerDisconnect(PeerHandle peer_id, const Status& why) {
  MutexLock lock(ctx_.mu);
  auto peer = peers_.find(peer_id);
  if (peer == peers_.end()) return;
  DecodePeer& p = *peer->second;
  const bool was_alive = p.alive || p.said_goodbye;
  p.alive = false;
  if (!p.hello_answered) {
    p.hello_answered = true;
    p.hello_reply.set_value(Unavailable("connection closed before hello-ack: " + why.ToString()));
  }
  if (!was_alive) {
    // Connect is still at work (or failed): it drops the peer and says why.
    if (!p.closed_while_connecting) p.closed_while_connecting = why;
    return;
  }
  LostPeer lost;
  lost.id = peer_id;
  lost.host = p.host;
  lost.port = p.port;
  lost.host_id = p.info.host_id();
  lost.pid = p.info.pid();
  lost.process_start = p.info.process_start();
  const Clock::time_point now = Clock::now();
  lost.give_up = now + ctx_.options.peer_timeout;
  if (p.info.fence_ms() > 0) lost.fence_at = now + std::chrono::milliseconds(p.info.fence_ms());
  lost.backend_peer = std::exchange(p.backend_peer, std::nullopt);
  if (!lost.backend_peer) {
    StatusOr<PeerDescriptor> descriptor = DescriptorFromPeerInfo(p.info, ctx_.backend->Name());
    if (descriptor.ok()) lost.fence_sender = std::move(descriptor).value();
  }
  int failed = 0;
  for (const std::string& id : table_.AllIds()) {
    DecodeRoom* room = RoomOfLocked(peer_id, id);
    if (room == nullptr) continue;
    if (FailLocked(*room,
                   Unavailable("the prefill peer " + p.address + " was lost: " + why.ToString()))) {
      ++failed;
    }
    if (!room->pages_reusable) lost.quarantined.push_back(room->id);
  }
  KVT_LOG_WARN("xfer",
               "lost prefill peer '{}' at {} ({}); {} requests failed, {} keep their pages "
               "quarantined until its process is known to be gone{}",
               p.info.name(), p.address, why.ToString(), failed, lost.quarantined.size(),
               p.info.fence_ms() > 0
                   ? " or its fencing bound (" + std::to_string(p.info.fence_ms()) + " ms) passed"
                   : std::string(" (it promised no fencing bound)"));
  // The liveness worker proves the process gone, releases the pages and frees the connection
  // (never from this thread: it is the connection's own io thread).
  lost_.push_back(std::move(lost));
  lost_cv_.NotifyAll();
}

// -------------------------------------------------------------------------- liveness worker --
DecodeSide::PeerFate DecodeSide::CheckPeer(const LostPeer& lost) const {
  const std::string& own_host = ctx_.local_info.host_id();
  if (!own_host.empty() && lost.host_id == own_host && lost.pid != 0) {
    switch (CheckProcess(static_cast<pid_t>(lost.pid), lost.process_start)) {
      case ProcessLiveness::kGone:
        return PeerFate::kGone;
      case ProcessLiveness::kStopped:
        return PeerFate::kStopped;
      case ProcessLiveness::kRunning:
        return PeerFate::kUnknown;
      case ProcessLiveness::kUnknown:
        break;
    }
  }
  // Another host: a prefill engine closes its port only after it quiesced its writes and said
  // so, and a dead process's port refuses; either way no write of it lands any more.
  return PortRefuses(lost.host, lost.port) ? PeerFate::kGone : PeerFate::kUnknown;
}

void DecodeSide::LivenessLoop() {
  MutexLock lock(ctx_.mu);
  while (!ctx_.stop) {
    if (lost_.empty()) {
      lost_cv_.WaitUntil(ctx_.mu, Clock::now() + std::chrono::seconds(1));
      continue;
    }
    // The connection is dead: it goes at once (closing it joins its io thread), and so does
    // this side's end of a two-sided pair (tearing down a communicator may take a while); only
    // the record of what is quarantined stays until the proof.
    std::vector<PeerId> backend_peers;
    std::vector<PeerDescriptor> fence;
    std::vector<std::unique_ptr<DecodePeer>> closed;
    for (LostPeer& l : lost_) {
      if (l.backend_peer) backend_peers.push_back(*std::exchange(l.backend_peer, std::nullopt));
      if (l.fence_sender) fence.push_back(*std::exchange(l.fence_sender, std::nullopt));
      auto peer = peers_.find(l.id);
      if (peer != peers_.end()) {
        closed.push_back(std::move(peer->second));
        peers_.erase(peer);
      }
    }
    std::vector<LostPeer> lost = lost_;
    lock.Unlock();
    for (PeerId b : backend_peers) {
      (void)ctx_.backend->Disconnect(b, Backend::DisconnectMode::kPeerDead);
    }
    for (const PeerDescriptor& d : fence) ctx_.backend->FenceSender(d);
    for (auto& peer : closed) {
      if (peer->client) peer->client->Close();
    }
    closed.clear();
    std::vector<PeerFate> fate(lost.size(), PeerFate::kUnknown);
    for (size_t i = 0; i < lost.size(); ++i) {
      fate[i] = lost[i].quarantined.empty() ? PeerFate::kGone : CheckPeer(lost[i]);
    }
    lock.Lock();
    const auto now = Clock::now();
    for (size_t i = 0; i < lost.size(); ++i) {
      auto it = std::find_if(lost_.begin(), lost_.end(),
                             [&](const LostPeer& l) { return l.id == lost[i].id; });
      if (it == lost_.end()) continue;
      if (fate[i] == PeerFate::kStopped && it->fence_at != Clock::time_point::max()) {
        // A stopped process keeps whatever it was doing for when it continues: its bound
        // restarts from then, with the time it needs to notice the silence and stop.
        it->fence_at = std::max(it->fence_at, now + kFenceTeardown);
        continue;
      }
      const bool gone = fate[i] == PeerFate::kGone;
      const bool fenced = now >= it->fence_at;
      const bool give_up = it->fence_at == Clock::time_point::max() && now >= it->give_up;
      if (!gone && !fenced && !give_up) continue;
      if (gone || fenced) {
        for (const std::string& id : lost[i].quarantined) {
          if (DecodeRoom* room = RoomOfLocked(lost[i].id, id)) MarkReusableLocked(*room);
        }
        if (fenced && !gone && !lost[i].quarantined.empty()) {
          KVT_LOG_INFO("xfer",
                       "prefill peer {}:{}: its fencing bound passed; the pages of {} failed "
                       "requests are free again",
                       lost[i].host, lost[i].port, lost[i].quarantined.size());
        }
      } else {
        KVT_LOG_WARN("xfer",
                     "prefill peer {}:{} is unreachable but not known to be gone; {} failed "
                     "requests keep their pages quarantined until it acknowledges",
                     lost[i].host, lost[i].port, lost[i].quarantined.size());
      }
      lost_.erase(it);
    }
    if (!ctx_.stop) lost_cv_.WaitUntil(ctx_.mu, Clock::now() + kLivenessPeriod);
  }
}

uint64_t DecodeSide::ControlLanes() const {
  MutexLock lock(ctx_.mu);
  uint64_t n = 0;
  for (const auto& [id, peer] : peers_) n += peer->client != nullptr && peer->client->using_lane();
  return n;
}

}  // namespace kvt::transfer::engine

#include "kvt/transfer/engine.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include "control/io_loop.h"
#include "engine/layout_codec.h"
#include "kvt/common/log.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/transfer/control/control_client.h"
#include "kvt/transfer/control/protocol.h"
#include "kvt/transfer/plan.h"

namespace kvt::transfer {

const char* RequestStateName(RequestState state) {
  switch (state) {
    case RequestState::kBootstrapping:
      return "Bootstrapping";
    case RequestState::kWaitingForInput:
      return "WaitingForInput";
    case RequestState::kTransferring:
      return "Transferring";
    case RequestState::kSuccess:
      return "Success";
    case RequestState::kFailed:
      return "Failed";
  }
  return "Unknown";
}

namespace {

using Clock = std::chrono::steady_clock;
using control::ConnectionId;

constexpr auto kBusyPoll = std::chrono::microseconds(20);
constexpr auto kNotifiedPoll = std::chrono::microseconds(200);
constexpr auto kDeviceSpinGap = std::chrono::microseconds(4);
constexpr auto kIdlePoll = std::chrono::milliseconds(10);

// True when nothing listens at host:port any more (connection refused), i.e. the process that
// served it is gone. False when it accepts, or when the answer is unclear (timeout).
bool PeerPortRefuses(const std::string& host, uint16_t port) {
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
      if (poll(&pfd, 1, 1000) == 1) {
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

class TransferEngine::Impl : public control::ControlHandler {
 public:
  Impl(const EngineOptions& options, pool::KvPool* pool, std::shared_ptr<Backend> backend)
      : options_(options), pool_(pool), backend_(std::move(backend)) {}

  ~Impl() override { Shutdown(); }

  Status Init() {
    if (pool_ == nullptr) return InvalidArgument("the engine needs a pool (got null)");
    if (options_.control_busy_poll.count() < 0) {
      return InvalidArgument("EngineOptions::control_busy_poll = " +
                             std::to_string(options_.control_busy_poll.count()) +
                             " us: must be >= 0 (0: the control threads sleep between frames)");
    }
    // The pool's guards decide what may be registered for transfer.
    KVT_ASSIGN_OR_RETURN(pool::ContiguousBufInfos infos, pool_->GetContiguousBufInfos());
    KVT_ASSIGN_OR_RETURN(local_layout_, LayoutFromPool(*pool_, options_.tp_rank, options_.tp_size));
    if (!backend_) {
      KVT_ASSIGN_OR_RETURN(backend_, CreateBackend(options_.backend, options_.backend_options));
    }
    std::vector<LocalRegion> regions;
    for (size_t i = 0; i < infos.data_ptrs.size(); ++i) {
      LocalRegion r;
      r.base = infos.data_ptrs[i];
      r.length = static_cast<uint64_t>(infos.data_lens[i]);
      r.item_len = static_cast<uint64_t>(infos.item_lens[i]);
      r.kind =
          pool_->memory_kind() == pool::MemoryKind::kCuda ? MemoryKind::kCuda : MemoryKind::kHost;
      r.device = pool_->memory_kind() == pool::MemoryKind::kCuda ? pool_->options().device : -1;
      regions.push_back(r);
    }
    item_len_ = regions.empty() ? 0 : regions.front().item_len;
    buffer_len_ = regions.empty() ? 0 : regions.front().length;
    KVT_ASSIGN_OR_RETURN(PeerDescriptor descriptor, backend_->Register(regions));
    // Device backends take page lists (one gather/scatter launch per layer batch).
    page_writes_ = backend_->Capabilities().page_writes;
    notified_ = backend_->Capabilities().notifies_completion;
    if (notified_) {
      // Never blocks (a CUDA host callback may call it): a flag the poller's wait checks.
      backend_->SetCompletionNotifier([this] {
        kicked_.store(true);
        cv_.notify_all();
      });
    }
    local_info_ = MakePeerInfo(options_.name, options_.prefill, local_layout_, descriptor, regions);
    if (options_.prefill) {
      control::ControlServerOptions server = options_.server;
      server.server_id = options_.name;
      server.limits.heartbeat_interval = options_.heartbeat_interval;
      server.limits.idle_timeout = options_.peer_timeout;
      // The server polls while any request of the engine is not final.
      server.busy_poll.window = options_.control_busy_poll;
      server.busy_poll.hint = [this] { return active_count_.load(std::memory_order_relaxed) > 0; };
      KVT_ASSIGN_OR_RETURN(server_, control::ControlServer::Create(server, this));
    }
    poller_ = std::thread([this] { PollLoop(); });
    KVT_LOG_INFO("xfer", "{} engine '{}' up: backend {}, {} buffers of {} bytes per page{}",
                 options_.prefill ? "prefill" : "decode", options_.name, backend_->Name(),
                 regions.size(), item_len_,
                 server_ ? ", control port " + std::to_string(server_->port()) : "");
    return OkStatus();
  }

  void Shutdown() {
    if (shut_down_.exchange(true)) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (poller_.joinable()) poller_.join();
    if (notified_) backend_->SetCompletionNotifier(nullptr);
    if (server_) server_->Stop();
    std::vector<std::unique_ptr<DecodePeer>> peers;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [id, peer] : peers_) peers.push_back(std::move(peer));
      peers_.clear();
    }
    for (auto& peer : peers) {
      if (peer->client) peer->client->Close();
      if (peer->backend_peer) (void)backend_->Disconnect(*peer->backend_peer);
    }
    for (auto& t : probes_) t.join();
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, room] : rooms_) ReleaseWritesLocked(room);
  }

  uint16_t port() const { return server_ ? server_->port() : 0; }
  std::string_view backend_name() const { return backend_->Name(); }

  // ---------------------------------------------------------------------------- decode side --
  StatusOr<PeerHandle> ConnectPeer(const std::string& host, uint16_t port) {
    if (options_.prefill) {
      return FailedPrecondition("ConnectPeer is for decode engines; this engine is prefill");
    }
    const std::string address = host + ":" + std::to_string(port);
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [id, peer] : peers_) {
        if (peer->address == address && peer->alive) return id;
      }
    }
    auto peer = std::make_unique<DecodePeer>();
    peer->address = address;
    peer->host = host;
    peer->port = port;
    peer->handler = std::make_unique<PeerClientHandler>(this);
    std::future<StatusOr<v1::HelloAck>> hello_reply = peer->hello_reply.get_future();
    PeerHandle id;
    DecodePeer* raw = peer.get();
    {
      std::lock_guard<std::mutex> lock(mu_);
      id = next_peer_++;
      raw->id = id;
      raw->handler->id = id;
      peers_[id] = std::move(peer);
    }
    control::ControlClientOptions copts;
    copts.host = host;
    copts.port = port;
    copts.client_id = options_.name;
    copts.role = v1::ROLE_DECODE;
    copts.cluster_token = options_.cluster_token;
    copts.limits.heartbeat_interval = options_.heartbeat_interval;
    copts.limits.idle_timeout = options_.peer_timeout;
    // A connection polls while its own peer has requests in flight (not the whole engine's: a
    // decode engine with many prefill peers would spin a core per peer).
    copts.busy_poll.window = options_.control_busy_poll;
    copts.busy_poll.hint = [raw] { return raw->in_flight.load(std::memory_order_relaxed) > 0; };
    auto client = control::ControlClient::Connect(copts, raw->handler.get());
    if (!client.ok()) {
      DropPeer(id);
      return client.status().WithContext("connecting to prefill engine at " + address);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      raw->client = std::move(client).value();
    }
    v1::Envelope hello;
    hello.mutable_hello()->set_protocol_version(control::kProtocolVersion);
    *hello.mutable_hello()->mutable_peer() = local_info_;
    Status sent = raw->client->Send(hello);
    if (!sent.ok()) {
      DropPeer(id);
      return sent.WithContext("sending hello to " + address);
    }
    if (hello_reply.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      DropPeer(id);
      return DeadlineExceeded("prefill engine at " + address + " did not answer hello in 10 s");
    }
    StatusOr<v1::HelloAck> ack = hello_reply.get();
    if (!ack.ok()) {
      DropPeer(id);
      return ack.status().WithContext("hello to " + address);
    }
    const v1::PeerInfo& reply = ack->peer();
    // The prefill side checked compatibility too; check here as well so the error names both
    // sides' values from this side's point of view.
    Status compatible = CheckCompatible(local_layout_, reply.layout(), "decode", "prefill");
    if (!compatible.ok()) {
      DropPeer(id);
      return compatible;
    }
    std::optional<PeerId> backend_peer;
    if (backend_->Capabilities().two_sided) {
      // The receiving side takes part in the transfers: join the connection the prefill side
      // made for us.
      StatusOr<PeerDescriptor> descriptor = DescriptorFromPeerInfo(reply, backend_->Name());
      StatusOr<PeerId> joined = descriptor.ok()
                                    ? backend_->Accept(*descriptor, ack->backend_token())
                                    : StatusOr<PeerId>(descriptor.status());
      if (!joined.ok()) {
        DropPeer(id);
        return joined.status().WithContext("joining the " + std::string(backend_->Name()) +
                                           " connection of prefill engine at " + address);
      }
      backend_peer = *joined;
    }
    std::lock_guard<std::mutex> lock(mu_);
    raw->info = reply;
    raw->backend_peer = backend_peer;
    raw->alive = true;
    KVT_LOG_INFO("xfer", "connected to prefill '{}' at {}", reply.name(), address);
    return id;
  }

  Status Receive(const std::string& room_id, PeerHandle peer_id, std::vector<int32_t> dst_pages,
                 std::chrono::milliseconds deadline, int32_t layer_begin, int32_t layer_end) {
    if (options_.prefill) return FailedPrecondition("Receive is for decode engines");
    if (room_id.empty()) return InvalidArgument("room id is empty");
    if (dst_pages.empty()) return InvalidArgument("room '" + room_id + "' names no pages");
    const int32_t num_layers = static_cast<int32_t>(local_layout_.num_layers());
    if (layer_end < 0) layer_end = num_layers;
    if (layer_begin < 0 || layer_begin >= layer_end || layer_end > num_layers) {
      return InvalidArgument("layer range [" + std::to_string(layer_begin) + ", " +
                             std::to_string(layer_end) + ") is not inside [0, " +
                             std::to_string(num_layers) + ")");
    }
    KVT_RETURN_IF_ERROR(CheckOwnPages(dst_pages, "destination"));
    if (deadline.count() <= 0) deadline = options_.default_deadline;
    v1::Envelope envelope;
    control::ControlClient* client = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto peer = peers_.find(peer_id);
      if (peer == peers_.end() || !peer->second->alive) {
        return Unavailable("peer " + std::to_string(peer_id) +
                           " is not connected; call ConnectPeer first");
      }
      if (rooms_.count(room_id) != 0) {
        return AlreadyExists("room '" + room_id + "' is already known to this engine");
      }
      Room& room = NewRoomLocked(room_id, deadline);
      room.peer = peer_id;
      peer->second->in_flight.fetch_add(1, std::memory_order_relaxed);  // until it is final
      room.layer_begin = layer_begin;
      room.layer_end = layer_end;
      room.dst_pages = dst_pages;
      auto* req = envelope.mutable_transfer_request();
      req->set_room_id(room_id);
      req->set_mode(v1::TRANSFER_MODE_PUSH);
      control::SetDstPages(*req, dst_pages);
      req->mutable_layers()->set_begin(static_cast<uint32_t>(layer_begin));
      req->mutable_layers()->set_end(static_cast<uint32_t>(layer_end));
      req->set_deadline_ms(static_cast<uint32_t>(deadline.count()));
      req->set_backend(std::string(backend_->Name()));
      client = peer->second->client.get();
      // Sent under the lock so that the answer cannot overtake the room's state change. Stamped
      // before: the send may write to the socket on this thread, and the peer may act on it
      // before this thread runs again.
      room.request_sent = Clock::now();
      Status sent = client->Send(envelope);
      if (!sent.ok()) {
        room.pages_reusable = true;  // nothing was asked of the peer
        FailLocked(room, sent.WithContext("sending the transfer request"));
        return sent;
      }
      AdvanceState(room, RequestState::kWaitingForInput);
      // With busy polling, the answer is expected now: have the io thread poll for it.
      client->Wake();
    }
    return OkStatus();
  }

  // --------------------------------------------------------------------------- prefill side --
  Status Send(const std::string& room_id, std::vector<int32_t> src_pages) {
    if (!options_.prefill) return FailedPrecondition("Send is for prefill engines");
    if (room_id.empty()) return InvalidArgument("room id is empty");
    if (src_pages.empty()) return InvalidArgument("room '" + room_id + "' names no pages");
    KVT_RETURN_IF_ERROR(CheckOwnPages(src_pages, "source"));
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rooms_.find(room_id);
    Room* room;
    if (it == rooms_.end()) {
      room = &NewRoomLocked(room_id, options_.default_deadline);
    } else {
      room = &it->second;
      if (room->have_src || IsFinal(room->state)) {
        return AlreadyExists("room '" + room_id + "' already has source pages (state " +
                             RequestStateName(room->state) + ")");
      }
    }
    room->have_src = true;
    room->src_pages = std::move(src_pages);
    AdvanceLocked(*room);
    cv_.notify_all();
    return OkStatus();
  }

  Status LayersReady(const std::string& room_id, int32_t layers_done, cudaEvent_t ready) {
    if (!options_.prefill) {
      return FailedPrecondition(
          "LayersReady is for prefill engines; call it on the engine that Send()s the room");
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rooms_.find(room_id);
    if (it == rooms_.end()) return NotFound("no room '" + room_id + "'; call Send first");
    Room& room = it->second;
    const int32_t clamped =
        std::clamp(layers_done, 0, static_cast<int32_t>(local_layout_.num_layers()));
    if (clamped > room.layers_ready && ready != nullptr) room.ready = ready;
    room.layers_ready = std::max(room.layers_ready, clamped);
    AdvanceLocked(room);
    cv_.notify_all();
    return OkStatus();
  }

  // ------------------------------------------------------------------------------ both sides --
  StatusOr<RequestInfo> GetRequest(const std::string& room_id) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rooms_.find(room_id);
    if (it == rooms_.end()) return NotFound("no room '" + room_id + "'");
    return InfoOf(it->second);
  }

  StatusOr<RequestInfo> WaitRequest(const std::string& room_id,
                                    std::chrono::milliseconds timeout) const {
    std::unique_lock<std::mutex> lock(mu_);
    const auto until = Clock::now() + timeout;
    while (true) {
      auto it = rooms_.find(room_id);
      if (it == rooms_.end()) return NotFound("no room '" + room_id + "'");
      if (IsFinal(it->second.state)) return InfoOf(it->second);
      if (final_cv_.wait_until(lock, until) == std::cv_status::timeout) {
        return DeadlineExceeded("room '" + room_id + "' is still " +
                                RequestStateName(rooms_.at(room_id).state) + " after " +
                                std::to_string(timeout.count()) + " ms");
      }
    }
  }

  Status Abort(const std::string& room_id, const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rooms_.find(room_id);
    if (it == rooms_.end()) return NotFound("no room '" + room_id + "'");
    Room& room = it->second;
    if (IsFinal(room.state)) return OkStatus();
    v1::Envelope abort;
    abort.mutable_abort()->set_room_id(room_id);
    abort.mutable_abort()->set_code(v1::STATUS_CODE_ABORTED);
    abort.mutable_abort()->set_reason(reason);
    if (options_.prefill) {
      ReleaseWritesLocked(room);  // quiesce before telling the decode side
      if (room.have_request) (void)SendToConnLocked(room.conn, abort);
    } else {
      room.pages_reusable = false;  // until the prefill side acknowledges
      (void)SendToPeerLocked(room.peer, abort);
    }
    FailLocked(room, Aborted(reason));
    return OkStatus();
  }

  Status Forget(const std::string& room_id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rooms_.find(room_id);
    if (it == rooms_.end()) return NotFound("no room '" + room_id + "'");
    if (!IsFinal(it->second.state)) {
      return FailedPrecondition("room '" + room_id + "' is still " +
                                RequestStateName(it->second.state) + "; abort it first");
    }
    rooms_.erase(it);
    return OkStatus();
  }

  EngineStats stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  // ------------------------------------------------- control server (prefill) --------------
  void OnConnect(ConnectionId id, const control::ConnectionInfo& info) override {
    KVT_LOG_DEBUG("xfer", "control connection {} from {}", id, info.remote_address);
  }

  void OnMessage(ConnectionId conn, const v1::Envelope& envelope) override {
    switch (envelope.body_case()) {
      case v1::Envelope::kHello:
        return OnHello(conn, envelope.hello());
      case v1::Envelope::kTransferRequest:
        return OnTransferRequest(conn, envelope);
      case v1::Envelope::kAbort:
        return OnPrefillAbort(conn, envelope.abort());
      case v1::Envelope::kAbortAck:
        // The decode side acknowledged an abort this engine sent; the room is already final
        // here and its writes were released before the abort went out.
        KVT_LOG_DEBUG("xfer", "abort of room '{}' acknowledged", envelope.abort_ack().room_id());
        return;
      case v1::Envelope::kError:
        KVT_LOG_WARN("xfer", "connection {} reported: {}", conn,
                     control::StatusFromError(envelope.error()).ToString());
        return;
      default:
        (void)server_->Send(conn, control::MakeErrorEnvelope(
                                      v1::STATUS_CODE_INVALID_ARGUMENT,
                                      "a prefill engine does not accept " +
                                          std::string(control::BodyName(envelope)) + " messages"));
    }
  }

  void OnDisconnect(ConnectionId conn, const Status& why) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto session = sessions_.find(conn);
    if (session == sessions_.end()) return;
    int failed = 0;
    for (auto& [id, room] : rooms_) {
      if (room.have_request && room.conn == conn && !IsFinal(room.state)) {
        ReleaseWritesLocked(room);
        FailLocked(room, Unavailable("the decode peer's control connection was lost (" +
                                     why.ToString() + ")"));
        ++failed;
      }
    }
    (void)backend_->Disconnect(session->second.backend_peer, Backend::DisconnectMode::kPeerDead);
    KVT_LOG_INFO("xfer", "decode peer '{}' disconnected ({}); {} requests failed",
                 session->second.info.name(), why.ToString(), failed);
    sessions_.erase(session);
  }

 private:
  struct Room {
    std::string id;
    RequestState state = RequestState::kBootstrapping;
    Status status;
    Clock::time_point created;
    Clock::time_point deadline;
    Clock::time_point finished;
    Clock::time_point request_sent;  // RequestInfo's timeline
    Clock::time_point request_seen;
    Clock::time_point source_ready;
    Clock::time_point first_post;
    Clock::time_point last_post;
    int32_t layer_begin = 0;
    int32_t layer_end = 0;
    uint64_t bytes = 0;
    // prefill
    bool have_src = false;
    std::vector<int32_t> src_pages;
    int32_t layers_ready = 0;
    bool have_request = false;
    ConnectionId conn = 0;
    std::vector<int32_t> dst_pages;
    std::vector<PageUnit> units;
    cudaEvent_t ready = nullptr;  // the producer's event covering layers [0, layers_ready)
    bool planned = false;         // the spec was validated (and, for run backends, planned)
    std::optional<Plan> plan;
    int32_t posted_end = 0;  // layers [layer_begin, posted_end) posted
    std::vector<WriteId> writes;
    // decode
    PeerHandle peer = 0;
    bool pages_reusable = false;
  };

  struct Session {
    PeerId backend_peer = 0;
    v1::PeerInfo info;
  };

  class PeerClientHandler : public control::ControlClient::Handler {
   public:
    explicit PeerClientHandler(Impl* impl) : impl(impl) {}
    void OnMessage(const v1::Envelope& envelope) override { impl->OnPeerMessage(id, envelope); }
    void OnDisconnect(const Status& why) override { impl->OnPeerDisconnect(id, why); }
    Impl* impl;
    PeerHandle id = 0;
  };

  struct DecodePeer {
    // Non-final rooms of this peer: its connection's io thread busy-polls while > 0. Declared
    // before the client, whose io thread reads it, so that it outlives that thread.
    std::atomic<int64_t> in_flight{0};
    PeerHandle id = 0;
    std::string address;
    std::string host;
    uint16_t port = 0;
    std::unique_ptr<PeerClientHandler> handler;  // outlives client (declared first)
    std::unique_ptr<control::ControlClient> client;
    std::promise<StatusOr<v1::HelloAck>> hello_reply;
    bool hello_answered = false;
    v1::PeerInfo info;
    std::optional<PeerId> backend_peer;  // two-sided backends: this side's end of the pair
    bool alive = false;
  };

  // ---------------------------------------------------------------- state helpers (mu_ held) --
  Room& NewRoomLocked(const std::string& id, std::chrono::milliseconds deadline) {
    Room& room = rooms_[id];
    room.id = id;
    room.created = Clock::now();
    room.deadline = room.created + deadline;
    room.layer_end = static_cast<int32_t>(local_layout_.num_layers());
    active_.insert(id);
    active_count_.store(active_.size(), std::memory_order_relaxed);
    // With busy polling, frames for this room are expected from now on (e.g. the request of a
    // room a prefill Send opened): have a sleeping server thread start polling.
    if (active_.size() == 1 && server_) server_->Wake();
    return room;
  }

  static RequestInfo InfoOf(const Room& room) {
    RequestInfo info;
    info.room = room.id;
    info.state = room.state;
    info.status = room.status;
    info.bytes = room.bytes;
    info.layers_posted =
        room.posted_end > room.layer_begin ? room.posted_end - room.layer_begin : 0;
    info.pages_reusable = room.pages_reusable;
    info.created = room.created;
    info.finished = room.finished;
    info.request_sent = room.request_sent;
    info.request_seen = room.request_seen;
    info.source_ready = room.source_ready;
    info.first_post = room.first_post;
    info.last_post = room.last_post;
    return info;
  }

  // Moves the state forward; never backward, never out of a final state.
  void AdvanceState(Room& room, RequestState to) {
    if (IsFinal(room.state) || static_cast<int>(to) <= static_cast<int>(room.state)) return;
    room.state = to;
    if (IsFinal(to)) {
      room.finished = Clock::now();
      active_.erase(room.id);
      active_count_.store(active_.size(), std::memory_order_relaxed);
      if (!options_.prefill) {  // every decode room was counted in its peer's in_flight
        auto peer = peers_.find(room.peer);
        if (peer != peers_.end()) peer->second->in_flight.fetch_sub(1, std::memory_order_relaxed);
      }
      // The backend copied the runs when they were posted: the storage can serve the next plan.
      if (room.plan) {
        RecycleRunsLocked(std::move(room.plan->runs));
        room.plan.reset();
      }
      if (to == RequestState::kSuccess) {
        ++stats_.requests_succeeded;
        stats_.bytes += room.bytes;
      } else {
        ++stats_.requests_failed;
      }
      final_cv_.notify_all();
    }
  }

  // Run storage of finished plans, reused by the next ones (planning then allocates nothing in
  // steady state). At most kSpareRunVectors vectors of at most kMaxSpareRunBytes each.
  static constexpr size_t kSpareRunVectors = 4;
  static constexpr size_t kMaxSpareRunBytes = size_t{32} << 20;

  void RecycleRunsLocked(std::vector<CopyRun> runs) {
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

  std::vector<CopyRun> TakeSpareRunsLocked() {
    if (spare_runs_.empty()) return {};
    auto largest =
        std::max_element(spare_runs_.begin(), spare_runs_.end(),
                         [](const auto& a, const auto& b) { return a.capacity() < b.capacity(); });
    std::vector<CopyRun> runs = std::move(*largest);
    spare_runs_.erase(largest);
    return runs;
  }

  void FailLocked(Room& room, Status why) {
    if (IsFinal(room.state)) return;
    room.status = std::move(why);
    KVT_LOG_DEBUG("xfer", "room '{}' failed: {}", room.id, room.status.ToString());
    AdvanceState(room, RequestState::kFailed);
  }

  // Waits out and frees every write of the room (so no byte of it lands later).
  void ReleaseWritesLocked(Room& room) {
    for (WriteId w : room.writes) backend_->Release(w);
    room.writes.clear();
  }

  Status SendToConnLocked(ConnectionId conn, const v1::Envelope& envelope) {
    if (!server_) return FailedPrecondition("no control server");
    return server_->Send(conn, envelope);
  }

  Status SendToPeerLocked(PeerHandle peer, const v1::Envelope& envelope) {
    auto it = peers_.find(peer);
    if (it == peers_.end() || !it->second->client) return Unavailable("peer is gone");
    return it->second->client->Send(envelope);
  }

  // Prefill: sends TransferDone for a room that just became final.
  void SendDoneLocked(Room& room) {
    if (!room.have_request) return;
    v1::Envelope done;
    auto* d = done.mutable_transfer_done();
    d->set_room_id(room.id);
    d->set_status(control::ToProtoCode(room.status.code()));
    if (!room.status.ok()) d->set_message(room.status.message().substr(0, 4000));
    d->set_bytes(room.bytes);
    Status sent = SendToConnLocked(room.conn, done);
    if (!sent.ok()) {
      KVT_LOG_WARN("xfer", "could not send done for room '{}': {}", room.id, sent.ToString());
    }
  }

  void FailAndReportLocked(Room& room, Status why) {
    ReleaseWritesLocked(room);
    FailLocked(room, std::move(why));
    SendDoneLocked(room);
  }

  Status CheckOwnPages(const std::vector<int32_t>& pages, const char* side) const {
    const uint64_t num_pages = local_layout_.num_pages();
    for (size_t i = 0; i < pages.size(); ++i) {
      if (pages[i] < 1 || static_cast<uint64_t>(pages[i]) >= num_pages) {
        return OutOfRange(std::string(side) + " page " + std::to_string(pages[i]) +
                          " at position " + std::to_string(i) + " is outside [1, " +
                          std::to_string(num_pages) + "); page 0 is the dummy page");
      }
    }
    return OkStatus();
  }

  // Prefill: posts what can be posted and finishes the room when every write is visible.
  void AdvanceLocked(Room& room) {
    if (IsFinal(room.state) || !room.have_src || !room.have_request) return;
    auto session = sessions_.find(room.conn);
    if (session == sessions_.end()) {
      FailLocked(room, Unavailable("the decode peer's session is gone"));
      return;
    }
    if (!room.planned) {
      if (room.src_pages.size() != room.dst_pages.size()) {
        FailAndReportLocked(room,
                            InvalidArgument("room '" + room.id + "': the decode side asked for " +
                                            std::to_string(room.dst_pages.size()) +
                                            " pages but the prefill side has " +
                                            std::to_string(room.src_pages.size())));
        return;
      }
      const v1::MemoryDescriptor& remote0 = session->second.info.buffers(0);
      PlanSpec spec;
      spec.src_pages = room.src_pages;
      spec.dst_pages = room.dst_pages;
      spec.num_layers = static_cast<int32_t>(local_layout_.num_layers());
      spec.layer_begin = room.layer_begin;
      spec.layer_end = room.layer_end;
      spec.src_item_len = item_len_;
      spec.dst_item_len = remote0.item_len();
      spec.src_buffer_len = buffer_len_;
      spec.dst_buffer_len = remote0.length();
      spec.units = room.units;
      if (page_writes_) {
        // The backend takes the page lists themselves; validate them as a plan would.
        Status valid = ValidatePlanSpec(spec);
        if (!valid.ok()) {
          FailAndReportLocked(room, valid.WithContext("room '" + room.id + "'"));
          return;
        }
      } else {
        StatusOr<Plan> plan = BuildPlan(spec, TakeSpareRunsLocked());
        if (!plan.ok()) {
          FailAndReportLocked(room, plan.status().WithContext("room '" + room.id + "'"));
          return;
        }
        room.plan = std::move(plan).value();
      }
      room.planned = true;
      room.posted_end = room.layer_begin;
      AdvanceState(room, RequestState::kWaitingForInput);
    }
    const int32_t ready_end = std::min(room.layers_ready, room.layer_end);
    if (ready_end == room.layer_end && room.source_ready == Clock::time_point()) {
      room.source_ready = Clock::now();
    }
    if (ready_end > room.posted_end) {
      uint64_t bytes = 0;
      size_t num_runs = 0;
      StatusOr<WriteId> write =
          PostLayersLocked(room, session->second, ready_end, &bytes, &num_runs);
      if (!write.ok()) {
        FailAndReportLocked(room,
                            write.status().WithContext("posting layers of room '" + room.id + "'"));
        return;
      }
      room.writes.push_back(*write);
      room.last_post = Clock::now();
      if (room.first_post == Clock::time_point()) room.first_post = room.last_post;
      room.bytes += bytes;
      room.posted_end = ready_end;
      ++stats_.writes_posted;
      stats_.runs_posted += num_runs;
      AdvanceState(room, RequestState::kTransferring);
      if (room.posted_end < room.layer_end) {
        v1::Envelope progress;
        progress.mutable_layer_progress()->set_room_id(room.id);
        progress.mutable_layer_progress()->set_layers_done(
            static_cast<uint32_t>(room.posted_end - room.layer_begin));
        progress.mutable_layer_progress()->set_bytes_done(room.bytes);
        (void)SendToConnLocked(room.conn, progress);
      }
    }
    CheckWritesLocked(room);
  }

  // Prefill: posts layers [room.posted_end, ready_end) of the room to the backend: as page lists
  // (device backends: one gather/scatter per batch, waiting on the producer's event on the GPU)
  // or as the plan's copy runs (after the producer's event, when one was given, completed).
  StatusOr<WriteId> PostLayersLocked(Room& room, const Session& session, int32_t ready_end,
                                     uint64_t* bytes, size_t* num_runs) {
    if (page_writes_) {
      PageWrite write;
      write.src_pages = room.src_pages;
      write.dst_pages = room.dst_pages;
      write.num_layers = static_cast<int32_t>(local_layout_.num_layers());
      write.layer_begin = room.posted_end;
      write.layer_end = ready_end;
      write.units = room.units;
      PlanSpec spec;
      spec.src_pages = room.src_pages;
      spec.layer_begin = room.posted_end;
      spec.layer_end = ready_end;
      spec.src_item_len = item_len_;
      spec.units = room.units;
      write.bytes = PlanBytes(spec);
      write.ready = room.ready;
      *bytes = write.bytes;
      *num_runs = 0;
      return backend_->PostPages(session.backend_peer, write);
    }
    if (room.ready != nullptr) {
      // A CPU copy cannot wait on the GPU: the layers must be complete before it reads them.
      Status synced = kvt::cuda::ToStatus(cudaEventSynchronize(room.ready),
                                          "cudaEventSynchronize on the room's ready event");
      if (!synced.ok()) return synced;
    }
    std::span<const CopyRun> runs = room.plan->Layers(room.posted_end, ready_end);
    *bytes = 0;
    for (const CopyRun& r : runs) *bytes += r.bytes;
    *num_runs = runs.size();
    return backend_->PostWrite(session.backend_peer, runs);
  }

  // Prefill: completes the room once all layers are posted and every write is visible.
  void CheckWritesLocked(Room& room) {
    if (IsFinal(room.state) || !room.planned) return;
    for (auto it = room.writes.begin(); it != room.writes.end();) {
      Status st = backend_->Check(*it);
      if (st.code() == StatusCode::kInProgress) return;  // later writes cannot be done sooner
      if (!st.ok()) {
        FailAndReportLocked(room, st.WithContext("writing room '" + room.id + "'"));
        return;
      }
      backend_->Release(*it);
      it = room.writes.erase(it);
    }
    if (room.posted_end == room.layer_end && room.writes.empty()) {
      room.status = OkStatus();
      AdvanceState(room, RequestState::kSuccess);
      SendDoneLocked(room);
      KVT_LOG_DEBUG(
          "xfer", "room '{}' done: {} bytes, {} us after it was created", room.id, room.bytes,
          std::chrono::duration_cast<std::chrono::microseconds>(room.finished - room.created)
              .count());
    }
  }

  // --------------------------------------------------------------- prefill message handling --
  void OnHello(ConnectionId conn, const v1::Hello& hello) {
    Status compatible = CheckCompatible(local_layout_, hello.peer().layout(), "prefill", "decode");
    if (compatible.ok() && hello.peer().buffers_size() != local_info_.buffers_size()) {
      compatible = FailedPrecondition(
          "buffer count mismatch: prefill registers " + std::to_string(local_info_.buffers_size()) +
          " buffers, decode " + std::to_string(hello.peer().buffers_size()));
    }
    StatusOr<PeerDescriptor> descriptor =
        compatible.ok() ? DescriptorFromPeerInfo(hello.peer(), backend_->Name())
                        : StatusOr<PeerDescriptor>(compatible);
    StatusOr<PeerId> backend_peer =
        descriptor.ok() ? backend_->Connect(*descriptor) : StatusOr<PeerId>(descriptor.status());
    if (!backend_peer.ok()) {
      KVT_LOG_WARN("xfer", "refusing decode peer '{}': {}", hello.peer().name(),
                   backend_peer.status().ToString());
      (void)server_->Send(conn, control::MakeErrorEnvelope(backend_peer.status()));
      (void)server_->Disconnect(conn, backend_peer.status());
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      Session& session = sessions_[conn];
      session.backend_peer = *backend_peer;
      session.info = hello.peer();
    }
    v1::Envelope ack;
    ack.mutable_hello_ack()->set_protocol_version(control::kProtocolVersion);
    *ack.mutable_hello_ack()->mutable_peer() = local_info_;
    if (backend_->Capabilities().two_sided) {
      StatusOr<std::string> token = backend_->ConnectToken(*backend_peer);
      if (!token.ok()) {
        KVT_LOG_WARN("xfer", "refusing decode peer '{}': {}", hello.peer().name(),
                     token.status().ToString());
        {
          std::lock_guard<std::mutex> lock(mu_);
          sessions_.erase(conn);
        }
        (void)backend_->Disconnect(*backend_peer, Backend::DisconnectMode::kPeerDead);
        (void)server_->Send(conn, control::MakeErrorEnvelope(token.status()));
        (void)server_->Disconnect(conn, token.status());
        return;
      }
      ack.mutable_hello_ack()->set_backend_token(*token);
    }
    (void)server_->Send(conn, ack);
    KVT_LOG_INFO("xfer", "decode peer '{}' connected", hello.peer().name());
  }

  void OnTransferRequest(ConnectionId conn, const v1::Envelope& envelope) {
    const v1::TransferRequest& req = envelope.transfer_request();
    bool new_room = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto reject = [&](const Status& why) {
        (void)server_->Send(conn, control::MakeErrorEnvelope(why, req.room_id()));
      };
      if (sessions_.count(conn) == 0) {
        return reject(FailedPrecondition("send Hello before TransferRequest"));
      }
      if (req.mode() != v1::TRANSFER_MODE_PUSH) {
        return reject(Unimplemented("room '" + req.room_id() +
                                    "': only push mode is implemented on this engine"));
      }
      if (!req.backend().empty() && req.backend() != backend_->Name()) {
        return reject(InvalidArgument("room '" + req.room_id() + "' asks for backend '" +
                                      req.backend() + "' but this engine runs '" +
                                      std::string(backend_->Name()) + "'"));
      }
      const uint32_t num_layers = local_layout_.num_layers();
      int32_t begin = 0, end = static_cast<int32_t>(num_layers);
      if (req.has_layers()) {
        begin = static_cast<int32_t>(req.layers().begin());
        end = static_cast<int32_t>(req.layers().end());
      }
      auto it = rooms_.find(req.room_id());
      Room* room;
      if (it == rooms_.end()) {
        const auto deadline = req.deadline_ms() > 0 ? std::chrono::milliseconds(req.deadline_ms())
                                                    : options_.default_deadline;
        room = &NewRoomLocked(req.room_id(), deadline);
        new_room = true;
      } else {
        room = &it->second;
        if (room->have_request || IsFinal(room->state)) {
          return reject(AlreadyExists("room '" + req.room_id() + "' was already requested (" +
                                      RequestStateName(room->state) + ")"));
        }
        if (req.deadline_ms() > 0) {
          room->deadline = Clock::now() + std::chrono::milliseconds(req.deadline_ms());
        }
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
      AdvanceLocked(*room);
    }
    cv_.notify_all();
    if (new_room && options_.on_transfer_request) {
      options_.on_transfer_request(req.room_id(), control::DstPageCount(req));
    }
  }

  void OnPrefillAbort(ConnectionId conn, const v1::Abort& abort) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rooms_.find(abort.room_id());
    if (it != rooms_.end() && it->second.have_request && it->second.conn == conn) {
      ReleaseWritesLocked(it->second);
      FailLocked(it->second, Aborted("aborted by the decode side: " + abort.reason()));
    }
    v1::Envelope ack;
    ack.mutable_abort_ack()->set_room_id(abort.room_id());
    ack.mutable_abort_ack()->set_writes_quiesced(true);  // released above, or never posted
    (void)server_->Send(conn, ack);
  }

  // ---------------------------------------------------------------- decode message handling --
  void OnPeerMessage(PeerHandle peer_id, const v1::Envelope& envelope) {
    std::lock_guard<std::mutex> lock(mu_);
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
    auto room_of = [&](const std::string& id) -> Room* {
      auto it = rooms_.find(id);
      if (it == rooms_.end() || it->second.peer != peer_id) return nullptr;
      return &it->second;
    };
    switch (envelope.body_case()) {
      case v1::Envelope::kLayerProgress: {
        if (Room* room = room_of(envelope.layer_progress().room_id())) {
          AdvanceState(*room, RequestState::kTransferring);
        }
        return;
      }
      case v1::Envelope::kTransferDone: {
        const v1::TransferDone& done = envelope.transfer_done();
        if (Room* room = room_of(done.room_id())) {
          // The prefill side sends done only after its writes are visible or quiesced.
          room->pages_reusable = true;
          room->bytes = done.bytes();
          if (done.status() == v1::STATUS_CODE_OK) {
            room->status = OkStatus();
            AdvanceState(*room, RequestState::kSuccess);
          } else {
            FailLocked(*room, Status(control::FromProtoCode(done.status()),
                                     "prefill side: " + done.message()));
          }
        }
        return;
      }
      case v1::Envelope::kAbort: {
        if (Room* room = room_of(envelope.abort().room_id())) {
          room->pages_reusable = true;  // the prefill side quiesced before aborting
          FailLocked(*room, Aborted("aborted by the prefill side: " + envelope.abort().reason()));
        }
        v1::Envelope ack;
        ack.mutable_abort_ack()->set_room_id(envelope.abort().room_id());
        ack.mutable_abort_ack()->set_writes_quiesced(true);
        (void)p.client->Send(ack);
        return;
      }
      case v1::Envelope::kAbortAck: {
        if (Room* room = room_of(envelope.abort_ack().room_id())) {
          if (envelope.abort_ack().writes_quiesced()) room->pages_reusable = true;
        }
        return;
      }
      case v1::Envelope::kError: {
        const v1::Error& error = envelope.error();
        if (Room* room = room_of(error.room_id())) {
          room->pages_reusable = true;  // the prefill side refused: it posted nothing
          FailLocked(*room, control::StatusFromError(error).WithContext("prefill side"));
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

  void OnPeerDisconnect(PeerHandle peer_id, const Status& why) {
    std::string host;
    uint16_t port = 0;
    std::vector<std::string> affected;
    std::optional<PeerId> backend_peer;
    // Two-sided backends: this side's end of the pair goes with the control connection (after
    // the lock is released: tearing down a communicator may take a while).
    struct BackendRelease {
      Backend* backend;
      std::optional<PeerId>* peer;
      ~BackendRelease() {
        if (peer->has_value()) {
          (void)backend->Disconnect(**peer, Backend::DisconnectMode::kPeerDead);
        }
      }
    } release{backend_.get(), &backend_peer};
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto peer = peers_.find(peer_id);
      if (peer == peers_.end()) return;
      DecodePeer& p = *peer->second;
      p.alive = false;
      backend_peer = std::exchange(p.backend_peer, std::nullopt);
      if (!p.hello_answered) {
        p.hello_answered = true;
        p.hello_reply.set_value(
            Unavailable("connection closed before hello-ack: " + why.ToString()));
      }
      host = p.host;
      port = p.port;
      for (auto& [id, room] : rooms_) {
        if (room.peer != peer_id) continue;
        if (!IsFinal(room.state)) {
          FailLocked(room,
                     Unavailable("the prefill peer " + p.address + " was lost: " + why.ToString()));
        }
        if (!room.pages_reusable) affected.push_back(id);
      }
      if (affected.empty() || stop_) return;
      // Writes into those pages may still land unless the peer process is gone: find out off
      // the control thread.
      probes_.emplace_back([this, host, port, affected, peer_id] {
        // A killed process's sockets are released one by one, so the listener may still accept
        // for a moment after the connection closed: probe until it refuses, for up to
        // peer_timeout.
        const auto give_up = std::chrono::steady_clock::now() + options_.peer_timeout;
        bool dead = PeerPortRefuses(host, port);
        while (!dead && std::chrono::steady_clock::now() < give_up) {
          {
            std::unique_lock<std::mutex> wait(mu_);
            if (cv_.wait_for(wait, std::chrono::milliseconds(50), [this] { return stop_; })) {
              return;
            }
          }
          dead = PeerPortRefuses(host, port);
        }
        std::lock_guard<std::mutex> lock(mu_);
        if (!dead) {
          KVT_LOG_WARN("xfer",
                       "prefill peer {}:{} still listens; {} failed requests keep their "
                       "pages quarantined until it acknowledges",
                       host, port, affected.size());
          return;
        }
        for (const std::string& id : affected) {
          auto it = rooms_.find(id);
          if (it != rooms_.end() && it->second.peer == peer_id) it->second.pages_reusable = true;
        }
        final_cv_.notify_all();
      });
    }
  }

  void DropPeer(PeerHandle id) {
    std::unique_ptr<DecodePeer> peer;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = peers_.find(id);
      if (it == peers_.end()) return;
      peer = std::move(it->second);
      peers_.erase(it);
    }
    if (peer->client) peer->client->Close();
  }

  // -------------------------------------------------------------------------------- poller --
  void PollLoop() {
    // Short sleeps while writes are in flight: without this the kernel rounds each one up by
    // the default 50 µs timer slack.
    (void)prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      const auto now = Clock::now();
      bool writes_in_flight = false;
      WriteId oldest_write = 0;  // the first room's first write in flight
      auto next_wake = now + kIdlePoll;
      std::vector<std::string> ids(active_.begin(), active_.end());
      for (const std::string& id : ids) {
        auto it = rooms_.find(id);
        if (it == rooms_.end()) continue;
        Room& room = it->second;
        if (now >= room.deadline) {
          const Status why =
              DeadlineExceeded("room '" + room.id + "' missed its deadline in state " +
                               RequestStateName(room.state));
          if (options_.prefill) {
            FailAndReportLocked(room, why);
          } else {
            room.pages_reusable = false;
            v1::Envelope abort;
            abort.mutable_abort()->set_room_id(room.id);
            abort.mutable_abort()->set_code(v1::STATUS_CODE_DEADLINE_EXCEEDED);
            abort.mutable_abort()->set_reason(why.message());
            (void)SendToPeerLocked(room.peer, abort);
            FailLocked(room, why);
          }
          continue;
        }
        next_wake = std::min(next_wake, room.deadline);
        if (options_.prefill && !room.writes.empty()) {
          CheckWritesLocked(room);
          if (!room.writes.empty() && !writes_in_flight) oldest_write = room.writes.front();
          writes_in_flight |= !room.writes.empty();
        }
      }
      // Forget final rooms past their retention.
      if (now - last_sweep_ > std::chrono::seconds(1)) {
        last_sweep_ = now;
        for (auto it = rooms_.begin(); it != rooms_.end();) {
          const bool expired = IsFinal(it->second.state) &&
                               now - it->second.finished > options_.retention &&
                               (options_.prefill || it->second.pages_reusable);
          it = expired ? rooms_.erase(it) : std::next(it);
        }
      }
      // A backend that notifies completion wakes the poller itself; the poll is then only a
      // safety net.
      if (writes_in_flight) {
        next_wake = std::min(next_wake, now + (notified_ ? kNotifiedPoll : kBusyPoll));
      }
      if (writes_in_flight && page_writes_ && options_.device_spin.count() > 0) {
        // Device writes complete on the GPU: watch one of them without the lock for a while
        // (a CPU core for microsecond completion; waking from the notifier costs tens of µs),
        // then run the pass again. A write released meanwhile just ends the spin.
        lock.unlock();
        const auto until = std::min(Clock::now() + options_.device_spin, next_wake);
        while (!kicked_.load(std::memory_order_relaxed) && Clock::now() < until &&
               backend_->Check(oldest_write).code() == StatusCode::kInProgress) {
          // A few µs between checks: Check takes the backend's lock, which posting threads
          // need too.
          const auto next = Clock::now() + kDeviceSpinGap;
          while (Clock::now() < next) control::internal::SpinPause();
        }
        kicked_.store(false);
        lock.lock();
        continue;
      }
      // A notification that came while this pass ran skips the sleep (one that comes between
      // here and the wait is caught by the safety poll).
      if (!kicked_.exchange(false)) cv_.wait_until(lock, next_wake);
    }
  }

  const EngineOptions options_;
  pool::KvPool* const pool_;
  std::shared_ptr<Backend> backend_;
  std::unique_ptr<control::ControlServer> server_;
  v1::Layout local_layout_;
  v1::PeerInfo local_info_;
  uint64_t item_len_ = 0;
  uint64_t buffer_len_ = 0;
  bool page_writes_ = false;
  bool notified_ = false;            // the backend calls the completion notifier
  std::atomic<bool> kicked_{false};  // set by the notifier; consumed by the poller's wait
  std::atomic<bool> shut_down_{false};
  std::thread poller_;

  mutable std::mutex mu_;                     // guards everything below
  mutable std::condition_variable cv_;        // wakes the poller
  mutable std::condition_variable final_cv_;  // a room became final (WaitRequest)
  bool stop_ = false;
  std::unordered_map<std::string, Room> rooms_;
  std::vector<std::vector<CopyRun>> spare_runs_;  // RecycleRunsLocked
  std::set<std::string> active_;                  // non-final rooms
  std::atomic<size_t> active_count_{0};           // active_.size(), read by the control io threads
  std::unordered_map<ConnectionId, Session> sessions_;       // prefill: decode peers by connection
  std::map<PeerHandle, std::unique_ptr<DecodePeer>> peers_;  // decode: prefill peers
  PeerHandle next_peer_ = 1;
  std::vector<std::thread> probes_;
  EngineStats stats_;
  Clock::time_point last_sweep_ = Clock::now();
};

// --------------------------------------------------------------------------- public wrapper --
TransferEngine::TransferEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TransferEngine::~TransferEngine() = default;

StatusOr<std::unique_ptr<TransferEngine>> TransferEngine::Create(const EngineOptions& options,
                                                                 pool::KvPool* pool,
                                                                 std::shared_ptr<Backend> backend) {
  auto impl = std::make_unique<Impl>(options, pool, std::move(backend));
  KVT_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<TransferEngine>(new TransferEngine(std::move(impl)));
}

uint16_t TransferEngine::port() const { return impl_->port(); }
std::string_view TransferEngine::backend_name() const { return impl_->backend_name(); }
StatusOr<PeerHandle> TransferEngine::ConnectPeer(const std::string& host, uint16_t port) {
  return impl_->ConnectPeer(host, port);
}
Status TransferEngine::Receive(const std::string& room, PeerHandle peer,
                               std::vector<int32_t> dst_pages, std::chrono::milliseconds deadline,
                               int32_t layer_begin, int32_t layer_end) {
  return impl_->Receive(room, peer, std::move(dst_pages), deadline, layer_begin, layer_end);
}
Status TransferEngine::Send(const std::string& room, std::vector<int32_t> src_pages) {
  return impl_->Send(room, std::move(src_pages));
}
Status TransferEngine::LayersReady(const std::string& room, int32_t layers_done,
                                   cudaEvent_t ready) {
  return impl_->LayersReady(room, layers_done, ready);
}
StatusOr<RequestInfo> TransferEngine::GetRequest(const std::string& room) const {
  return impl_->GetRequest(room);
}
StatusOr<RequestInfo> TransferEngine::WaitRequest(const std::string& room,
                                                  std::chrono::milliseconds timeout) const {
  return impl_->WaitRequest(room, timeout);
}
Status TransferEngine::Abort(const std::string& room, const std::string& reason) {
  return impl_->Abort(room, reason);
}
Status TransferEngine::Forget(const std::string& room) { return impl_->Forget(room); }
EngineStats TransferEngine::stats() const { return impl_->stats(); }

}  // namespace kvt::transfer

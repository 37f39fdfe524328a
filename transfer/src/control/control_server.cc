#include "control/control_server.h"

#include <fmt/format.h>

#include <atomic>
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include "connection.h"
#include "control/auth.h"
#include "control/protocol.h"
#include "io_loop.h"
#include "kvt/common/log.h"

namespace kvt::control {

using internal::asio::ip::tcp;
namespace asio = internal::asio;

namespace {

constexpr size_t kMaxThreads = 64;
// Open connections plus those closing (each for at most close_linger) stay below this many
// times max_connections.
constexpr size_t kMaxConnectionsFactor = 4;
// After an accept error (EMFILE, ...), wait before accepting again instead of spinning.
constexpr std::chrono::milliseconds kAcceptRetryDelay{50};

StatusOr<asio::ip::address> ParseBindAddress(const std::string& text) {
  if (text == "localhost") return asio::ip::address(asio::ip::address_v4::loopback());
  boost::system::error_code ec;
  asio::ip::address address = asio::ip::make_address(text, ec);
  if (ec) {
    return InvalidArgument(
        fmt::format("bind_address \"{}\" is not an IP address (use e.g. 127.0.0.1, ::1, 0.0.0.0 or "
                    "localhost)",
                    text));
  }
  return address;
}

}  // namespace

struct ControlServer::Impl {
  Impl(const ControlServerOptions& opts, ControlHandler* h)
      : options(opts),
        handler(h),
        work(asio::make_work_guard(io)),
        accept_strand(asio::make_strand(io)),
        acceptor(accept_strand),
        accept_retry_timer(accept_strand) {}

  void StartAccept();
  std::atomic<bool> accepting{false};  // StartAccept was posted
  void OnAccept(const boost::system::error_code& ec, tcp::socket socket);
  void RejectOverLimit(tcp::socket& socket, size_t open);
  // The server is full: evicts the oldest connection still waiting for its auth_response, so
  // that connections which never authenticate cannot lock clients out. False when there is
  // none.
  bool EvictUnauthenticated(size_t open);
  std::shared_ptr<internal::Connection> Find(ConnectionId id) const;

  const ControlServerOptions options;
  ControlHandler* const handler;
  // Declared first so that it is destroyed last: sockets and timers need it while they die.
  asio::io_context io;
  // The io thread's lanes (busy polling with lanes allowed), else null.
  std::unique_ptr<internal::LanePollSet> lanes;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  asio::strand<asio::io_context::executor_type> accept_strand;
  tcp::acceptor acceptor;                 // used on accept_strand only
  asio::steady_timer accept_retry_timer;  // used on accept_strand only
  std::vector<std::thread> threads;
  uint16_t port = 0;
  std::atomic<ConnectionId> next_id{1};
  std::atomic<bool> stopping{false};
  std::mutex stop_mutex;  // serializes Stop()

  mutable std::mutex connections_mutex;
  std::unordered_map<ConnectionId, std::shared_ptr<internal::Connection>>
      connections;                              // guarded by connections_mutex
  size_t closed_connections = 0;                // guarded by connections_mutex
  size_t opened_connections = 0;                // guarded by connections_mutex
  std::condition_variable connections_changed;  // signalled under connections_mutex
};

void ControlServer::Impl::StartAccept() {
  if (stopping.load()) return;
  acceptor.async_accept(
      asio::make_strand(io),
      asio::bind_executor(accept_strand, [this](const boost::system::error_code& ec, auto socket) {
        OnAccept(ec, tcp::socket(std::move(socket)));
      }));
}

void ControlServer::Impl::OnAccept(const boost::system::error_code& ec, tcp::socket socket) {
  if (stopping.load() || ec == asio::error::operation_aborted) return;
  if (ec) {
    KVT_LOG_WARN("ctl", "accept on port {} failed: {}; retrying in {} ms", port, ec.message(),
                 kAcceptRetryDelay.count());
    accept_retry_timer.expires_after(kAcceptRetryDelay);
    accept_retry_timer.async_wait([this](const boost::system::error_code& wait_ec) {
      if (!wait_ec) StartAccept();
    });
    return;
  }
  // Connections still saying goodbye (evicted ones among them) do not count against
  // max_connections, but all of them together stay under kMaxConnectionsFactor times it.
  size_t open = 0;
  size_t total = 0;
  {
    std::lock_guard<std::mutex> lock(connections_mutex);
    total = connections.size();
    for (const auto& [other, connection] : connections) open += connection->closing() ? 0 : 1;
  }
  if (total >= kMaxConnectionsFactor * options.max_connections ||
      (open >= options.max_connections && !EvictUnauthenticated(open))) {
    RejectOverLimit(socket, open);
    StartAccept();
    return;
  }

  const ConnectionId id = next_id.fetch_add(1);
  internal::ConnectionConfig config;
  config.side = internal::Side::kServer;
  config.id = id;
  config.local_id = options.server_id;
  config.cluster_token = options.cluster_token;
  config.limits = options.limits;
  config.validation = options.validation;
  config.lanes = lanes.get();
  config.lane_ring_bytes = options.busy_poll.lane_ring_bytes;

  internal::ConnectionCallbacks callbacks;
  callbacks.on_open = [this, id](const ConnectionInfo& info) { handler->OnConnect(id, info); };
  callbacks.on_message = [this, id](const v1::Envelope& envelope) {
    handler->OnMessage(id, envelope);
    return OkStatus();
  };
  callbacks.on_heartbeat = [this, id] { handler->OnHeartbeat(id); };
  callbacks.on_close = [this, id](const Status& why, bool was_open) {
    // Forget the connection first, so that Send(id) from OnDisconnect (or after it) is NotFound.
    std::shared_ptr<internal::Connection> keep;
    {
      std::lock_guard<std::mutex> lock(connections_mutex);
      auto it = connections.find(id);
      if (it != connections.end()) {
        keep = std::move(it->second);
        connections.erase(it);
      }
    }
    if (was_open) {
      try {
        handler->OnDisconnect(id, why);
      } catch (const std::exception& e) {
        KVT_LOG_ERROR("ctl", "OnDisconnect({}) threw: {}", id, e.what());
      }
    }
    // Stop() waits for the map to empty and for OnDisconnect to have run: notify last.
    std::lock_guard<std::mutex> lock(connections_mutex);
    ++closed_connections;
    connections_changed.notify_all();
  };
  auto connection = std::make_shared<internal::Connection>(std::move(socket), std::move(config),
                                                           std::move(callbacks));
  KVT_LOG_DEBUG("ctl", "connection {} accepted from {}", id, connection->remote_address());
  {
    std::lock_guard<std::mutex> lock(connections_mutex);
    connections.emplace(id, connection);
    ++opened_connections;
  }
  connection->Start();
  StartAccept();
}

bool ControlServer::Impl::EvictUnauthenticated(size_t open) {
  std::shared_ptr<internal::Connection> victim;
  {
    std::lock_guard<std::mutex> lock(connections_mutex);
    ConnectionId oldest = 0;
    for (const auto& [id, connection] : connections) {
      if (connection->awaiting_authentication() && (oldest == 0 || id < oldest)) {
        oldest = id;
        victim = connection;
      }
    }
    if (victim == nullptr || !victim->ClaimForEviction()) return false;
  }
  KVT_LOG_WARN("ctl",
               "{} connections open (max_connections = {}): closing unauthenticated connection {} "
               "({}) to make room",
               open, options.max_connections, victim->id(), victim->remote_address());
  victim->Evict(ResourceExhausted(fmt::format(
      "the server is full ({} connections, max_connections = {}) and this connection has not "
      "authenticated; authenticate right after connecting",
      open, options.max_connections)));
  return true;
}

void ControlServer::Impl::RejectOverLimit(tcp::socket& socket, size_t open) {
  boost::system::error_code ec;
  const tcp::endpoint remote = socket.remote_endpoint(ec);
  const std::string message =
      fmt::format("too many connections: {} open, the limit is {} (max_connections); retry later",
                  open, options.max_connections);
  KVT_LOG_WARN("ctl", "refusing a connection from {}: {}",
               ec ? std::string("<unknown>") : internal::EndpointString(remote), message);
  // One non-blocking write attempt: a refused peer gets no buffering and no timers from us.
  StatusOr<std::string> frame =
      EncodeFrame(MakeErrorEnvelope(v1::STATUS_CODE_RESOURCE_EXHAUSTED, message));
  if (frame.ok()) {
    socket.non_blocking(true, ec);
    socket.write_some(asio::buffer(*frame), ec);
  }
  socket.shutdown(tcp::socket::shutdown_both, ec);
  socket.close(ec);
}

std::shared_ptr<internal::Connection> ControlServer::Impl::Find(ConnectionId id) const {
  std::lock_guard<std::mutex> lock(connections_mutex);
  auto it = connections.find(id);
  return it == connections.end() ? nullptr : it->second;
}

StatusOr<std::unique_ptr<ControlServer>> ControlServer::Create(const ControlServerOptions& options,
                                                               ControlHandler* handler,
                                                               AcceptStart start) {
  if (handler == nullptr) return InvalidArgument("ControlServer::Create: handler is null");
  KVT_RETURN_IF_ERROR(internal::CheckBusyPoll(options.busy_poll));
  if (options.busy_poll.window.count() > 0 && options.num_threads > 1) {
    return InvalidArgument(fmt::format(
        "busy_poll with num_threads = {}: a polling io thread cannot see the sockets another io "
        "thread is waiting on in epoll, so the frames would still wait for a wake-up; use "
        "num_threads = 1 with busy polling (or busy_poll.window = 0)",
        options.num_threads));
  }
  if (options.num_threads < 1 || options.num_threads > kMaxThreads) {
    return InvalidArgument(
        fmt::format("num_threads = {}: must be in 1..{}", options.num_threads, kMaxThreads));
  }
  if (options.max_connections < 1) return InvalidArgument("max_connections must be >= 1");
  if (options.limits.max_frame_bytes < 64) {
    return InvalidArgument(
        fmt::format("limits.max_frame_bytes = {}: too small for any real message (>= 64)",
                    options.limits.max_frame_bytes));
  }
  KVT_RETURN_IF_ERROR(internal::CheckConnectionLimits(options.limits));
  if (options.server_id.empty() || options.server_id.size() > options.validation.max_name_bytes) {
    return InvalidArgument(
        fmt::format("server_id must be 1..{} bytes", options.validation.max_name_bytes));
  }
  KVT_ASSIGN_OR_RETURN(asio::ip::address address, ParseBindAddress(options.bind_address));
  if (!options.cluster_token.empty()) {
    KVT_RETURN_IF_ERROR(CheckClusterToken(options.cluster_token));
  } else if (!address.is_loopback() && !options.allow_remote_without_token) {
    return InvalidArgument(fmt::format(
        "refusing to listen on {} without a cluster token: anyone who reaches the port could "
        "drive transfers. Set KVT_CLUSTER_TOKEN (or ControlServerOptions::cluster_token), bind "
        "to 127.0.0.1, or set allow_remote_without_token on an isolated network",
        options.bind_address));
  }

  auto impl = std::make_unique<Impl>(options, handler);
  const tcp::endpoint endpoint(address, options.port);
  try {
    impl->acceptor.open(endpoint.protocol());
    impl->acceptor.set_option(tcp::acceptor::reuse_address(true));
    impl->acceptor.bind(endpoint);
    impl->acceptor.listen(asio::socket_base::max_listen_connections);
    impl->port = impl->acceptor.local_endpoint().port();
  } catch (const boost::system::system_error& e) {
    return Unavailable(fmt::format("cannot listen on {}: {}", internal::EndpointString(endpoint),
                                   e.code().message()));
  }
  KVT_LOG_INFO("ctl", "control server \"{}\" listening on {} ({})", options.server_id,
               internal::EndpointString(tcp::endpoint(address, impl->port)),
               options.cluster_token.empty() ? "no authentication" : "HMAC authentication");
  Impl* raw = impl.get();
  raw->lanes = internal::MakeLanePollSet(options.busy_poll);
  try {
    for (size_t i = 0; i < options.num_threads; ++i) {
      raw->threads.emplace_back([raw] {
        internal::RunIoLoop(raw->io, raw->options.busy_poll, "control server", raw->lanes.get());
      });
    }
  } catch (const std::system_error& e) {
    auto server = std::unique_ptr<ControlServer>(new ControlServer(std::move(impl)));
    server->Stop();
    return ResourceExhausted(fmt::format("cannot start control server threads: {}", e.what()));
  }
  auto server = std::unique_ptr<ControlServer>(new ControlServer(std::move(impl)));
  if (start == AcceptStart::kNow) server->StartAccepting();
  return server;
}

ControlServer::ControlServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

void ControlServer::StartAccepting() {
  if (impl_->accepting.exchange(true)) return;
  Impl* raw = impl_.get();
  asio::post(raw->accept_strand, [raw] { raw->StartAccept(); });
}

ControlServer::~ControlServer() { Stop(); }

uint16_t ControlServer::port() const { return impl_->port; }

void ControlServer::Wake() {
  if (impl_->options.busy_poll.window.count() > 0) asio::post(impl_->io, [] {});
}

Status ControlServer::Send(ConnectionId id, const v1::Envelope& envelope, QueueLimit limit) {
  std::shared_ptr<internal::Connection> connection = impl_->Find(id);
  if (connection == nullptr) {
    return NotFound(fmt::format("no open control connection {} (it closed or never existed)", id));
  }
  return connection->Send(envelope, limit);
}

Status ControlServer::Disconnect(ConnectionId id, const Status& why) {
  std::shared_ptr<internal::Connection> connection = impl_->Find(id);
  if (connection == nullptr) {
    return NotFound(fmt::format("no open control connection {} (it closed or never existed)", id));
  }
  connection->Close(why.ok() ? Aborted("disconnected by the server") : why);
  return OkStatus();
}

size_t ControlServer::connection_count() const {
  std::lock_guard<std::mutex> lock(impl_->connections_mutex);
  return impl_->connections.size();
}

size_t ControlServer::lane_count() const {
  std::lock_guard<std::mutex> lock(impl_->connections_mutex);
  size_t n = 0;
  for (const auto& [id, connection] : impl_->connections) n += connection->lane_active() ? 1 : 0;
  return n;
}

void ControlServer::Stop() {
  Impl& impl = *impl_;
  std::lock_guard<std::mutex> stop_lock(impl.stop_mutex);
  if (impl.threads.empty() && impl.stopping.load()) return;
  impl.stopping.store(true);
  asio::post(impl.accept_strand, [&impl] {
    boost::system::error_code ignored;
    impl.acceptor.close(ignored);
    try {
      impl.accept_retry_timer.cancel();
    } catch (const std::exception&) {
    }
  });

  std::vector<std::shared_ptr<internal::Connection>> open;
  {
    std::lock_guard<std::mutex> lock(impl.connections_mutex);
    for (const auto& [id, connection] : impl.connections) open.push_back(connection);
  }
  for (const auto& connection : open) connection->Close(Aborted("control server stopping"));
  open.clear();
  {
    // Connections say goodbye within close_linger; give them that long, then cut them off.
    std::unique_lock<std::mutex> lock(impl.connections_mutex);
    const auto wait = impl.options.limits.close_linger + std::chrono::milliseconds(500);
    if (!impl.connections_changed.wait_for(
            lock, wait, [&] { return impl.closed_connections == impl.opened_connections; })) {
      KVT_LOG_WARN("ctl", "{} connection(s) did not close in time; dropping them",
                   impl.opened_connections - impl.closed_connections);
    }
  }
  impl.work.reset();
  impl.io.stop();
  for (std::thread& thread : impl.threads) {
    if (thread.joinable()) thread.join();
  }
  impl.threads.clear();
  std::lock_guard<std::mutex> lock(impl.connections_mutex);
  impl.connections.clear();
}

}  // namespace kvt::control

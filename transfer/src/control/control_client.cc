#include "control/control_client.h"

#include <fmt/format.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <condition_variable>
#include <deque>
#include <exception>
#include <future>
#include <mutex>
#include <optional>
#include <stop_token>
#include <thread>

#include "connection.h"
#include "control/auth.h"
#include "io_loop.h"
#include "kvt/common/log.h"

namespace kvt::control {

using internal::asio::ip::tcp;
namespace asio = internal::asio;

namespace {

// Extra time granted to the I/O thread beyond the configured timeouts before Connect gives up
// waiting for it (the timeouts themselves run on that thread).
constexpr std::chrono::milliseconds kWaitMargin{1000};

long long Ms(std::chrono::milliseconds d) { return static_cast<long long>(d.count()); }

}  // namespace

struct ControlClient::Impl {
  Impl(const ControlClientOptions& opts, Handler* h)
      : options(opts), handler(h), work(asio::make_work_guard(io)) {}

  const ControlClientOptions options;
  Handler* const handler;
  asio::io_context io;  // declared first: destroyed last
  // The io thread's lanes (busy polling with lanes allowed), else null.
  std::unique_ptr<internal::LanePollSet> lanes = internal::MakeLanePollSet(options.busy_poll);
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  std::thread thread;
  std::shared_ptr<internal::Connection> connection;
  std::mutex close_mutex;  // serializes Close()

  mutable std::mutex mutex;
  std::condition_variable changed;  // signalled under mutex
  bool open = false;                // guarded by mutex
  bool closed = false;              // guarded by mutex
  Status close_status;              // guarded by mutex
  std::string server_id;            // guarded by mutex; immutable once open
  std::deque<v1::Envelope> inbox;   // guarded by mutex

  void Shutdown();
};

void ControlClient::Impl::Shutdown() {
  std::lock_guard<std::mutex> close_lock(close_mutex);
  if (!thread.joinable()) return;
  if (connection != nullptr) {
    connection->Close(Aborted("control client closed by this side"));
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait_for(lock, options.limits.close_linger + std::chrono::milliseconds(500),
                     [&] { return closed; });
  }
  work.reset();
  io.stop();
  thread.join();
  connection.reset();
  std::lock_guard<std::mutex> lock(mutex);
  if (!closed) {
    closed = true;
    close_status = Aborted("control client closed by this side");
  }
  changed.notify_all();
}

StatusOr<std::unique_ptr<ControlClient>> ControlClient::Connect(const ControlClientOptions& options,
                                                                Handler* handler,
                                                                std::stop_token stop) {
  if (!options.cluster_token.empty()) KVT_RETURN_IF_ERROR(CheckClusterToken(options.cluster_token));
  if (options.client_id.empty() || options.client_id.size() > options.validation.max_name_bytes) {
    return InvalidArgument(
        fmt::format("client_id must be 1..{} bytes", options.validation.max_name_bytes));
  }
  if (options.port == 0) return InvalidArgument("ControlClientOptions::port is 0");
  if (options.max_inbox_frames < 1) return InvalidArgument("max_inbox_frames must be >= 1");
  KVT_RETURN_IF_ERROR(internal::CheckConnectionLimits(options.limits));
  KVT_RETURN_IF_ERROR(internal::CheckBusyPoll(options.busy_poll));
  const std::string target = fmt::format("{}:{}", options.host, options.port);
  if (stop.stop_requested()) {
    return Aborted(fmt::format("connecting to {} was stopped before it began", target));
  }

  auto impl = std::make_unique<Impl>(options, handler);
  Impl* raw = impl.get();
  // From here on, `client` owns the thread: every early return joins it.
  std::unique_ptr<ControlClient> client(new ControlClient(std::move(impl)));
  raw->thread = std::thread([raw] {
    internal::RunIoLoop(raw->io, raw->options.busy_poll, "control client", raw->lanes.get());
  });

  // 1. Resolve and connect, bounded by connect_timeout. Everything runs on one strand, so the
  // timer and the completions see `timed_out` consistently.
  struct ConnectState {
    explicit ConnectState(asio::io_context& io)
        : strand(asio::make_strand(io)), socket(strand), resolver(strand), timer(strand) {}
    asio::strand<asio::io_context::executor_type> strand;
    tcp::socket socket;
    tcp::resolver resolver;
    asio::steady_timer timer;
    bool timed_out = false;
    bool stopped = false;   // a stop was requested on Connect's stop_token
    bool finished = false;  // a completion reported; the timer must not touch the socket now
    std::promise<Status> done;
  };
  auto state = std::make_shared<ConnectState>(raw->io);
  std::future<Status> connected = state->done.get_future();
  asio::post(state->strand, [state, &options, target] {
    state->timer.expires_after(options.connect_timeout);
    state->timer.async_wait([state](const boost::system::error_code& ec) {
      if (ec || state->finished) return;
      state->timed_out = true;
      state->resolver.cancel();
      boost::system::error_code ignored;
      state->socket.close(ignored);
    });
    auto fail = [state, target, timeout = options.connect_timeout](
                    const boost::system::error_code& ec, std::string_view step) {
      state->finished = true;
      state->timer.cancel();
      if (state->stopped) {
        state->done.set_value(Aborted(fmt::format("connecting to {} was stopped", target)));
      } else if (state->timed_out) {
        state->done.set_value(DeadlineExceeded(
            fmt::format("connecting to {} timed out after {} ms ({})", target, Ms(timeout), step)));
      } else {
        state->done.set_value(
            Unavailable(fmt::format("cannot connect to {}: {}: {}", target, step, ec.message())));
      }
    };
    state->resolver.async_resolve(
        options.host, std::to_string(options.port),
        [state, fail](const boost::system::error_code& ec, tcp::resolver::results_type results) {
          if (ec || state->stopped) return fail(ec, "resolve");
          asio::async_connect(
              state->socket, results,
              [state, fail](const boost::system::error_code& connect_ec, const tcp::endpoint&) {
                if (connect_ec) return fail(connect_ec, "connect");
                state->finished = true;
                state->timer.cancel();
                state->done.set_value(OkStatus());
              });
        });
  });
  // Posted after the steps above, so it runs after them on the strand; the resolve handler checks
  // `stopped` for a stop that came between resolving and connecting.
  std::stop_callback stop_connecting(stop, [state] {
    asio::post(state->strand, [state] {
      if (state->finished) return;
      state->stopped = true;
      state->resolver.cancel();
      boost::system::error_code ignored;
      state->socket.close(ignored);
    });
  });
  if (connected.wait_for(options.connect_timeout + kWaitMargin) != std::future_status::ready) {
    return DeadlineExceeded(fmt::format("connecting to {} did not finish in {} ms", target,
                                        Ms(options.connect_timeout + kWaitMargin)));
  }
  KVT_RETURN_IF_ERROR(connected.get());

  // 2. Handshake on a Connection of our own.
  internal::ConnectionConfig config;
  config.side = internal::Side::kClient;
  config.id = 1;
  config.local_id = options.client_id;
  config.role = options.role;
  config.cluster_token = options.cluster_token;
  config.require_server_proof = options.require_server_proof;
  config.limits = options.limits;
  config.validation = options.validation;
  config.lanes = raw->lanes.get();
  config.lane_ring_bytes = options.busy_poll.lane_ring_bytes;

  internal::ConnectionCallbacks callbacks;
  callbacks.on_open = [raw](const ConnectionInfo& info) {
    std::lock_guard<std::mutex> lock(raw->mutex);
    raw->open = true;
    raw->server_id = info.peer_id;
    raw->changed.notify_all();
  };
  callbacks.on_message = [raw](const v1::Envelope& envelope) -> Status {
    if (raw->handler != nullptr) {
      raw->handler->OnMessage(envelope);
      return OkStatus();
    }
    std::lock_guard<std::mutex> lock(raw->mutex);
    if (raw->inbox.size() >= raw->options.max_inbox_frames) {
      return ResourceExhausted(fmt::format(
          "control client inbox full ({} messages, max_inbox_frames): call Receive() more "
          "often or pass a Handler",
          raw->inbox.size()));
    }
    raw->inbox.push_back(envelope);
    raw->changed.notify_all();
    return OkStatus();
  };
  callbacks.on_close = [raw](const Status& why, bool was_open) {
    {
      std::lock_guard<std::mutex> lock(raw->mutex);
      raw->closed = true;
      raw->close_status = why;
      raw->changed.notify_all();
    }
    if (was_open && raw->handler != nullptr) raw->handler->OnDisconnect(why);
  };
  raw->connection = std::make_shared<internal::Connection>(tcp::socket(std::move(state->socket)),
                                                           std::move(config), std::move(callbacks));
  raw->connection->Start();

  // Declared before `lock`: a callback running on another thread takes the mutex, and this
  // callback's destructor waits for it.
  std::stop_callback stop_handshake(stop, [raw] {
    std::lock_guard<std::mutex> guard(raw->mutex);
    raw->changed.notify_all();
  });
  std::unique_lock<std::mutex> lock(raw->mutex);
  if (!raw->changed.wait_for(lock, options.limits.handshake_timeout + kWaitMargin,
                             [&] { return raw->open || raw->closed || stop.stop_requested(); })) {
    lock.unlock();
    return DeadlineExceeded(fmt::format("handshake with {} did not finish in {} ms", target,
                                        Ms(options.limits.handshake_timeout + kWaitMargin)));
  }
  if (!raw->open && !raw->closed) {
    lock.unlock();
    return Aborted(fmt::format("connecting to {} was stopped during the handshake", target));
  }
  if (!raw->open) {
    Status why = raw->close_status;
    lock.unlock();
    return why.WithContext(fmt::format("control connection to {}", target));
  }
  lock.unlock();
  return client;
}

ControlClient::ControlClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ControlClient::~ControlClient() { Close(); }

Status ControlClient::Send(const v1::Envelope& envelope, QueueLimit limit) {
  if (impl_->connection == nullptr) return Unavailable("control client is not connected");
  return impl_->connection->Send(envelope, limit);
}

StatusOr<v1::Envelope> ControlClient::Receive(std::chrono::milliseconds timeout,
                                              std::stop_token stop) {
  if (impl_->handler != nullptr) {
    return FailedPrecondition("ControlClient::Receive: this client delivers to its Handler");
  }
  // Declared before `lock` (see Connect).
  std::stop_callback wake(stop, [this] {
    std::lock_guard<std::mutex> guard(impl_->mutex);
    impl_->changed.notify_all();
  });
  std::unique_lock<std::mutex> lock(impl_->mutex);
  impl_->changed.wait_for(lock, timeout, [&] {
    return !impl_->inbox.empty() || impl_->closed || stop.stop_requested();
  });
  if (!impl_->inbox.empty()) {
    v1::Envelope envelope = std::move(impl_->inbox.front());
    impl_->inbox.pop_front();
    return envelope;
  }
  if (impl_->closed) return impl_->close_status;
  if (stop.stop_requested()) return Aborted("stopped while waiting for a control message");
  return DeadlineExceeded(fmt::format("no control message within {} ms", Ms(timeout)));
}

void ControlClient::Wake() {
  if (impl_->options.busy_poll.window.count() > 0) asio::post(impl_->io, [] {});
}

bool ControlClient::connected() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->open && !impl_->closed;
}

bool ControlClient::using_lane() const {
  // Like Send(): `connection` is set before Connect returns and reset only by Close.
  return impl_->connection != nullptr && impl_->connection->lane_active();
}

const std::string& ControlClient::server_id() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->server_id;
}

void ControlClient::Close() { impl_->Shutdown(); }

}  // namespace kvt::control

// ControlServer: accepts control connections (TCP, framed kvt.v1.Envelope), authenticates them,
// validates every frame and hands valid messages to a ControlHandler.
//
// Threads: the server owns its io_context and a pool of `num_threads` threads (default 1); no
// Asio type appears in this header. Each connection runs on its own strand, so the handler's
// calls for one connection are serialized and in arrival order; calls for different connections
// may run concurrently when num_threads > 1. Handlers must not block for long (they hold up that
// connection's reads) and must not call Stop() (it joins the threads they run on).
//
// Per connection: on accept the server sends AuthChallenge. With a cluster token the client must
// answer with a valid HMAC (auth.h) within limits.handshake_timeout or it is refused
// ("authentication failed" Error frame, then close); until then its frames may be at most
// limits.max_handshake_frame_bytes. Without a token the client's first complete frame must
// arrive within limits.handshake_timeout. Every frame must arrive whole within
// limits.frame_timeout of its first byte. A full server (max_connections) makes room by closing
// its oldest connection still waiting for an auth_response. Frames that do not decode, break the
// size limit or fail Validate() get an Error frame naming the problem and the connection is closed
// and logged (tag "ctl"); other connections are unaffected. Hello / HelloAck with another protocol
// version get Error(PROTOCOL_VERSION_MISMATCH) naming both versions, then close. Heartbeats are
// answered by the server itself and not passed to the handler.
//
// Security: without a cluster token the server listens on loopback only, unless
// allow_remote_without_token is set.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "control/validate.h"
#include "kvt/common/status.h"
#include "kvt/transfer/control_options.h"
#include "kvt/v1/control.pb.h"

namespace kvt::control {

// Names one accepted connection for the server's lifetime; never reused. 0 is never an id.
using ConnectionId = uint64_t;

// What the server knows about a connection once its handshake is done.
struct ConnectionInfo {
  ConnectionId id = 0;
  std::string remote_address;  // "ip:port"
  bool authenticated = false;  // true when the peer proved the cluster token
  // The peer's name: on a server, the client_id of its AuthResponse (empty without
  // authentication); on a client, the server_id of the server's AuthChallenge.
  std::string peer_id;
  // The client's role from its AuthResponse (server side, authenticated only); else UNSPECIFIED.
  v1::Role role = v1::ROLE_UNSPECIFIED;
};

// Receives a server's events. Implementations must be thread-safe across connections (see the
// thread contract above). The caller owns the handler; it must outlive the server's Stop().
class ControlHandler {
 public:
  virtual ~ControlHandler() = default;
  // The connection finished its handshake; messages may follow.
  virtual void OnConnect(ConnectionId id, const ConnectionInfo& info) {}
  // One validated message (never an auth message or a heartbeat).
  virtual void OnMessage(ConnectionId id, const v1::Envelope& envelope) = 0;
  // A heartbeat or heartbeat ack arrived: the peer is alive (the idle timeout restarts).
  virtual void OnHeartbeat(ConnectionId id) {}
  // The connection is gone: called exactly once for each connection that got OnConnect, last.
  virtual void OnDisconnect(ConnectionId id, const Status& why) = 0;
};

// When a new server starts taking connections: at once, or once its owner calls
// StartAccepting() (an owner whose handler uses the server it stores, e.g. to reply, stores it
// first: its io threads never see the pointer before it is set).
enum class AcceptStart { kNow, kOnStartAccepting };

class ControlServer {
 public:
  // Binds, listens and starts serving. InvalidArgument for bad options (a short token, no token
  // with a non-loopback address, ...); Unavailable when the address cannot be bound.
  static StatusOr<std::unique_ptr<ControlServer>> Create(const ControlServerOptions& options,
                                                         ControlHandler* handler,
                                                         AcceptStart start = AcceptStart::kNow);

  // Starts taking connections (AcceptStart::kOnStartAccepting); does nothing the second time.
  void StartAccepting();

  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;
  ~ControlServer();  // Stop()

  // The port actually bound (useful with options.port = 0).
  uint16_t port() const;

  // With busy polling (options.busy_poll): gets the io thread out of the reactor's sleep so that
  // it polls, e.g. when the owner starts expecting frames (busy_poll.hint now true). Thread-safe,
  // non-blocking; does nothing without busy polling.
  void Wake();

  // Queues one frame for the connection. Thread-safe, non-blocking. NotFound when the
  // connection is gone; ResourceExhausted when its send queue is full (unless `limit` exempts
  // the frame); InvalidArgument when the envelope is empty or too large.
  Status Send(ConnectionId id, const v1::Envelope& envelope,
              QueueLimit limit = QueueLimit::kEnforced);

  // Closes the connection after its queued frames are sent (bounded by limits.close_linger).
  // Thread-safe. NotFound when it is already gone.
  Status Disconnect(ConnectionId id, const Status& why);

  // Connections currently open (handshake done or in progress).
  size_t connection_count() const;
  // Of those, the ones whose frames go through a shared-memory lane (BusyPollOptions::lanes).
  size_t lane_count() const;

  // Stops accepting, closes every connection (OnDisconnect with Aborted), joins the threads.
  // Idempotent; do not call from a handler.
  void Stop();

 private:
  struct Impl;
  explicit ControlServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvt::control

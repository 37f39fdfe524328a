// ControlClient: one outgoing control connection, with the same framing, validation and
// authentication as ControlServer (see control_server.h).
//
// Threads: each client owns an io_context and one thread that does its I/O and runs its
// Handler's calls (serialized, in arrival order). Send() and Close() may be called from any
// thread. Without a Handler, received messages wait in a bounded inbox for Receive().
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stop_token>
#include <string>

#include "control/validate.h"
#include "kvt/common/status.h"
#include "kvt/transfer/control_options.h"
#include "kvt/v1/control.pb.h"

namespace kvt::control {

struct ControlClientOptions {
  std::string host = "127.0.0.1";  // IP address or host name of the server
  uint16_t port = 0;
  // Who we are; bound into the authentication MAC.
  std::string client_id = "kvt-client";
  v1::Role role = v1::ROLE_TOOL;
  // Shared secret (>= 16 bytes); empty: connect only to servers without authentication.
  std::string cluster_token;
  // With a token: make the server prove it knows the token too (mutual authentication), and
  // refuse servers that do not authenticate at all.
  bool require_server_proof = true;
  std::chrono::milliseconds connect_timeout{5000};  // TCP connect (resolution included)
  // Received messages kept for Receive() when there is no Handler; overflowing it closes the
  // connection with ResourceExhausted.
  size_t max_inbox_frames = 1024;
  ConnectionLimits limits;
  ValidationLimits validation;
  BusyPollOptions busy_poll;  // how the io thread(s) wait for frames (control_options.h)
};

class ControlClient {
 public:
  // Receives the client's events on its I/O thread.
  class Handler {
   public:
    virtual ~Handler() = default;
    // One validated message (never an auth message or a heartbeat).
    virtual void OnMessage(const v1::Envelope& envelope) = 0;
    // The connection is gone; called once, last. Not called when Connect() fails.
    virtual void OnDisconnect(const Status& why) = 0;
  };

  // Connects and authenticates; returns once the connection is ready for Send(), or fails
  // within connect_timeout + limits.handshake_timeout. `handler` may be null (use Receive());
  // otherwise the caller owns it and it must outlive the client. A stop requested on `stop`
  // (from any thread) ends the attempt at once with Aborted.
  // Errors: DeadlineExceeded (timeouts), Unavailable (refused / reset), FailedPrecondition
  // (authentication refused or impossible, with the server's message), Aborted (stopped).
  static StatusOr<std::unique_ptr<ControlClient>> Connect(const ControlClientOptions& options,
                                                          Handler* handler = nullptr,
                                                          std::stop_token stop = {});

  ControlClient(const ControlClient&) = delete;
  ControlClient& operator=(const ControlClient&) = delete;
  ~ControlClient();  // Close()

  // Queues one frame. Thread-safe, non-blocking. Unavailable once the connection is closed;
  // ResourceExhausted when the send queue is full (unless `limit` exempts the frame).
  Status Send(const v1::Envelope& envelope, QueueLimit limit = QueueLimit::kEnforced);

  // The next received message, waiting up to `timeout`. Only without a Handler
  // (FailedPrecondition otherwise). DeadlineExceeded when nothing came; once the connection is
  // closed and the inbox is empty, the Status it closed with; Aborted when a stop was requested
  // on `stop` before a message came (the connection stays open).
  StatusOr<v1::Envelope> Receive(std::chrono::milliseconds timeout, std::stop_token stop = {});

  // False once the connection has closed (either side).
  bool connected() const;
  // Whether its frames go through a shared-memory lane (BusyPollOptions::lanes; thread-safe).
  bool using_lane() const;

  // With busy polling (options.busy_poll): gets the io thread out of the reactor's sleep so that
  // it polls, e.g. right after a request went out whose answer is expected (busy_poll.hint now
  // true). Thread-safe, non-blocking; does nothing without busy polling.
  void Wake();

  // The server's name from its AuthChallenge.
  const std::string& server_id() const;

  // Sends what is queued (bounded by limits.close_linger), closes, joins the I/O thread.
  // Idempotent; do not call from the Handler.
  void Close();

 private:
  struct Impl;
  explicit ControlClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvt::control

// The plain-socket ceiling of `kvt-bench transfer` over UCX's tcp transport: what one TCP
// connection on loopback moves when a request's bytes are written as they are, with nothing on
// top of the kernel.
//
// The prefill process sends (SendSocketRequests), the decode process receives
// (SocketCeilingReceiver), as kvt's writes go. Per request: `bytes` written from one buffer in
// kSocketWriteBytes send() calls; the receiver recv()s into one buffer of `bytes` and answers one
// byte; the sender's clock runs from its first send() to that byte read.
//
// Plain POSIX sockets, no library (not Asio, not UCX): a ceiling must be the kernel's own TCP
// path, and any layer on top would be part of what is measured. Kernel defaults otherwise
// (buffer autotuning, no SO_SNDBUF / SO_RCVBUF), TCP_NODELAY on both ends for the one-byte answer.
// Bounded: every send() and recv() carries SO_SNDTIMEO / SO_RCVTIMEO and the request's deadline;
// accept() waits in poll() for at most the deadline.
//
// Thread contract: an object and a call are used by one thread; the two ends run in different
// processes (or threads).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "kvt/common/status.h"

namespace kvt::bench {

inline constexpr int64_t kSocketWriteBytes = int64_t{1} << 20;

// The receiving end: a listening socket on 127.0.0.1 (a port the kernel picks), then one
// accepted connection.
class SocketCeilingReceiver {
 public:
  static StatusOr<std::unique_ptr<SocketCeilingReceiver>> Listen();
  ~SocketCeilingReceiver();
  SocketCeilingReceiver(const SocketCeilingReceiver&) = delete;
  SocketCeilingReceiver& operator=(const SocketCeilingReceiver&) = delete;

  uint16_t port() const { return port_; }

  // Accepts one connection (within `timeout`), then `requests` times: reads `bytes` into a
  // buffer of that size and answers one byte. Each request must arrive within `timeout`.
  Status Receive(int64_t bytes, int requests, std::chrono::milliseconds timeout);

 private:
  SocketCeilingReceiver(int listen_fd, uint16_t port) : listen_fd_(listen_fd), port_(port) {}
  int listen_fd_ = -1;
  uint16_t port_ = 0;
};

// Connects to 127.0.0.1:`port` and sends `requests` requests of `bytes` each (see above);
// returns each request's milliseconds, first send() -> answer read. Each request must complete
// within `timeout`.
StatusOr<std::vector<double>> SendSocketRequests(uint16_t port, int64_t bytes, int requests,
                                                 std::chrono::milliseconds timeout);

}  // namespace kvt::bench

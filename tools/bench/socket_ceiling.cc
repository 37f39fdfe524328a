#include "socket_ceiling.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace kvt::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Owns one file descriptor.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

std::string Errno(const char* what) {
  return fmt::format("socket ceiling: {}: {}", what, std::strerror(errno));
}

// SO_SNDTIMEO / SO_RCVTIMEO of `timeout` (at least 1 ms) and TCP_NODELAY.
Status SetUp(int fd, std::chrono::milliseconds timeout) {
  const int64_t ms = std::max<int64_t>(timeout.count(), 1);
  const timeval tv = {static_cast<time_t>(ms / 1000), static_cast<suseconds_t>(ms % 1000 * 1000)};
  const int one = 1;
  if (::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) != 0 ||
      ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0 ||
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) {
    return Unavailable(Errno("setsockopt (timeouts, TCP_NODELAY)"));
  }
  return OkStatus();
}

// Sends all `n` bytes (one send() unless the kernel takes fewer), unless the deadline passes.
Status SendAll(int fd, const uint8_t* p, size_t n, Clock::time_point deadline, const char* what) {
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return DeadlineExceeded(
          fmt::format("socket ceiling: {}: the receiver took no bytes in time", what));
    }
    if (w <= 0) return Unavailable(Errno(what));
    p += w;
    n -= static_cast<size_t>(w);
    if (n > 0 && Clock::now() > deadline) {
      return DeadlineExceeded(
          fmt::format("socket ceiling: {}: {} bytes left at the deadline", what, n));
    }
  }
  return OkStatus();
}

// Reads all `n` bytes (MSG_WAITALL: one wake-up when the kernel has them), unless the deadline
// passes.
Status ReceiveAll(int fd, uint8_t* p, size_t n, Clock::time_point deadline, const char* what) {
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, MSG_WAITALL);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) return Unavailable(fmt::format("socket ceiling: {}: the peer closed", what));
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return DeadlineExceeded(
          fmt::format("socket ceiling: {}: {} bytes missing at the timeout", what, n));
    }
    if (r < 0) return Unavailable(Errno(what));
    p += r;
    n -= static_cast<size_t>(r);
    if (n > 0 && Clock::now() > deadline) {
      return DeadlineExceeded(
          fmt::format("socket ceiling: {}: {} bytes missing at the deadline", what, n));
    }
  }
  return OkStatus();
}

}  // namespace

StatusOr<std::unique_ptr<SocketCeilingReceiver>> SocketCeilingReceiver::Listen() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Unavailable(Errno("socket"));
  auto receiver = std::unique_ptr<SocketCeilingReceiver>(new SocketCeilingReceiver(fd, 0));
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return Unavailable(Errno("bind 127.0.0.1:0"));
  }
  if (::listen(fd, 1) != 0) return Unavailable(Errno("listen"));
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return Unavailable(Errno("getsockname"));
  }
  receiver->port_ = ntohs(addr.sin_port);
  return receiver;
}

SocketCeilingReceiver::~SocketCeilingReceiver() {
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

Status SocketCeilingReceiver::Receive(int64_t bytes, int requests,
                                      std::chrono::milliseconds timeout) {
  pollfd pfd = {listen_fd_, POLLIN, 0};
  int ready = 0;
  do {
    ready = ::poll(&pfd, 1, static_cast<int>(std::max<int64_t>(timeout.count(), 1)));
  } while (ready < 0 && errno == EINTR);
  if (ready < 0) return Unavailable(Errno("poll for the sender's connection"));
  if (ready == 0) {
    return DeadlineExceeded(
        fmt::format("socket ceiling: the sender did not connect to 127.0.0.1:{} within {} ms",
                    port_, timeout.count()));
  }
  const Fd conn(::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC));
  if (conn.get() < 0) return Unavailable(Errno("accept"));
  KVT_RETURN_IF_ERROR(SetUp(conn.get(), timeout));
  std::vector<uint8_t> buffer(static_cast<size_t>(bytes));  // zeroed: touched before timing
  const uint8_t answer = 1;
  for (int i = 0; i < requests; ++i) {
    const auto deadline = Clock::now() + timeout;
    KVT_RETURN_IF_ERROR(
        ReceiveAll(conn.get(), buffer.data(), buffer.size(), deadline, "receiving a request"));
    KVT_RETURN_IF_ERROR(SendAll(conn.get(), &answer, 1, deadline, "answering a request"));
  }
  return OkStatus();
}

StatusOr<std::vector<double>> SendSocketRequests(uint16_t port, int64_t bytes, int requests,
                                                 std::chrono::milliseconds timeout) {
  const Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return Unavailable(Errno("socket"));
  KVT_RETURN_IF_ERROR(SetUp(fd.get(), timeout));  // SO_SNDTIMEO bounds connect() too
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  int rc = 0;
  do {
    rc = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) return Unavailable(Errno(fmt::format("connect to 127.0.0.1:{}", port).c_str()));
  const std::vector<uint8_t> source(static_cast<size_t>(bytes), 0x5a);
  std::vector<double> ms;
  ms.reserve(static_cast<size_t>(requests));
  for (int i = 0; i < requests; ++i) {
    const auto t0 = Clock::now();
    const auto deadline = t0 + timeout;
    for (size_t off = 0; off < source.size(); off += kSocketWriteBytes) {
      const size_t n = std::min<size_t>(kSocketWriteBytes, source.size() - off);
      KVT_RETURN_IF_ERROR(SendAll(fd.get(), source.data() + off, n, deadline, "sending a request"));
    }
    uint8_t answer = 0;
    KVT_RETURN_IF_ERROR(ReceiveAll(fd.get(), &answer, 1, deadline, "waiting for the answer"));
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  return ms;
}

}  // namespace kvt::bench

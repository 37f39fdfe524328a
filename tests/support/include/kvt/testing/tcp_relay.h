// A TCP relay on loopback for fault tests: clients connect to port(), each connection is joined
// to a fresh connection to the target, and bytes flow both ways until Pause(), which stops
// forwarding without closing anything (a peer that went silent: a stopped process, a cable pulled
// without a reset), until Resume(). Hand-written because no Debian package offers an in-process
// relay that can freeze a live connection; it is small, blocking-free (poll with a short timeout)
// and bounded: every thread stops when the relay is destroyed.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace kvt::testing {

class TcpRelay {
 public:
  explicit TcpRelay(uint16_t target_port) : target_port_(target_port) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr = Loopback(0);
    const int one = 1;
    setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        listen(listen_fd_, 16) != 0) {
      close(listen_fd_);
      listen_fd_ = -1;
      return;
    }
    socklen_t len = sizeof(addr);
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    acceptor_ = std::thread([this] { Accept(); });
  }

  ~TcpRelay() {
    stop_ = true;
    if (acceptor_.joinable()) acceptor_.join();
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& t : pipes_) t.join();
    if (listen_fd_ >= 0) close(listen_fd_);
  }

  TcpRelay(const TcpRelay&) = delete;
  TcpRelay& operator=(const TcpRelay&) = delete;

  // 0 when the relay could not listen.
  uint16_t port() const { return port_; }
  void Pause() { paused_ = true; }
  void Resume() { paused_ = false; }
  // From now on every connection closes (both ends) right after the target's n-th reply (read)
  // was forwarded: a server that answers a request-response exchange n times and goes away.
  void CloseAfterReplies(int n) { close_after_replies_ = n; }

 private:
  static sockaddr_in Loopback(uint16_t port) {
    sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return addr;
  }

  void Accept() {
    while (!stop_) {
      pollfd pfd = {listen_fd_, POLLIN, 0};
      if (poll(&pfd, 1, 20) != 1) continue;
      const int client = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (client < 0) continue;
      const int upstream = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in target = Loopback(target_port_);
      if (connect(upstream, reinterpret_cast<sockaddr*>(&target), sizeof(target)) != 0) {
        close(client);
        close(upstream);
        continue;
      }
      std::lock_guard<std::mutex> lock(mu_);
      pipes_.emplace_back([this, client, upstream] { Pipe(client, upstream); });
    }
  }

  // Forwards both ways until either side closes or the relay stops; nothing moves while paused
  // (the kernel's buffers fill, as they would toward a peer that stopped reading).
  void Pipe(int a, int b) {
    char buf[64 * 1024];
    bool open = true;
    int replies = 0;  // reads from the target forwarded
    while (!stop_ && open) {
      if (paused_) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        continue;
      }
      pollfd pfds[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
      if (poll(pfds, 2, 20) <= 0) continue;
      for (int i = 0; i < 2 && open; ++i) {
        if ((pfds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
        const int from = i == 0 ? a : b, to = i == 0 ? b : a;
        const ssize_t n = read(from, buf, sizeof(buf));
        if (n <= 0) {
          open = false;
          break;
        }
        for (ssize_t done = 0; done < n;) {
          const ssize_t w = write(to, buf + done, static_cast<size_t>(n - done));
          if (w <= 0) {
            open = false;
            break;
          }
          done += w;
        }
        if (from == b && ++replies == close_after_replies_) open = false;
      }
    }
    close(a);
    close(b);
  }

  uint16_t target_port_;
  uint16_t port_ = 0;
  int listen_fd_ = -1;
  std::atomic<bool> stop_{false};
  std::atomic<bool> paused_{false};
  std::atomic<int> close_after_replies_{0};  // 0: never
  std::mutex mu_;
  std::vector<std::thread> pipes_;
  std::thread acceptor_;
};

}  // namespace kvt::testing

// The two-process harness of the GPU backend tests. The test binary re-executes itself as a child
// (posix_spawn of /proc/self/exe, never a bare fork after CUDA is initialised) that runs one hidden
// test; the two talk over a pair of pipes in length-prefixed messages, every read bounded, so a
// dead or wedged peer fails a test instead of hanging it.
//
// The protocol both harnesses share: the child sends its descriptor first, then answers commands:
// "verify" followed by the expected pool image (it replies "" when its pool equals the image, else
// what differs) and "exit" (it replies "bye" and exits 0 when its own checks passed).
//
// Header-only, test-only. A Channel or ChildProcess is used from one thread.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "kvt/common/status.h"
#include "kvt/transfer/backend.h"

extern char** environ;

namespace kvt::transfer::testing {

// The child's ends of the pipes, as numbered in the child.
inline constexpr int kChildIn = 100;
inline constexpr int kChildOut = 101;

// Length-prefixed messages over a pair of pipe ends (owned: closed on destruction); every read is
// bounded.
class Channel {
 public:
  using Clock = std::chrono::steady_clock;

  Channel() = default;
  Channel(int in, int out) : in_(in), out_(out) {}
  ~Channel() { Close(); }
  Channel(Channel&& o) noexcept : in_(std::exchange(o.in_, -1)), out_(std::exchange(o.out_, -1)) {}
  Channel& operator=(Channel&& o) noexcept {
    Close();
    in_ = std::exchange(o.in_, -1);
    out_ = std::exchange(o.out_, -1);
    return *this;
  }
  void Close() {
    if (in_ >= 0) close(in_);
    if (out_ >= 0) close(out_);
    in_ = out_ = -1;
  }

  Status Send(std::string_view message) {
    const uint64_t size = message.size();
    KVT_RETURN_IF_ERROR(WriteAll(&size, sizeof(size)));
    return WriteAll(message.data(), message.size());
  }
  StatusOr<std::string> Receive(std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    uint64_t size = 0;
    KVT_RETURN_IF_ERROR(ReadAll(&size, sizeof(size), deadline));
    if (size > (uint64_t{1} << 32)) {
      return DataLoss("message of " + std::to_string(size) + " bytes");
    }
    std::string message(size, '\0');
    KVT_RETURN_IF_ERROR(ReadAll(message.data(), size, deadline));
    return message;
  }

 private:
  Status WriteAll(const void* data, size_t bytes) {
    const auto* p = static_cast<const char*>(data);
    while (bytes > 0) {
      const ssize_t n = write(out_, p, bytes);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return Unavailable(std::string("pipe write: ") + std::strerror(errno));
      p += n;
      bytes -= static_cast<size_t>(n);
    }
    return OkStatus();
  }
  Status ReadAll(void* data, size_t bytes, Clock::time_point deadline) {
    auto* p = static_cast<char*>(data);
    while (bytes > 0) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return DeadlineExceeded("no message from the other process in time");
      pollfd pfd = {in_, POLLIN, 0};
      const int ready = poll(&pfd, 1, static_cast<int>(std::min<long long>(left, 1000)));
      if (ready <= 0) continue;  // timed out (the deadline decides) or interrupted
      const ssize_t n = read(in_, p, bytes);
      if (n < 0 && errno == EINTR) continue;
      if (n == 0) return Unavailable("the other process closed its pipe (exited?)");
      if (n < 0) return Unavailable(std::string("pipe read: ") + std::strerror(errno));
      p += n;
      bytes -= static_cast<size_t>(n);
    }
    return OkStatus();
  }

  int in_ = -1;
  int out_ = -1;
};

// ---- Descriptors over the channel ---------------------------------------------------------

inline void PutU64(std::string& out, uint64_t v) {
  out.append(reinterpret_cast<const char*>(&v), 8);
}
inline void PutString(std::string& out, std::string_view s) {
  PutU64(out, s.size());
  out += s;
}

// A descriptor and a token (empty where the protocol has none) as one message.
inline std::string EncodeDescriptor(const PeerDescriptor& d, std::string_view token = {}) {
  std::string out;
  PutString(out, d.backend);
  PutString(out, d.address);
  PutString(out, token);
  PutU64(out, d.regions.size());
  for (const RemoteRegion& r : d.regions) {
    PutU64(out, r.base);
    PutU64(out, r.length);
    PutU64(out, r.item_len);
    PutString(out, r.key);
  }
  return out;
}

struct DescriptorMessage {
  PeerDescriptor descriptor;
  std::string token;
};

inline StatusOr<DescriptorMessage> DecodeDescriptor(std::string_view in) {
  size_t at = 0;
  auto u64 = [&](uint64_t& v) {
    if (in.size() - at < 8) return false;
    std::memcpy(&v, in.data() + at, 8);
    at += 8;
    return true;
  };
  auto str = [&](std::string& s) {
    uint64_t n = 0;
    if (!u64(n) || in.size() - at < n) return false;
    s.assign(in.data() + at, n);
    at += n;
    return true;
  };
  DescriptorMessage m;
  PeerDescriptor& d = m.descriptor;
  uint64_t count = 0;
  if (!str(d.backend) || !str(d.address) || !str(m.token) || !u64(count)) {
    return DataLoss("short descriptor");
  }
  for (uint64_t i = 0; i < count; ++i) {
    RemoteRegion r;
    if (!u64(r.base) || !u64(r.length) || !u64(r.item_len) || !str(r.key)) {
      return DataLoss("short descriptor region");
    }
    d.regions.push_back(std::move(r));
  }
  return m;
}

// ---- The child process --------------------------------------------------------------------

// The parent's handle on the child: spawns it, talks to it, reaps or kills it (on destruction
// too, so no child outlives its test).
class ChildProcess {
 public:
  using Clock = std::chrono::steady_clock;

  ChildProcess() = default;
  ~ChildProcess() { Kill(); }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // Runs this binary again with only `test` (a DISABLED_ test, which finds its pipe ends in the
  // environment variable `env_name` = "<in fd>,<out fd>" followed by `env_suffix`).
  Status Start(std::string_view env_name, std::string_view test, std::string_view env_suffix = {}) {
    int to_child[2], from_child[2];
    if (pipe2(to_child, O_CLOEXEC) != 0 || pipe2(from_child, O_CLOEXEC) != 0) {
      return Internal(std::string("pipe2: ") + std::strerror(errno));
    }
    char exe[4096] = {};
    const ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (len <= 0) return Internal("readlink /proc/self/exe failed");
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string_view var(*e);
      // The child runs one hidden test: no sharding, no report overwriting the parent's.
      if (var.starts_with(env_name) || var.starts_with("GTEST_")) continue;
      env.emplace_back(var);
    }
    env.push_back(std::string(env_name) + "=" + std::to_string(kChildIn) + "," +
                  std::to_string(kChildOut) + std::string(env_suffix));
    std::vector<std::string> args = {exe, "--gtest_filter=" + std::string(test),
                                     "--gtest_also_run_disabled_tests", "--gtest_brief=1"};
    std::vector<char*> argv, envp;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, to_child[0], kChildIn);
    posix_spawn_file_actions_adddup2(&actions, from_child[1], kChildOut);
    const int err = posix_spawn(&pid_, exe, &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    close(to_child[0]);
    close(from_child[1]);
    if (err != 0) {
      close(to_child[1]);
      close(from_child[0]);
      pid_ = -1;
      return Internal(std::string("posix_spawn: ") + std::strerror(err));
    }
    channel_ = Channel(from_child[0], to_child[1]);
    return OkStatus();
  }

  Channel& channel() { return channel_; }

  // "" when the child's pool equals `expected`, else the child's description of the mismatch.
  StatusOr<std::string> Verify(const std::vector<uint8_t>& expected) {
    KVT_RETURN_IF_ERROR(channel_.Send("verify"));
    KVT_RETURN_IF_ERROR(channel_.Send(
        std::string_view(reinterpret_cast<const char*>(expected.data()), expected.size())));
    return channel_.Receive(std::chrono::seconds(60));
  }

  // Asks the child to exit; its exit status (0 when its own checks passed). `limit` bounds the
  // wait for its goodbye and, again, for its exit.
  StatusOr<int> Stop(std::chrono::seconds limit) {
    KVT_RETURN_IF_ERROR(channel_.Send("exit"));
    auto bye = channel_.Receive(limit);
    if (!bye.ok()) return bye.status();
    return Reap(limit);
  }

  // SIGKILL; waits (bounded) until the process is gone.
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    (void)Reap(std::chrono::seconds(30));
  }

 private:
  StatusOr<int> Reap(std::chrono::seconds limit) {
    const auto give_up = Clock::now() + limit;
    while (pid_ > 0) {
      int status = 0;
      const pid_t done = waitpid(pid_, &status, WNOHANG);
      if (done == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      if (done < 0 && errno != EINTR) {
        pid_ = -1;
        return Internal(std::string("waitpid: ") + std::strerror(errno));
      }
      if (Clock::now() > give_up) {
        kill(pid_, SIGKILL);
        return DeadlineExceeded("the child did not exit in time; killed it");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return Internal("no child");
  }

  pid_t pid_ = -1;
  Channel channel_;
};

}  // namespace kvt::transfer::testing

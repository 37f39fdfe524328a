// Small pieces the kvt command-line tools share: host:port parsing, ready files (how a tool
// tells the process that started it which ports it bound), child processes that never outlive
// their parent, and signal-driven shutdown.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "kvt/common/status.h"

namespace kvt::tools {

struct HostPort {
  std::string host;
  uint16_t port = 0;
};

// "host:port", "[v6]:port" or ":port" (host defaults to 127.0.0.1). InvalidArgument naming the
// text otherwise.
StatusOr<HostPort> ParseHostPort(const std::string& text);

// Writes `contents` to `path` atomically (a temporary file renamed into place).
Status WriteReadyFile(const std::string& path, const std::string& contents);

// Waits until `path` exists and is non-empty, then returns its contents. DeadlineExceeded after
// `timeout`; Aborted when `pid` (if > 0) exits first (saying how, in words) or when `stop` (if
// set; polled every 10 ms) returns true.
StatusOr<std::string> WaitReadyFile(const std::string& path, std::chrono::milliseconds timeout,
                                    pid_t pid = -1, const std::function<bool()>& stop = nullptr);

// A waitpid status in words: "exited with code 3", "was killed by signal 9 (Killed)".
std::string DescribeWaitStatus(int status);

// Makes this process receive SIGTERM when its parent exits (Linux prctl), so agents started by
// a driver never outlive it, even when the driver is killed with SIGKILL.
Status ExitWithParent();

// Blocks SIGINT/SIGTERM in the calling thread (call before starting other threads) and returns
// once one of them arrives: the signal number.
void BlockTerminationSignals();
int WaitForTerminationSignal();
// After BlockTerminationSignals: waits up to `timeout` (0: just looks) for SIGINT/SIGTERM and
// returns it (consumed), or 0 when none came.
int WaitForTerminationSignalFor(std::chrono::milliseconds timeout);

// A child process started with argv; killed (SIGTERM, then SIGKILL after `grace`) and reaped
// when the object is destroyed, unless it was already waited for.
class ChildProcess {
 public:
  ChildProcess() = default;
  // FailedPrecondition "cannot execute PATH: <reason>" when argv[0] cannot be executed.
  static StatusOr<ChildProcess> Spawn(const std::vector<std::string>& argv,
                                      const std::string& log_path = "");
  ~ChildProcess();
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  bool running();
  // Sends `signal`; no effect when the child is gone.
  void Signal(int signal);
  // Terminates (SIGTERM, SIGKILL after grace) and reaps; returns the exit status as waitpid
  // reports it, or -1 when there was no child.
  int Stop(std::chrono::milliseconds grace = std::chrono::milliseconds(3000));

 private:
  pid_t pid_ = -1;
};

// The last `max_lines` lines of a text file (a child's log), each indented by four spaces;
// empty when the file cannot be read.
std::string LogTail(const std::string& path, size_t max_lines);

// The folder holding this executable (from /proc/self/exe).
std::string ExecutableDir();

// The first of `candidates` (paths relative to ExecutableDir(), or absolute) that is an
// executable file; NotFound listing where it looked.
StatusOr<std::string> FindTool(const std::string& name, const std::vector<std::string>& candidates);

}  // namespace kvt::tools

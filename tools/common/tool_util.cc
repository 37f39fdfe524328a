#include "tool_util.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <fstream>
#include <sstream>
#include <thread>

namespace kvt::tools {

using Clock = std::chrono::steady_clock;

StatusOr<HostPort> ParseHostPort(const std::string& text) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos) {
    return InvalidArgument("'" + text + "' is not host:port (e.g. 127.0.0.1:7000)");
  }
  HostPort hp;
  hp.host = text.substr(0, colon);
  if (hp.host.size() >= 2 && hp.host.front() == '[' && hp.host.back() == ']') {
    hp.host = hp.host.substr(1, hp.host.size() - 2);
  }
  if (hp.host.empty()) hp.host = "127.0.0.1";
  const std::string port = text.substr(colon + 1);
  char* end = nullptr;
  errno = 0;
  const long value = std::strtol(port.c_str(), &end, 10);
  if (port.empty() || *end != '\0' || errno != 0 || value < 0 || value > 65535) {
    return InvalidArgument("port '" + port + "' in '" + text + "' is not a number in 0..65535");
  }
  hp.port = static_cast<uint16_t>(value);
  return hp;
}

Status WriteReadyFile(const std::string& path, const std::string& contents) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) return Unavailable("cannot write '" + tmp + "': " + std::strerror(errno));
    out << contents;
    if (!out.flush()) return Unavailable("cannot write '" + tmp + "'");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return Unavailable("cannot rename '" + tmp + "' to '" + path + "': " + std::strerror(errno));
  }
  return OkStatus();
}

std::string DescribeWaitStatus(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = strsignal(sig);
    return "was killed by signal " + std::to_string(sig) +
           (name != nullptr ? " (" + std::string(name) + ")" : std::string());
  }
  return "stopped (wait status " + std::to_string(status) + ")";
}

StatusOr<std::string> WaitReadyFile(const std::string& path, std::chrono::milliseconds timeout,
                                    pid_t pid, const std::function<bool()>& stop) {
  const auto until = Clock::now() + timeout;
  while (true) {
    std::ifstream in(path);
    if (in) {
      std::stringstream ss;
      ss << in.rdbuf();
      if (!ss.str().empty()) return ss.str();
    }
    if (pid > 0) {
      int status = 0;
      if (waitpid(pid, &status, WNOHANG) == pid) {
        return Aborted("process " + std::to_string(pid) + " " + DescribeWaitStatus(status) +
                       " before writing '" + path + "'");
      }
    }
    if (stop && stop()) return Aborted("stopped while waiting for '" + path + "'");
    if (Clock::now() > until) {
      return DeadlineExceeded("'" + path + "' did not appear within " +
                              std::to_string(timeout.count()) + " ms");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

Status ExitWithParent() {
  if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0) {
    return Internal(std::string("prctl(PR_SET_PDEATHSIG): ") + std::strerror(errno));
  }
  if (getppid() == 1) return Aborted("the parent process is already gone");
  return OkStatus();
}

void BlockTerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int WaitForTerminationSignalFor(std::chrono::milliseconds timeout) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  const auto ms = std::max<int64_t>(0, timeout.count());
  timespec wait{static_cast<time_t>(ms / 1000), static_cast<long>(ms % 1000) * 1000000L};
  while (true) {
    const int sig = sigtimedwait(&set, nullptr, &wait);
    if (sig > 0) return sig;
    if (errno != EINTR) return 0;  // EAGAIN: none within the timeout
  }
}

int WaitForTerminationSignal() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  int sig = 0;
  while (sigwait(&set, &sig) != 0) {
  }
  return sig;
}

StatusOr<ChildProcess> ChildProcess::Spawn(const std::vector<std::string>& argv,
                                           const std::string& log_path) {
  if (argv.empty()) return InvalidArgument("no program to start");
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // The child reports a failed exec through this pipe (its errno); a successful exec closes it.
  int exec_pipe[2];
  if (pipe2(exec_pipe, O_CLOEXEC) != 0) {
    return Unavailable(std::string("cannot start ") + argv[0] + ": pipe: " + std::strerror(errno));
  }
  const pid_t pid = fork();
  if (pid < 0) {
    const int err = errno;
    close(exec_pipe[0]);
    close(exec_pipe[1]);
    return Unavailable("cannot start " + argv[0] + ": fork: " + std::strerror(err));
  }
  if (pid == 0) {
    // Child: restore default signal handling, redirect output, exec.
    sigset_t none;
    sigemptyset(&none);
    pthread_sigmask(SIG_SETMASK, &none, nullptr);
    if (!log_path.empty()) {
      int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd >= 0) {
        dup2(fd, STDOUT_FILENO);
        dup2(fd, STDERR_FILENO);
      }
    }
    execv(args[0], args.data());
    const int err = errno;
    ssize_t ignored = write(exec_pipe[1], &err, sizeof(err));
    (void)ignored;
    _exit(127);
  }
  close(exec_pipe[1]);
  int exec_errno = 0;
  ssize_t n;
  do {
    n = read(exec_pipe[0], &exec_errno, sizeof(exec_errno));
  } while (n < 0 && errno == EINTR);
  close(exec_pipe[0]);
  if (n == static_cast<ssize_t>(sizeof(exec_errno))) {
    int status = 0;
    waitpid(pid, &status, 0);
    return FailedPrecondition("cannot execute " + argv[0] + ": " + std::strerror(exec_errno) +
                              "; check the path and that the file is an executable program");
  }
  ChildProcess child;
  child.pid_ = pid;
  return child;
}

ChildProcess::~ChildProcess() { Stop(); }

ChildProcess::ChildProcess(ChildProcess&& other) noexcept : pid_(other.pid_) { other.pid_ = -1; }

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    Stop();
    pid_ = other.pid_;
    other.pid_ = -1;
  }
  return *this;
}

bool ChildProcess::running() {
  if (pid_ <= 0) return false;
  int status = 0;
  if (waitpid(pid_, &status, WNOHANG) == pid_) {
    pid_ = -1;
    return false;
  }
  return true;
}

void ChildProcess::Signal(int signal) {
  if (pid_ > 0) kill(pid_, signal);
}

int ChildProcess::Stop(std::chrono::milliseconds grace) {
  if (pid_ <= 0) return -1;
  int status = 0;
  if (waitpid(pid_, &status, WNOHANG) == pid_) {
    pid_ = -1;
    return status;
  }
  kill(pid_, SIGTERM);
  const auto until = Clock::now() + grace;
  while (Clock::now() < until) {
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return status;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  kill(pid_, SIGKILL);
  waitpid(pid_, &status, 0);
  pid_ = -1;
  return status;
}

std::string LogTail(const std::string& path, size_t max_lines) {
  std::ifstream in(path);
  std::deque<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    lines.push_back(std::move(line));
    if (lines.size() > max_lines) lines.pop_front();
  }
  std::string out;
  for (const std::string& l : lines) out += "    " + l + "\n";
  return out;
}

std::string ExecutableDir() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  std::string path(buf, static_cast<size_t>(n));
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

StatusOr<std::string> FindTool(const std::string& name,
                               const std::vector<std::string>& candidates) {
  const std::string dir = ExecutableDir();
  std::string tried;
  for (const std::string& c : candidates) {
    const std::string path = c.empty() || c[0] == '/' ? c : dir + "/" + c;
    tried += (tried.empty() ? "" : ", ") + path;
    if (access(path.c_str(), X_OK) == 0) return path;
  }
  return NotFound("cannot find " + name + "; looked at " + tried +
                  "; build it (tools/setup.sh) or pass its path");
}

}  // namespace kvt::tools

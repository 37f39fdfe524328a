#include "netns.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace kvt::multinode {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr char kNetnsDir[] = "/run/netns";
constexpr char kSwitchBridge[] = "br0";

// ---- what the signal handler cleans up: fixed arrays, written before use ------------------

constexpr int kMaxGroups = 64;
constexpr int kMaxNamespaces = 16;
constexpr size_t kMaxNameLength = 64;

std::atomic<pid_t> g_groups[kMaxGroups];
char g_namespaces[kMaxNamespaces][kMaxNameLength];
std::atomic<bool> g_namespace_used[kMaxNamespaces];

void RegisterGroup(pid_t pid) {
  for (auto& slot : g_groups) {
    pid_t expected = 0;
    if (slot.compare_exchange_strong(expected, pid)) return;
  }
}

void UnregisterGroup(pid_t pid) {
  for (auto& slot : g_groups) {
    pid_t expected = pid;
    if (slot.compare_exchange_strong(expected, 0)) return;
  }
}

void RegisterNamespace(const std::string& ns) {
  for (int i = 0; i < kMaxNamespaces; ++i) {
    if (g_namespace_used[i].load()) continue;
    std::strncpy(g_namespaces[i], ns.c_str(), kMaxNameLength - 1);
    g_namespaces[i][kMaxNameLength - 1] = '\0';
    g_namespace_used[i].store(true);
    return;
  }
}

void UnregisterNamespace(const std::string& ns) {
  for (int i = 0; i < kMaxNamespaces; ++i) {
    if (g_namespace_used[i].load() && ns == g_namespaces[i]) g_namespace_used[i].store(false);
  }
}

// Async-signal-safe: kill(2), umount2(2) and unlink(2) only. A namespace whose mount is gone
// disappears with its last process, and every process in it is being killed.
void EmergencyCleanup() {
  for (auto& slot : g_groups) {
    const pid_t pid = slot.exchange(0);
    if (pid > 0) kill(-pid, SIGKILL);
  }
  for (int i = 0; i < kMaxNamespaces; ++i) {
    if (!g_namespace_used[i].exchange(false)) continue;
    char path[sizeof(kNetnsDir) + kMaxNameLength + 1];
    size_t n = 0;
    for (const char* p = kNetnsDir; *p != '\0';) path[n++] = *p++;
    path[n++] = '/';
    for (const char* p = g_namespaces[i]; *p != '\0' && n + 1 < sizeof(path);) path[n++] = *p++;
    path[n] = '\0';
    umount2(path, MNT_DETACH);
    unlink(path);
  }
}

void OnTerminationSignal(int signal) {
  static const char kMessage[] = "\nmultinode: signal received; killing agents, removing netns\n";
  ssize_t ignored = write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
  (void)ignored;
  EmergencyCleanup();
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(signal, &dfl, nullptr);
  raise(signal);
}

// The command line in quotes, for messages.
std::string QuotedCommand(const std::vector<std::string>& argv) {
  std::string out = "'";
  for (const std::string& a : argv) {
    if (out.size() > 1) out += ' ';
    out += a;
  }
  out += '\'';
  return out;
}

bool ProcessAlive(pid_t pid) { return kill(pid, 0) == 0 || errno != ESRCH; }

// The owner's pid of a namespace named kvt<pid>-<anything>; 0 when the name is not ours.
pid_t OwnerOf(const std::string& name) {
  if (name.rfind("kvt", 0) != 0) return 0;
  size_t i = 3;
  pid_t pid = 0;
  while (i < name.size() && name[i] >= '0' && name[i] <= '9' && pid < 100000000) {
    pid = pid * 10 + (name[i] - '0');
    ++i;
  }
  if (i == 3 || i >= name.size() || name[i] != '-') return 0;
  return pid;
}

// Kills every process in `ns` (ours or not) and deletes it.
void RemoveNamespace(const std::string& ns) {
  for (int round = 0; round < 3; ++round) {
    auto pids = RunCommand({"ip", "netns", "pids", ns}, 5s);
    if (!pids.ok() || pids->empty()) break;
    size_t pos = 0;
    while (pos < pids->size()) {
      const size_t end = pids->find('\n', pos);
      const std::string line = pids->substr(pos, end == std::string::npos ? end : end - pos);
      pos = end == std::string::npos ? pids->size() : end + 1;
      const int pid = std::atoi(line.c_str());
      if (pid > 1 && pid != getpid()) {
        kill(pid, SIGKILL);
      }
    }
    std::this_thread::sleep_for(50ms);
  }
  (void)RunCommand({"ip", "netns", "del", ns}, 10s);
}

// Forks a child in its own process group that dies with this process (SIGKILL even reaches a
// stopped one), with stdout and stderr on `out_fd` and stdin on /dev/null, and execs argv (PATH
// searched). Returns the child's pid.
StatusOr<pid_t> ForkInGroup(const std::vector<std::string>& argv, int out_fd) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return Unavailable(std::string("fork: ") + strerror(errno));
  if (pid == 0) {
    sigset_t none;
    sigemptyset(&none);
    pthread_sigmask(SIG_SETMASK, &none, nullptr);
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    dup2(out_fd, STDOUT_FILENO);
    dup2(out_fd, STDERR_FILENO);
    int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, STDIN_FILENO);
    execvp(args[0], args.data());
    _exit(127);
  }
  // Also from the parent, so that a signal to the group cannot miss a child not yet scheduled.
  setpgid(pid, pid);
  return pid;
}

}  // namespace

StatusOr<std::string> RunCommand(const std::vector<std::string>& argv,
                                 std::chrono::milliseconds timeout) {
  if (argv.empty()) return InvalidArgument("no command");
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) return Unavailable(std::string("pipe: ") + strerror(errno));
  StatusOr<pid_t> child = ForkInGroup(argv, out[1]);
  if (!child.ok()) {
    close(out[0]);
    close(out[1]);
    return child.status();
  }
  const pid_t pid = *child;
  close(out[1]);
  std::string output;
  const auto until = Clock::now() + timeout;
  bool timed_out = false;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    pollfd p{out[0], POLLIN, 0};
    const int r = poll(&p, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) continue;
    char buf[4096];
    const ssize_t n = read(out[0], buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    output.append(buf, static_cast<size_t>(n));
  }
  close(out[0]);
  if (timed_out) kill(-pid, SIGKILL);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (timed_out) {
    return Unavailable(QuotedCommand(argv) + " did not finish within " + std::to_string(timeout.count()) +
                       " ms: " + output);
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    const std::string how = WIFEXITED(status) ? "exited with " + std::to_string(WEXITSTATUS(status))
                                              : "was killed by a signal";
    if (WIFEXITED(status) && WEXITSTATUS(status) == 127 && output.empty()) {
      return Unavailable(QuotedCommand(argv) + ": cannot execute " + argv[0]);
    }
    return Unavailable(QuotedCommand(argv) + " " + how + ": " + output);
  }
  return output;
}

void InstallCleanupHandlers() {
  static std::atomic<bool> installed{false};
  if (installed.exchange(true)) return;
  struct sigaction sa {};
  sa.sa_handler = OnTerminationSignal;
  sigemptyset(&sa.sa_mask);
  for (int signal : {SIGINT, SIGTERM, SIGHUP, SIGALRM, SIGABRT}) sigaction(signal, &sa, nullptr);
}

int SweepStaleNamespaces() {
  int removed = 0;
  DIR* dir = opendir(kNetnsDir);
  if (dir == nullptr) return 0;
  std::vector<std::string> stale;
  while (dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    const pid_t owner = OwnerOf(name);
    if (owner <= 0 || owner == getpid() || ProcessAlive(owner)) continue;
    stale.push_back(name);
  }
  closedir(dir);
  for (const std::string& ns : stale) {
    RemoveNamespace(ns);
    ++removed;
  }
  return removed;
}

// ---- NodeProcess ------------------------------------------------------------------------------

StatusOr<std::unique_ptr<NodeProcess>> NodeProcess::Spawn(const std::string& ns,
                                                          const std::vector<std::string>& argv,
                                                          const std::string& log_path) {
  std::vector<std::string> full = {"ip", "netns", "exec", ns};
  full.insert(full.end(), argv.begin(), argv.end());
  const int log = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log < 0) return Unavailable("cannot open " + log_path + ": " + strerror(errno));
  // The agents are started without --exit-with-parent so that the child's SIGKILL-on-parent-
  // death stays in force after exec.
  StatusOr<pid_t> child = ForkInGroup(full, log);
  close(log);
  if (!child.ok()) return child.status();
  const pid_t pid = *child;
  RegisterGroup(pid);
  std::unique_ptr<NodeProcess> process(new NodeProcess());
  process->pid_ = pid;
  return process;
}

NodeProcess::~NodeProcess() { Stop(); }

bool NodeProcess::Running() {
  if (pid_ <= 0) return false;
  int status = 0;
  const pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == pid_ || (r < 0 && errno == ECHILD)) {
    kill(-pid_, SIGKILL);  // anything it left in its group
    UnregisterGroup(pid_);
    pid_ = -1;
    return false;
  }
  return true;
}

void NodeProcess::Signal(int signal) {
  if (pid_ > 0) kill(-pid_, signal);
}

void NodeProcess::Stop(std::chrono::milliseconds grace) {
  if (pid_ <= 0) return;
  kill(-pid_, SIGCONT);
  kill(-pid_, SIGTERM);
  const auto until = Clock::now() + grace;
  while (Clock::now() < until && Running()) std::this_thread::sleep_for(5ms);
  if (pid_ <= 0) return;
  kill(-pid_, SIGKILL);
  int status = 0;
  while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  UnregisterGroup(pid_);
  pid_ = -1;
}

// ---- Network ----------------------------------------------------------------------------------

StatusOr<std::unique_ptr<Network>> Network::Create(const std::vector<std::string>& node_names) {
  if (geteuid() != 0) {
    return FailedPrecondition("network namespaces need root (euid " + std::to_string(geteuid()) +
                              ")");
  }
  std::unique_ptr<Network> network(new Network());
  network->prefix_ = "kvt" + std::to_string(getpid()) + "-";
  Status built = network->Build(node_names);
  if (!built.ok()) {
    network->Destroy();
    return built;
  }
  return network;
}

Status Network::Build(const std::vector<std::string>& node_names) {
  switch_ns_ = prefix_ + "sw";
  // The first namespace tells whether this machine lets us make them at all.
  RegisterNamespace(switch_ns_);
  auto made = RunCommand({"ip", "netns", "add", switch_ns_});
  if (!made.ok()) {
    UnregisterNamespace(switch_ns_);
    return FailedPrecondition("cannot make network namespaces here: " + made.status().message());
  }
  namespaces_.push_back(switch_ns_);
  auto run = [](const std::vector<std::string>& argv) -> Status {
    auto r = RunCommand(argv);
    return r.ok() ? OkStatus() : r.status();
  };
  KVT_RETURN_IF_ERROR(
      run({"ip", "-n", switch_ns_, "link", "add", kSwitchBridge, "type", "bridge"}));
  KVT_RETURN_IF_ERROR(run({"ip", "-n", switch_ns_, "link", "set", kSwitchBridge, "up"}));
  // 10.231.<subnet>.0/24: any subnet would do (the addresses live in these namespaces only);
  // one per pid keeps captures and logs of parallel test processes apart.
  const int subnet = static_cast<int>(getpid() % 250) + 1;
  int host = 1;
  for (const std::string& name : node_names) {
    Node node;
    node.name = name;
    node.ns = prefix_ + name;
    node.address = "10.231." + std::to_string(subnet) + "." + std::to_string(host++);
    RegisterNamespace(node.ns);
    auto added = RunCommand({"ip", "netns", "add", node.ns});
    if (!added.ok()) {
      UnregisterNamespace(node.ns);
      return added.status();
    }
    namespaces_.push_back(node.ns);
    const std::string port = "v" + name;  // the bridge's side, inside the switch namespace
    KVT_RETURN_IF_ERROR(run({"ip", "link", "add", "name", kNodeInterface, "netns", node.ns, "type",
                             "veth", "peer", "name", port, "netns", switch_ns_}));
    KVT_RETURN_IF_ERROR(
        run({"ip", "-n", switch_ns_, "link", "set", port, "master", kSwitchBridge, "up"}));
    KVT_RETURN_IF_ERROR(run({"ip", "-n", node.ns, "link", "set", "lo", "up"}));
    KVT_RETURN_IF_ERROR(
        run({"ip", "-n", node.ns, "addr", "add", node.address + "/24", "dev", kNodeInterface}));
    KVT_RETURN_IF_ERROR(run({"ip", "-n", node.ns, "link", "set", kNodeInterface, "up"}));
    nodes_.push_back(node);
  }
  return OkStatus();
}

Network::~Network() { Destroy(); }

void Network::Destroy() {
  // Nodes first, the switch last.
  while (!namespaces_.empty()) {
    const std::string ns = namespaces_.back();
    namespaces_.pop_back();
    RemoveNamespace(ns);
    UnregisterNamespace(ns);
  }
}

const Network::Node& Network::node(const std::string& name) const {
  for (const Node& n : nodes_) {
    if (n.name == name) return n;
  }
  throw std::out_of_range("no node named '" + name + "'");
}

StatusOr<std::string> Network::Exec(const std::string& node_name,
                                    const std::vector<std::string>& argv) {
  std::vector<std::string> full = {"ip", "netns", "exec", node(node_name).ns};
  full.insert(full.end(), argv.begin(), argv.end());
  return RunCommand(full);
}

Status Network::SetLink(const std::string& node_name, bool up) {
  auto r = RunCommand(
      {"ip", "-n", node(node_name).ns, "link", "set", kNodeInterface, up ? "up" : "down"});
  return r.ok() ? OkStatus() : r.status();
}

// ---- ScopedNetns ------------------------------------------------------------------------------

ScopedNetns::ScopedNetns(const std::string& ns) {
  const std::string self = "/proc/self/task/" + std::to_string(syscall(SYS_gettid)) + "/ns/net";
  original_ = open(self.c_str(), O_RDONLY | O_CLOEXEC);
  if (original_ < 0) {
    status_ = Unavailable("cannot open " + self + ": " + strerror(errno));
    return;
  }
  const std::string path = std::string(kNetnsDir) + "/" + ns;
  const int target = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (target < 0) {
    status_ = Unavailable("cannot open " + path + ": " + strerror(errno));
    return;
  }
  if (setns(target, CLONE_NEWNET) != 0) {
    status_ = Unavailable("setns into " + ns + ": " + strerror(errno));
  }
  close(target);
}

ScopedNetns::~ScopedNetns() {
  if (original_ < 0) return;
  if (setns(original_, CLONE_NEWNET) != 0) {
    // Every later socket of this thread would be in the wrong namespace: nothing sane is left.
    std::abort();
  }
  close(original_);
}

}  // namespace kvt::multinode

// Network namespaces as nodes, for the multi-node tests: a Network makes one namespace per node
// plus one "switch" namespace holding a bridge, joins each node to the bridge with a veth pair
// and gives each node a private address. Every interface and address exists only inside those
// namespaces, so nothing of it is visible in (or collides with) the host's network, and two
// test processes never share anything but the namespace name space, which carries their pid
// ("kvt<pid>-<node>").
//
// Processes run inside a node through `ip netns exec` (which also gives them a sysfs of their
// namespace, where UCX looks for network devices), each in its own process group, killed with
// SIGKILL when the test process dies (PR_SET_PDEATHSIG).
//
// Cleanup, on every exit path: the destructors (processes first, then namespaces); the
// termination signals SIGINT, SIGTERM, SIGHUP, SIGALRM (the watchdog) and SIGABRT, whose handler
// kills every registered process group, detaches every registered namespace and re-raises the
// signal; and SweepStaleNamespaces(), which removes what a test process killed with SIGKILL left
// behind (namespaces whose pid is no longer alive).
//
// Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2; nftables and tc for the faults.
// Thread safety: none; one test thread drives a Network and its processes.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "kvt/common/status.h"

namespace kvt::multinode {

// Runs argv (no shell) with stdout and stderr captured, killed after `timeout`. The output when
// it exits 0; Unavailable with the command, its exit status and its output otherwise.
StatusOr<std::string> RunCommand(const std::vector<std::string>& argv,
                                 std::chrono::milliseconds timeout = std::chrono::seconds(10));

// Installs the handlers for the termination signals (once; later calls do nothing).
void InstallCleanupHandlers();

// Removes namespaces named kvt<pid>-* whose pid is not alive, with the processes still in them.
// Returns how many it removed.
int SweepStaleNamespaces();

// A process started inside a node's namespace, in its own process group.
class NodeProcess {
 public:
  // Starts argv in namespace `ns`, stdout and stderr appended to `log_path`.
  static StatusOr<std::unique_ptr<NodeProcess>> Spawn(const std::string& ns,
                                                      const std::vector<std::string>& argv,
                                                      const std::string& log_path);
  ~NodeProcess();  // Stop()
  NodeProcess(const NodeProcess&) = delete;
  NodeProcess& operator=(const NodeProcess&) = delete;

  pid_t pid() const { return pid_; }
  // False once the process exited (it is then reaped).
  bool Running();
  // Sends `signal` to the process group (SIGSTOP, SIGCONT, SIGKILL ...).
  void Signal(int signal);
  // SIGCONT + SIGTERM, SIGKILL after `grace`; reaps. Safe to call again.
  void Stop(std::chrono::milliseconds grace = std::chrono::milliseconds(2000));

 private:
  NodeProcess() = default;
  pid_t pid_ = -1;
};

// The namespaces, the bridge and the veth pairs; destroyed with the object.
class Network {
 public:
  struct Node {
    std::string name;     // as given to Create, e.g. "p0"
    std::string ns;       // the namespace, kvt<pid>-<name>
    std::string address;  // IPv4, inside the namespace only
  };
  // The interface of a node (inside its namespace) and of the bridge's side (inside the switch).
  static constexpr char kNodeInterface[] = "eth0";

  // FailedPrecondition when namespaces cannot be made here (not root, no iproute2, no
  // permission): the tests skip on it. Other errors as Unavailable with the command's output.
  static StatusOr<std::unique_ptr<Network>> Create(const std::vector<std::string>& node_names);
  ~Network();  // Destroy()
  Network(const Network&) = delete;
  Network& operator=(const Network&) = delete;

  // Kills what still runs in the namespaces and deletes them (the veths and the bridge go with
  // them). Safe to call again.
  void Destroy();

  const Node& node(const std::string& name) const;
  const std::string& switch_ns() const { return switch_ns_; }

  // `ip netns exec <node's ns> argv...`
  StatusOr<std::string> Exec(const std::string& node, const std::vector<std::string>& argv);
  // The node's link (its side of the veth) down or up, from inside its namespace.
  Status SetLink(const std::string& node, bool up);

 private:
  Network() = default;
  Status Build(const std::vector<std::string>& node_names);

  std::string prefix_;
  std::string switch_ns_;
  std::vector<Node> nodes_;
  std::vector<std::string> namespaces_;  // made so far, switch included
};

// Moves the calling thread into a namespace for the object's life (setns is per thread), so
// that sockets opened meanwhile, and threads started meanwhile, belong to that namespace.
class ScopedNetns {
 public:
  explicit ScopedNetns(const std::string& ns);
  ~ScopedNetns();
  ScopedNetns(const ScopedNetns&) = delete;
  ScopedNetns& operator=(const ScopedNetns&) = delete;
  const Status& status() const { return status_; }

 private:
  int original_ = -1;
  Status status_;
};

}  // namespace kvt::multinode

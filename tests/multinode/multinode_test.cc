// Agents on separate nodes: network namespaces (netns.h) for a bootstrap node, two prefill
// nodes and two decode nodes on one bridge, the real kvt-bootstrap and kvt-agent processes in
// them, data over UCX across the veths. The driver (this process) reaches each agent's RPC port
// on its node's loopback, so faults on the nodes' links never touch the driver's connections.
//
// Each decode agent is fed by both prefill agents. The workload moves 500 requests and checks
// every byte, over UCX_TLS=tcp and over UCX's own choice of transports; each fault is a test of
// its own: a link down and up again (no RST: only heartbeats can notice), SIGKILL and SIGSTOP of
// a prefill and of a decode agent, a bootstrap restart, 1 % packet loss (nftables) on a prefill
// node, a bandwidth cap (tc tbf) on it, and 1000 aborts in flight. Speeds go to stdout and to
// the test's properties, never into assertions.
//
// The engines listen on the nodes' addresses, which needs a cluster token (KVT_CLUSTER_TOKEN,
// set here for every process). All nodes share one kernel, so a decode engine sees a prefill
// process on "the same host": it can tell a stopped or dead peer from an unreachable one, which
// separate machines cannot.
//
// Needs root; skips without it or when this machine cannot make network namespaces.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "agent_command.h"
#include "cluster.h"
#include "control/protocol.h"
#include "kvt/testing/status.h"
#include "netns.h"
#include "rpc_client.h"
#include "tool_util.h"

namespace kvt::multinode {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;
using integration::Describe;
using integration::IsFinal;

constexpr char kClusterToken[] = "kvt-multinode-test-cluster-token";
constexpr uint16_t kBootstrapPort = 9000;
// The tests of silent peers (a link down, a process stopped) give the agents' engines a short
// peer timeout (--peer-timeout-ms, with heartbeats every kEngineHeartbeat) so that they notice
// quickly; the others keep the engine's default, kDefaultPeerTimeout, which heartbeats delayed
// by a heavily loaded machine do not trip. An agent without those flags keeps the default too.
constexpr auto kShortPeerTimeout = 3000ms;
constexpr auto kEngineHeartbeat = 500ms;
constexpr auto kDefaultPeerTimeout = 10000ms;
// A decode agent reports a room from a silent prefill peer FAILED only once its pages may be
// reused: the engine notices the silence after the peer timeout and frees the pages when the
// peer's fencing bound (the peer timeout + kFenceExtra, promised in its hello) has passed since.
constexpr auto kFenceExtra = 2s;
// Slack on top of what the engines promise, for a loaded two-core machine.
constexpr auto kMargin = 6s;
// How long the pages of failed rooms may take to come back, beyond the peer timeout, once the
// peer is reachable again (or known dead).
constexpr auto kPagesBackMargin = 10s;
constexpr auto kReadyTimeout = 60s;  // agents start in about a second on an idle machine
constexpr auto kRequestTimeout = 30s;
// The whole test, set up and torn down; SIGALRM cleans up (netns.h) and ends the process.
constexpr unsigned kWatchdogSeconds = 170;

// 4 layers x 2 heads x 64 x bf16: 2 KiB of KV per token, 32 KiB per 16-token page.
constexpr int64_t kLayers = 4;
constexpr int64_t kTokenBytes = kLayers * 2 * 64 * 2 * 2;

const std::vector<std::string> kPrefills = {"p0", "p1"};
const std::vector<std::string> kDecodes = {"d0", "d1"};

struct AgentConfig {
  std::string ucx_tls = "tcp";      // empty: UCX's choice
  int64_t layer_time_us = 0;        // prefill: simulated compute per layer (a serial forward)
  int64_t tokens = 16384;           // pool size in token slots
  int64_t deadline_ms = 60000;      // longer than any fault, so failures come from the fault
  bool short_peer_timeout = false;  // kShortPeerTimeout instead of the engine's default
};

struct Agent {
  std::string name;  // also its node's name
  std::string role;
  std::vector<std::string> argv;
  std::string log_path;
  std::string ready_path;
  std::unique_ptr<NodeProcess> process;
  uint16_t rpc_port = 0;
  std::unique_ptr<tools::RpcClient> rpc;
};

// One request: a room moved from a prefill agent to a decode agent.
struct Flow {
  std::string prefill;
  std::string decode;
  std::string room;
  uint64_t tokens = 0;
};

std::vector<Flow> Flows(const std::string& prefill, const std::string& decode,
                        const std::string& tag, int count, uint64_t tokens) {
  std::vector<Flow> flows;
  for (int i = 0; i < count; ++i) {
    flows.push_back(
        {prefill, decode, tag + "-" + prefill + decode + "-" + std::to_string(i), tokens});
  }
  return flows;
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

class MultinodeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "network namespaces need root; not running as root";
    InstallCleanupHandlers();
    const int swept = SweepStaleNamespaces();
    if (swept > 0) std::cout << "removed " << swept << " stale namespaces\n";
    alarm(kWatchdogSeconds);
    setenv("KVT_CLUSTER_TOKEN", kClusterToken, 1);
    auto network = Network::Create({"boot", "p0", "p1", "d0", "d1"});
    if (!network.ok() && network.status().code() == StatusCode::kFailedPrecondition) {
      GTEST_SKIP() << network.status().ToString();
    }
    ASSERT_TRUE(network.ok()) << network.status().ToString();
    network_ = std::move(network).value();
    const char* tmp = getenv("TMPDIR");
    std::string dir =
        std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/kvt-multinode-XXXXXX";
    ASSERT_NE(mkdtemp(dir.data()), nullptr) << "cannot create a scratch folder " << dir;
    dir_ = dir;
  }

  void TearDown() override {
    const bool failed = HasFailure();
    if (failed && !dir_.empty()) std::cerr << "logs of the failed test:\n" << LogTails();
    for (auto& [name, agent] : agents_) agent.rpc.reset();
    // Every agent told to stop at once, then each waited for (SIGKILL after a grace period).
    for (auto& [name, agent] : agents_) {
      if (agent.process == nullptr) continue;
      agent.process->Signal(SIGCONT);
      agent.process->Signal(SIGTERM);
    }
    agents_.clear();
    bootstrap_.reset();
    network_.reset();
    if (!dir_.empty() && !failed) {
      std::error_code ignored;
      std::filesystem::remove_all(dir_, ignored);
    } else if (!dir_.empty()) {
      std::cerr << "scratch folder kept: " << dir_ << "\n";
    }
    unsetenv("KVT_CLUSTER_TOKEN");
    alarm(0);
  }

  std::string LogTails() const {
    std::string out = "  bootstrap.log:\n" + tools::LogTail(dir_ + "/bootstrap.log", 15);
    for (const auto& [name, agent] : agents_) {
      out += "  " + name + ".log:\n" + tools::LogTail(agent.log_path, 25);
    }
    return out;
  }

  std::string BootstrapAddress() const {
    return network_->node("boot").address + ":" + std::to_string(kBootstrapPort);
  }

  // kvt-bootstrap on the boot node, on a fixed port so that a restart comes back at the same
  // address.
  Status StartBootstrap() {
    KVT_ASSIGN_OR_RETURN(const std::string binary, integration::BootstrapBinary());
    tools::BootstrapCommand command;
    command.binary = binary;
    command.listen = BootstrapAddress();
    command.ready_file = dir_ + "/bootstrap.json";
    command.heartbeat_ms = 200;
    command.exit_with_parent = false;  // NodeProcess kills it with the test process
    std::error_code ignored;
    std::filesystem::remove(command.ready_file, ignored);
    KVT_ASSIGN_OR_RETURN(bootstrap_, NodeProcess::Spawn(network_->node("boot").ns, command.Argv(),
                                                        dir_ + "/bootstrap.log"));
    return tools::WaitReadyFile(command.ready_file, kReadyTimeout, bootstrap_->pid()).status();
  }

  // The bootstrap, then every agent of both roles (spawned together, then waited for).
  Status StartCluster(const AgentConfig& config) {
    KVT_RETURN_IF_ERROR(StartBootstrap());
    KVT_ASSIGN_OR_RETURN(const std::string binary, integration::AgentBinary());
    auto help = RunCommand({binary, "--help"});
    const bool short_peer_timeout = config.short_peer_timeout && help.ok() &&
                                    help->find("--peer-timeout-ms") != std::string::npos &&
                                    help->find("--engine-heartbeat-ms") != std::string::npos;
    peer_timeout_ = short_peer_timeout ? kShortPeerTimeout : kDefaultPeerTimeout;
    std::cout << "agents' peer timeout: " << peer_timeout_.count() << " ms\n";
    for (const auto* names : {&kPrefills, &kDecodes}) {
      for (const std::string& name : *names) {
        Agent agent;
        agent.name = name;
        agent.role = names == &kPrefills ? "prefill" : "decode";
        agent.log_path = dir_ + "/" + name + ".log";
        agent.ready_path = dir_ + "/" + name + ".json";
        tools::AgentCommand command;
        command.binary = binary;
        command.role = agent.role;
        command.name = name;
        command.bootstrap = BootstrapAddress();
        command.ready_file = agent.ready_path;
        command.device = "host";
        command.backend = "ucx";
        command.layers = kLayers;
        command.heads = 2;
        command.head_dim = 64;
        command.dtype = "bf16";
        command.page_size = 16;
        command.tokens = config.tokens;
        command.deadline_ms = config.deadline_ms;
        if (agent.role == "prefill") command.layer_time_us = config.layer_time_us;
        command.ucx_tls = config.ucx_tls;
        command.exit_with_parent = false;  // NodeProcess kills it with the test process
        command.extra = {"--rpc", "127.0.0.1:0"};
        if (short_peer_timeout) {
          command.extra.insert(command.extra.end(),
                               {"--peer-timeout-ms", std::to_string(kShortPeerTimeout.count()),
                                "--engine-heartbeat-ms", std::to_string(kEngineHeartbeat.count())});
        }
        if (agent.role == "prefill") {
          // p1 listens on every interface and advertises none: its entry must carry the
          // address of its interface toward the bootstrap (never 0.0.0.0), or no decode agent
          // reaches it. p0 listens on its node's address, which it registers as given.
          command.extra.push_back("--listen");
          command.extra.push_back(name == "p1" ? std::string("0.0.0.0:0")
                                               : network_->node(name).address + ":0");
        }
        agent.argv = command.Argv();
        agents_[name] = std::move(agent);
      }
    }
    for (auto& [name, agent] : agents_) KVT_RETURN_IF_ERROR(Spawn(agent));
    for (auto& [name, agent] : agents_) KVT_RETURN_IF_ERROR(WaitReady(agent));
    return OkStatus();
  }

  Status Spawn(Agent& agent) {
    std::error_code ignored;
    std::filesystem::remove(agent.ready_path, ignored);
    agent.rpc.reset();
    KVT_ASSIGN_OR_RETURN(agent.process, NodeProcess::Spawn(network_->node(agent.name).ns,
                                                           agent.argv, agent.log_path));
    return OkStatus();
  }

  // Waits for the agent's ready file, then connects to its RPC port from inside its node.
  Status WaitReady(Agent& agent) {
    KVT_ASSIGN_OR_RETURN(std::string text, tools::WaitReadyFile(agent.ready_path, kReadyTimeout,
                                                                agent.process->pid()));
    nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return DataLoss("ready file of " + agent.name + " is not JSON: " + text);
    agent.rpc_port = j.value("rpc_port", 0);
    if (agent.rpc_port == 0) return DataLoss("no rpc_port in the ready file: " + text);
    ScopedNetns in(network_->node(agent.name).ns);
    KVT_RETURN_IF_ERROR(in.status());
    KVT_ASSIGN_OR_RETURN(tools::RpcClient rpc,
                         integration::ConnectRpc(agent.rpc_port, "multinode-driver"));
    agent.rpc = std::make_unique<tools::RpcClient>(std::move(rpc));
    return OkStatus();
  }

  Status Restart(const std::string& name) {
    Agent& agent = agents_.at(name);
    agent.rpc.reset();
    agent.process.reset();  // stops it if it still runs
    KVT_RETURN_IF_ERROR(Spawn(agent));
    return WaitReady(agent);
  }

  tools::RpcClient& Rpc(const std::string& name) { return *agents_.at(name).rpc; }

  StatusOr<v1::AgentStatsReply> Stats(const std::string& name) {
    return integration::Stats(Rpc(name));
  }

  std::map<std::string, int64_t> FreePages() {
    std::map<std::string, int64_t> free;
    for (auto& [name, agent] : agents_) {
      auto stats = Stats(name);
      free[name] = stats.ok() ? stats->free_pages() : -1;
    }
    return free;
  }

  // Waits until `name` has `expected` free pages; the last count seen otherwise.
  StatusOr<int64_t> WaitFreePages(const std::string& name, int64_t expected,
                                  std::chrono::milliseconds timeout) {
    const auto until = Clock::now() + timeout;
    int64_t last = -1;
    while (true) {
      KVT_ASSIGN_OR_RETURN(v1::AgentStatsReply stats, Stats(name));
      last = stats.free_pages();
      if (last == expected) return last;
      if (Clock::now() > until) {
        return DeadlineExceeded(name + " has " + std::to_string(last) + " free pages after " +
                                std::to_string(timeout.count()) + " ms, expected " +
                                std::to_string(expected) + " (of " +
                                std::to_string(stats.total_pages()) + ")");
      }
      std::this_thread::sleep_for(50ms);
    }
  }

  // Submits one side of a flow, retrying while the agent says to retry later: no free pages,
  // or (decode) the prefill agent not registered or not reachable yet, for up to `timeout`.
  Status SubmitSide(const std::string& agent, const integration::SubmitArgs& args,
                    std::chrono::milliseconds timeout) {
    const auto until = Clock::now() + timeout;
    bool retried = false;
    while (true) {
      KVT_ASSIGN_OR_RETURN(v1::SubmitReply reply, integration::Submit(Rpc(agent), args));
      const v1::StatusCode code = reply.status();
      if (code == v1::STATUS_CODE_OK) return OkStatus();
      // A retry of a submit whose first attempt went through after all.
      if (code == v1::STATUS_CODE_ALREADY_EXISTS && retried) return OkStatus();
      const bool transient =
          code == v1::STATUS_CODE_RESOURCE_EXHAUSTED || code == v1::STATUS_CODE_NOT_FOUND ||
          code == v1::STATUS_CODE_UNAVAILABLE || code == v1::STATUS_CODE_DEADLINE_EXCEEDED;
      if (!transient || Clock::now() > until) {
        return Status(control::FromProtoCode(code), reply.message())
            .WithContext(agent + " refused room '" + args.room + "'");
      }
      retried = true;
      std::this_thread::sleep_for(code == v1::STATUS_CODE_RESOURCE_EXHAUSTED ? 2ms : 100ms);
    }
  }

  Status Submit(const Flow& flow, std::chrono::milliseconds timeout = kRequestTimeout) {
    KVT_RETURN_IF_ERROR(
        SubmitSide(flow.prefill, integration::ForPrefill(flow.room, flow.tokens), timeout));
    return SubmitSide(flow.decode, integration::ForDecode(flow.room, flow.tokens, flow.prefill),
                      timeout);
  }

  // Final reports of the flows' decode sides (rooms grouped by decode agent).
  StatusOr<std::map<std::string, v1::RequestReport>> WaitDecodes(
      const std::vector<Flow>& flows, std::chrono::milliseconds timeout) {
    std::map<std::string, std::vector<std::string>> by_agent;
    for (const Flow& f : flows) by_agent[f.decode].push_back(f.room);
    return WaitGrouped(by_agent, timeout);
  }

  StatusOr<std::map<std::string, v1::RequestReport>> WaitPrefills(
      const std::vector<Flow>& flows, std::chrono::milliseconds timeout) {
    std::map<std::string, std::vector<std::string>> by_agent;
    for (const Flow& f : flows) by_agent[f.prefill].push_back(f.room);
    return WaitGrouped(by_agent, timeout);
  }

  StatusOr<std::map<std::string, v1::RequestReport>> WaitGrouped(
      const std::map<std::string, std::vector<std::string>>& by_agent,
      std::chrono::milliseconds timeout) {
    const auto until = Clock::now() + timeout;
    std::map<std::string, v1::RequestReport> all;
    for (const auto& [agent, rooms] : by_agent) {
      const auto left = std::max(
          1ms, std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()));
      auto reports = integration::WaitFinal(Rpc(agent), rooms, left);
      if (!reports.ok()) return reports.status().WithContext("on " + agent);
      all.insert(reports->begin(), reports->end());
    }
    return all;
  }

  // Runs the flows (at most `window` in flight) and checks that every one arrived intact.
  // The bytes moved.
  StatusOr<uint64_t> RunVerified(const std::vector<Flow>& flows, size_t window = 50,
                                 std::chrono::milliseconds timeout = kRequestTimeout) {
    uint64_t bytes = 0;
    for (size_t begin = 0; begin < flows.size(); begin += window) {
      const std::vector<Flow> batch(flows.begin() + begin,
                                    flows.begin() + std::min(flows.size(), begin + window));
      for (const Flow& f : batch) KVT_RETURN_IF_ERROR(Submit(f, timeout));
      KVT_ASSIGN_OR_RETURN(auto reports, WaitDecodes(batch, timeout));
      for (const Flow& f : batch) {
        const v1::RequestReport& r = reports.at(f.room);
        if (r.state() != v1::REQUEST_STATE_SUCCESS || !r.verified() || r.mismatches() != 0) {
          return DataLoss("from " + f.prefill + " to " + f.decode + ": " + Describe(r));
        }
        if (r.bytes() != f.tokens * kTokenBytes) {
          return DataLoss(Describe(r) + ": expected " + std::to_string(f.tokens * kTokenBytes) +
                          " bytes");
        }
        bytes += r.bytes();
      }
      KVT_ASSIGN_OR_RETURN(auto prefill_reports, WaitPrefills(batch, timeout));
      for (const auto& [room, r] : prefill_reports) {
        if (r.state() != v1::REQUEST_STATE_SUCCESS) return DataLoss("prefill side " + Describe(r));
      }
    }
    return bytes;
  }

  // How long a decode agent may take to report FAILED the rooms of a prefill peer gone silent:
  // the silence noticed, then the fencing bound passed, then slack.
  std::chrono::milliseconds SilentPrefillBound() const {
    return 2 * peer_timeout_ + kFenceExtra + kMargin;
  }

  std::chrono::milliseconds peer_timeout_ = kDefaultPeerTimeout;
  std::unique_ptr<Network> network_;
  std::string dir_;
  std::unique_ptr<NodeProcess> bootstrap_;
  std::map<std::string, Agent> agents_;
};

// ---- the workload -----------------------------------------------------------------------------

class MultinodeWorkloadTest : public MultinodeTest,
                              public ::testing::WithParamInterface<std::string> {};

// 500 requests of 16..1024 tokens, each decode agent fed by both prefill agents, every byte
// checked; both agents of each role end with all their pages free.
TEST_P(MultinodeWorkloadTest, FiveHundredRequestsTwoPrefillsTwoDecodes) {
  AgentConfig config;
  config.ucx_tls = GetParam();
  KVT_ASSERT_OK(StartCluster(config));
  const auto initial = FreePages();
  std::mt19937 rng(17);
  std::uniform_int_distribution<uint64_t> tokens(1, 64);
  std::vector<Flow> flows;
  for (int i = 0; i < 500; ++i) {
    flows.push_back(
        {kPrefills[i % 2], kDecodes[(i / 2) % 2], "w-" + std::to_string(i), tokens(rng) * 16});
  }
  const auto start = Clock::now();
  KVT_ASSERT_OK_AND_ASSIGN(const uint64_t bytes, RunVerified(flows));
  const double seconds = Seconds(Clock::now() - start);
  std::cout << "500 requests, " << bytes / 1048576.0 << " MiB in " << seconds << " s ("
            << bytes / seconds / 1e6
            << " MB/s) over UCX_TLS=" << (GetParam().empty() ? "<UCX's choice>" : GetParam())
            << "\n";
  RecordProperty("mbytes_per_s", std::to_string(bytes / seconds / 1e6));
  for (const std::string& d : kDecodes) {
    KVT_ASSERT_OK_AND_ASSIGN(auto stats, Stats(d));
    EXPECT_EQ(stats.verified(), 250u) << d;
    EXPECT_EQ(stats.corrupted(), 0u) << d;
    EXPECT_EQ(stats.failed(), 0u) << d;
  }
  for (const auto& [name, free] : initial) {
    KVT_EXPECT_OK(WaitFreePages(name, free, 10s).status());
  }
}

INSTANTIATE_TEST_SUITE_P(Ucx, MultinodeWorkloadTest, ::testing::Values("tcp", ""),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param.empty() ? std::string("UcxDefault")
                                                     : std::string("UcxTcp");
                         });

// ---- faults -----------------------------------------------------------------------------------

std::vector<Flow> Concat(std::vector<Flow> a, const std::vector<Flow>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Rooms of a fault: each final report is either a success (on the decode side: with every byte
// verified; only decode agents verify), or a failure that says why. The number of failures.
enum class Side { kPrefill, kDecode };
int ExpectSucceededOrFailedWithReason(const std::map<std::string, v1::RequestReport>& reports,
                                      Side side) {
  int failed = 0;
  for (const auto& [room, r] : reports) {
    if (r.state() == v1::REQUEST_STATE_SUCCESS) {
      if (side == Side::kDecode) {
        EXPECT_TRUE(r.verified() && r.mismatches() == 0) << Describe(r);
      }
      continue;
    }
    ++failed;
    EXPECT_EQ(r.state(), v1::REQUEST_STATE_FAILED) << Describe(r);
    EXPECT_NE(r.status(), v1::STATUS_CODE_OK) << Describe(r);
    EXPECT_FALSE(r.message().empty()) << "a failed room without a reason: " << Describe(r);
  }
  return failed;
}

class MultinodeFaultTest : public MultinodeTest {
 protected:
  // A slow serial forward (0.4 s a room) keeps rooms in flight when the fault comes.
  static AgentConfig SlowPrefills(bool short_peer_timeout = false) {
    AgentConfig config;
    config.layer_time_us = 100000;
    config.short_peer_timeout = short_peer_timeout;
    return config;
  }

  void ExpectBystandersVerified(const std::vector<Flow>& flows) {
    auto reports = WaitDecodes(flows, kRequestTimeout);
    ASSERT_TRUE(reports.ok()) << reports.status().ToString();
    for (const auto& [room, r] : *reports) {
      EXPECT_TRUE(r.state() == v1::REQUEST_STATE_SUCCESS && r.verified()) << Describe(r);
    }
  }

  void ExpectPagesBack(const std::vector<std::string>& names,
                       const std::map<std::string, int64_t>& initial,
                       std::chrono::milliseconds timeout) {
    for (const std::string& name : names) {
      auto free = WaitFreePages(name, initial.at(name), timeout);
      EXPECT_TRUE(free.ok()) << "pages of failed rooms did not come back to " << name << ": "
                             << free.status().ToString();
    }
  }

  void ExpectNoCorruption() {
    for (const std::string& d : kDecodes) {
      auto stats = Stats(d);
      ASSERT_TRUE(stats.ok()) << stats.status().ToString();
      EXPECT_EQ(stats->corrupted(), 0u) << d << ": a request's bytes differed from the pattern";
    }
  }

  // p0 becomes unreachable without any RST (`fault`) while rooms from it are in flight to both
  // decode agents, then reachable again (`heal`): the decode agents fail those rooms with a
  // reason within the peer timeout, p1's rooms are untouched, the pages come back, and new
  // rooms from p0 succeed byte-exact (no late write of a failed room lands in reused pages).
  //
  // `stopped_here`: the fault stops p0's process on this host (SIGSTOP). The decode engines then
  // do not count the time it spends stopped toward its fencing bound, so its failed rooms keep
  // their pages, and the agents (which report a failed room final only once its pages may be
  // reused) report none of them FAILED while it is stopped; they must once it continues.
  // The prefill agent p0 becomes unreachable mid-transfer (`fault`). Its rooms fail on both
  // decode agents within the peer timeout, reported FAILED with a reason at once, their pages
  // quarantined. Link down: the pages come back once p0's fencing bound has passed, while the
  // link is still down. Stopped process (same kernel: the decode engines see the stop): the
  // pages stay quarantined however long it is stopped, and come back within the teardown time
  // after it continues. Then new rooms through p0 succeed and nothing is corrupted.
  void PrefillUnreachable(const std::function<Status()>& fault, const std::function<Status()>& heal,
                          bool stopped_here = false) {
    KVT_ASSERT_OK(StartCluster(SlowPrefills(/*short_peer_timeout=*/true)));
    const auto initial = FreePages();
    const auto affected = Concat(Flows("p0", "d0", "a", 3, 256), Flows("p0", "d1", "a", 3, 256));
    const auto bystanders = Concat(Flows("p1", "d0", "b", 2, 256), Flows("p1", "d1", "b", 2, 256));
    for (const Flow& f : Concat(affected, bystanders)) KVT_ASSERT_OK(Submit(f));
    std::this_thread::sleep_for(300ms);
    KVT_ASSERT_OK(fault());
    const auto start = Clock::now();
    auto reports = WaitDecodes(affected, peer_timeout_ + kMargin);
    const double noticed = Seconds(Clock::now() - start);
    ASSERT_TRUE(reports.ok())
        << "the rooms from the unreachable prefill are not reported final (FAILED) by the "
           "decode agents within the peer timeout + "
        << kMargin.count() << " s: " << reports.status().ToString();
    const int failed = ExpectSucceededOrFailedWithReason(*reports, Side::kDecode);
    EXPECT_GT(failed, 0);
    std::cout << "the decode agents failed p0's rooms " << noticed << " s after the fault\n";
    RecordProperty("seconds_to_fail", std::to_string(noticed));
    ExpectBystandersVerified(bystanders);
    if (stopped_here) {
      // Well past the fencing bound: a stopped process's bound does not run.
      std::this_thread::sleep_until(start + 2 * peer_timeout_ + kFenceExtra + 1500ms);
      for (const std::string& d : kDecodes) {
        std::vector<std::string> rooms;
        for (const Flow& f : affected) {
          if (f.decode == d) rooms.push_back(f.room);
        }
        KVT_ASSERT_OK_AND_ASSIGN(auto now, integration::Query(Rpc(d), rooms));
        for (const v1::RequestReport& r : now) {
          if (r.state() != v1::REQUEST_STATE_FAILED) continue;
          EXPECT_TRUE(r.pages_quarantined())
              << "the pages of a room from a stopped prefill process were released while it "
                 "was stopped: "
              << Describe(r);
        }
      }
      KVT_ASSERT_OK(heal());
      ExpectPagesBack({"d0", "d1", "p0"}, initial, kFenceExtra + kPagesBackMargin);
    } else {
      // The fencing bound frees the pages while p0 is still unreachable.
      ExpectPagesBack({"d0", "d1"}, initial, peer_timeout_ + kFenceExtra + kMargin);
      KVT_ASSERT_OK(heal());
      ExpectPagesBack({"p0"}, initial, peer_timeout_ + kPagesBackMargin);
    }
    const auto fresh = Concat(Flows("p0", "d0", "n", 3, 256), Flows("p0", "d1", "n", 3, 256));
    auto moved = RunVerified(fresh, 50, peer_timeout_ + kRequestTimeout);
    EXPECT_TRUE(moved.ok()) << "new rooms after recovery: " << moved.status().ToString();
    ExpectNoCorruption();
  }
};

// The prefill node's link goes down mid-transfer (no RST: only the heartbeats can tell) and
// comes back.
TEST_F(MultinodeFaultTest, PrefillLinkDownThenUp) {
  PrefillUnreachable([this] { return network_->SetLink("p0", false); },
                     [this] { return network_->SetLink("p0", true); });
}

// The prefill agent is stopped mid-transfer (alive, silent) for longer than the peer timeout,
// then continued.
TEST_F(MultinodeFaultTest, PrefillSigstopThenSigcont) {
  PrefillUnreachable(
      [this] {
        agents_.at("p0").process->Signal(SIGSTOP);
        return OkStatus();
      },
      [this] {
        agents_.at("p0").process->Signal(SIGCONT);
        return OkStatus();
      },
      /*stopped_here=*/true);
}

// The prefill agent is killed mid-transfer: its closed sockets tell at once and its death frees
// the pages; a new agent of the same name takes over.
TEST_F(MultinodeFaultTest, PrefillSigkillThenRestart) {
  KVT_ASSERT_OK(StartCluster(SlowPrefills()));
  const auto initial = FreePages();
  const auto affected = Concat(Flows("p0", "d0", "a", 3, 256), Flows("p0", "d1", "a", 3, 256));
  const auto bystanders = Concat(Flows("p1", "d0", "b", 2, 256), Flows("p1", "d1", "b", 2, 256));
  for (const Flow& f : Concat(affected, bystanders)) KVT_ASSERT_OK(Submit(f));
  std::this_thread::sleep_for(300ms);
  agents_.at("p0").process->Signal(SIGKILL);
  const auto start = Clock::now();
  KVT_ASSERT_OK_AND_ASSIGN(auto reports, WaitDecodes(affected, kMargin + 4s));
  std::cout << "the decode agents failed p0's rooms " << Seconds(Clock::now() - start)
            << " s after SIGKILL\n";
  EXPECT_GT(ExpectSucceededOrFailedWithReason(reports, Side::kDecode), 0);
  ExpectBystandersVerified(bystanders);
  ExpectPagesBack({"d0", "d1"}, initial, kPagesBackMargin);
  KVT_ASSERT_OK(Restart("p0"));
  KVT_ASSERT_OK(
      RunVerified(Concat(Flows("p0", "d0", "n", 3, 256), Flows("p0", "d1", "n", 3, 256))).status());
  ExpectPagesBack({"p0", "d0", "d1"}, initial, kPagesBackMargin);
  ExpectNoCorruption();
}

// A decode agent is killed mid-transfer: both prefill agents fail its rooms and get their pages
// back; the other decode agent goes on; a new agent of the same name takes over.
TEST_F(MultinodeFaultTest, DecodeSigkillThenRestart) {
  KVT_ASSERT_OK(StartCluster(SlowPrefills()));
  const auto initial = FreePages();
  const auto affected = Concat(Flows("p0", "d0", "a", 3, 256), Flows("p1", "d0", "a", 3, 256));
  const auto bystanders = Concat(Flows("p0", "d1", "b", 2, 256), Flows("p1", "d1", "b", 2, 256));
  for (const Flow& f : Concat(affected, bystanders)) KVT_ASSERT_OK(Submit(f));
  std::this_thread::sleep_for(300ms);
  agents_.at("d0").process->Signal(SIGKILL);
  const auto start = Clock::now();
  KVT_ASSERT_OK_AND_ASSIGN(auto reports, WaitPrefills(affected, kMargin + 5s));
  std::cout << "the prefill agents failed d0's rooms " << Seconds(Clock::now() - start)
            << " s after SIGKILL\n";
  EXPECT_GT(ExpectSucceededOrFailedWithReason(reports, Side::kPrefill), 0);
  ExpectBystandersVerified(bystanders);
  ExpectPagesBack({"p0", "p1", "d1"}, initial, kPagesBackMargin);
  KVT_ASSERT_OK(Restart("d0"));
  KVT_ASSERT_OK(
      RunVerified(Concat(Flows("p0", "d0", "n", 3, 256), Flows("p1", "d0", "n", 3, 256))).status());
  ExpectPagesBack({"p0", "p1", "d0", "d1"}, initial, kPagesBackMargin);
  ExpectNoCorruption();
}

// A decode agent is stopped mid-transfer (alive, silent): the prefill agents fail its rooms
// within the peer timeout; once continued it fails them too, gets its pages back and takes new
// rooms.
TEST_F(MultinodeFaultTest, DecodeSigstopThenSigcont) {
  KVT_ASSERT_OK(StartCluster(SlowPrefills(/*short_peer_timeout=*/true)));
  const auto initial = FreePages();
  const auto affected = Concat(Flows("p0", "d0", "a", 3, 256), Flows("p1", "d0", "a", 3, 256));
  const auto bystanders = Concat(Flows("p0", "d1", "b", 2, 256), Flows("p1", "d1", "b", 2, 256));
  for (const Flow& f : Concat(affected, bystanders)) KVT_ASSERT_OK(Submit(f));
  std::this_thread::sleep_for(300ms);
  agents_.at("d0").process->Signal(SIGSTOP);
  const auto start = Clock::now();
  auto prefill_reports = WaitPrefills(affected, peer_timeout_ + kMargin);
  EXPECT_TRUE(prefill_reports.ok())
      << "the prefill agents did not fail the stopped decode agent's rooms: "
      << prefill_reports.status().ToString();
  if (prefill_reports.ok()) {
    EXPECT_GT(ExpectSucceededOrFailedWithReason(*prefill_reports, Side::kPrefill), 0);
    std::cout << "the prefill agents failed d0's rooms " << Seconds(Clock::now() - start)
              << " s after SIGSTOP\n";
  }
  ExpectBystandersVerified(bystanders);
  agents_.at("d0").process->Signal(SIGCONT);
  auto decode_reports = WaitDecodes(affected, SilentPrefillBound());
  EXPECT_TRUE(decode_reports.ok()) << "the continued decode agent does not report its rooms final: "
                                   << decode_reports.status().ToString();
  if (decode_reports.ok()) ExpectSucceededOrFailedWithReason(*decode_reports, Side::kDecode);
  ExpectPagesBack({"p0", "p1", "d0"}, initial, peer_timeout_ + kPagesBackMargin);
  auto moved = RunVerified(Concat(Flows("p0", "d0", "n", 3, 256), Flows("p1", "d0", "n", 3, 256)),
                           50, peer_timeout_ + kRequestTimeout);
  EXPECT_TRUE(moved.ok()) << "new rooms after recovery: " << moved.status().ToString();
  ExpectNoCorruption();
}

// The bootstrap is killed while rooms are in flight (they finish: the data path does not need
// it) and started again at the same address: the agents register again with their heartbeats
// and new rooms find their prefill agents by name.
TEST_F(MultinodeFaultTest, BootstrapRestart) {
  AgentConfig config;
  config.layer_time_us = 50000;
  KVT_ASSERT_OK(StartCluster(config));
  std::vector<Flow> in_flight;
  for (const std::string& p : kPrefills) {
    for (const std::string& d : kDecodes) in_flight = Concat(in_flight, Flows(p, d, "a", 2, 256));
  }
  for (const Flow& f : in_flight) KVT_ASSERT_OK(Submit(f));
  bootstrap_->Signal(SIGKILL);
  bootstrap_.reset();
  ExpectBystandersVerified(in_flight);
  std::this_thread::sleep_for(1s);  // the agents' heartbeats meet a closed port meanwhile
  KVT_ASSERT_OK(StartBootstrap());
  const auto start = Clock::now();
  std::vector<Flow> fresh;
  for (const std::string& p : kPrefills) {
    for (const std::string& d : kDecodes) fresh = Concat(fresh, Flows(p, d, "n", 2, 256));
  }
  KVT_ASSERT_OK(RunVerified(fresh).status());
  std::cout << "new rooms by name moved " << Seconds(Clock::now() - start)
            << " s after the bootstrap restarted\n";
  ExpectNoCorruption();
}

// 1 % of the packets on p0's link dropped (nftables: these kernels have no netem): TCP
// retransmits, every transfer still arrives intact. Reports the speed.
TEST_F(MultinodeFaultTest, PacketLossOnPrefillNode) {
  if (auto nft = RunCommand({"nft", "--version"}); !nft.ok()) {
    GTEST_SKIP() << "nft is not installed (Debian package nftables): " << nft.status().ToString();
  }
  KVT_ASSERT_OK(StartCluster(AgentConfig{}));
  const std::vector<std::vector<std::string>> rules = {
      {"nft", "add", "table", "inet", "kvtloss"},
      {"nft", "add", "chain", "inet", "kvtloss", "in", "{ type filter hook input priority 0; }"},
      {"nft", "add", "chain", "inet", "kvtloss", "out", "{ type filter hook output priority 0; }"},
      // On the node's link only: the driver's RPC on the node's loopback keeps all its packets.
      {"nft", "add", "rule", "inet", "kvtloss", "in", "iifname", Network::kNodeInterface, "numgen",
       "random", "mod", "100", "<", "1", "counter", "drop"},
      {"nft", "add", "rule", "inet", "kvtloss", "out", "oifname", Network::kNodeInterface, "numgen",
       "random", "mod", "100", "<", "1", "counter", "drop"},
  };
  for (const auto& rule : rules) KVT_ASSERT_OK(network_->Exec("p0", rule).status());
  const auto flows = Concat(Flows("p0", "d0", "l", 20, 1024), Flows("p0", "d1", "l", 20, 1024));
  const auto start = Clock::now();
  auto bytes = RunVerified(flows, 10, 60s);
  const double seconds = Seconds(Clock::now() - start);
  KVT_ASSERT_OK(bytes.status());
  auto counters = network_->Exec("p0", {"nft", "list", "table", "inet", "kvtloss"});
  std::cout << "with 1 % loss on p0's link: " << *bytes / 1048576.0 << " MiB in " << seconds
            << " s (" << *bytes / seconds / 1e6 << " MB/s)\n"
            << (counters.ok() ? *counters : counters.status().ToString()) << "\n";
  RecordProperty("mbytes_per_s_with_loss", std::to_string(*bytes / seconds / 1e6));
  ExpectNoCorruption();
}

// p0's link capped at 200 Mbit/s (tc tbf): transfers succeed, at about that speed. Reports the
// speed without and with the cap.
TEST_F(MultinodeFaultTest, BandwidthCapOnPrefillNode) {
  if (auto tc = RunCommand({"tc", "-V"}); !tc.ok()) {
    GTEST_SKIP() << "tc is not installed (Debian package iproute2): " << tc.status().ToString();
  }
  KVT_ASSERT_OK(StartCluster(AgentConfig{}));
  auto speed = [this](const std::string& tag) -> StatusOr<double> {
    const auto flows = Concat(Flows("p0", "d0", tag, 4, 2048), Flows("p0", "d1", tag, 4, 2048));
    const auto start = Clock::now();
    KVT_ASSIGN_OR_RETURN(const uint64_t bytes, RunVerified(flows, 8, 60s));
    return bytes / Seconds(Clock::now() - start) / 1e6;
  };
  KVT_ASSERT_OK_AND_ASSIGN(const double uncapped, speed("u"));
  KVT_ASSERT_OK(network_
                    ->Exec("p0", {"tc", "qdisc", "add", "dev", Network::kNodeInterface, "root",
                                  "tbf", "rate", "200mbit", "burst", "256kb", "latency", "50ms"})
                    .status());
  KVT_ASSERT_OK_AND_ASSIGN(const double capped, speed("c"));
  auto qdisc = network_->Exec("p0", {"tc", "-s", "qdisc", "show", "dev", Network::kNodeInterface});
  std::cout << "p0 -> d0, d1, 16 MiB: " << uncapped << " MB/s uncapped, " << capped
            << " MB/s with tbf rate 200mbit (25 MB/s)\n"
            << (qdisc.ok() ? *qdisc : qdisc.status().ToString()) << "\n";
  RecordProperty("mbytes_per_s_uncapped", std::to_string(uncapped));
  RecordProperty("mbytes_per_s_capped", std::to_string(capped));
  ExpectNoCorruption();
}

// 1000 rooms over all four prefill/decode pairs, each aborted in flight from one side or the
// other: every room ends (none stuck), every page comes back, and the cluster moves new rooms.
TEST_F(MultinodeFaultTest, ThousandAbortsInFlight) {
  AgentConfig config;
  config.layer_time_us = 20000;
  KVT_ASSERT_OK(StartCluster(config));
  const auto initial = FreePages();
  std::vector<Flow> flows;
  for (int i = 0; i < 1000; ++i) {
    flows.push_back({kPrefills[i % 2], kDecodes[(i / 2) % 2], "x-" + std::to_string(i), 16});
  }
  for (const Flow& f : flows) KVT_ASSERT_OK(Submit(f));
  int aborted = 0, already_final = 0;
  for (size_t i = 0; i < flows.size(); ++i) {
    const Flow& f = flows[i];
    const std::string& side = i % 2 == 0 ? f.decode : f.prefill;
    KVT_ASSERT_OK_AND_ASSIGN(v1::SubmitReply reply,
                             integration::AbortRoom(Rpc(side), f.room, "multinode abort test"));
    if (reply.status() == v1::STATUS_CODE_OK) {
      ++aborted;
    } else {
      ++already_final;
    }
  }
  KVT_ASSERT_OK_AND_ASSIGN(auto decode_reports, WaitDecodes(flows, 60s));
  KVT_ASSERT_OK_AND_ASSIGN(auto prefill_reports, WaitPrefills(flows, 60s));
  int succeeded = 0;
  for (const auto& [room, r] : decode_reports) {
    if (r.state() == v1::REQUEST_STATE_SUCCESS) {
      ++succeeded;
      EXPECT_TRUE(r.verified()) << Describe(r);
    } else {
      EXPECT_FALSE(r.message().empty()) << Describe(r);
    }
  }
  std::cout << "1000 rooms: " << aborted << " aborts accepted, " << already_final
            << " refused (room already over), " << succeeded << " succeeded anyway\n";
  EXPECT_GT(aborted, 500);
  ExpectPagesBack({"p0", "p1", "d0", "d1"}, initial, 20s);
  std::vector<Flow> fresh;
  for (const std::string& p : kPrefills) {
    for (const std::string& d : kDecodes) fresh = Concat(fresh, Flows(p, d, "n", 2, 256));
  }
  KVT_ASSERT_OK(RunVerified(fresh).status());
  ExpectNoCorruption();
}

}  // namespace
}  // namespace kvt::multinode

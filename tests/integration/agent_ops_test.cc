// What an operator sees of kvt-agent processes: an agent started before its bootstrap waits for
// it (bounded, logged) and says when it is back; failed requests are logged at warn with room
// and reason on both sides; a prefill agent lost mid-request is logged on the decode side; a
// prefill room ends at its request's deadline and gives its pages back.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "agent_command.h"
#include "fixture.h"
#include "kvt/transfer/registry.h"

namespace kvt::integration {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Polls `path` until it holds `text`; false after `timeout`.
bool WaitForLog(const std::string& path, const std::string& text,
                std::chrono::milliseconds timeout) {
  const auto until = Clock::now() + timeout;
  while (Clock::now() < until) {
    if (ReadAll(path).find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(20ms);
  }
  return ReadAll(path).find(text) != std::string::npos;
}

// A loopback port nobody listens on right now (the kernel's pick, released again).
uint16_t FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  uint16_t port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

class AgentBootstrapTest : public ::testing::Test {
 protected:
  void SetUp() override {
    unsetenv("KVT_CLUSTER_TOKEN");
    dir_ = ::testing::TempDir() + "/kvt-agent-ops-" + std::to_string(getpid());
    std::filesystem::create_directories(dir_);
    auto agent = AgentBinary();
    auto bootstrap = BootstrapBinary();
    ASSERT_TRUE(agent.ok()) << agent.status();
    ASSERT_TRUE(bootstrap.ok()) << bootstrap.status();
    agent_bin_ = *agent;
    bootstrap_bin_ = *bootstrap;
  }
  void TearDown() override {
    if (HasFailure()) {
      std::cerr << "agent log:\n" << ReadAll(dir_ + "/agent.log") << std::flush;
    }
    std::filesystem::remove_all(dir_);
  }

  std::vector<std::string> AgentArgs(uint16_t bootstrap_port, const std::string& extra_flag = "",
                                     const std::string& extra_value = "") {
    tools::AgentCommand command;
    command.binary = agent_bin_;
    command.role = "decode";
    command.name = "ops-decode";
    command.layers = 2;
    command.heads = 2;
    command.head_dim = 64;
    command.tokens = 256;
    command.bootstrap = "127.0.0.1:" + std::to_string(bootstrap_port);
    command.ready_file = dir_ + "/agent.json";
    if (!extra_flag.empty()) command.extra = {extra_flag, extra_value};
    return command.Argv();
  }

  std::string dir_, agent_bin_, bootstrap_bin_;
};

TEST_F(AgentBootstrapTest, AgentStartedBeforeTheBootstrapWaitsForIt) {
  const uint16_t port = FreePort();
  ASSERT_NE(port, 0);
  auto agent = tools::ChildProcess::Spawn(AgentArgs(port), dir_ + "/agent.log");
  ASSERT_TRUE(agent.ok()) << agent.status();
  ASSERT_TRUE(WaitForLog(dir_ + "/agent.log", "not registered with the bootstrap at", 20s))
      << "the agent did not report the missing bootstrap";
  ASSERT_TRUE(agent->running()) << "the agent exited instead of waiting for the bootstrap";

  tools::BootstrapCommand command;
  command.binary = bootstrap_bin_;
  command.listen = "127.0.0.1:" + std::to_string(port);
  command.ready_file = dir_ + "/bootstrap.json";
  auto bootstrap = tools::ChildProcess::Spawn(command.Argv(), dir_ + "/bootstrap.log");
  ASSERT_TRUE(bootstrap.ok()) << bootstrap.status();
  auto ready = tools::WaitReadyFile(dir_ + "/agent.json", 30s, agent->pid());
  ASSERT_TRUE(ready.ok()) << ready.status();
  EXPECT_TRUE(WaitForLog(dir_ + "/agent.log", "is back", 5s));

  transfer::RegistryClientOptions lookup;
  lookup.port = port;
  auto found =
      transfer::RegistryClient::Lookup(lookup, "ops-decode", transfer::AgentRole::kDecode, 0u);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->size(), 1u) << "the agent is not registered after the bootstrap came back";
  agent->Stop();
  bootstrap->Stop();
}

TEST_F(AgentBootstrapTest, AgentGivesUpAfterTheWaitItWasGiven) {
  const uint16_t port = FreePort();
  ASSERT_NE(port, 0);
  auto agent =
      tools::ChildProcess::Spawn(AgentArgs(port, "--bootstrap-wait-s", "1"), dir_ + "/agent.log");
  ASSERT_TRUE(agent.ok()) << agent.status();
  const auto until = Clock::now() + 20s;
  while (agent->running() && Clock::now() < until) std::this_thread::sleep_for(20ms);
  ASSERT_FALSE(agent->running()) << "the agent kept waiting beyond --bootstrap-wait-s 1";
  const std::string log = ReadAll(dir_ + "/agent.log");
  EXPECT_NE(log.find("could not register with the bootstrap at 127.0.0.1:" + std::to_string(port) +
                     " within 1 s"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("start kvt-bootstrap there"), std::string::npos) << log;
  EXPECT_NE(log.find("--bootstrap-wait-s"), std::string::npos) << log;
  EXPECT_NE(log.find("retrying in"), std::string::npos) << log;
}

// An agent stopped by SIGTERM removes its registry entry on the way out: its name, role and
// rank are free at once for an agent at another address, long before the entry would have
// expired (--heartbeat-ms 10000: 30 s without heartbeats).
TEST_F(AgentBootstrapTest, AStoppedAgentsKeyIsFreeAtOnce) {
  tools::BootstrapCommand command;
  command.binary = bootstrap_bin_;
  command.ready_file = dir_ + "/bootstrap.json";
  command.heartbeat_ms = 10000;
  auto bootstrap = tools::ChildProcess::Spawn(command.Argv(), dir_ + "/bootstrap.log");
  ASSERT_TRUE(bootstrap.ok()) << bootstrap.status();
  auto bootstrap_ready = tools::WaitReadyFile(command.ready_file, 30s, bootstrap->pid());
  ASSERT_TRUE(bootstrap_ready.ok()) << bootstrap_ready.status();
  const uint16_t port = nlohmann::json::parse(*bootstrap_ready).value("port", 0);
  ASSERT_NE(port, 0) << *bootstrap_ready;

  auto agent = tools::ChildProcess::Spawn(AgentArgs(port), dir_ + "/agent.log");
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto ready = tools::WaitReadyFile(dir_ + "/agent.json", 30s, agent->pid());
  ASSERT_TRUE(ready.ok()) << ready.status();
  transfer::RegistryClientOptions client;
  client.port = port;
  auto before =
      transfer::RegistryClient::Lookup(client, "ops-decode", transfer::AgentRole::kDecode, 0u);
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_EQ(before->size(), 1u) << "the agent did not register";

  EXPECT_EQ(agent->Stop(), 0) << "kvt-agent did not exit cleanly on SIGTERM";
  auto after =
      transfer::RegistryClient::Lookup(client, "ops-decode", transfer::AgentRole::kDecode, 0u);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(after->empty()) << "the stopped agent's entry is still there at "
                              << (after->empty() ? "" : after->front().control_address);
  EXPECT_NE(ReadAll(dir_ + "/agent.log").find("unregistered from the bootstrap"),
            std::string::npos);

  transfer::AgentEntry successor;
  successor.name = "ops-decode";
  successor.role = transfer::AgentRole::kDecode;
  successor.control_address = "127.0.0.2:0";
  client.role = transfer::AgentRole::kDecode;
  auto taken = transfer::RegistryClient::Start(client, successor);
  ASSERT_TRUE(taken.ok()) << "the key is not free: " << taken.status();
  EXPECT_TRUE((*taken)->Unregister(2s).ok());
  bootstrap->Stop();
}

using AgentLogTest = ClusterTest;

// 2 layers x 300 ms: an abort 150 ms in lands mid-forward.
constexpr int64_t kSlowLayerUs = 300000;

TEST_F(AgentLogTest, FailedRequestIsLoggedAtWarnOnBothSides) {
  AgentSpec prefill_spec = Prefill("log-prefill", kSlowLayerUs);
  prefill_spec.layout.layers = 2;
  AgentSpec decode_spec = Decode("log-decode");
  decode_spec.layout.layers = 2;
  KVT_ASSERT_OK_AND_ASSIGN(auto agents, cluster_->StartAgents({prefill_spec, decode_spec}));
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient prefill, ConnectRpc(agents[0]->rpc_port));
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient decode, ConnectRpc(agents[1]->rpc_port));
  KVT_ASSERT_OK(SubmitAccepted(decode, ForDecode("doomed-room", 100, "log-prefill")));
  KVT_ASSERT_OK(SubmitAccepted(prefill, ForPrefill("doomed-room", 100)));
  std::this_thread::sleep_for(150ms);
  KVT_ASSERT_OK_AND_ASSIGN(v1::SubmitReply aborted,
                           AbortRoom(prefill, "doomed-room", "operator pulled the plug"));
  ASSERT_EQ(aborted.status(), v1::STATUS_CODE_OK) << aborted.message();
  KVT_ASSERT_OK_AND_ASSIGN(v1::RequestReport on_decode, WaitFinal(decode, "doomed-room", 10s));
  KVT_ASSERT_OK_AND_ASSIGN(v1::RequestReport on_prefill, WaitFinal(prefill, "doomed-room", 10s));
  ASSERT_EQ(on_decode.state(), v1::REQUEST_STATE_FAILED) << Describe(on_decode);
  for (const AgentProcess* agent : agents) {
    EXPECT_TRUE(WaitForLog(agent->log_path, "room 'doomed-room' failed", 5s))
        << agent->spec.name << " did not log the failed request";
    const std::string log = ReadAll(agent->log_path);
    const size_t line = log.find("room 'doomed-room' failed");
    if (line == std::string::npos) continue;
    const size_t begin = log.rfind('\n', line) == std::string::npos ? 0 : log.rfind('\n', line);
    const std::string text = log.substr(begin, log.find('\n', line) - begin);
    EXPECT_NE(text.find("[warning]"), std::string::npos) << agent->spec.name << ": " << text;
    EXPECT_NE(text.find("operator pulled the plug"), std::string::npos)
        << agent->spec.name << ": " << text;
  }
}

TEST_F(AgentLogTest, LostPrefillIsLoggedOnTheDecodeSide) {
  AgentSpec prefill_spec = Prefill("lost-prefill", kSlowLayerUs);
  prefill_spec.layout.layers = 2;
  AgentSpec decode_spec = Decode("lost-decode");
  decode_spec.layout.layers = 2;
  KVT_ASSERT_OK_AND_ASSIGN(auto agents, cluster_->StartAgents({prefill_spec, decode_spec}));
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient prefill, ConnectRpc(agents[0]->rpc_port));
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient decode, ConnectRpc(agents[1]->rpc_port));
  KVT_ASSERT_OK(SubmitAccepted(decode, ForDecode("orphan-room", 100, "lost-prefill")));
  KVT_ASSERT_OK(SubmitAccepted(prefill, ForPrefill("orphan-room", 100)));
  std::this_thread::sleep_for(150ms);
  agents[0]->process.Signal(SIGKILL);
  KVT_ASSERT_OK_AND_ASSIGN(v1::RequestReport on_decode, WaitFinal(decode, "orphan-room", 15s));
  ASSERT_EQ(on_decode.state(), v1::REQUEST_STATE_FAILED) << Describe(on_decode);
  EXPECT_TRUE(WaitForLog(agents[1]->log_path, "room 'orphan-room' failed", 10s));
  const std::string log = ReadAll(agents[1]->log_path);
  EXPECT_NE(log.find("was lost"), std::string::npos) << log;
  EXPECT_NE(log.find("[warning]"), std::string::npos) << log;
}

// A prefill room whose decode request never comes ends at the SubmitRequest's deadline (not the
// agent's default) and its source pages return to the pool.
TEST_F(AgentLogTest, PrefillRoomEndsAtItsDeadlineAndFreesItsPages) {
  KVT_ASSERT_OK_AND_ASSIGN(AgentProcess * agent, cluster_->StartAgent(Prefill("alone-prefill")));
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient prefill, ConnectRpc(agent->rpc_port));
  SubmitArgs args = ForPrefill("never-asked", 300);
  args.deadline_ms = 400;  // the agent's default is 20 s
  KVT_ASSERT_OK(SubmitAccepted(prefill, args));
  KVT_ASSERT_OK_AND_ASSIGN(v1::AgentStatsReply during, Stats(prefill));
  EXPECT_LT(during.free_pages(), during.total_pages());
  KVT_ASSERT_OK_AND_ASSIGN(v1::RequestReport report, WaitFinal(prefill, "never-asked", 8s));
  EXPECT_EQ(report.state(), v1::REQUEST_STATE_FAILED) << Describe(report);
  EXPECT_EQ(report.status(), v1::STATUS_CODE_DEADLINE_EXCEEDED) << Describe(report);
  // A failed room is reported as soon as its engine says so; the agent counts it as failed only
  // after it has put the room's pages back, so the counter (not a sleep) orders the check.
  v1::AgentStatsReply after;
  const auto give_up = std::chrono::steady_clock::now() + 5s;
  do {
    KVT_ASSERT_OK_AND_ASSIGN(after, Stats(prefill));
    if (after.failed() >= 1) break;
    std::this_thread::sleep_for(10ms);
  } while (std::chrono::steady_clock::now() < give_up);
  ASSERT_EQ(after.failed(), 1u) << "the agent never counted the room that missed its deadline";
  EXPECT_EQ(after.free_pages(), after.total_pages()) << "the failed room kept its pages";
}

// A driver request that breaks a validation rule is answered with an Error tied to it, and the
// same connection keeps serving.
TEST_F(AgentLogTest, MalformedRequestIsAnsweredAndTheConnectionKeepsServing) {
  KVT_ASSERT_OK_AND_ASSIGN(AgentProcess * agent, cluster_->StartAgent(Prefill("rpc-prefill")));
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient rpc, ConnectRpc(agent->rpc_port));
  v1::Envelope bad;
  bad.mutable_submit_request()->set_room_id("zero-tokens");
  bad.mutable_submit_request()->set_num_tokens(0);  // breaks 1..16777216
  auto reply = rpc.Call(bad, 5s);                   // an Error with reply_to becomes a Status
  ASSERT_FALSE(reply.ok());
  EXPECT_EQ(reply.status().code(), StatusCode::kInvalidArgument) << reply.status();
  EXPECT_NE(reply.status().message().find("submit_request.num_tokens"), std::string::npos);
  KVT_ASSERT_OK_AND_ASSIGN(v1::AgentStatsReply stats, Stats(rpc));  // same connection
  EXPECT_EQ(stats.name(), "rpc-prefill");
}

// A submit whose prefill address accepts TCP but never speaks blocks on connecting to that peer;
// meanwhile the same agent's other driver calls (stats, queries) answer at once, and the stuck
// submit is answered with its error once the connect gives up.
TEST_F(AgentLogTest, SubmitToASilentPeerDoesNotStallOtherCalls) {
  // A listener that never accepts: the kernel completes the handshake, nothing is ever sent.
  const int silent = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(silent, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(bind(silent, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(silent, 16), 0);
  ASSERT_EQ(getsockname(silent, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string silent_address = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));

  KVT_ASSERT_OK_AND_ASSIGN(AgentProcess * agent, cluster_->StartAgent(Decode("stall-decode")));
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient submitter, ConnectRpc(agent->rpc_port, "submitter"));
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient observer, ConnectRpc(agent->rpc_port, "observer"));
  StatusOr<v1::SubmitReply> stuck = Unavailable("not answered");
  std::thread submit(
      [&] { stuck = Submit(submitter, ForDecodeAt("stuck-room", 100, silent_address)); });
  std::this_thread::sleep_for(300ms);  // the submit is now waiting on the silent peer
  for (int i = 0; i < 5; ++i) {
    const auto start = Clock::now();
    StatusOr<v1::AgentStatsReply> stats = Stats(observer);
    const auto took = Clock::now() - start;
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_LT(took, 200ms) << "stats took "
                           << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                           << " ms while a submit waited on a silent peer";
    StatusOr<std::vector<v1::RequestReport>> reports = Query(observer, {"stuck-room"});
    EXPECT_TRUE(reports.ok()) << reports.status();
  }
  submit.join();
  close(silent);
  ASSERT_TRUE(stuck.ok()) << stuck.status();
  EXPECT_NE(stuck->status(), v1::STATUS_CODE_OK) << "a submit to a silent peer was accepted";
  EXPECT_FALSE(stuck->message().empty());
}

}  // namespace
}  // namespace kvt::integration

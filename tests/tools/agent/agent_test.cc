// The agent's building blocks and kvt-agent's command line: device names, the page-list
// arena's bookkeeping, which pool/backend pairs the agent refuses (and how it says so), what a
// started agent reports in its ready file, and its driver RPC in-process (aborts wherever a
// room is, drivers that disconnect, the prefill address cache). Runs without a GPU;
// device-dependent expectations follow what this process sees.
#include "agent.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>
#include <vector>

#include "advertise.h"
#include "agent_rpc.h"
#include "control/control_server.h"
#include "device_spec.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/testing/run_tool.h"
#include "kvt/transfer/registry.h"
#include "page_list_arena.h"
#include "pattern_id.h"
#include "rpc_client.h"
#include "tool_util.h"

namespace kvt::tools {
namespace {

using kvt::testing::RunTool;
using kvt::testing::ToolResult;
using ::testing::HasSubstr;

// ---- device names -----------------------------------------------------------------------

TEST(DeviceSpecTest, ParsesHostAndCudaDevices) {
  auto host = ParseDeviceSpec("host");
  ASSERT_TRUE(host.ok()) << host.status().ToString();
  EXPECT_FALSE(host->cuda());
  EXPECT_EQ(host->ToString(), "host");

  auto cuda3 = ParseDeviceSpec("cuda:3");
  ASSERT_TRUE(cuda3.ok()) << cuda3.status().ToString();
  EXPECT_TRUE(cuda3->cuda());
  EXPECT_EQ(cuda3->memory, pool::MemoryKind::kCuda);
  EXPECT_EQ(cuda3->index, 3);
  EXPECT_EQ(cuda3->ToString(), "cuda:3");

  auto cuda = ParseDeviceSpec("cuda");
  ASSERT_TRUE(cuda.ok()) << cuda.status().ToString();
  EXPECT_EQ(cuda->ToString(), "cuda:0");
}

TEST(DeviceSpecTest, RefusesOtherSpellingsNamingTheText) {
  for (const std::string text : {"", "gpu", "cuda:", "cuda:x", "cuda:-1", "cuda:1a", "CUDA:0",
                                 "cuda0", "host:0", "cuda:99999"}) {
    auto spec = ParseDeviceSpec(text);
    ASSERT_FALSE(spec.ok()) << "'" << text << "' was accepted";
    EXPECT_EQ(spec.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(spec.status().message(), HasSubstr("'" + text + "'"));
    EXPECT_THAT(spec.status().message(), HasSubstr("cuda:N"));
  }
}

TEST(DeviceSpecTest, BackendDefaultsFollowTheMemory) {
  EXPECT_EQ(DefaultBackendFor(DeviceSpec{}), "ucx");
  EXPECT_EQ(DefaultBackendFor(DeviceSpec{pool::MemoryKind::kCuda, 1}), "cuda_ipc");
}

TEST(DeviceSpecTest, CheckNamesTheDevicesPresent) {
  EXPECT_TRUE(CheckDeviceSpec(DeviceSpec{}).ok());
  const cuda::DeviceCountResult devices = cuda::DeviceCount();
  const Status cuda0 = CheckDeviceSpec(DeviceSpec{pool::MemoryKind::kCuda, 0});
  const Status beyond = CheckDeviceSpec(DeviceSpec{pool::MemoryKind::kCuda, 64});
  ASSERT_FALSE(beyond.ok());
  if (devices.count == 0) {
    ASSERT_FALSE(cuda0.ok());
    EXPECT_EQ(cuda0.code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(cuda0.message(), HasSubstr("no usable CUDA device"));
    EXPECT_THAT(cuda0.message(), HasSubstr(devices.reason));
    EXPECT_THAT(cuda0.message(), HasSubstr("--device host"));
    EXPECT_THAT(DescribeCudaDevices(), HasSubstr("none"));
  } else {
    EXPECT_TRUE(cuda0.ok()) << cuda0.ToString();
    EXPECT_EQ(beyond.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(beyond.message(), HasSubstr("cuda:64 does not exist"));
    EXPECT_THAT(beyond.message(), HasSubstr("cuda:0"));
    EXPECT_FALSE(CudaDeviceName(0).empty());
  }
}

// ---- the page-list arena's bookkeeping -----------------------------------------------------

TEST(RangeAllocatorTest, HandsOutDisjointRunsAndCoalescesOnFree) {
  RangeAllocator arena(100);
  auto a = arena.Allocate(30);
  auto b = arena.Allocate(30);
  auto c = arena.Allocate(40);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->offset, 0);
  EXPECT_EQ(b->offset, 30);
  EXPECT_EQ(c->offset, 60);
  EXPECT_EQ(arena.free_units(), 0);
  auto full = arena.Allocate(1);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.status().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(full.status().message(), HasSubstr("retry"));

  arena.Free(*b);  // a hole in the middle
  auto too_long = arena.Allocate(31);
  EXPECT_EQ(too_long.status().code(), StatusCode::kResourceExhausted);
  arena.Free(*a);  // merges with the hole after it
  EXPECT_EQ(arena.free_runs(), 1u);
  auto merged = arena.Allocate(60);
  ASSERT_TRUE(merged.ok()) << merged.status().ToString();
  EXPECT_EQ(merged->offset, 0);
  arena.Free(*merged);
  arena.Free(*c);  // merges with the run before it
  EXPECT_EQ(arena.free_runs(), 1u);
  EXPECT_EQ(arena.free_units(), 100);
}

TEST(RangeAllocatorTest, RefusesImpossibleLengths) {
  RangeAllocator arena(8);
  EXPECT_EQ(arena.Allocate(0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(arena.Allocate(-1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(arena.Allocate(9).status().code(), StatusCode::kInvalidArgument);
}

// Random allocate/free churn: runs never overlap, and once everything is freed the arena is
// one run again (no leaked or double-counted units).
TEST(RangeAllocatorTest, ChurnKeepsRunsDisjointAndEndsWhole) {
  constexpr int64_t kCapacity = 1000;
  RangeAllocator arena(kCapacity);
  std::mt19937 rng(11);
  std::vector<Range> live;
  std::vector<int> owner(kCapacity, -1);
  for (int step = 0; step < 5000; ++step) {
    if (!live.empty() && (rng() % 2 == 0 || live.size() > 40)) {
      const size_t i = rng() % live.size();
      for (int64_t u = live[i].offset; u < live[i].offset + live[i].length; ++u) owner[u] = -1;
      arena.Free(live[i]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      continue;
    }
    auto r = arena.Allocate(1 + static_cast<int64_t>(rng() % 60));
    if (!r.ok()) {
      ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
      continue;
    }
    for (int64_t u = r->offset; u < r->offset + r->length; ++u) {
      ASSERT_GE(u, 0);
      ASSERT_LT(u, kCapacity);
      ASSERT_EQ(owner[u], -1) << "unit " << u << " handed out twice (step " << step << ")";
      owner[u] = step;
    }
    live.push_back(*r);
  }
  for (const Range& r : live) arena.Free(r);
  EXPECT_EQ(arena.free_units(), kCapacity);
  EXPECT_EQ(arena.free_runs(), 1u);
}

// ---- which pools and backends the agent takes ----------------------------------------------

AgentOptions SmallAgent(pool::MemoryKind memory, const std::string& backend) {
  AgentOptions o;
  o.name = "agent-test";
  o.prefill = false;  // no listening port needed
  o.pool.size = 256;
  o.pool.page_size = 16;
  o.pool.head_num = 2;
  o.pool.head_dim = 64;
  o.pool.layer_num = 2;
  o.pool.memory = memory;
  o.pool.pin_host_memory = false;
  o.engine.backend = *transfer::DefaultBackendConfig(backend);
  return o;
}

TEST(AgentTest, CudaPoolWithLoopbackIsRefusedWithWhatToUse) {
  auto agent = Agent::Create(SmallAgent(pool::MemoryKind::kCuda, "loopback"));
  ASSERT_FALSE(agent.ok());
  EXPECT_EQ(agent.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(agent.status().message(), HasSubstr("loopback"));
  EXPECT_THAT(agent.status().message(), HasSubstr("cuda_ipc or ucx"));
}

TEST(AgentTest, CudaPoolWithoutDeviceSaysSo) {
  if (cuda::HasDevice()) GTEST_SKIP() << "this process sees a CUDA device";
  auto agent = Agent::Create(SmallAgent(pool::MemoryKind::kCuda, "ucx"));
  ASSERT_FALSE(agent.ok());
  EXPECT_EQ(agent.status().code(), StatusCode::kUnavailable) << agent.status().ToString();
}

TEST(AgentTest, HostPoolAgentStillRuns) {
  auto agent = Agent::Create(SmallAgent(pool::MemoryKind::kHost, "loopback"));
  ASSERT_TRUE(agent.ok()) << agent.status().ToString();
  EXPECT_EQ((*agent)->pool().memory_kind(), pool::MemoryKind::kHost);
  EXPECT_EQ((*agent)->Stats().total_pages, 256 / 16);
  EXPECT_EQ((*agent)->Stats().free_pages, 256 / 16);
}

// ---- the address an agent advertises -------------------------------------------------------

TEST(AdvertiseTest, ParsesHostWithAndWithoutPort) {
  auto host = ParseAdvertise("10.0.0.5");
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_EQ(host->host, "10.0.0.5");
  EXPECT_FALSE(host->port.has_value());
  auto named = ParseAdvertise("node-3:7000");
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(named->host, "node-3");
  EXPECT_EQ(named->port, 7000);
  auto v6 = ParseAdvertise("[fd00::5]:7001");
  ASSERT_TRUE(v6.ok()) << v6.status();
  EXPECT_EQ(v6->host, "fd00::5");
  EXPECT_EQ(v6->port, 7001);
  auto bare_v6 = ParseAdvertise("fd00::5");
  ASSERT_TRUE(bare_v6.ok()) << bare_v6.status();
  EXPECT_EQ(bare_v6->host, "fd00::5");
  EXPECT_FALSE(bare_v6->port.has_value());
}

TEST(AdvertiseTest, RefusesWildcardsEmptyHostsAndBadPortsNamingTheText) {
  for (const std::string text : {"0.0.0.0", "0.0.0.0:7000", "::", "[::]:7000", ":7000", ""}) {
    auto parsed = ParseAdvertise(text);
    ASSERT_FALSE(parsed.ok()) << "'" << text << "' was accepted";
    EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(parsed.status().message(), HasSubstr("--advertise '" + text + "'"));
    EXPECT_THAT(parsed.status().message(), HasSubstr("other hosts reach"));
  }
  for (const std::string text : {"10.0.0.5:0", "10.0.0.5:70000", "10.0.0.5:x", "10.0.0.5:"}) {
    auto parsed = ParseAdvertise(text);
    ASSERT_FALSE(parsed.ok()) << "'" << text << "' was accepted";
    EXPECT_THAT(parsed.status().message(), HasSubstr("not a number in 1..65535"));
  }
}

TEST(AdvertiseTest, AdvertiseOverridesTheListenAddressAndTheBoundPortIsTheDefault) {
  AdvertiseInputs in;
  in.listen_host = "0.0.0.0";
  in.bound_port = 7300;
  in.advertise = Advertise{"10.1.2.3", std::nullopt};
  EXPECT_EQ(*AdvertisedControlAddress(in), "10.1.2.3:7300");
  in.advertise = Advertise{"10.1.2.3", 9000};
  EXPECT_EQ(*AdvertisedControlAddress(in), "10.1.2.3:9000");
  in.advertise = Advertise{"fd00::7", std::nullopt};
  EXPECT_EQ(*AdvertisedControlAddress(in), "[fd00::7]:7300");
  in.advertise.reset();
  in.listen_host = "10.4.5.6";
  EXPECT_EQ(*AdvertisedControlAddress(in), "10.4.5.6:7300");
}

// A wildcard listen address is never registered: the interface toward the registry is (on a
// host whose registry is on loopback, the loopback address; tests/multinode checks real ones).
TEST(AdvertiseTest, WildcardListenDerivesTheInterfaceTowardTheRegistry) {
  for (const std::string wildcard : {"0.0.0.0", "::"}) {
    AdvertiseInputs in;
    in.listen_host = wildcard;
    in.bound_port = 7300;
    in.registry_host = "127.0.0.1";
    in.registry_port = 7400;
    auto address = AdvertisedControlAddress(in);
    ASSERT_TRUE(address.ok()) << address.status();
    EXPECT_EQ(*address, "127.0.0.1:7300") << wildcard;
  }
  auto derived = OutgoingAddressToward("127.0.0.1", 9);
  ASSERT_TRUE(derived.ok()) << derived.status();
  EXPECT_FALSE(IsWildcardHost(*derived)) << *derived;
  EXPECT_TRUE(IsWildcardHost("0.0.0.0") && IsWildcardHost("::") && IsWildcardHost(""));
  EXPECT_FALSE(IsWildcardHost("127.0.0.1") || IsWildcardHost("node-3"));
}

TEST(AdvertiseTest, DecodeAgentsAdvertiseAHostAndNoPort) {
  AdvertiseInputs in;
  in.prefill = false;
  in.listen_host = "127.0.0.1";
  in.registry_host = "127.0.0.1";
  in.registry_port = 7400;
  EXPECT_EQ(*AdvertisedControlAddress(in), "127.0.0.1:0");
  in.advertise = Advertise{"10.1.2.3", std::nullopt};
  EXPECT_EQ(*AdvertisedControlAddress(in), "10.1.2.3:0");
  in.advertise = Advertise{"10.1.2.3", 9000};
  auto refused = AdvertisedControlAddress(in);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("give --advertise 10.1.2.3"));
}

TEST(AdvertiseTest, UnresolvableRegistrySaysToGiveAdvertise) {
  auto derived = OutgoingAddressToward("no-such-host.invalid", 7000);
  ASSERT_FALSE(derived.ok());
  EXPECT_EQ(derived.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(derived.status().message(), HasSubstr("no-such-host.invalid"));
  EXPECT_THAT(derived.status().message(), HasSubstr("--advertise HOST[:PORT]"));
}

// Starts kvt-agent (prefill) with `extra` flags against an in-process registry and returns the
// control address its entry carries, and the engine port from its ready file.
struct Registered {
  std::string control_address;
  uint16_t engine_port = 0;
};

StatusOr<Registered> RegisterPrefillAgent(const std::vector<std::string>& extra) {
  // A wildcard --listen needs a cluster token; the agent and the registry share this one.
  constexpr const char* kToken = "advertise-test-token-0123456789";
  setenv("KVT_CLUSTER_TOKEN", kToken, 1);
  struct Unset {
    ~Unset() { unsetenv("KVT_CLUSTER_TOKEN"); }
  } unset;
  transfer::RegistryServerOptions options;
  options.server.cluster_token = kToken;
  options.heartbeat_interval = std::chrono::milliseconds(200);
  KVT_ASSIGN_OR_RETURN(auto registry, transfer::RegistryServer::Create(options));
  const std::string dir = ::testing::TempDir() + "/kvt-agent-advertise-" +
                          std::to_string(getpid()) + "-" + std::to_string(registry->port());
  std::filesystem::create_directories(dir);
  const std::string ready = dir + "/ready.json";
  std::vector<std::string> argv = {KVT_AGENT_PATH,
                                   "--role",
                                   "prefill",
                                   "--name",
                                   "advertised",
                                   "--device",
                                   "host",
                                   "--backend",
                                   "loopback",
                                   "--layers",
                                   "2",
                                   "--heads",
                                   "2",
                                   "--head-dim",
                                   "64",
                                   "--tokens",
                                   "256",
                                   "--bootstrap",
                                   "127.0.0.1:" + std::to_string(registry->port()),
                                   "--ready-file",
                                   ready,
                                   "--exit-with-parent"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  KVT_ASSIGN_OR_RETURN(auto child, ChildProcess::Spawn(argv, dir + "/agent.log"));
  auto text = WaitReadyFile(ready, std::chrono::seconds(30), child.pid());
  if (!text.ok()) return text.status().WithContext(LogTail(dir + "/agent.log", 20));
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, false);
  auto entries = registry->Lookup("advertised", transfer::AgentRole::kPrefill, std::nullopt);
  child.Stop();
  std::filesystem::remove_all(dir);
  if (entries.size() != 1)
    return Internal("expected one entry, found " + std::to_string(entries.size()));
  return Registered{entries[0].control_address, j.value("engine_port", uint16_t{0})};
}

TEST(KvtAgentCliTest, AdvertiseIsWhatTheRegistryEntryCarries) {
  auto host_only = RegisterPrefillAgent({"--advertise", "10.9.8.7"});
  ASSERT_TRUE(host_only.ok()) << host_only.status();
  ASSERT_NE(host_only->engine_port, 0);
  EXPECT_EQ(host_only->control_address, "10.9.8.7:" + std::to_string(host_only->engine_port));
  auto with_port = RegisterPrefillAgent({"--advertise", "node-7.example:7777"});
  ASSERT_TRUE(with_port.ok()) << with_port.status();
  EXPECT_EQ(with_port->control_address, "node-7.example:7777");
}

TEST(KvtAgentCliTest, WildcardListenIsNeverRegistered) {
  auto registered = RegisterPrefillAgent({"--listen", "0.0.0.0:0"});
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_THAT(registered->control_address, ::testing::Not(HasSubstr("0.0.0.0")));
  // The registry is on loopback here, so the interface toward it is.
  EXPECT_EQ(registered->control_address, "127.0.0.1:" + std::to_string(registered->engine_port));
}

TEST(KvtAgentCliTest, BadAdvertiseIsRefusedBeforeAnythingStarts) {
  const ToolResult wildcard = RunTool(KVT_AGENT_PATH, "--advertise 0.0.0.0:7000");
  EXPECT_EQ(wildcard.exit_code, 1) << wildcard.err;
  EXPECT_THAT(wildcard.err, HasSubstr("--advertise '0.0.0.0:7000'"));
  EXPECT_THAT(wildcard.err, HasSubstr("wildcard"));
  const ToolResult decode_port = RunTool(KVT_AGENT_PATH, "--role decode --advertise 10.0.0.5:7000");
  EXPECT_EQ(decode_port.exit_code, 1) << decode_port.err;
  EXPECT_THAT(decode_port.err, HasSubstr("give --advertise 10.0.0.5"));
}

// ---- a decode agent checks the prefill entry's layout before any request --------------------

// A control server that only counts connections and messages, and answers nothing (a hello
// to it waits for its timeout): the stand-in for a prefill engine.
class CountingHandler : public control::ControlHandler {
 public:
  void OnConnect(control::ConnectionId, const control::ConnectionInfo&) override { ++connects; }
  void OnMessage(control::ConnectionId, const v1::Envelope&) override { ++messages; }
  void OnDisconnect(control::ConnectionId, const Status&) override {}
  std::atomic<int> connects{0};
  std::atomic<int> messages{0};
};

transfer::AgentLayout LayoutOf(const AgentOptions& o) {
  return transfer::AgentLayout{
      .num_layers = static_cast<uint32_t>(o.pool.layer_num),
      .page_size = static_cast<uint32_t>(o.pool.page_size),
      .dtype = o.pool.dtype,
      .head_num = static_cast<uint32_t>(o.pool.head_num),
      .head_dim = static_cast<uint32_t>(o.pool.head_dim),
      .tp_rank = 0,
      .tp_size = 1,
      .num_pages = static_cast<uint64_t>(o.pool.size / o.pool.page_size + 1),
      .num_tokens = static_cast<uint64_t>(o.pool.size)};
}

TEST(AgentRpcTest, DecodeRefusesAnIncompatiblePrefillEntryBeforeAnyRequest) {
  auto registry = transfer::RegistryServer::Create(transfer::RegistryServerOptions{});
  ASSERT_TRUE(registry.ok()) << registry.status();
  CountingHandler prefill_engine;
  auto prefill_server =
      control::ControlServer::Create(control::ControlServerOptions{}, &prefill_engine);
  ASSERT_TRUE(prefill_server.ok()) << prefill_server.status();

  const AgentOptions decode_options = SmallAgent(pool::MemoryKind::kHost, "loopback");
  transfer::AgentEntry prefill;
  prefill.name = "other-model";
  prefill.role = transfer::AgentRole::kPrefill;
  prefill.control_address = "127.0.0.1:" + std::to_string((*prefill_server)->port());
  prefill.layout = LayoutOf(decode_options);
  prefill.layout->page_size = 32;
  prefill.layout->head_dim = 128;
  prefill.layout->num_pages = 256 / 32 + 1;
  transfer::RegistryClientOptions client;
  client.port = (*registry)->port();
  auto registration = transfer::RegistryClient::Start(client, prefill);
  ASSERT_TRUE(registration.ok()) << registration.status();

  auto agent = Agent::Create(decode_options);
  ASSERT_TRUE(agent.ok()) << agent.status();
  AgentRpc rpc(agent->get(), "decode-test", /*prefill=*/false, 0, 1, client,
               LayoutOf(decode_options));
  auto rpc_server = rpc.Serve(control::ControlServerOptions{});
  ASSERT_TRUE(rpc_server.ok()) << rpc_server.status();
  auto driver =
      RpcClient::Connect("127.0.0.1", (*rpc_server)->port(), "driver", std::chrono::seconds(5));
  ASSERT_TRUE(driver.ok()) << driver.status();
  v1::Envelope submit;
  submit.mutable_submit_request()->set_room_id("room-1");
  submit.mutable_submit_request()->set_num_tokens(20);
  submit.mutable_submit_request()->set_prefill_name("other-model");
  auto reply = driver->Call(submit, std::chrono::seconds(10));
  ASSERT_TRUE(reply.ok()) << reply.status();
  ASSERT_TRUE(reply->has_submit_reply());
  EXPECT_EQ(reply->submit_reply().status(), v1::STATUS_CODE_FAILED_PRECONDITION);
  const std::string& message = reply->submit_reply().message();
  EXPECT_THAT(message, HasSubstr("prefill agent 'other-model'"));
  EXPECT_THAT(message, HasSubstr("page_size decode=16 prefill=32"));
  EXPECT_THAT(message, HasSubstr("head_dim decode=64 prefill=128"));
  // Nothing reached the prefill agent: no connection, no hello, no request.
  EXPECT_EQ(prefill_engine.connects.load(), 0);
  EXPECT_EQ(prefill_engine.messages.load(), 0);
  EXPECT_EQ((*agent)->Stats().submitted, 0u);
  rpc.Stop();
}

// A QueryRequests whose reply would not fit one frame is answered with an error saying how many
// room_ids to name per call, and the connection keeps serving.
TEST(AgentRpcTest, AQueryWhoseReplyWouldNotFitSaysHowManyRoomsToName) {
  auto agent = Agent::Create(SmallAgent(pool::MemoryKind::kHost, "loopback"));
  ASSERT_TRUE(agent.ok()) << agent.status();
  AgentRpc rpc(agent->get(), "decode-test", /*prefill=*/false, 0, 1, std::nullopt, std::nullopt);
  control::ControlServerOptions options;
  options.limits.max_frame_bytes = 4096;
  auto rpc_server = rpc.Serve(options);
  ASSERT_TRUE(rpc_server.ok()) << rpc_server.status();
  auto driver =
      RpcClient::Connect("127.0.0.1", (*rpc_server)->port(), "driver", std::chrono::seconds(5));
  ASSERT_TRUE(driver.ok()) << driver.status();
  v1::Envelope query;
  for (int i = 0; i < 200; ++i) {
    std::string room = "r";  // appended: GCC 12 warns falsely (-Wrestrict) on "r" + ...
    room += std::to_string(i);
    query.mutable_query_requests()->add_room_ids(room);
  }
  auto reply = driver->Call(query, std::chrono::seconds(10));
  ASSERT_FALSE(reply.ok()) << "a reply came: " << reply->ShortDebugString();
  EXPECT_EQ(reply.status().code(), StatusCode::kResourceExhausted) << reply.status();
  EXPECT_THAT(reply.status().message(), HasSubstr("QueryRequests names 200 rooms"));
  EXPECT_THAT(reply.status().message(), HasSubstr("4096 bytes"));
  EXPECT_THAT(reply.status().message(), HasSubstr("room_ids per call"));
  // Still serving: a query that fits is answered.
  v1::Envelope small;
  small.mutable_query_requests()->add_room_ids("r1");
  auto answered = driver->Call(small, std::chrono::seconds(10));
  ASSERT_TRUE(answered.ok()) << answered.status();
  ASSERT_EQ(answered->query_requests_reply().reports_size(), 1);
  EXPECT_EQ(answered->query_requests_reply().reports(0).status(), v1::STATUS_CODE_NOT_FOUND);
  rpc.Stop();
}

// ---- aborts, drivers that leave, and the prefill address cache ------------------------------

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// Polls `done` every 5 ms until it holds or `timeout` has passed; its last answer.
template <typename Condition>
bool WaitFor(Condition done, std::chrono::milliseconds timeout) {
  const auto until = Clock::now() + timeout;
  while (!done()) {
    if (Clock::now() >= until) return done();
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

// A loopback TCP proxy in front of `upstream_port` that holds every connection's bytes until
// Open(): a connect through it stays under way (no challenge, no hello answer) for as long as a
// test needs, then completes as a direct one would.
class GatedProxy {
 public:
  explicit GatedProxy(uint16_t upstream_port) : upstream_port_(upstream_port) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (listen_fd_ < 0 || bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        listen(listen_fd_, 16) != 0 ||
        getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      return;
    }
    port_ = ntohs(addr.sin_port);
    threads_.emplace_back([this] { AcceptLoop(); });
  }
  ~GatedProxy() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();  // every loop looks at stop_ at least every 20 ms
    for (int fd : fds_) close(fd);
    if (listen_fd_ >= 0) close(listen_fd_);
  }
  GatedProxy(const GatedProxy&) = delete;
  GatedProxy& operator=(const GatedProxy&) = delete;

  uint16_t port() const { return port_; }  // 0: the listener could not be set up
  int accepted() const { return accepted_.load(); }
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }

 private:
  bool Stopping() {
    std::lock_guard<std::mutex> lock(mu_);
    return stop_;
  }

  void AcceptLoop() {
    while (!Stopping()) {
      pollfd p{listen_fd_, POLLIN, 0};
      if (poll(&p, 1, 20) <= 0) continue;
      const int client = accept(listen_fd_, nullptr, nullptr);
      if (client < 0) continue;
      const int server = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in up{};
      up.sin_family = AF_INET;
      up.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      up.sin_port = htons(upstream_port_);
      if (server < 0 || connect(server, reinterpret_cast<sockaddr*>(&up), sizeof(up)) != 0) {
        close(client);
        if (server >= 0) close(server);
        continue;
      }
      fds_.push_back(client);
      fds_.push_back(server);
      ++accepted_;
      pumps_.emplace_back([this, client, server] { Pump(client, server); });
      pumps_.emplace_back([this, client, server] { Pump(server, client); });
    }
    for (std::thread& t : pumps_) t.join();
  }

  void Pump(int from, int to) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return open_ || stop_; });
    }
    char buffer[16384];
    while (!Stopping()) {
      pollfd p{from, POLLIN, 0};
      if (poll(&p, 1, 20) <= 0) continue;
      const ssize_t n = read(from, buffer, sizeof(buffer));
      if (n <= 0) {
        shutdown(to, SHUT_WR);
        return;
      }
      for (ssize_t sent = 0; sent < n;) {
        const ssize_t w = write(to, buffer + sent, static_cast<size_t>(n - sent));
        if (w <= 0) return;
        sent += w;
      }
    }
  }

  const uint16_t upstream_port_;
  int listen_fd_ = -1;
  uint16_t port_ = 0;
  std::atomic<int> accepted_{0};
  // The accept thread's: it starts the pumps and joins them before it ends.
  std::vector<int> fds_;
  std::vector<std::thread> pumps_;
  std::vector<std::thread> threads_;  // the accept thread
  std::mutex mu_;                     // guards open_ and stop_
  std::condition_variable cv_;
  bool open_ = false;
  bool stop_ = false;
};

// A loopback port nobody listens on: one the kernel picked, released again.
uint16_t UnusedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  uint16_t port = 0;
  if (fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  if (fd >= 0) close(fd);
  return port;
}

// Joins the RPC's submit workers before the server they reply through goes, on every return
// (declared after the server).
struct StopWorkers {
  AgentRpc* rpc;
  ~StopWorkers() { rpc->Stop(); }
};

AgentOptions PrefillAgent() {
  AgentOptions o = SmallAgent(pool::MemoryKind::kHost, "loopback");
  o.name = "prefill-test";
  o.prefill = true;
  return o;
}

v1::Envelope SubmitEnvelope(uint64_t id, const std::string& room, uint64_t tokens,
                            const std::string& prefill_address) {
  v1::Envelope e;
  e.set_id(id);
  auto* s = e.mutable_submit_request();
  s->set_room_id(room);
  s->set_num_tokens(tokens);
  if (!prefill_address.empty()) s->set_prefill_address(prefill_address);
  return e;
}

std::string Loopback(uint16_t port) { return "127.0.0.1:" + std::to_string(port); }

// A driver connection that may have many calls under way (RpcClient has one at a time).
StatusOr<std::unique_ptr<control::ControlClient>> PipelinedDriver(uint16_t port,
                                                                  const std::string& name) {
  control::ControlClientOptions o;
  o.port = port;
  o.client_id = name;
  o.role = v1::ROLE_TOOL;
  return control::ControlClient::Connect(o);
}

StatusOr<v1::SubmitReply> AbortRoomCall(RpcClient& rpc, const std::string& room,
                                        const std::string& reason) {
  v1::Envelope abort;
  abort.mutable_abort_room()->set_room_id(room);
  abort.mutable_abort_room()->set_reason(reason);
  KVT_ASSIGN_OR_RETURN(v1::Envelope reply, rpc.Call(abort, 10s));
  if (!reply.has_submit_reply()) return Internal("AbortRoom answered " + reply.ShortDebugString());
  return reply.submit_reply();
}

StatusOr<v1::RequestReport> ReportOf(RpcClient& rpc, const std::string& room) {
  v1::Envelope query;
  query.mutable_query_requests()->add_room_ids(room);
  KVT_ASSIGN_OR_RETURN(v1::Envelope reply, rpc.Call(query, 10s));
  if (reply.query_requests_reply().reports_size() != 1) {
    return Internal("QueryRequests answered " + reply.ShortDebugString());
  }
  return reply.query_requests_reply().reports(0);
}

// One prefill stand-in per submit worker, none answering a hello: a submit to each keeps one
// of the decode agent's submit workers connecting until the stand-ins stop.
struct BusyWorkers {
  std::vector<std::unique_ptr<CountingHandler>> handlers;
  std::vector<std::unique_ptr<control::ControlServer>> servers;
  std::unique_ptr<control::ControlClient> driver;

  Status Occupy(uint16_t rpc_port) {
    for (size_t i = 0; i < AgentRpc::kSubmitWorkers; ++i) {
      handlers.push_back(std::make_unique<CountingHandler>());
      KVT_ASSIGN_OR_RETURN(
          auto server,
          control::ControlServer::Create(control::ControlServerOptions{}, handlers.back().get()));
      servers.push_back(std::move(server));
    }
    KVT_ASSIGN_OR_RETURN(driver, PipelinedDriver(rpc_port, "busy-driver"));
    for (size_t i = 0; i < servers.size(); ++i) {
      KVT_RETURN_IF_ERROR(driver->Send(
          SubmitEnvelope(i + 1, "busy-" + std::to_string(i), 16, Loopback(servers[i]->port()))));
    }
    // Each stand-in got its hello: every worker is connecting.
    const bool all = WaitFor(
        [&] {
          int hellos = 0;
          for (const auto& h : handlers) hellos += h->messages.load();
          return hellos == static_cast<int>(handlers.size());
        },
        20s);
    return all ? OkStatus() : DeadlineExceeded("the busy submits did not all reach their peers");
  }

  // Ends the connects (their submits fail) and takes their replies.
  Status Release() {
    for (auto& server : servers) server->Stop();
    for (size_t i = 0; i < servers.size(); ++i) KVT_RETURN_IF_ERROR(driver->Receive(20s).status());
    return OkStatus();
  }
};

// An AbortRoom reaches a submit still waiting for a worker: the abort is answered OK, the
// submit is answered ABORTED at once (not when a worker frees up), and the room's report says
// it was aborted; a second abort is told the room already ended.
TEST(AgentRpcTest, AbortOfAQueuedSubmitAnswersItAndReportsTheAbort) {
  AgentOptions options = SmallAgent(pool::MemoryKind::kHost, "loopback");
  options.engine.hello_timeout = 30s;  // the busy submits end when their stand-ins stop
  auto agent = Agent::Create(options);
  ASSERT_TRUE(agent.ok()) << agent.status();
  AgentRpc rpc(agent->get(), "decode-test", /*prefill=*/false, 0, 1, std::nullopt, std::nullopt);
  auto rpc_server = rpc.Serve(control::ControlServerOptions{});
  ASSERT_TRUE(rpc_server.ok()) << rpc_server.status();
  StopWorkers stop_workers{&rpc};
  BusyWorkers busy;
  const Status occupied = busy.Occupy((*rpc_server)->port());
  ASSERT_TRUE(occupied.ok()) << occupied;

  auto driver = PipelinedDriver((*rpc_server)->port(), "driver");
  ASSERT_TRUE(driver.ok()) << driver.status();
  ASSERT_TRUE((*driver)->Send(SubmitEnvelope(77, "queued-room", 40, "127.0.0.1:1")).ok());
  auto observer = RpcClient::Connect("127.0.0.1", (*rpc_server)->port(), "observer", 5s);
  ASSERT_TRUE(observer.ok()) << observer.status();
  EXPECT_TRUE(WaitFor(
      [&] {
        auto r = ReportOf(*observer, "queued-room");
        return r.ok() && r->state() == v1::REQUEST_STATE_BOOTSTRAPPING;
      },
      10s))
      << "the queued room is not reported as bootstrapping";

  auto aborted = AbortRoomCall(*observer, "queued-room", "the user cancelled");
  ASSERT_TRUE(aborted.ok()) << aborted.status();
  EXPECT_EQ(aborted->status(), v1::STATUS_CODE_OK) << aborted->message();
  auto submit_reply = (*driver)->Receive(5s);  // the workers are all still connecting
  ASSERT_TRUE(submit_reply.ok()) << "the aborted submit was not answered: "
                                 << submit_reply.status();
  EXPECT_EQ(submit_reply->reply_to(), 77u);
  EXPECT_EQ(submit_reply->submit_reply().status(), v1::STATUS_CODE_ABORTED)
      << submit_reply->ShortDebugString();
  EXPECT_THAT(submit_reply->submit_reply().message(), HasSubstr("the user cancelled"));

  auto report = ReportOf(*observer, "queued-room");
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->state(), v1::REQUEST_STATE_FAILED);
  EXPECT_EQ(report->status(), v1::STATUS_CODE_ABORTED);
  EXPECT_THAT(report->message(), HasSubstr("room 'queued-room' was aborted before it started"));
  EXPECT_THAT(report->message(), HasSubstr("the user cancelled"));

  auto again = AbortRoomCall(*observer, "queued-room", "twice");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->status(), v1::STATUS_CODE_FAILED_PRECONDITION) << again->message();
  EXPECT_THAT(again->message(), HasSubstr("room 'queued-room' already ended (Failed: Aborted"));

  const Status released = busy.Release();
  EXPECT_TRUE(released.ok()) << released;
  EXPECT_EQ((*agent)->Stats().submitted, 0u);
  EXPECT_EQ((*agent)->Stats().free_pages, (*agent)->Stats().total_pages);
}

// An AbortRoom reaches a submit that is connecting to its prefill agent: the abort is answered
// OK and reported at once, and when the connect completes the submit is answered ABORTED
// without its request reaching either engine.
TEST(AgentRpcTest, AbortWhileConnectingStopsTheSubmitBeforeItReachesThePeer) {
  auto prefill = Agent::Create(PrefillAgent());
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  auto decode = Agent::Create(SmallAgent(pool::MemoryKind::kHost, "loopback"));
  ASSERT_TRUE(decode.ok()) << decode.status();
  GatedProxy proxy((*prefill)->engine_port());
  ASSERT_NE(proxy.port(), 0);
  AgentRpc rpc(decode->get(), "decode-test", /*prefill=*/false, 0, 1, std::nullopt, std::nullopt);
  auto rpc_server = rpc.Serve(control::ControlServerOptions{});
  ASSERT_TRUE(rpc_server.ok()) << rpc_server.status();
  StopWorkers stop_workers{&rpc};
  auto driver = PipelinedDriver((*rpc_server)->port(), "driver");
  ASSERT_TRUE(driver.ok()) << driver.status();
  ASSERT_TRUE(
      (*driver)->Send(SubmitEnvelope(5, "connecting-room", 40, Loopback(proxy.port()))).ok());
  ASSERT_TRUE(WaitFor([&] { return proxy.accepted() == 1; }, 10s)) << "no connect came";

  auto observer = RpcClient::Connect("127.0.0.1", (*rpc_server)->port(), "observer", 5s);
  ASSERT_TRUE(observer.ok()) << observer.status();
  auto aborted = AbortRoomCall(*observer, "connecting-room", "the user cancelled");
  ASSERT_TRUE(aborted.ok()) << aborted.status();
  EXPECT_EQ(aborted->status(), v1::STATUS_CODE_OK) << aborted->message();
  auto report = ReportOf(*observer, "connecting-room");
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->state(), v1::REQUEST_STATE_FAILED);
  EXPECT_EQ(report->status(), v1::STATUS_CODE_ABORTED);
  EXPECT_THAT(report->message(), HasSubstr("the user cancelled"));

  proxy.Open();  // the connect completes now
  auto submit_reply = (*driver)->Receive(20s);
  ASSERT_TRUE(submit_reply.ok()) << submit_reply.status();
  EXPECT_EQ(submit_reply->submit_reply().status(), v1::STATUS_CODE_ABORTED)
      << submit_reply->ShortDebugString();
  EXPECT_EQ((*decode)->engine().GetRequest("connecting-room").status().code(),
            StatusCode::kNotFound)
      << "the aborted room was handed to the decode engine";
  EXPECT_EQ((*prefill)->engine().GetRequest("connecting-room").status().code(),
            StatusCode::kNotFound)
      << "the aborted room's request reached the prefill engine";
  EXPECT_EQ((*decode)->Stats().submitted, 0u);
  EXPECT_EQ((*decode)->Stats().free_pages, (*decode)->Stats().total_pages);
}

// Through the agent's own API: a room aborted while Submit connects to its peer gives its pages
// back at once, and Submit returns Aborted once the connect completes.
TEST(AgentTest, AbortWhileConnectingFreesThePagesAtOnce) {
  auto prefill = Agent::Create(PrefillAgent());
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  auto decode = Agent::Create(SmallAgent(pool::MemoryKind::kHost, "loopback"));
  ASSERT_TRUE(decode.ok()) << decode.status();
  GatedProxy proxy((*prefill)->engine_port());
  ASSERT_NE(proxy.port(), 0);
  const int64_t total = (*decode)->Stats().total_pages;

  Status submitted = Internal("Submit did not return");
  std::thread submit([&] {
    SubmitSpec spec;
    spec.room = "connecting-room";
    spec.tokens = 40;  // 3 pages of 16 tokens
    spec.prefill_host = "127.0.0.1";
    spec.prefill_port = proxy.port();
    submitted = (*decode)->Submit(spec);
  });
  const bool connecting = WaitFor([&] { return proxy.accepted() == 1; }, 10s);
  EXPECT_TRUE(connecting) << "no connect came";
  EXPECT_EQ((*decode)->Stats().free_pages, total - 3);
  const Status aborted = (*decode)->Abort("connecting-room", "the user cancelled");
  EXPECT_TRUE(aborted.ok()) << aborted;
  EXPECT_EQ((*decode)->Stats().free_pages, total) << "the aborted room kept its pages";
  for (const RequestReport& report : (*decode)->Reports({"connecting-room"})) {
    EXPECT_EQ(report.state, transfer::RequestState::kFailed);
    EXPECT_EQ(report.status.code(), StatusCode::kAborted) << report.status;
  }

  proxy.Open();
  submit.join();  // the connect completes once the proxy passes its bytes
  EXPECT_EQ(submitted.code(), StatusCode::kAborted) << submitted;
  EXPECT_EQ((*decode)->engine().GetRequest("connecting-room").status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ((*decode)->Stats().free_pages, total);
}

// An abort of a room that already ended (failed or succeeded) says so, naming the room and how
// it ended, and leaves its report as it was.
TEST(AgentRpcTest, AbortOfAnEndedRoomSaysHowItEndedAndChangesNothing) {
  auto prefill = Agent::Create(PrefillAgent());
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  AgentRpc rpc(prefill->get(), "prefill-test", /*prefill=*/true, 0, 1, std::nullopt, std::nullopt);
  auto rpc_server = rpc.Serve(control::ControlServerOptions{});
  ASSERT_TRUE(rpc_server.ok()) << rpc_server.status();
  StopWorkers stop_workers{&rpc};
  auto driver = RpcClient::Connect("127.0.0.1", (*rpc_server)->port(), "driver", 5s);
  ASSERT_TRUE(driver.ok()) << driver.status();
  v1::Envelope submit = SubmitEnvelope(0, "late-room", 20, "");
  submit.mutable_submit_request()->set_deadline_ms(100);  // no decode side comes
  auto accepted = driver->Call(submit, 10s);
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  ASSERT_EQ(accepted->submit_reply().status(), v1::STATUS_CODE_OK)
      << accepted->submit_reply().message();
  ASSERT_TRUE(WaitFor(
      [&] {
        auto r = ReportOf(*driver, "late-room");
        return r.ok() && r->state() == v1::REQUEST_STATE_FAILED;
      },
      10s));

  auto aborted = AbortRoomCall(*driver, "late-room", "too late");
  ASSERT_TRUE(aborted.ok()) << aborted.status();
  EXPECT_EQ(aborted->status(), v1::STATUS_CODE_FAILED_PRECONDITION) << aborted->message();
  EXPECT_THAT(aborted->message(), HasSubstr("room 'late-room' already ended (Failed"));
  EXPECT_THAT(aborted->message(), HasSubstr("DeadlineExceeded"));
  auto report = ReportOf(*driver, "late-room");
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status(), v1::STATUS_CODE_DEADLINE_EXCEEDED) << report->message();

  // A success, on both sides.
  auto decode = Agent::Create(SmallAgent(pool::MemoryKind::kHost, "loopback"));
  ASSERT_TRUE(decode.ok()) << decode.status();
  SubmitSpec spec;
  spec.room = "done-room";
  spec.tokens = 40;
  spec.prefill_host = "127.0.0.1";
  spec.prefill_port = (*prefill)->engine_port();
  ASSERT_TRUE((*decode)->Submit(spec).ok());
  SubmitSpec prefill_spec;
  prefill_spec.room = "done-room";
  prefill_spec.tokens = 40;
  ASSERT_TRUE((*prefill)->Submit(prefill_spec).ok());
  for (Agent* agent : {decode->get(), prefill->get()}) {
    ASSERT_TRUE(WaitFor(
        [&] { return agent->Reports({"done-room"})[0].state == transfer::RequestState::kSuccess; },
        10s))
        << agent->Reports({"done-room"})[0].status;
    const Status again = agent->Abort("done-room", "too late");
    EXPECT_EQ(again.code(), StatusCode::kFailedPrecondition) << again;
    EXPECT_THAT(again.message(), HasSubstr("room 'done-room' already ended (Success)"));
    EXPECT_EQ(agent->Reports({"done-room"})[0].state, transfer::RequestState::kSuccess);
  }
  EXPECT_TRUE((*decode)->Reports({"done-room"})[0].verified);
}

// A driver that disconnects has its submits that no worker has started dropped: they never
// run, and their reports say why. The submits of other drivers go on.
TEST(AgentRpcTest, QueuedSubmitsOfADriverThatLeftAreDropped) {
  auto prefill = Agent::Create(PrefillAgent());
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  AgentOptions options = SmallAgent(pool::MemoryKind::kHost, "loopback");
  options.engine.hello_timeout = 30s;  // the busy submits end when their stand-ins stop
  auto decode = Agent::Create(options);
  ASSERT_TRUE(decode.ok()) << decode.status();
  AgentRpc rpc(decode->get(), "decode-test", /*prefill=*/false, 0, 1, std::nullopt, std::nullopt);
  auto rpc_server = rpc.Serve(control::ControlServerOptions{});
  ASSERT_TRUE(rpc_server.ok()) << rpc_server.status();
  StopWorkers stop_workers{&rpc};
  BusyWorkers busy;
  const Status occupied = busy.Occupy((*rpc_server)->port());
  ASSERT_TRUE(occupied.ok()) << occupied;

  const std::string prefill_address = Loopback((*prefill)->engine_port());
  const std::vector<std::string> rooms = {"left-0", "left-1", "left-2"};
  {
    auto leaving = PipelinedDriver((*rpc_server)->port(), "leaving-driver");
    ASSERT_TRUE(leaving.ok()) << leaving.status();
    for (size_t i = 0; i < rooms.size(); ++i) {
      ASSERT_TRUE((*leaving)->Send(SubmitEnvelope(i + 1, rooms[i], 16, prefill_address)).ok());
    }
    (*leaving)->Close();
  }
  auto observer = RpcClient::Connect("127.0.0.1", (*rpc_server)->port(), "observer", 5s);
  ASSERT_TRUE(observer.ok()) << observer.status();
  for (const std::string& room : rooms) {
    StatusOr<v1::RequestReport> report = NotFound("not asked");
    EXPECT_TRUE(WaitFor(
        [&] {
          report = ReportOf(*observer, room);
          return report.ok() && report->state() == v1::REQUEST_STATE_FAILED &&
                 report->status() == v1::STATUS_CODE_ABORTED;
        },
        10s))
        << room << ": " << (report.ok() ? report->ShortDebugString() : report.status().ToString());
    if (report.ok()) {
      EXPECT_THAT(report->message(), HasSubstr("disconnected"));
    }
  }

  // The workers free up; a submit queued after the dropped ones runs, and they do not.
  const Status released = busy.Release();
  ASSERT_TRUE(released.ok()) << released;
  auto marker = observer->Call(SubmitEnvelope(0, "marker", 16, prefill_address), 20s);
  ASSERT_TRUE(marker.ok()) << marker.status();
  EXPECT_EQ(marker->submit_reply().status(), v1::STATUS_CODE_OK)
      << marker->submit_reply().message();
  EXPECT_EQ((*decode)->Stats().submitted, 1u);
  for (const std::string& room : rooms) {
    EXPECT_EQ((*decode)->engine().GetRequest(room).status().code(), StatusCode::kNotFound) << room;
  }
}

// A decode agent that cannot connect to the address it looked up forgets it: the next submit
// looks the prefill agent up again (it may have restarted elsewhere) instead of retrying the
// dead address for the rest of the cache's lifetime.
TEST(AgentRpcTest, AFailedConnectDropsTheCachedPrefillAddress) {
  transfer::RegistryServerOptions registry_options;
  registry_options.heartbeat_interval = 100ms;
  registry_options.missed_heartbeats = 2;
  auto registry = transfer::RegistryServer::Create(registry_options);
  ASSERT_TRUE(registry.ok()) << registry.status();
  transfer::RegistryClientOptions client;
  client.port = (*registry)->port();

  const uint16_t dead_port = UnusedPort();
  ASSERT_NE(dead_port, 0);
  const AgentOptions decode_options = SmallAgent(pool::MemoryKind::kHost, "loopback");
  transfer::AgentEntry entry;
  entry.name = "moving-prefill";
  entry.role = transfer::AgentRole::kPrefill;
  entry.control_address = Loopback(dead_port);
  entry.layout = LayoutOf(decode_options);
  auto registration = transfer::RegistryClient::Start(client, entry);
  ASSERT_TRUE(registration.ok()) << registration.status();

  AgentOptions options = decode_options;
  options.engine.hello_timeout = 300ms;  // the stand-in below never answers
  auto agent = Agent::Create(options);
  ASSERT_TRUE(agent.ok()) << agent.status();
  AgentRpc rpc(agent->get(), "decode-test", /*prefill=*/false, 0, 1, client, LayoutOf(options));
  auto rpc_server = rpc.Serve(control::ControlServerOptions{});
  ASSERT_TRUE(rpc_server.ok()) << rpc_server.status();
  StopWorkers stop_workers{&rpc};
  auto driver = RpcClient::Connect("127.0.0.1", (*rpc_server)->port(), "driver", 5s);
  ASSERT_TRUE(driver.ok()) << driver.status();
  v1::Envelope first = SubmitEnvelope(0, "room-1", 16, "");
  first.mutable_submit_request()->set_prefill_name("moving-prefill");
  auto refused = driver->Call(first, 10s);
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_EQ(refused->submit_reply().status(), v1::STATUS_CODE_UNAVAILABLE)
      << refused->submit_reply().message();

  // The prefill agent stops (removing its entry) and comes back at another address.
  registration->reset();
  ASSERT_TRUE(WaitFor(
      [&] {
        return (*registry)
            ->Lookup("moving-prefill", transfer::AgentRole::kPrefill, std::nullopt)
            .empty();
      },
      10s));
  CountingHandler stand_in;
  auto stand_in_server = control::ControlServer::Create(control::ControlServerOptions{}, &stand_in);
  ASSERT_TRUE(stand_in_server.ok()) << stand_in_server.status();
  entry.control_address = Loopback((*stand_in_server)->port());
  auto moved = transfer::RegistryClient::Start(client, entry);
  ASSERT_TRUE(moved.ok()) << moved.status();

  v1::Envelope second = SubmitEnvelope(0, "room-2", 16, "");
  second.mutable_submit_request()->set_prefill_name("moving-prefill");
  auto reply = driver->Call(second, 10s);
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(stand_in.connects.load(), 1)
      << "the second submit went to the cached dead address: " << reply->submit_reply().message();
}

// ---- kvt-agent's command line --------------------------------------------------------------

TEST(KvtAgentCliTest, BadDeviceNamesAreRefusedBeforeAnythingStarts) {
  for (const std::string device : {"gpu0", "cuda:x", "cuda:"}) {
    const ToolResult r = RunTool(KVT_AGENT_PATH, "--device " + device);
    EXPECT_EQ(r.exit_code, 1) << device << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr("--device"));
    EXPECT_THAT(r.err, HasSubstr("'" + device + "'"));
    EXPECT_THAT(r.err, HasSubstr("use 'host' or 'cuda:N'"));
  }
}

TEST(KvtAgentCliTest, CudaPoolWithLoopbackIsRefused) {
  const ToolResult r = RunTool(KVT_AGENT_PATH, "--device cuda:0 --backend loopback");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--backend loopback"));
  EXPECT_THAT(r.err, HasSubstr("--backend cuda_ipc or ucx"));
}

TEST(KvtAgentCliTest, MissingDeviceNamesWhatThereIs) {
  const cuda::DeviceCountResult devices = cuda::DeviceCount();
  const ToolResult r = RunTool(KVT_AGENT_PATH, "--device cuda:64");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  if (devices.count == 0) {
    EXPECT_THAT(r.err, HasSubstr("no usable CUDA device"));
    EXPECT_THAT(r.err, HasSubstr("--device host"));
  } else {
    EXPECT_THAT(r.err, HasSubstr("cuda:64 does not exist"));
    EXPECT_THAT(r.err, HasSubstr("cuda:0 ("));
  }
}

TEST(KvtAgentCliTest, ControlBusyPollOutsideASecondIsRefused) {
  for (const char* us : {"-5", "1000001"}) {
    const ToolResult r = RunTool(KVT_AGENT_PATH, std::string("--control-busy-poll-us ") + us);
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_THAT(r.err, HasSubstr(std::string("--control-busy-poll-us ") + us +
                                 ": must be in 0 .. 1000000"));
  }
}

TEST(KvtAgentCliTest, UcxCopyThreadsOutOfRangeAreRefused) {
  const ToolResult r = RunTool(KVT_AGENT_PATH, "--ucx-copy-threads 65");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.out + r.err, HasSubstr("--ucx-copy-threads"));
}

TEST(KvtAgentCliTest, BadUcxCudaModeIsRefused) {
  const ToolResult r = RunTool(KVT_AGENT_PATH, "--ucx-cuda-mode sometimes");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.out + r.err, HasSubstr("--ucx-cuda-mode"));
}

// Range errors name the flag, the allowed range and the value in plain numbers (CLI11's own
// validators print their double bounds with hundreds of digits).
TEST(KvtAgentCliTest, RangeErrorsSayFlagRangeAndValuePlainly) {
  struct Case {
    std::string args, flag, value, allowed;
  };
  for (const Case& c :
       {Case{"--layers 0", "--layers", "0", "1..4096"},
        Case{"--heads -3", "--heads", "-3", "1..65536"},
        Case{"--tokens 0", "--tokens", "0", ">= 1"},
        Case{"--deadline-ms 0", "--deadline-ms", "0", "1..3600000"},
        Case{"--ucx-copy-threads 65", "--ucx-copy-threads", "65", "0..64"},
        Case{"--ucx-staging-slots 0", "--ucx-staging-slots", "0", "1..4096"},
        Case{"--ucx-staging-slot-bytes 100", "--ucx-staging-slot-bytes", "100", "4096..4294967296"},
        Case{"--layer-time-us -5", "--layer-time-us", "-5", ">= 0"},
        Case{"--page-size 16x", "--page-size", "16x", "1..65536"}}) {
    const ToolResult r = RunTool(KVT_AGENT_PATH, c.args);
    EXPECT_NE(r.exit_code, 0) << c.args;
    const std::string text = r.out + r.err;
    EXPECT_THAT(text, HasSubstr(c.flag)) << c.args;
    EXPECT_THAT(text, HasSubstr(c.value)) << c.args;
    EXPECT_THAT(text, HasSubstr(c.allowed)) << c.args;
    EXPECT_THAT(text, ::testing::Not(::testing::ContainsRegex("[0-9]{20}"))) << c.args;
    EXPECT_THAT(text, ::testing::Not(HasSubstr("e+308"))) << c.args;
  }
}

TEST(KvtAgentCliTest, TpRankMustBeBelowTpSize) {
  const ToolResult r = RunTool(KVT_AGENT_PATH, "--tp-rank 2 --tp-size 2");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--tp-rank 2 is not below --tp-size 2"));
  EXPECT_THAT(r.err, HasSubstr("0..1"));
}

TEST(KvtAgentCliTest, UnknownLogLevelIsRefusedWithTheAllowedOnes) {
  // The bad --rpc is never reached when the level is checked first, as it must be.
  const ToolResult r =
      RunTool(std::string("KVT_LOG_LEVEL=verbose ") + KVT_AGENT_PATH, "--rpc 127.0.0.1:99999");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("KVT_LOG_LEVEL='verbose'"));
  EXPECT_THAT(r.err, HasSubstr("trace, debug, info, warn, error"));
}

// The errors a user can cause name flags and values, never the classes behind them.
TEST(KvtAgentCliTest, ErrorsNameNoInternalClasses) {
  for (const std::string args :
       {"--tokens 8 --page-size 16", "--dtype fp4", "--listen nowhere", "--rpc 1.2.3.4:99999",
        "--bootstrap bad", "--tp-rank 3 --tp-size 2", "--heads 0", "--role both"}) {
    const ToolResult r = RunTool(KVT_AGENT_PATH, args + " --bootstrap-wait-s 0");
    EXPECT_NE(r.exit_code, 0) << args;
    // The error is the last line; the status code's name ("InvalidArgument: ") may lead it.
    std::string text = r.out + r.err;
    while (!text.empty() && text.back() == '\n') text.pop_back();
    text = text.substr(text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1);
    std::string after_code = text;
    for (const std::string code :
         {"InvalidArgument: ", "FailedPrecondition: ", "NotFound: ", "Unavailable: ",
          "OutOfRange: ", "AlreadyExists: ", "ResourceExhausted: ", "Aborted: ",
          "DeadlineExceeded: ", "Unimplemented: ", "DataLoss: ", "Internal: "}) {
      const size_t at = after_code.find(code);
      if (at != std::string::npos) after_code.erase(at, code.size());
    }
    EXPECT_THAT(after_code, ::testing::Not(::testing::ContainsRegex("[A-Z][a-z0-9]+[A-Z][a-z]")))
        << args << ": " << text;
    EXPECT_THAT(after_code, ::testing::Not(HasSubstr("::"))) << args << ": " << text;
  }
}

// The pattern of a request depends on the shard, so pages of another TP rank never verify.
TEST(PatternIdTest, EachTpRankHasItsOwnPattern) {
  EXPECT_NE(PatternRequestId("room-1", 0), PatternRequestId("room-1", 1));
  EXPECT_NE(PatternRequestId("room-1", 1), PatternRequestId("room-1", 256));
  EXPECT_NE(PatternRequestId("room-1", 0), PatternRequestId("room-2", 0));
  EXPECT_EQ(PatternRequestId("room-1", 3), PatternRequestId("room-1", 3));
}

// A host agent started without --backend runs ucx and says so (and which memory) in its ready
// file.
TEST(KvtAgentCliTest, ReadyFileNamesMemoryAndBackend) {
  const std::string dir = ::testing::TempDir() + "/kvt-agent-cli-" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  const std::string ready = dir + "/ready.json";
  auto child = ChildProcess::Spawn(
      {KVT_AGENT_PATH, "--role", "decode", "--device", "host", "--layers", "2", "--heads", "2",
       "--head-dim", "64", "--tokens", "256", "--ready-file", ready, "--exit-with-parent"},
      dir + "/agent.log");
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  auto text = WaitReadyFile(ready, std::chrono::seconds(30), child->pid());
  ASSERT_TRUE(text.ok()) << text.status().ToString() << "\n" << LogTail(dir + "/agent.log", 20);
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << *text;
  EXPECT_EQ(j.value("memory", ""), "host") << *text;
  EXPECT_EQ(j.value("backend", ""), "ucx") << *text;
  EXPECT_FALSE(j.contains("device_name")) << *text;
  child->Stop();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvt::tools

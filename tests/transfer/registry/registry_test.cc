#include "kvt/transfer/registry.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "control/control_client.h"
#include "control/control_server.h"

namespace kvt::transfer {
namespace {

using namespace std::chrono_literals;

AgentEntry Agent(const std::string& name, AgentRole role, uint32_t rank, uint16_t port) {
  AgentEntry a;
  a.name = name;
  a.role = role;
  a.tp_rank = rank;
  a.tp_size = 2;
  a.control_address = "127.0.0.1:" + std::to_string(port);
  a.host_id = "host-a";
  a.layout = AgentLayout{.num_layers = 4,
                         .page_size = 16,
                         .dtype = DType::kFP16,
                         .head_num = 2,
                         .head_dim = 64,
                         .tp_rank = rank,
                         .tp_size = 2,
                         .num_pages = 65,
                         .num_tokens = 1024,
                         .total_kv_heads = 4};
  return a;
}

RegistryServerOptions FastRegistry(uint16_t port = 0) {
  RegistryServerOptions o;
  o.server.port = port;
  o.heartbeat_interval = 50ms;
  o.missed_heartbeats = 3;
  return o;
}

// Entries live 1 s (10 intervals of 100 ms): a refreshing entry stays live through a loaded
// machine's stalls, and one that stopped is gone within a bounded wait.
RegistryServerOptions SteadyRegistry() {
  RegistryServerOptions o;
  o.heartbeat_interval = 100ms;
  o.missed_heartbeats = 10;
  return o;
}

RegistryClientOptions ClientTo(uint16_t port) {
  RegistryClientOptions c;
  c.port = port;
  c.timeout = 2s;
  return c;
}

bool WaitUntil(const std::function<bool()>& cond, std::chrono::milliseconds limit = 3s) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < until) {
    if (cond()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return cond();
}

// Two prefill ranks of "llama-p" (ports 7000, 7001) and rank 0 of "llama-d" (7100), registered
// with the registry at `port`; `agents` keeps their registrations.
void RegisterThree(uint16_t port, std::vector<std::unique_ptr<RegistryClient>>& agents) {
  for (const AgentEntry& e : {Agent("llama-p", AgentRole::kPrefill, 0, 7000),
                              Agent("llama-p", AgentRole::kPrefill, 1, 7001),
                              Agent("llama-d", AgentRole::kDecode, 0, 7100)}) {
    auto registration = RegistryClient::Start(ClientTo(port), e);
    ASSERT_TRUE(registration.ok()) << e.name << ": " << registration.status();
    agents.push_back(std::move(registration).value());
  }
}

// The wire form of Agent(name, role, rank, port): what a RegistryClient sends for it.
v1::AgentInfo Info(const std::string& name, uint32_t rank, uint16_t port,
                   const std::string& host_id = "host-a") {
  v1::AgentInfo info;
  info.set_name(name);
  info.set_role(v1::ROLE_PREFILL);
  info.set_tp_rank(rank);
  info.set_tp_size(2);
  info.set_control_address("127.0.0.1:" + std::to_string(port));
  info.set_host_id(host_id);
  return info;
}

// A registry connection that sends RegisterAgent / UnregisterAgent itself: registrations that
// are never refreshed, several over one connection, and an agent that is killed (its connection
// closes without an unregistration).
class RawRegistrant {
 public:
  static std::unique_ptr<RawRegistrant> Connect(uint16_t port) {
    control::ControlClientOptions options;
    options.port = port;
    options.role = v1::ROLE_PREFILL;
    auto client = control::ControlClient::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    if (!client.ok()) return nullptr;
    return std::unique_ptr<RawRegistrant>(new RawRegistrant(std::move(client).value()));
  }

  // The reply's status and message (INTERNAL and the reason when there is no reply).
  std::pair<v1::StatusCode, std::string> Register(const std::string& name,
                                                  const std::string& address) {
    v1::AgentInfo agent;
    agent.set_name(name);
    agent.set_role(v1::ROLE_PREFILL);
    agent.set_tp_size(1);
    agent.set_control_address(address);
    return Register(agent);
  }
  std::pair<v1::StatusCode, std::string> Register(const v1::AgentInfo& agent) {
    v1::Envelope request;
    *request.mutable_register_agent()->mutable_agent() = agent;
    return Call(request);
  }
  std::pair<v1::StatusCode, std::string> Unregister(const v1::AgentInfo& agent) {
    v1::Envelope request;
    *request.mutable_unregister_agent()->mutable_agent() = agent;
    return Call(request);
  }

 private:
  explicit RawRegistrant(std::unique_ptr<control::ControlClient> client)
      : client_(std::move(client)) {}

  std::pair<v1::StatusCode, std::string> Call(v1::Envelope& request) {
    request.set_id(++next_id_);
    if (Status sent = client_->Send(request); !sent.ok()) {
      return {v1::STATUS_CODE_INTERNAL, sent.ToString()};
    }
    auto reply = client_->Receive(2s);
    if (!reply.ok()) return {v1::STATUS_CODE_INTERNAL, reply.status().ToString()};
    if (!reply->has_register_agent_reply()) return {v1::STATUS_CODE_INTERNAL, "no reply"};
    return {reply->register_agent_reply().status(), reply->register_agent_reply().message()};
  }

  std::unique_ptr<control::ControlClient> client_;
  uint64_t next_id_ = 0;
};

TEST(RegistryTest, RegistersAndLooksUpByNameRoleAndRank) {
  auto server = RegistryServer::Create(FastRegistry());
  ASSERT_TRUE(server.ok()) << server.status();
  const uint16_t port = (*server)->port();
  std::vector<std::unique_ptr<RegistryClient>> agents;
  ASSERT_NO_FATAL_FAILURE(RegisterThree(port, agents));
  EXPECT_EQ((*server)->size(), 3u);

  auto all = RegistryClient::Lookup(ClientTo(port), "", AgentRole::kAny, std::nullopt);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->size(), 3u);
  auto prefill = RegistryClient::Lookup(ClientTo(port), "", AgentRole::kPrefill, std::nullopt);
  ASSERT_EQ(prefill->size(), 2u);
  EXPECT_EQ((*prefill)[0].tp_rank, 0u);
  EXPECT_EQ((*prefill)[1].control_address, "127.0.0.1:7001");
  auto rank1 = RegistryClient::Lookup(ClientTo(port), "llama-p", AgentRole::kPrefill, 1u);
  ASSERT_EQ(rank1->size(), 1u);
  EXPECT_EQ((*rank1)[0].control_address, "127.0.0.1:7001");
  auto none = RegistryClient::Lookup(ClientTo(port), "nobody", AgentRole::kAny, std::nullopt);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

// Every field of an entry survives the trip to the registry and back, through the client's
// look-up and the server's.
TEST(RegistryTest, EntriesComeBackFieldByField) {
  auto server = RegistryServer::Create(FastRegistry());
  ASSERT_TRUE(server.ok()) << server.status();
  const AgentEntry sent = Agent("llama-d", AgentRole::kDecode, 1, 7101);
  auto client = RegistryClient::Start(ClientTo((*server)->port()), sent);
  ASSERT_TRUE(client.ok()) << client.status();
  auto remote = RegistryClient::Lookup(ClientTo((*server)->port()), "llama-d", AgentRole::kDecode,
                                       std::nullopt);
  ASSERT_TRUE(remote.ok()) << remote.status();
  const std::vector<AgentEntry> local = (*server)->Lookup("llama-d", AgentRole::kAny, 1u);
  for (const std::vector<AgentEntry>* found : {&std::as_const(*remote), &local}) {
    ASSERT_EQ(found->size(), 1u);
    const AgentEntry& got = found->front();
    EXPECT_EQ(got.name, sent.name);
    EXPECT_EQ(got.role, AgentRole::kDecode);
    EXPECT_EQ(got.tp_rank, 1u);
    EXPECT_EQ(got.tp_size, 2u);
    EXPECT_EQ(got.control_address, "127.0.0.1:7101");
    EXPECT_EQ(got.host_id, "host-a");
    ASSERT_TRUE(got.layout.has_value());
    EXPECT_EQ(got.layout->num_layers, 4u);
    EXPECT_EQ(got.layout->page_size, 16u);
    EXPECT_EQ(got.layout->dtype, DType::kFP16);
    EXPECT_EQ(got.layout->head_num, 2u);
    EXPECT_EQ(got.layout->head_dim, 64u);
    EXPECT_EQ(got.layout->tp_rank, 1u);
    EXPECT_EQ(got.layout->tp_size, 2u);
    EXPECT_EQ(got.layout->num_pages, 65u);
    EXPECT_EQ(got.layout->num_tokens, 1024u);
    EXPECT_EQ(got.layout->total_kv_heads, 4u);
  }

  // An entry without a layout comes back without one.
  AgentEntry bare = Agent("bare", AgentRole::kPrefill, 0, 7300);
  bare.layout.reset();
  auto bare_client = RegistryClient::Start(ClientTo((*server)->port()), bare);
  ASSERT_TRUE(bare_client.ok()) << bare_client.status();
  auto bare_found = (*server)->Lookup("bare", AgentRole::kPrefill, std::nullopt);
  ASSERT_EQ(bare_found.size(), 1u);
  EXPECT_FALSE(bare_found[0].layout.has_value());
}

// Groups and aux slots travel too.
TEST(RegistryTest, LayoutGroupsAndAuxSlotsComeBack) {
  auto server = RegistryServer::Create(FastRegistry());
  ASSERT_TRUE(server.ok()) << server.status();
  AgentEntry sent = Agent("mla-p", AgentRole::kPrefill, 0, 7200);
  sent.layout->num_layers = 64;
  sent.layout->groups = {AgentKvGroup{.shape = KvShape::kLatent,
                                      .num_layers = 61,
                                      .head_num = 1,
                                      .head_dim = 576,
                                      .dtype = DType::kBF16,
                                      .page_bytes = 16 * 576 * 2},
                         AgentKvGroup{.shape = KvShape::kKeyValue,
                                      .num_layers = 3,
                                      .head_num = 2,
                                      .head_dim = 64,
                                      .dtype = DType::kFP16,
                                      .page_bytes = 16 * 2 * 64 * 2}};
  sent.layout->aux_slot_bytes = {4, 4096, 7168};
  sent.layout->aux_slots = 512;
  auto client = RegistryClient::Start(ClientTo((*server)->port()), sent);
  ASSERT_TRUE(client.ok()) << client.status();
  auto remote = RegistryClient::Lookup(ClientTo((*server)->port()), "mla-p", AgentRole::kPrefill,
                                       std::nullopt);
  ASSERT_TRUE(remote.ok()) << remote.status();
  const std::vector<AgentEntry> local = (*server)->Lookup("mla-p", AgentRole::kAny, 0u);
  for (const std::vector<AgentEntry>* found : {&std::as_const(*remote), &local}) {
    ASSERT_EQ(found->size(), 1u);
    ASSERT_TRUE(found->front().layout.has_value());
    EXPECT_EQ(*found->front().layout, *sent.layout);
  }
}

// The engines' compatibility check, run on registry entries.
TEST(RegistryTest, CheckLayoutCompatibleNamesEveryDifferenceWithBothValues) {
  const AgentLayout decode = *Agent("d", AgentRole::kDecode, 0, 1).layout;
  EXPECT_TRUE(CheckLayoutCompatible(decode, decode, "decode", "prefill").ok());
  AgentLayout prefill = decode;
  prefill.page_size = 32;
  prefill.head_dim = 128;
  const Status refused = CheckLayoutCompatible(decode, prefill, "decode", "prefill");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(), ::testing::HasSubstr("page_size decode=16 prefill=32"));
  EXPECT_THAT(refused.message(), ::testing::HasSubstr("head_dim decode=64 prefill=128"));
  AgentLayout uint8_pool = decode;
  uint8_pool.dtype = DType::kUInt8;
  EXPECT_EQ(CheckLayoutCompatible(uint8_pool, decode, "decode", "prefill").code(),
            StatusCode::kInvalidArgument);
}

// Addresses no peer can connect to are refused on the agent's side already, naming the
// address and --advertise.
TEST(RegistryTest, RefusesUnroutableControlAddressesNamingTheFlag) {
  auto server = RegistryServer::Create(FastRegistry());
  ASSERT_TRUE(server.ok()) << server.status();
  for (const std::string address : {"0.0.0.0:7000", "[::]:7000", ":7000", "10.0.0.5:0"}) {
    AgentEntry entry = Agent("p", AgentRole::kPrefill, 0, 1);
    entry.control_address = address;
    auto client = RegistryClient::Start(ClientTo((*server)->port()), entry);
    ASSERT_FALSE(client.ok()) << address << " was registered";
    EXPECT_EQ(client.status().code(), StatusCode::kInvalidArgument) << address;
    EXPECT_THAT(client.status().message(), ::testing::HasSubstr(address)) << address;
    EXPECT_THAT(client.status().message(), ::testing::HasSubstr("--advertise HOST[:PORT]"))
        << address;
  }
  // A decode engine accepts no connections: its entry says port 0.
  AgentEntry decode = Agent("d", AgentRole::kDecode, 0, 0);
  auto decode_client = RegistryClient::Start(ClientTo((*server)->port()), decode);
  EXPECT_TRUE(decode_client.ok()) << decode_client.status();
  EXPECT_EQ((*server)->size(), 1u);
}

// The registry judges for itself what a client skipped: a raw RegisterAgent with a wildcard.
TEST(RegistryTest, RegistryItselfRefusesAWildcardAddress) {
  auto server = RegistryServer::Create(FastRegistry());
  ASSERT_TRUE(server.ok()) << server.status();
  control::ControlClientOptions options;
  options.port = (*server)->port();
  options.role = v1::ROLE_PREFILL;
  auto client = control::ControlClient::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  v1::Envelope request;
  request.set_id(1);
  v1::AgentInfo* agent = request.mutable_register_agent()->mutable_agent();
  agent->set_name("raw");
  agent->set_role(v1::ROLE_PREFILL);
  agent->set_tp_size(1);
  agent->set_control_address("0.0.0.0:7000");
  ASSERT_TRUE((*client)->Send(request).ok());
  auto reply = (*client)->Receive(2s);
  ASSERT_TRUE(reply.ok()) << reply.status();
  ASSERT_TRUE(reply->has_register_agent_reply());
  EXPECT_EQ(reply->register_agent_reply().status(), v1::STATUS_CODE_INVALID_ARGUMENT);
  EXPECT_THAT(reply->register_agent_reply().message(), ::testing::HasSubstr("0.0.0.0:7000"));
  EXPECT_THAT(reply->register_agent_reply().message(), ::testing::HasSubstr("--advertise"));
  EXPECT_EQ((*server)->size(), 0u);
}

// An IPv4 address of this host other than loopback; empty when it has none.
std::string NonLoopbackAddress() {
  ifaddrs* all = nullptr;
  if (getifaddrs(&all) != 0) return "";
  std::string found;
  for (const ifaddrs* a = all; a != nullptr && found.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    const auto* in = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
    if ((ntohl(in->sin_addr.s_addr) >> 24) == 127) continue;
    char text[INET_ADDRSTRLEN] = {};
    if (inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text)) != nullptr) found = text;
  }
  freeifaddrs(all);
  return found;
}

// A loopback address is fine from an agent that reached the registry over loopback (everyone
// who finds it runs on that host), and refused from one that came over a real interface.
TEST(RegistryTest, LoopbackAddressOnlyFromAgentsOnLoopback) {
  const std::string external = NonLoopbackAddress();
  if (external.empty()) GTEST_SKIP() << "this host has no IPv4 address besides loopback";
  RegistryServerOptions options = FastRegistry();
  options.server.bind_address = "0.0.0.0";
  options.server.allow_remote_without_token = true;
  auto server = RegistryServer::Create(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto local = RegistryClient::Start(ClientTo((*server)->port()),
                                     Agent("near", AgentRole::kPrefill, 0, 7000));
  EXPECT_TRUE(local.ok()) << local.status();
  RegistryClientOptions from_outside = ClientTo((*server)->port());
  from_outside.host = external;
  auto remote = RegistryClient::Start(from_outside, Agent("far", AgentRole::kPrefill, 0, 7000));
  ASSERT_FALSE(remote.ok());
  EXPECT_EQ(remote.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(remote.status().message(), ::testing::HasSubstr("127.0.0.1:7000"));
  EXPECT_THAT(remote.status().message(), ::testing::HasSubstr("loopback"));
  EXPECT_THAT(remote.status().message(), ::testing::HasSubstr(external));
  EXPECT_THAT(remote.status().message(), ::testing::HasSubstr("--advertise HOST[:PORT]"));
  AgentEntry advertised = Agent("far", AgentRole::kPrefill, 0, 7000);
  advertised.control_address = external + ":7000";
  auto fixed = RegistryClient::Start(from_outside, advertised);
  EXPECT_TRUE(fixed.ok()) << fixed.status();
}

TEST(RegistryTest, EntriesExpireWhenHeartbeatsStop) {
  auto server = RegistryServer::Create(FastRegistry());
  ASSERT_TRUE(server.ok());
  auto client = RegistryClient::Start(ClientTo((*server)->port()),
                                      Agent("short-lived", AgentRole::kDecode, 0, 7200));
  ASSERT_TRUE(client.ok());
  // Heartbeats keep it alive past several intervals.
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ((*server)->size(), 1u);
  EXPECT_GE((*client)->refreshes(), 3u);
  // An agent that is killed never unregisters: its entry expires.
  auto killed = RawRegistrant::Connect((*server)->port());
  ASSERT_NE(killed, nullptr);
  ASSERT_EQ(killed->Register("killed", "127.0.0.1:7201").first, v1::STATUS_CODE_OK);
  killed.reset();
  EXPECT_TRUE(WaitUntil(
      [&] { return (*server)->Lookup("killed", AgentRole::kAny, std::nullopt).empty(); }));
  EXPECT_EQ((*server)->size(), 1u);
}

TEST(RegistryTest, RestartedRegistryIsRefilledByHeartbeats) {
  auto server = RegistryServer::Create(FastRegistry());
  ASSERT_TRUE(server.ok());
  const uint16_t port = (*server)->port();
  auto client = RegistryClient::Start(ClientTo(port), Agent("survivor", AgentRole::kPrefill, 0, 1));
  ASSERT_TRUE(client.ok());
  server->reset();  // the registry dies and comes back on the same port, empty
  auto again = RegistryServer::Create(FastRegistry(port));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(WaitUntil([&] { return (*again)->size() == 1; }));
  auto found = (*again)->Lookup("survivor", AgentRole::kPrefill, std::nullopt);
  ASSERT_EQ(found.size(), 1u);
}

TEST(RegistryTest, RefusesBadRegistrationsAndUnreachableRegistries) {
  auto server = RegistryServer::Create(FastRegistry());
  ASSERT_TRUE(server.ok());
  auto tool =
      RegistryClient::Start(ClientTo((*server)->port()), Agent("tool", AgentRole::kTool, 0, 1));
  ASSERT_FALSE(tool.ok());
  EXPECT_NE(tool.status().message().find("only prefill and decode"), std::string::npos)
      << tool.status();
  EXPECT_EQ((*server)->size(), 0u);

  const uint16_t dead_port = (*server)->port();
  server->reset();
  auto orphan = RegistryClient::Start(ClientTo(dead_port), Agent("x", AgentRole::kDecode, 0, 1));
  ASSERT_FALSE(orphan.ok());
  EXPECT_NE(orphan.status().message().find("bootstrap"), std::string::npos) << orphan.status();

  // A layout whose dtype is a store type, not a pool dtype, is refused before anything is sent.
  AgentEntry uint8_pool = Agent("u8", AgentRole::kDecode, 0, 1);
  uint8_pool.layout->dtype = DType::kUInt8;
  auto refused = RegistryClient::Start(ClientTo(dead_port), uint8_pool);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("layout.dtype = uint8"), std::string::npos)
      << refused.status();

  RegistryServerOptions bad = FastRegistry();
  bad.heartbeat_interval = 0ms;
  EXPECT_EQ(RegistryServer::Create(bad).status().code(), StatusCode::kInvalidArgument);
  bad = FastRegistry();
  bad.missed_heartbeats = 1;  // entries would expire between two refreshes
  const Status one = RegistryServer::Create(bad).status();
  EXPECT_EQ(one.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(one.message().find("missed_heartbeats=1: must be >= 2"), std::string::npos) << one;
}

// A lookup that matches more agents than one reply carries is answered with an error saying
// how to narrow it (instead of a reply the client would refuse); narrower lookups still work.
TEST(RegistryTest, ALookupMatchingMoreThanOneReplyHoldsSaysHowToNarrowIt) {
  RegistryServerOptions options = FastRegistry();
  options.server.validation.max_agents_per_reply = 2;
  auto server = RegistryServer::Create(options);
  ASSERT_TRUE(server.ok()) << server.status();
  const uint16_t port = (*server)->port();
  std::vector<std::unique_ptr<RegistryClient>> agents;
  ASSERT_NO_FATAL_FAILURE(RegisterThree(port, agents));

  auto all = RegistryClient::Lookup(ClientTo(port), "", AgentRole::kAny, std::nullopt);
  ASSERT_FALSE(all.ok());
  EXPECT_EQ(all.status().code(), StatusCode::kResourceExhausted) << all.status();
  EXPECT_NE(all.status().message().find("the lookup matches 3 agents; one reply holds 2"),
            std::string::npos)
      << all.status();
  EXPECT_NE(all.status().message().find("look up by name, role or tp_rank"), std::string::npos)
      << all.status();
  auto prefill =
      RegistryClient::Lookup(ClientTo(port), "llama-p", AgentRole::kPrefill, std::nullopt);
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  EXPECT_EQ(prefill->size(), 2u);
}

// A registry at its max_entries refuses new keys, naming the limit, the flag and the key, and
// goes on refreshing the keys it holds.
TEST(RegistryTest, AFullRegistryRefusesNewKeysNamingTheLimitAndKeepsRefreshing) {
  RegistryServerOptions options = SteadyRegistry();
  options.max_entries = 2;
  auto server = RegistryServer::Create(options);
  ASSERT_TRUE(server.ok()) << server.status();
  const uint16_t port = (*server)->port();
  auto p0 = RegistryClient::Start(ClientTo(port), Agent("llama-p", AgentRole::kPrefill, 0, 7000));
  ASSERT_TRUE(p0.ok()) << p0.status();
  auto p1 = RegistryClient::Start(ClientTo(port), Agent("llama-p", AgentRole::kPrefill, 1, 7001));
  ASSERT_TRUE(p1.ok()) << p1.status();

  auto third = RegistryClient::Start(ClientTo(port), Agent("llama-d", AgentRole::kDecode, 0, 0));
  ASSERT_FALSE(third.ok());
  EXPECT_EQ(third.status().code(), StatusCode::kResourceExhausted) << third.status();
  EXPECT_THAT(third.status().message(), ::testing::HasSubstr("holds 2 live entries"));
  EXPECT_THAT(third.status().message(), ::testing::HasSubstr("--max-entries 2"));
  EXPECT_THAT(third.status().message(), ::testing::HasSubstr("decode 'llama-d' rank 0"));
  EXPECT_THAT(third.status().message(), ::testing::HasSubstr("raise --max-entries"));

  // The held keys are refreshed as before (a refresh is no new entry).
  const uint64_t before = (*p0)->refreshes() + (*p1)->refreshes();
  EXPECT_TRUE(WaitUntil([&] { return (*p0)->refreshes() + (*p1)->refreshes() >= before + 4; }));
  EXPECT_EQ((*server)->size(), 2u);
  EXPECT_TRUE((*server)->Lookup("llama-d", AgentRole::kAny, std::nullopt).empty());

  RegistryServerOptions none = SteadyRegistry();
  none.max_entries = 0;
  const Status refused = RegistryServer::Create(none).status();
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), ::testing::HasSubstr("max_entries=0: must be >= 1"));
}

// Entries that stop refreshing expire as registrations arrive, without any look-up: their keys
// stop counting against max_entries, and a registry that is only registered to holds no more
// than its live entries.
TEST(RegistryTest, ExpiredEntriesMakeRoomWithoutAnyLookup) {
  RegistryServerOptions options = SteadyRegistry();
  options.max_entries = 2;
  auto server = RegistryServer::Create(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto raw = RawRegistrant::Connect((*server)->port());
  ASSERT_NE(raw, nullptr);
  EXPECT_EQ(raw->Register("gone-0", "127.0.0.1:7000").first, v1::STATUS_CODE_OK);
  EXPECT_EQ(raw->Register("gone-1", "127.0.0.1:7001").first, v1::STATUS_CODE_OK);
  const auto [code, message] = raw->Register("next", "127.0.0.1:7002");
  EXPECT_EQ(code, v1::STATUS_CODE_RESOURCE_EXHAUSTED) << message;
  // Neither gone-* is refreshed: once they expired (1 s), the registration goes through.
  EXPECT_TRUE(WaitUntil(
      [&] { return raw->Register("next", "127.0.0.1:7002").first == v1::STATUS_CODE_OK; }, 10s));
  // gone-0 expired first, which made the room; gone-1 was registered a moment later and expires
  // that moment later, so the registry holds at most 2 entries now and only "next" soon after.
  EXPECT_LE((*server)->size(), 2u);
  EXPECT_TRUE(WaitUntil([&] { return (*server)->size() == 1u; }));
  EXPECT_EQ((*server)->Lookup("next", AgentRole::kPrefill, std::nullopt).size(), 1u);
}

// A key held by a live agent is not taken over by an agent at another address (or on another
// host): the registration is refused naming the key, both addresses and what to do, and the
// holder keeps its entry and its refreshes.
TEST(RegistryTest, AKeyHeldByALiveAgentIsRefusedToAnotherNamingTheHolder) {
  auto server = RegistryServer::Create(SteadyRegistry());
  ASSERT_TRUE(server.ok()) << server.status();
  const uint16_t port = (*server)->port();
  auto holder =
      RegistryClient::Start(ClientTo(port), Agent("llama-p", AgentRole::kPrefill, 0, 7000));
  ASSERT_TRUE(holder.ok()) << holder.status();

  auto other =
      RegistryClient::Start(ClientTo(port), Agent("llama-p", AgentRole::kPrefill, 0, 7001));
  ASSERT_FALSE(other.ok()) << "a second agent took over prefill 'llama-p' rank 0";
  EXPECT_EQ(other.status().code(), StatusCode::kAlreadyExists) << other.status();
  const std::string& message = other.status().message();
  EXPECT_THAT(message, ::testing::HasSubstr("prefill 'llama-p' rank 0 is held by the agent at "
                                            "127.0.0.1:7000 (host_id host-a)"));
  EXPECT_THAT(message, ::testing::HasSubstr("the registration of 127.0.0.1:7001 (host_id host-a, "
                                            "connection from 127.0.0.1:"));
  EXPECT_THAT(message, ::testing::HasSubstr("another name or tp_rank (kvt-agent --name / "
                                            "--tp-rank)"));
  EXPECT_THAT(message, ::testing::HasSubstr("once its entry expired (1000 ms after its last "
                                            "heartbeat)"));

  AgentEntry elsewhere = Agent("llama-p", AgentRole::kPrefill, 0, 7000);
  elsewhere.host_id = "host-b";  // the same address on another machine
  auto moved = RegistryClient::Start(ClientTo(port), elsewhere);
  ASSERT_FALSE(moved.ok());
  EXPECT_EQ(moved.status().code(), StatusCode::kAlreadyExists) << moved.status();

  // Other ranks and roles of the same name are other keys.
  auto rank1 =
      RegistryClient::Start(ClientTo(port), Agent("llama-p", AgentRole::kPrefill, 1, 7001));
  EXPECT_TRUE(rank1.ok()) << rank1.status();

  const uint64_t before = (*holder)->refreshes();
  EXPECT_TRUE(WaitUntil([&] { return (*holder)->refreshes() >= before + 2; }));
  auto found = (*server)->Lookup("llama-p", AgentRole::kPrefill, 0u);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].control_address, "127.0.0.1:7000");
  EXPECT_EQ(found[0].host_id, "host-a");
}

// Two live agents giving the same address (two decode agents of one host register HOST:0) are
// told apart by their connections: the second is refused while the first's is open.
TEST(RegistryTest, TwoLiveAgentsGivingTheSameAddressAreToldApart) {
  auto server = RegistryServer::Create(SteadyRegistry());
  ASSERT_TRUE(server.ok()) << server.status();
  const uint16_t port = (*server)->port();
  const AgentEntry decode = Agent("llama-d", AgentRole::kDecode, 0, 0);
  auto first = RegistryClient::Start(ClientTo(port), decode);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = RegistryClient::Start(ClientTo(port), decode);
  ASSERT_FALSE(second.ok()) << "two agents shared decode 'llama-d' rank 0";
  EXPECT_EQ(second.status().code(), StatusCode::kAlreadyExists) << second.status();
  EXPECT_THAT(second.status().message(),
              ::testing::HasSubstr("two agents register the same control address"));
  EXPECT_THAT(second.status().message(), ::testing::HasSubstr("127.0.0.1:0"));
  const uint64_t before = (*first)->refreshes();
  EXPECT_TRUE(WaitUntil([&] { return (*first)->refreshes() >= before + 2; }));
}

// The same agent registering again (a restart at the same address, after its connection
// closed) takes its entry back at once, without waiting for it to expire.
TEST(RegistryTest, TheSameAgentRegistersAgainOnceItsConnectionClosed) {
  auto server = RegistryServer::Create(SteadyRegistry());
  ASSERT_TRUE(server.ok()) << server.status();
  const uint16_t port = (*server)->port();
  AgentEntry agent = Agent("llama-p", AgentRole::kPrefill, 0, 7000);
  auto first = RawRegistrant::Connect(port);
  ASSERT_NE(first, nullptr);
  ASSERT_EQ(first->Register(Info("llama-p", 0, 7000)).first, v1::STATUS_CODE_OK);
  first.reset();  // the agent is killed (its connection closes); it restarts with a new layout
  agent.layout->num_pages = 129;
  agent.layout->num_tokens = 2048;
  auto again = RegistryClient::Start(ClientTo(port), agent);
  ASSERT_TRUE(again.ok()) << again.status();
  auto found = (*server)->Lookup("llama-p", AgentRole::kPrefill, 0u);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].layout->num_pages, 129u);
}

// An agent at another address waits for a holder whose connection closed (it may reconnect):
// Unavailable saying when the key frees, then the key is its own once the entry expired.
TEST(RegistryTest, AnExpiredHolderIsReplaced) {
  auto server = RegistryServer::Create(SteadyRegistry());
  ASSERT_TRUE(server.ok()) << server.status();
  const uint16_t port = (*server)->port();
  auto holder = RawRegistrant::Connect(port);
  ASSERT_NE(holder, nullptr);
  ASSERT_EQ(holder->Register(Info("llama-p", 0, 7000)).first, v1::STATUS_CODE_OK);
  holder.reset();  // killed: its connection closes, its entry stays until it expires
  const AgentEntry successor = Agent("llama-p", AgentRole::kPrefill, 0, 7001);
  auto early = RegistryClient::Start(ClientTo(port), successor);
  ASSERT_FALSE(early.ok());
  EXPECT_EQ(early.status().code(), StatusCode::kUnavailable) << early.status();
  EXPECT_THAT(early.status().message(), ::testing::HasSubstr("127.0.0.1:7000"));
  EXPECT_THAT(early.status().message(), ::testing::HasSubstr("its connection has closed"));
  EXPECT_THAT(early.status().message(), ::testing::HasSubstr("retry once its entry expired"));

  std::unique_ptr<RegistryClient> registered;
  EXPECT_TRUE(WaitUntil(
      [&] {
        auto attempt = RegistryClient::Start(ClientTo(port), successor);
        if (attempt.ok()) registered = std::move(attempt).value();
        return registered != nullptr;
      },
      10s));
  auto found = (*server)->Lookup("llama-p", AgentRole::kPrefill, 0u);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].control_address, "127.0.0.1:7001");
}

// ---- unregistration ----

// Entries that would live half a minute without their heartbeats: a key freed at once was
// freed by the unregistration, not by expiry.
RegistryServerOptions LongLivedRegistry() {
  RegistryServerOptions o;
  o.heartbeat_interval = 1s;
  o.missed_heartbeats = 30;
  return o;
}

// An agent that unregisters frees its key at once: another agent (at another address) takes
// it without waiting for the entry to expire. The stopped client refreshes no more and ends
// its registration once.
TEST(RegistryTest, UnregisterFreesTheKeyForAnotherAgentAtOnce) {
  auto server = RegistryServer::Create(LongLivedRegistry());
  ASSERT_TRUE(server.ok()) << server.status();
  const uint16_t port = (*server)->port();
  auto holder =
      RegistryClient::Start(ClientTo(port), Agent("llama-p", AgentRole::kPrefill, 0, 7000));
  ASSERT_TRUE(holder.ok()) << holder.status();
  auto other_rank =
      RegistryClient::Start(ClientTo(port), Agent("llama-p", AgentRole::kPrefill, 1, 7001));
  ASSERT_TRUE(other_rank.ok()) << other_rank.status();

  const Status unregistered = (*holder)->Unregister(2s);
  ASSERT_TRUE(unregistered.ok()) << unregistered;
  EXPECT_TRUE((*server)->Lookup("llama-p", AgentRole::kPrefill, 0u).empty());
  EXPECT_EQ((*server)->Lookup("llama-p", AgentRole::kPrefill, 1u).size(), 1u)
      << "another rank's entry went too";

  auto successor =
      RegistryClient::Start(ClientTo(port), Agent("llama-p", AgentRole::kPrefill, 0, 7002));
  ASSERT_TRUE(successor.ok()) << successor.status();
  auto found = (*server)->Lookup("llama-p", AgentRole::kPrefill, 0u);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].control_address, "127.0.0.1:7002");

  const Status again = (*holder)->Unregister(2s);
  EXPECT_EQ(again.code(), StatusCode::kFailedPrecondition) << again;
  EXPECT_THAT(again.message(), ::testing::HasSubstr("prefill 'llama-p' rank 0 at 127.0.0.1:7000"));
  EXPECT_THAT(again.message(), ::testing::HasSubstr("already ended"));
  const uint64_t refreshes = (*holder)->refreshes();
  const uint64_t successor_before = (*successor)->refreshes();
  // The registry answers every 1 s heartbeat of the successor; the stopped holder sends none.
  EXPECT_TRUE(WaitUntil([&] { return (*successor)->refreshes() > successor_before; }, 5s));
  EXPECT_EQ((*holder)->refreshes(), refreshes);
}

// Destroying a RegistryClient unregisters too.
TEST(RegistryTest, DestroyingTheClientUnregisters) {
  auto server = RegistryServer::Create(LongLivedRegistry());
  ASSERT_TRUE(server.ok()) << server.status();
  auto holder = RegistryClient::Start(ClientTo((*server)->port()),
                                      Agent("llama-d", AgentRole::kDecode, 0, 0));
  ASSERT_TRUE(holder.ok()) << holder.status();
  EXPECT_EQ((*server)->size(), 1u);
  holder->reset();
  EXPECT_EQ((*server)->size(), 0u);
}

// Only the holder removes its entry: an unregistration giving another address (or host_id), or
// the holder's address over another connection while the holder's is open, is refused naming
// the key, the holder and the sender; the holder keeps its entry and its refreshes.
TEST(RegistryTest, UnregisterFromANonHolderIsRefusedNamingTheHolder) {
  auto server = RegistryServer::Create(LongLivedRegistry());
  ASSERT_TRUE(server.ok()) << server.status();
  const uint16_t port = (*server)->port();
  auto holder =
      RegistryClient::Start(ClientTo(port), Agent("llama-p", AgentRole::kPrefill, 0, 7000));
  ASSERT_TRUE(holder.ok()) << holder.status();
  auto raw = RawRegistrant::Connect(port);
  ASSERT_NE(raw, nullptr);

  const auto [code, message] = raw->Unregister(Info("llama-p", 0, 7001));
  EXPECT_EQ(code, v1::STATUS_CODE_FAILED_PRECONDITION) << message;
  EXPECT_THAT(message, ::testing::HasSubstr("prefill 'llama-p' rank 0 is held by the agent at "
                                            "127.0.0.1:7000 (host_id host-a) over its open "
                                            "connection from 127.0.0.1:"));
  EXPECT_THAT(message, ::testing::HasSubstr("the unregistration from 127.0.0.1:7001 (host_id "
                                            "host-a, connection from 127.0.0.1:"));
  EXPECT_THAT(message, ::testing::HasSubstr("only the holder removes its entry"));
  EXPECT_THAT(message, ::testing::HasSubstr("until that agent stops"));

  EXPECT_EQ(raw->Unregister(Info("llama-p", 0, 7000, "host-b")).first,
            v1::STATUS_CODE_FAILED_PRECONDITION);
  const auto [same_code, same_message] = raw->Unregister(Info("llama-p", 0, 7000));
  EXPECT_EQ(same_code, v1::STATUS_CODE_FAILED_PRECONDITION) << same_message;
  EXPECT_THAT(same_message, ::testing::HasSubstr("over its open connection"));

  auto found = (*server)->Lookup("llama-p", AgentRole::kPrefill, 0u);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].control_address, "127.0.0.1:7000");
  const uint64_t before = (*holder)->refreshes();
  EXPECT_TRUE(WaitUntil([&] { return (*holder)->refreshes() > before; }, 5s));
  EXPECT_TRUE((*holder)->Unregister(2s).ok());
  EXPECT_EQ((*server)->size(), 0u);
}

// An agent whose connection closed (it reconnects) removes its entry over a new connection.
TEST(RegistryTest, TheHolderUnregistersOverANewConnectionOnceItsOwnClosed) {
  auto server = RegistryServer::Create(LongLivedRegistry());
  ASSERT_TRUE(server.ok()) << server.status();
  const uint16_t port = (*server)->port();
  auto first = RawRegistrant::Connect(port);
  ASSERT_NE(first, nullptr);
  ASSERT_EQ(first->Register(Info("llama-p", 0, 7000)).first, v1::STATUS_CODE_OK);
  first.reset();
  auto second = RawRegistrant::Connect(port);
  ASSERT_NE(second, nullptr);
  // Refused (FAILED_PRECONDITION, nothing changes) until the registry has seen the first
  // connection close.
  std::pair<v1::StatusCode, std::string> answer;
  EXPECT_TRUE(WaitUntil([&] {
    answer = second->Unregister(Info("llama-p", 0, 7000));
    return answer.first != v1::STATUS_CODE_FAILED_PRECONDITION;
  }));
  EXPECT_EQ(answer.first, v1::STATUS_CODE_OK) << answer.second;
  EXPECT_EQ((*server)->size(), 0u);
}

// A key without a live entry is NOT_FOUND, naming it.
TEST(RegistryTest, UnregisterOfAnUnknownKeyIsNotFoundNamingIt) {
  auto server = RegistryServer::Create(LongLivedRegistry());
  ASSERT_TRUE(server.ok()) << server.status();
  auto raw = RawRegistrant::Connect((*server)->port());
  ASSERT_NE(raw, nullptr);
  const auto [code, message] = raw->Unregister(Info("nobody", 1, 7000));
  EXPECT_EQ(code, v1::STATUS_CODE_NOT_FOUND) << message;
  EXPECT_THAT(message, ::testing::HasSubstr("prefill 'nobody' rank 1 has no live entry"));
  EXPECT_THAT(message, ::testing::HasSubstr("the key is free"));

  // An entry removed once is unknown the second time.
  ASSERT_EQ(raw->Register(Info("once", 0, 7000)).first, v1::STATUS_CODE_OK);
  EXPECT_EQ(raw->Unregister(Info("once", 0, 7000)).first, v1::STATUS_CODE_OK);
  EXPECT_EQ(raw->Unregister(Info("once", 0, 7000)).first, v1::STATUS_CODE_NOT_FOUND);
}

// A control server that takes RegisterAgent and never answers: a registry that went silent.
class SilentRegistry : public control::ControlHandler {
 public:
  void OnMessage(control::ConnectionId, const v1::Envelope& envelope) override {
    if (envelope.has_register_agent()) ++registrations;
    if (envelope.has_unregister_agent()) ++unregistrations;
  }
  void OnDisconnect(control::ConnectionId, const Status&) override {}
  std::atomic<int> registrations{0};
  std::atomic<int> unregistrations{0};
};

// A registry that is gone costs Unregister no more than its bound.
TEST(RegistryTest, UnregisterFromAGoneRegistryReturnsWithinItsBound) {
  auto server = RegistryServer::Create(LongLivedRegistry());
  ASSERT_TRUE(server.ok()) << server.status();
  auto holder = RegistryClient::Start(ClientTo((*server)->port()),
                                      Agent("llama-p", AgentRole::kPrefill, 0, 7000));
  ASSERT_TRUE(holder.ok()) << holder.status();
  server->reset();
  const auto start = std::chrono::steady_clock::now();
  const Status unregistered = (*holder)->Unregister(300ms);
  const auto took = std::chrono::steady_clock::now() - start;
  ASSERT_FALSE(unregistered.ok());
  EXPECT_THAT(unregistered.message(),
              ::testing::HasSubstr("unregistering prefill 'llama-p' rank 0 at 127.0.0.1:7000"));
  EXPECT_THAT(unregistered.message(),
              ::testing::HasSubstr("its entry expires once its heartbeats are missed"));
  EXPECT_LT(took, 2s) << "Unregister(300ms) took "
                      << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                      << " ms";
}

// A registry that stops answering while a refresh waits for it (for up to the client's 10 s
// timeout) holds neither Unregister nor the destructor beyond their bound: the refresh is given
// up at once, and the unregistration's own wait ends at the bound (DeadlineExceeded).
TEST(RegistryTest, UnregisterFromASilentRegistryReturnsWithinItsBound) {
  auto server = RegistryServer::Create(FastRegistry());
  ASSERT_TRUE(server.ok()) << server.status();
  const uint16_t port = (*server)->port();
  RegistryClientOptions patient = ClientTo(port);
  patient.timeout = 10s;
  patient.unregister_timeout = 300ms;
  auto explicit_stop =
      RegistryClient::Start(patient, Agent("llama-p", AgentRole::kPrefill, 0, 7000));
  ASSERT_TRUE(explicit_stop.ok()) << explicit_stop.status();
  auto destroyed = RegistryClient::Start(patient, Agent("llama-p", AgentRole::kPrefill, 1, 7001));
  ASSERT_TRUE(destroyed.ok()) << destroyed.status();
  server->reset();
  SilentRegistry silent;
  control::ControlServerOptions same_port;
  same_port.port = port;
  auto silent_server = control::ControlServer::Create(same_port, &silent);
  ASSERT_TRUE(silent_server.ok()) << silent_server.status();
  // Both clients reconnected and wait for the answer to a refresh.
  ASSERT_TRUE(WaitUntil([&] { return silent.registrations.load() >= 2; }, 10s));

  auto start = std::chrono::steady_clock::now();
  const Status unregistered = (*explicit_stop)->Unregister(300ms);
  auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(unregistered.code(), StatusCode::kDeadlineExceeded) << unregistered;
  EXPECT_THAT(unregistered.message(), ::testing::HasSubstr("within 300 ms failed"));
  EXPECT_LT(took, 3s) << "Unregister(300ms) took "
                      << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                      << " ms";

  start = std::chrono::steady_clock::now();
  destroyed->reset();
  took = std::chrono::steady_clock::now() - start;
  EXPECT_LT(took, 3s) << "the destructor (unregister_timeout 300 ms) took "
                      << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                      << " ms";
  EXPECT_TRUE(WaitUntil([&] { return silent.unregistrations.load() == 2; }));
}

// A registry that takes connections and never says a word (the refresh waits in the handshake,
// and so would the unregistration's new connection) holds Unregister no longer either.
TEST(RegistryTest, UnregisterFromARegistryThatNeverSpeaksReturnsWithinItsBound) {
  auto server = RegistryServer::Create(FastRegistry());
  ASSERT_TRUE(server.ok()) << server.status();
  const uint16_t port = (*server)->port();
  RegistryClientOptions patient = ClientTo(port);
  patient.timeout = 10s;
  auto holder = RegistryClient::Start(patient, Agent("llama-p", AgentRole::kPrefill, 0, 7000));
  ASSERT_TRUE(holder.ok()) << holder.status();
  server->reset();
  // A listening socket that nobody accepts on: connections complete in the kernel, and no
  // byte ever comes.
  const int mute = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(mute, 0);
  const int one = 1;
  setsockopt(mute, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  ASSERT_EQ(bind(mute, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0)
      << std::strerror(errno);
  ASSERT_EQ(listen(mute, 16), 0) << std::strerror(errno);
  // The client's connection closed with the registry; its refresh thread connects again and
  // waits for the greeting.
  pollfd waiting{.fd = mute, .events = POLLIN, .revents = 0};
  ASSERT_EQ(poll(&waiting, 1, 10000), 1) << "the client did not connect again";
  const int accepted = accept(mute, nullptr, nullptr);
  ASSERT_GE(accepted, 0) << std::strerror(errno);
  const uint64_t refreshes = (*holder)->refreshes();
  const auto start = std::chrono::steady_clock::now();
  const Status unregistered = (*holder)->Unregister(300ms);
  const auto took = std::chrono::steady_clock::now() - start;
  close(accepted);
  close(mute);
  EXPECT_FALSE(unregistered.ok());
  EXPECT_THAT(unregistered.message(), ::testing::HasSubstr("within 300 ms failed"));
  EXPECT_LT(took, 3s) << "Unregister(300ms) took "
                      << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                      << " ms";
  EXPECT_EQ((*holder)->refreshes(), refreshes);
}

}  // namespace
}  // namespace kvt::transfer

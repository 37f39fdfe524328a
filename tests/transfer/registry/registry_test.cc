#include "kvt/transfer/registry.h"

#include <gtest/gtest.h>

#include <thread>
#include <utility>
#include <vector>

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

TEST(RegistryTest, RegistersAndLooksUpByNameRoleAndRank) {
  auto server = RegistryServer::Create(FastRegistry());
  ASSERT_TRUE(server.ok()) << server.status();
  const uint16_t port = (*server)->port();
  auto p0 = RegistryClient::Start(ClientTo(port), Agent("llama-p", AgentRole::kPrefill, 0, 7000));
  auto p1 = RegistryClient::Start(ClientTo(port), Agent("llama-p", AgentRole::kPrefill, 1, 7001));
  auto d0 = RegistryClient::Start(ClientTo(port), Agent("llama-d", AgentRole::kDecode, 0, 7100));
  ASSERT_TRUE(p0.ok() && p1.ok() && d0.ok()) << p0.status() << p1.status() << d0.status();
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
  client->reset();  // the agent stops
  EXPECT_TRUE(WaitUntil([&] { return (*server)->size() == 0; }));
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
}

}  // namespace
}  // namespace kvt::transfer

#include "kvt/transfer/registry.h"

#include <gtest/gtest.h>

#include <thread>

namespace kvt::transfer {
namespace {

using namespace std::chrono_literals;

v1::AgentInfo Agent(const std::string& name, v1::Role role, uint32_t rank, uint16_t port) {
  v1::AgentInfo a;
  a.set_name(name);
  a.set_role(role);
  a.set_tp_rank(rank);
  a.set_tp_size(2);
  a.set_control_address("127.0.0.1:" + std::to_string(port));
  a.mutable_layout()->set_num_layers(4);
  a.mutable_layout()->set_page_size(16);
  a.mutable_layout()->set_dtype(v1::DTYPE_BF16);
  a.mutable_layout()->set_head_num(2);
  a.mutable_layout()->set_head_dim(64);
  a.mutable_layout()->set_tp_size(2);
  a.mutable_layout()->set_tp_rank(rank);
  a.mutable_layout()->set_num_pages(65);
  a.mutable_layout()->set_num_tokens(1024);
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
  auto p0 = RegistryClient::Start(ClientTo(port), Agent("llama-p", v1::ROLE_PREFILL, 0, 7000));
  auto p1 = RegistryClient::Start(ClientTo(port), Agent("llama-p", v1::ROLE_PREFILL, 1, 7001));
  auto d0 = RegistryClient::Start(ClientTo(port), Agent("llama-d", v1::ROLE_DECODE, 0, 7100));
  ASSERT_TRUE(p0.ok() && p1.ok() && d0.ok()) << p0.status() << p1.status() << d0.status();
  EXPECT_EQ((*server)->size(), 3u);

  auto all = RegistryClient::Lookup(ClientTo(port), "", v1::ROLE_UNSPECIFIED, std::nullopt);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->size(), 3u);
  auto prefill = RegistryClient::Lookup(ClientTo(port), "", v1::ROLE_PREFILL, std::nullopt);
  ASSERT_EQ(prefill->size(), 2u);
  EXPECT_EQ((*prefill)[0].tp_rank(), 0u);
  EXPECT_EQ((*prefill)[1].control_address(), "127.0.0.1:7001");
  auto rank1 = RegistryClient::Lookup(ClientTo(port), "llama-p", v1::ROLE_PREFILL, 1u);
  ASSERT_EQ(rank1->size(), 1u);
  EXPECT_EQ((*rank1)[0].control_address(), "127.0.0.1:7001");
  auto none = RegistryClient::Lookup(ClientTo(port), "nobody", v1::ROLE_UNSPECIFIED, std::nullopt);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

TEST(RegistryTest, EntriesExpireWhenHeartbeatsStop) {
  auto server = RegistryServer::Create(FastRegistry());
  ASSERT_TRUE(server.ok());
  auto client = RegistryClient::Start(ClientTo((*server)->port()),
                                      Agent("short-lived", v1::ROLE_DECODE, 0, 7200));
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
  auto client = RegistryClient::Start(ClientTo(port), Agent("survivor", v1::ROLE_PREFILL, 0, 1));
  ASSERT_TRUE(client.ok());
  server->reset();  // the registry dies and comes back on the same port, empty
  auto again = RegistryServer::Create(FastRegistry(port));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(WaitUntil([&] { return (*again)->size() == 1; }));
  auto found = (*again)->Lookup("survivor", v1::ROLE_PREFILL, std::nullopt);
  ASSERT_EQ(found.size(), 1u);
}

TEST(RegistryTest, RefusesBadRegistrationsAndUnreachableRegistries) {
  auto server = RegistryServer::Create(FastRegistry());
  ASSERT_TRUE(server.ok());
  auto tool =
      RegistryClient::Start(ClientTo((*server)->port()), Agent("tool", v1::ROLE_TOOL, 0, 1));
  ASSERT_FALSE(tool.ok());
  EXPECT_NE(tool.status().message().find("only prefill and decode"), std::string::npos)
      << tool.status();
  EXPECT_EQ((*server)->size(), 0u);

  const uint16_t dead_port = (*server)->port();
  server->reset();
  auto orphan = RegistryClient::Start(ClientTo(dead_port), Agent("x", v1::ROLE_DECODE, 0, 1));
  ASSERT_FALSE(orphan.ok());
  EXPECT_NE(orphan.status().message().find("bootstrap"), std::string::npos) << orphan.status();

  RegistryServerOptions bad = FastRegistry();
  bad.heartbeat_interval = 0ms;
  EXPECT_EQ(RegistryServer::Create(bad).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvt::transfer

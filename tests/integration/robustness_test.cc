// What the servers do with hostile or mistaken peers: garbage and oversized frames on every
// listening port, clients with the wrong cluster token, and a decode agent whose pool layout does
// not match the prefill's.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <regex>

#include "control/control_client.h"
#include "control/framing.h"
#include "control/protocol.h"
#include "fixture.h"
#include "kvt/transfer/registry.h"

namespace kvt::integration {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// What a raw connection saw before the server closed it.
struct ProbeResult {
  bool server_closed = false;        // read returned 0 (FIN) or a reset
  std::vector<v1::Envelope> frames;  // every whole frame received (AuthChallenge, Error, ...)
  double close_ms = 0;               // from the last byte sent to the close
  std::string detail;

  bool HasError(v1::StatusCode code) const {
    for (const v1::Envelope& e : frames) {
      if (e.has_error() && e.error().code() == code) return true;
    }
    return false;
  }
  std::string Summary() const {
    std::string s = detail + "; frames:";
    for (const v1::Envelope& e : frames) {
      s.append(" ").append(control::BodyName(e));
      if (e.has_error()) {
        s.append("(").append(v1::StatusCode_Name(e.error().code()));
        s.append(" '").append(e.error().message()).append("')");
      }
    }
    return s;
  }
};

class Socket {
 public:
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() {
    if (fd_ >= 0) close(fd_);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }

 private:
  int fd_;
};

// Plain POSIX on purpose: the point is to send what no kvt client would.
StatusOr<int> ConnectTcp(uint16_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Unavailable(std::string("socket: ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    close(fd);
    return Unavailable("connect to 127.0.0.1:" + std::to_string(port) + ": " + std::strerror(err));
  }
  return fd;
}

enum class AfterSend { kKeepOpen, kHalfClose, kCloseAtOnce };

// Connects to `port`, sends `bytes`, then (kHalfClose) shuts our sending side or (kKeepOpen)
// leaves it open, and reads until the server closes the connection or `timeout` passes.
// kCloseAtOnce closes right after sending and observes nothing.
StatusOr<ProbeResult> Probe(uint16_t port, const std::string& bytes, AfterSend after,
                            std::chrono::milliseconds timeout = 5s) {
  KVT_ASSIGN_OR_RETURN(int fd, ConnectTcp(port));
  Socket sock(fd);
  ProbeResult result;
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) {
      // The server may close while we still send (it refused the frame from its header).
      result.detail =
          "send stopped after " + std::to_string(sent) + " bytes: " + std::strerror(errno);
      break;
    }
    sent += static_cast<size_t>(n);
  }
  if (after == AfterSend::kCloseAtOnce) return result;
  if (after == AfterSend::kHalfClose) shutdown(fd, SHUT_WR);
  const auto sent_at = Clock::now();
  const auto until = sent_at + timeout;
  control::FrameDecoder decoder(control::kDefaultMaxFrameBytes);
  char buf[65536];
  while (true) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
    if (left <= 0) {
      result.detail += " still open after " + std::to_string(timeout.count()) + " ms";
      return result;
    }
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) {
      result.server_closed = true;
      result.close_ms = std::chrono::duration<double, std::milli>(Clock::now() - sent_at).count();
      result.detail +=
          n == 0 ? " closed (EOF)" : std::string(" closed (") + std::strerror(errno) + ")";
      return result;
    }
    std::string_view data(buf, static_cast<size_t>(n));
    while (!data.empty()) {
      StatusOr<size_t> used = decoder.Feed(data);
      if (!used.ok()) return used.status().WithContext("the server sent a bad frame");
      data.remove_prefix(*used);
      if (decoder.frame_ready()) {
        v1::Envelope e;
        KVT_RETURN_IF_ERROR(decoder.Take(&e));
        result.frames.push_back(std::move(e));
      }
    }
  }
}

std::string BigEndian32(uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
          static_cast<char>(v)};
}

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

using GarbageTest = ClusterTest;

// Random bytes, a payload that is no Envelope, a 1 GiB length prefix and truncated frames, on
// the bootstrap, the prefill engine, and both agents' RPC ports: every time the server drops
// that connection promptly, and each server keeps serving everyone else.
TEST_F(GarbageTest, EveryPortDropsBadFramesAndKeepsServing) {
  KVT_ASSERT_OK_AND_ASSIGN(auto agents,
                           cluster_->StartAgents({Prefill("it-prefill"), Decode("it-decode")}));
  const std::vector<std::pair<std::string, uint16_t>> ports = {
      {"bootstrap", cluster_->bootstrap_port()},
      {"prefill engine", agents[0]->engine_port},
      {"prefill rpc", agents[0]->rpc_port},
      {"decode rpc", agents[1]->rpc_port}};

  // A payload of the announced length whose first byte is field 1 with wire type 7, which no
  // protobuf parser accepts, so the frame is whole but cannot be an Envelope.
  std::string not_an_envelope = RandomBytes(256, 7);
  not_an_envelope[0] = 0x0F;
  const std::string truncated = BigEndian32(100) + RandomBytes(10, 11);

  for (const auto& [what, port] : ports) {
    SCOPED_TRACE(what + " port " + std::to_string(port));
    // 1. Random bytes: almost surely an absurd length prefix, maybe more.
    // The first byte is set high so that the prefix announces more than any frame limit: a
    // random prefix under the limit (first byte 0, one port in 256) is a legitimate frame still
    // arriving, which the server waits for (case 4 covers that).
    std::string random_bytes = RandomBytes(4096, port);
    random_bytes[0] = static_cast<char>(0xF0);
    KVT_ASSERT_OK_AND_ASSIGN(ProbeResult random,
                             Probe(port, random_bytes, AfterSend::kKeepOpen));
    EXPECT_TRUE(random.server_closed) << random.Summary();
    EXPECT_LT(random.close_ms, 2000) << random.Summary();
    // The server speaks first (AuthChallenge), whatever the client sends.
    ASSERT_FALSE(random.frames.empty()) << random.Summary();
    EXPECT_TRUE(random.frames.front().has_auth_challenge()) << random.Summary();

    // 2. A whole frame that is not an Envelope: an Error frame, then close.
    KVT_ASSERT_OK_AND_ASSIGN(ProbeResult garbage,
                             Probe(port, BigEndian32(256) + not_an_envelope, AfterSend::kKeepOpen));
    EXPECT_TRUE(garbage.server_closed) << garbage.Summary();
    EXPECT_TRUE(garbage.HasError(v1::STATUS_CODE_MALFORMED_FRAME)) << garbage.Summary();
    EXPECT_LT(garbage.close_ms, 2000) << garbage.Summary();

    // 3. A 1 GiB length prefix: refused from the header alone, before any payload arrives.
    KVT_ASSERT_OK_AND_ASSIGN(ProbeResult huge,
                             Probe(port, BigEndian32(1u << 30) + "abcd", AfterSend::kKeepOpen));
    EXPECT_TRUE(huge.server_closed) << huge.Summary();
    EXPECT_TRUE(huge.HasError(v1::STATUS_CODE_MALFORMED_FRAME)) << huge.Summary();
    EXPECT_LT(huge.close_ms, 2000) << huge.Summary();

    // 4. A truncated frame, then our side closes: the server notices the EOF and closes too.
    KVT_ASSERT_OK_AND_ASSIGN(ProbeResult cut, Probe(port, truncated, AfterSend::kHalfClose));
    EXPECT_TRUE(cut.server_closed) << cut.Summary();
    EXPECT_LT(cut.close_ms, 2000) << cut.Summary();

    // 5. The same, closed outright (nothing to observe but the server's health below).
    KVT_ASSERT_OK(Probe(port, truncated, AfterSend::kCloseAtOnce).status());
  }

  // Every process survived, and every server still does its job for a well-behaved client.
  for (AgentProcess* agent : agents) {
    ASSERT_TRUE(agent->process.running()) << agent->spec.name << " died";
  }
  transfer::RegistryClientOptions registry;
  registry.port = cluster_->bootstrap_port();
  registry.client_id = "it-lookup";
  KVT_ASSERT_OK_AND_ASSIGN(
      auto found,
      transfer::RegistryClient::Lookup(registry, "it-prefill", transfer::AgentRole::kPrefill, 0u));
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].control_address, agents[0]->engine_address());
  // Fresh connections to both RPC ports; the decode agent's first request opens its first
  // connection to the prefill engine, after all the garbage it received.
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient prefill, ConnectRpc(agents[0]->rpc_port));
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient decode, ConnectRpc(agents[1]->rpc_port));
  KVT_ASSERT_OK_AND_ASSIGN(
      v1::RequestReport after,
      RunRequest(prefill, decode, ForDecode("after-garbage", 500, "it-prefill")));
  EXPECT_EQ(after.state(), v1::REQUEST_STATE_SUCCESS) << Describe(after);
  EXPECT_TRUE(after.verified()) << Describe(after);
  KVT_ASSERT_OK_AND_ASSIGN(const v1::AgentStatsReply stats, Stats(prefill));
  EXPECT_EQ(stats.succeeded(), 1u);
}

constexpr char kGoodToken[] = "it-cluster-token-0123456789abcdef";
constexpr char kWrongToken[] = "it-wrong-token-fedcba9876543210";

class ClusterTokenTest : public ClusterTest {
 protected:
  std::string ClusterToken() const override { return kGoodToken; }
};

StatusOr<std::unique_ptr<control::ControlClient>> ConnectWithToken(uint16_t port,
                                                                   const std::string& token) {
  control::ControlClientOptions options;
  options.port = port;
  options.client_id = "it-intruder";
  options.cluster_token = token;
  options.connect_timeout = 5s;
  return control::ControlClient::Connect(options);
}

// Every server refuses a client with another token (or none); the right token works, and the
// decode agent's own connections (bootstrap, prefill engine) authenticate with it.
TEST_F(ClusterTokenTest, WrongTokenIsRefusedRightTokenWorks) {
  KVT_ASSERT_OK_AND_ASSIGN(auto agents,
                           cluster_->StartAgents({Prefill("it-prefill"), Decode("it-decode")}));
  const std::vector<std::pair<std::string, uint16_t>> ports = {
      {"bootstrap", cluster_->bootstrap_port()},
      {"prefill engine", agents[0]->engine_port},
      {"prefill rpc", agents[0]->rpc_port},
      {"decode rpc", agents[1]->rpc_port}};
  for (const auto& [what, port] : ports) {
    SCOPED_TRACE(what + " port " + std::to_string(port));
    auto wrong = ConnectWithToken(port, kWrongToken);
    ASSERT_FALSE(wrong.ok()) << "a client with the wrong token got in";
    EXPECT_NE(wrong.status().message().find("authentication failed"), std::string::npos)
        << wrong.status().ToString();
    auto none = ConnectWithToken(port, "");
    ASSERT_FALSE(none.ok()) << "a client without a token got in";
    EXPECT_NE(none.status().message().find("requires authentication"), std::string::npos)
        << none.status().ToString();
    // The same client with the right token gets in: the refusals above were about the token.
    KVT_ASSERT_OK(ConnectWithToken(port, kGoodToken).status());
  }
  // The RPC client with the right token, through the environment like every kvt tool.
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient prefill, ConnectRpc(agents[0]->rpc_port));
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient decode, ConnectRpc(agents[1]->rpc_port));
  KVT_ASSERT_OK_AND_ASSIGN(const v1::AgentStatsReply stats, Stats(decode));
  EXPECT_EQ(stats.name(), "it-decode");
  // Both agents registered under the token, and the decode agent resolves the prefill by name
  // (bootstrap look-up) and pulls its KV over an authenticated engine connection.
  KVT_ASSERT_OK_AND_ASSIGN(v1::RequestReport report,
                           RunRequest(prefill, decode, ForDecode("with-token", 777, "it-prefill")));
  EXPECT_EQ(report.state(), v1::REQUEST_STATE_SUCCESS) << Describe(report);
  EXPECT_TRUE(report.verified()) << Describe(report);
  EXPECT_EQ(report.mismatches(), 0u) << Describe(report);
}

using LayoutMismatchTest = ClusterTest;

// The message the decode agent gives for `room`: its SubmitReply's when it refused the
// request, else the failed request's.
StatusOr<std::string> RefusalMessage(tools::RpcClient& decode, const SubmitArgs& args) {
  KVT_ASSIGN_OR_RETURN(v1::SubmitReply reply, Submit(decode, args));
  if (reply.status() != v1::STATUS_CODE_OK) {
    if (reply.status() != v1::STATUS_CODE_FAILED_PRECONDITION) {
      return Internal("expected FAILED_PRECONDITION, got " + v1::StatusCode_Name(reply.status()) +
                      ": " + reply.message());
    }
    return reply.message();
  }
  KVT_ASSIGN_OR_RETURN(v1::RequestReport report, WaitFinal(decode, args.room, 10s));
  if (report.state() != v1::REQUEST_STATE_FAILED) {
    return Internal("a mismatched layout was accepted: " + Describe(report));
  }
  return report.message();
}

// Decode agents with another page size or layer count are refused with both values named; the
// prefill keeps serving a decode agent whose layout matches.
TEST_F(LayoutMismatchTest, RefusalNamesBothValues) {
  AgentSpec page32 = Decode("it-decode-page32");
  page32.layout.page_size = 32;
  AgentSpec layers8 = Decode("it-decode-layers8");
  layers8.layout.layers = 8;
  KVT_ASSERT_OK_AND_ASSIGN(auto agents, cluster_->StartAgents({Prefill("it-prefill"), page32,
                                                               layers8, Decode("it-decode")}));
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient prefill, ConnectRpc(agents[0]->rpc_port));
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient decode_page32, ConnectRpc(agents[1]->rpc_port));
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient decode_layers8, ConnectRpc(agents[2]->rpc_port));
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient decode, ConnectRpc(agents[3]->rpc_port));

  KVT_ASSERT_OK_AND_ASSIGN(
      std::string page_message,
      RefusalMessage(decode_page32, ForDecode("page-mismatch", 64, "it-prefill")));
  EXPECT_TRUE(std::regex_search(
      page_message, std::regex("page_size (prefill=16 decode=32|decode=32 prefill=16)")))
      << page_message;

  // By address this time, past the bootstrap.
  KVT_ASSERT_OK_AND_ASSIGN(
      std::string layer_message,
      RefusalMessage(decode_layers8,
                     ForDecodeAt("layer-mismatch", 64, agents[0]->engine_address())));
  EXPECT_TRUE(std::regex_search(layer_message,
                                std::regex("num_layers (prefill=4 decode=8|decode=8 prefill=4)")))
      << layer_message;

  for (AgentProcess* agent : agents) {
    ASSERT_TRUE(agent->process.running()) << agent->spec.name << " died";
  }
  // Refused rooms hold no pages on the refusing agents.
  KVT_ASSERT_OK_AND_ASSIGN(const v1::AgentStatsReply refused, Stats(decode_page32));
  EXPECT_EQ(refused.submitted(), 0u);
  KVT_ASSERT_OK_AND_ASSIGN(v1::RequestReport ok,
                           RunRequest(prefill, decode, ForDecode("matching", 64, "it-prefill")));
  EXPECT_EQ(ok.state(), v1::REQUEST_STATE_SUCCESS) << Describe(ok);
  EXPECT_TRUE(ok.verified()) << Describe(ok);
}

}  // namespace
}  // namespace kvt::integration

// ControlServer and ControlClient over 127.0.0.1. Every wait is bounded; raw POSIX sockets play
// the misbehaving peers.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "control/auth.h"
#include "control/control_client.h"
#include "control/control_server.h"
#include "control/framing.h"
#include "control/lane.h"
#include "control/protocol.h"
#include "test_messages.h"

namespace kvt::control {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

const std::string kToken = "test-cluster-token-0123456789abcdef";
constexpr auto kWait = 5s;  // upper bound for anything that should happen "soon"

// Records the server's events; echoes every message back with reply_to set.
class RecordingHandler : public ControlHandler {
 public:
  void set_server(ControlServer* server) { server_.store(server); }
  // Runs on the io thread before each echo (set before the connection starts).
  void set_before_echo(std::function<void(const v1::Envelope&)> hook) {
    before_echo_ = std::move(hook);
  }

  void OnConnect(ConnectionId id, const ConnectionInfo& info) override {
    std::lock_guard<std::mutex> lock(mutex_);
    connects_.push_back(info);
    changed_.notify_all();
  }
  void OnMessage(ConnectionId id, const v1::Envelope& envelope) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      messages_.emplace_back(id, envelope);
      changed_.notify_all();
    }
    if (before_echo_) before_echo_(envelope);
    if (ControlServer* server = server_.load()) {
      v1::Envelope reply = envelope;
      reply.set_reply_to(envelope.id());
      (void)server->Send(id, reply);
    }
  }
  void OnDisconnect(ConnectionId id, const Status& why) override {
    std::lock_guard<std::mutex> lock(mutex_);
    disconnects_.emplace_back(id, why);
    changed_.notify_all();
  }

  bool WaitFor(const std::function<bool()>& done, std::chrono::milliseconds timeout = kWait) {
    std::unique_lock<std::mutex> lock(mutex_);
    return changed_.wait_for(lock, timeout, done);
  }
  size_t connects() {
    std::lock_guard<std::mutex> lock(mutex_);
    return connects_.size();
  }
  std::vector<ConnectionInfo> connect_infos() {
    std::lock_guard<std::mutex> lock(mutex_);
    return connects_;
  }
  std::vector<std::pair<ConnectionId, v1::Envelope>> messages() {
    std::lock_guard<std::mutex> lock(mutex_);
    return messages_;
  }
  std::vector<std::pair<ConnectionId, Status>> disconnects() {
    std::lock_guard<std::mutex> lock(mutex_);
    return disconnects_;
  }
  // Unlocked views for WaitFor predicates (which run under the lock).
  size_t connects_locked() const { return connects_.size(); }
  size_t messages_locked() const { return messages_.size(); }
  size_t disconnects_locked() const { return disconnects_.size(); }

 private:
  std::atomic<ControlServer*> server_{nullptr};
  std::function<void(const v1::Envelope&)> before_echo_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<ConnectionInfo> connects_;
  std::vector<std::pair<ConnectionId, v1::Envelope>> messages_;
  std::vector<std::pair<ConnectionId, Status>> disconnects_;
};

// A blocking TCP client with receive timeouts, to send arbitrary bytes.
class RawClient {
 public:
  explicit RawClient(uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    timeval tv{};
    tv.tv_sec = 5;
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~RawClient() {
    if (fd_ >= 0) ::close(fd_);
  }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  bool connected() const { return connected_; }

  bool SendBytes(std::string_view bytes) {
    while (!bytes.empty()) {
      ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (n <= 0) return false;
      bytes.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }
  bool SendEnvelope(const v1::Envelope& envelope) { return SendBytes(*EncodeFrame(envelope)); }
  void ShutdownWrite() { ::shutdown(fd_, SHUT_WR); }

  // The next frame; Unavailable at EOF / reset, DeadlineExceeded after 5 s of silence.
  StatusOr<v1::Envelope> ReadFrame() {
    char buffer[4096];
    while (true) {
      if (decoder_.frame_ready()) {
        v1::Envelope envelope;
        KVT_RETURN_IF_ERROR(decoder_.Take(&envelope));
        return envelope;
      }
      if (!pending_.empty()) {
        KVT_ASSIGN_OR_RETURN(size_t used, decoder_.Feed(pending_));
        pending_.erase(0, used);
        continue;
      }
      ssize_t n = ::recv(fd_, buffer, sizeof(buffer), 0);
      if (n == 0) return Unavailable("eof");
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return DeadlineExceeded("recv timed out");
        return Unavailable("recv failed");
      }
      pending_.append(buffer, static_cast<size_t>(n));
    }
  }

  // Reads frames until an Error frame (skipping the challenge and any echoes).
  StatusOr<v1::Error> ReadError() {
    for (int i = 0; i < 100; ++i) {
      KVT_ASSIGN_OR_RETURN(v1::Envelope envelope, ReadFrame());
      if (envelope.has_error()) return envelope.error();
    }
    return Internal("no error frame among 100 frames");
  }

  // True when the server closed the connection (EOF or reset) within the receive timeout.
  bool WaitForClose() {
    char buffer[4096];
    while (true) {
      ssize_t n = ::recv(fd_, buffer, sizeof(buffer), 0);
      if (n == 0) return true;
      if (n < 0) return errno == ECONNRESET;
    }
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
  FrameDecoder decoder_;
  std::string pending_;
};

std::string Header(uint32_t length) {
  return std::string{static_cast<char>(length >> 24), static_cast<char>(length >> 16),
                     static_cast<char>(length >> 8), static_cast<char>(length)};
}

class ControlServerTest : public ::testing::Test {
 protected:
  void StartServer(ControlServerOptions options = {}) {
    options.bind_address = "127.0.0.1";
    options_ = options;
    auto server = ControlServer::Create(options, &handler_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(server).value();
    handler_.set_server(server_.get());
  }

  void TearDown() override {
    handler_.set_server(nullptr);
    if (server_) server_->Stop();
  }

  ControlClientOptions ClientOptions(const std::string& id = "client") {
    ControlClientOptions options;
    options.port = server_->port();
    options.client_id = id;
    options.connect_timeout = 2000ms;
    options.limits.handshake_timeout = 2000ms;
    return options;
  }

  std::unique_ptr<ControlClient> Connect(ControlClientOptions options) {
    auto client = ControlClient::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? std::move(client).value() : nullptr;
  }

  // One echo round trip through `client`.
  void ExpectEcho(ControlClient& client, uint64_t id = 77) {
    v1::Envelope request = testing::MakeAgentRegistration();
    request.set_id(id);
    ASSERT_TRUE(client.Send(request).ok());
    StatusOr<v1::Envelope> reply = client.Receive(kWait);
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_EQ(reply->reply_to(), id);
    EXPECT_TRUE(reply->has_register_agent());
  }

  RecordingHandler handler_;
  ControlServerOptions options_;
  std::unique_ptr<ControlServer> server_;
};

TEST_F(ControlServerTest, EchoesToSeveralClients) {
  ControlServerOptions options;
  options.num_threads = 2;
  StartServer(options);
  constexpr int kClients = 4;
  constexpr int kMessages = 25;
  std::vector<std::unique_ptr<ControlClient>> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.push_back(Connect(ClientOptions("client-" + std::to_string(c))));
    ASSERT_NE(clients.back(), nullptr);
  }
  ASSERT_TRUE(handler_.WaitFor([&] { return handler_.connects_locked() == kClients; }));
  for (int c = 0; c < kClients; ++c) {
    v1::Envelope hello = testing::MakeHello();
    hello.set_id(1000);
    ASSERT_TRUE(clients[c]->Send(hello).ok());
    for (int m = 0; m < kMessages; ++m) {
      v1::Envelope request =
          testing::MakeTransferRequest("room-" + std::to_string(c) + "-" + std::to_string(m));
      request.set_id(m + 1);
      ASSERT_TRUE(clients[c]->Send(request).ok());
    }
  }
  for (int c = 0; c < kClients; ++c) {
    StatusOr<v1::Envelope> hello = clients[c]->Receive(kWait);
    ASSERT_TRUE(hello.ok()) << hello.status();
    EXPECT_TRUE(hello->has_hello());
    for (int m = 0; m < kMessages; ++m) {
      StatusOr<v1::Envelope> reply = clients[c]->Receive(kWait);
      ASSERT_TRUE(reply.ok()) << reply.status();
      EXPECT_EQ(reply->reply_to(), static_cast<uint64_t>(m + 1));
      EXPECT_EQ(reply->transfer_request().room_id(),
                "room-" + std::to_string(c) + "-" + std::to_string(m));
    }
  }
  EXPECT_EQ(handler_.messages().size(), static_cast<size_t>(kClients * (kMessages + 1)));
  EXPECT_EQ(server_->connection_count(), static_cast<size_t>(kClients));
  clients.clear();
  ASSERT_TRUE(handler_.WaitFor([&] { return handler_.disconnects_locked() == kClients; }));
  EXPECT_EQ(server_->connection_count(), 0u);
}

TEST_F(ControlServerTest, ClientWithHandlerGetsMessagesAndDisconnect) {
  StartServer();
  struct Handler : ControlClient::Handler {
    std::mutex mutex;
    std::condition_variable changed;
    std::vector<v1::Envelope> messages;
    std::optional<Status> disconnected;
    void OnMessage(const v1::Envelope& envelope) override {
      std::lock_guard<std::mutex> lock(mutex);
      messages.push_back(envelope);
      changed.notify_all();
    }
    void OnDisconnect(const Status& why) override {
      std::lock_guard<std::mutex> lock(mutex);
      disconnected = why;
      changed.notify_all();
    }
  } client_handler;
  auto client = ControlClient::Connect(ClientOptions(), &client_handler);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->server_id(), "kvt");
  EXPECT_EQ((*client)->Receive(10ms).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*client)->Send(testing::MakeAgentRegistration()).ok());
  {
    std::unique_lock<std::mutex> lock(client_handler.mutex);
    ASSERT_TRUE(client_handler.changed.wait_for(lock, kWait,
                                                [&] { return !client_handler.messages.empty(); }));
  }
  ASSERT_TRUE(handler_.WaitFor([&] { return handler_.connects_locked() == 1; }));
  const ConnectionId id = handler_.connect_infos()[0].id;
  ASSERT_TRUE(server_->Disconnect(id, Aborted("test says bye")).ok());
  {
    std::unique_lock<std::mutex> lock(client_handler.mutex);
    ASSERT_TRUE(client_handler.changed.wait_for(
        lock, kWait, [&] { return client_handler.disconnected.has_value(); }));
  }
  EXPECT_FALSE((*client)->connected());
  EXPECT_EQ((*client)->Send(testing::MakeHeartbeat()).code(), StatusCode::kUnavailable);
  ASSERT_TRUE(handler_.WaitFor([&] { return handler_.disconnects_locked() == 1; }));
  EXPECT_EQ(handler_.disconnects()[0].second.code(), StatusCode::kAborted);
  EXPECT_EQ(server_->Send(id, testing::MakeHeartbeat()).code(), StatusCode::kNotFound);
}

TEST_F(ControlServerTest, GarbageGetsErrorFrameAndDisconnectOthersUnaffected) {
  StartServer();
  auto good = Connect(ClientOptions("good"));
  ASSERT_NE(good, nullptr);
  RawClient raw(server_->port());
  ASSERT_TRUE(raw.connected());
  ASSERT_TRUE(raw.SendBytes(Header(8) + std::string(8, '\xff')));
  StatusOr<v1::Error> error = raw.ReadError();
  ASSERT_TRUE(error.ok()) << error.status();
  EXPECT_EQ(error->code(), v1::STATUS_CODE_MALFORMED_FRAME);
  EXPECT_THAT(error->message(), HasSubstr("not a kvt.v1.Envelope"));
  EXPECT_TRUE(raw.WaitForClose());
  ExpectEcho(*good);
  ASSERT_TRUE(handler_.WaitFor([&] { return handler_.disconnects_locked() == 1; }));
  EXPECT_EQ(handler_.disconnects()[0].second.code(), StatusCode::kDataLoss);
}

TEST_F(ControlServerTest, OversizedFrameIsRefusedFromItsHeader) {
  ControlServerOptions options;
  options.limits.max_frame_bytes = 4096;
  StartServer(options);
  auto good = Connect(ClientOptions("good"));
  ASSERT_NE(good, nullptr);
  RawClient raw(server_->port());
  ASSERT_TRUE(raw.SendBytes(Header(1u << 20)));  // no payload follows: refused from the header
  StatusOr<v1::Error> error = raw.ReadError();
  ASSERT_TRUE(error.ok()) << error.status();
  EXPECT_EQ(error->code(), v1::STATUS_CODE_MALFORMED_FRAME);
  EXPECT_THAT(error->message(), HasSubstr("1048576 bytes exceeds max_frame_bytes = 4096"));
  EXPECT_TRUE(raw.WaitForClose());
  ExpectEcho(*good);
}

TEST_F(ControlServerTest, ZeroLengthFrameIsRefused) {
  StartServer();
  RawClient raw(server_->port());
  ASSERT_TRUE(raw.SendBytes(Header(0)));
  StatusOr<v1::Error> error = raw.ReadError();
  ASSERT_TRUE(error.ok()) << error.status();
  EXPECT_THAT(error->message(), HasSubstr("zero-length frame"));
  EXPECT_TRUE(raw.WaitForClose());
}

TEST_F(ControlServerTest, EnvelopeWithoutBodyIsRefused) {
  StartServer();
  RawClient raw(server_->port());
  v1::Envelope empty;
  empty.set_id(5);
  const std::string payload = empty.SerializeAsString();
  ASSERT_TRUE(raw.SendBytes(Header(static_cast<uint32_t>(payload.size())) + payload));
  StatusOr<v1::Error> error = raw.ReadError();
  ASSERT_TRUE(error.ok()) << error.status();
  EXPECT_EQ(error->code(), v1::STATUS_CODE_MALFORMED_FRAME);
  EXPECT_THAT(error->message(), HasSubstr("no message body"));
  EXPECT_TRUE(raw.WaitForClose());
}

TEST_F(ControlServerTest, TruncatedFrameThenCloseDisconnectsOnlyThatPeer) {
  StartServer();
  auto good = Connect(ClientOptions("good"));
  ASSERT_NE(good, nullptr);
  {
    RawClient raw(server_->port());
    ASSERT_TRUE(raw.SendBytes(Header(100) + std::string(10, 'x')));
    raw.ShutdownWrite();
    EXPECT_TRUE(raw.WaitForClose());
  }
  ASSERT_TRUE(handler_.WaitFor([&] { return handler_.disconnects_locked() == 1; }));
  EXPECT_EQ(handler_.disconnects()[0].second.code(), StatusCode::kUnavailable);
  ExpectEcho(*good);
  EXPECT_EQ(server_->connection_count(), 1u);
}

TEST_F(ControlServerTest, StalledTruncatedFrameHitsIdleTimeout) {
  ControlServerOptions options;
  options.limits.idle_timeout = 300ms;
  StartServer(options);
  RawClient raw(server_->port());
  ASSERT_TRUE(raw.SendBytes(Header(100) + std::string(10, 'x')));
  const auto start = std::chrono::steady_clock::now();
  StatusOr<v1::Error> error = raw.ReadError();
  ASSERT_TRUE(error.ok()) << error.status();
  EXPECT_EQ(error->code(), v1::STATUS_CODE_DEADLINE_EXCEEDED);
  EXPECT_THAT(error->message(), HasSubstr("idle timeout"));
  EXPECT_TRUE(raw.WaitForClose());
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
}

TEST_F(ControlServerTest, InvalidMessageIsRefusedAndNotDispatched) {
  StartServer();
  auto bad = Connect(ClientOptions("bad"));
  auto good = Connect(ClientOptions("good"));
  ASSERT_NE(bad, nullptr);
  ASSERT_NE(good, nullptr);
  ASSERT_TRUE(bad->Send(testing::MakeHello()).ok());  // advertises 65 pages
  v1::Envelope request = testing::MakeTransferRequest();
  request.mutable_transfer_request()->set_dst_page_ids(3, 65);
  ASSERT_TRUE(bad->Send(request).ok());
  StatusOr<v1::Envelope> echo = bad->Receive(kWait);
  ASSERT_TRUE(echo.ok()) << echo.status();
  EXPECT_TRUE(echo->has_hello());
  StatusOr<v1::Envelope> error = bad->Receive(kWait);
  ASSERT_TRUE(error.ok()) << error.status();
  ASSERT_TRUE(error->has_error());
  EXPECT_EQ(error->error().code(), v1::STATUS_CODE_INVALID_ARGUMENT);
  EXPECT_THAT(error->error().message(),
              HasSubstr("transfer_request.dst_page_ids[3] = 65: the pool has pages 1..64"));
  StatusOr<v1::Envelope> after = bad->Receive(kWait);
  EXPECT_FALSE(after.ok());
  EXPECT_NE(after.status().code(), StatusCode::kDeadlineExceeded) << after.status();
  ExpectEcho(*good);
  for (const auto& [id, envelope] : handler_.messages()) {
    EXPECT_FALSE(envelope.has_transfer_request()) << "an invalid request reached the handler";
  }
}

TEST_F(ControlServerTest, ProtocolVersionMismatchAtHello) {
  StartServer();
  auto client = Connect(ClientOptions());
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->Send(testing::MakeHello(kProtocolVersion + 98)).ok());
  StatusOr<v1::Envelope> reply = client->Receive(kWait);
  ASSERT_TRUE(reply.ok()) << reply.status();
  ASSERT_TRUE(reply->has_error());
  EXPECT_EQ(reply->error().code(), v1::STATUS_CODE_PROTOCOL_VERSION_MISMATCH);
  EXPECT_THAT(reply->error().message(),
              HasSubstr("peer speaks " + std::to_string(kProtocolVersion + 98) +
                        ", this side speaks " + std::to_string(kProtocolVersion)));
  StatusOr<v1::Envelope> after = client->Receive(kWait);
  EXPECT_FALSE(after.ok());
  EXPECT_NE(after.status().code(), StatusCode::kDeadlineExceeded) << after.status();
  EXPECT_TRUE(handler_.messages().empty());
}

TEST_F(ControlServerTest, ClientChecksTheServersHelloAckVersionToo) {
  StartServer();
  auto client = Connect(ClientOptions());
  ASSERT_NE(client, nullptr);
  // The echo handler sends our HelloAck straight back: the client must refuse version 7.
  v1::Envelope ack;
  ack.mutable_hello_ack()->set_protocol_version(7);
  *ack.mutable_hello_ack()->mutable_peer() = testing::MakePeerInfo();
  ASSERT_TRUE(client->Send(ack).ok());
  // The server refuses it first (it checks too), so either side's refusal closes the link.
  StatusOr<v1::Envelope> reply = client->Receive(kWait);
  ASSERT_TRUE(reply.ok()) << reply.status();
  ASSERT_TRUE(reply->has_error());
  EXPECT_THAT(reply->error().message(),
              HasSubstr("peer speaks 7, this side speaks " + std::to_string(kProtocolVersion)));
}

TEST_F(ControlServerTest, AuthWithTheRightTokenSucceeds) {
  ControlServerOptions options;
  options.cluster_token = kToken;
  options.server_id = "registry";
  StartServer(options);
  ControlClientOptions client_options = ClientOptions("decode-7");
  client_options.cluster_token = kToken;
  client_options.role = v1::ROLE_DECODE;
  auto client = Connect(client_options);
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client->server_id(), "registry");
  ExpectEcho(*client);
  ASSERT_TRUE(handler_.WaitFor([&] { return handler_.connects_locked() == 1; }));
  const ConnectionInfo info = handler_.connect_infos()[0];
  EXPECT_TRUE(info.authenticated);
  EXPECT_EQ(info.peer_id, "decode-7");
  EXPECT_EQ(info.role, v1::ROLE_DECODE);
  EXPECT_THAT(info.remote_address, HasSubstr("127.0.0.1:"));
}

TEST_F(ControlServerTest, AuthWithoutMutualProofSucceeds) {
  ControlServerOptions options;
  options.cluster_token = kToken;
  StartServer(options);
  ControlClientOptions client_options = ClientOptions();
  client_options.cluster_token = kToken;
  client_options.require_server_proof = false;
  auto client = Connect(client_options);
  ASSERT_NE(client, nullptr);
  ExpectEcho(*client);
}

TEST_F(ControlServerTest, AuthWithAWrongTokenIsRefused) {
  ControlServerOptions options;
  options.cluster_token = kToken;
  StartServer(options);
  ControlClientOptions client_options = ClientOptions("intruder");
  client_options.cluster_token = "a-different-token-0123456789";
  auto client = ControlClient::Connect(client_options);
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(client.status().message(), HasSubstr("authentication failed"));
  EXPECT_EQ(handler_.connects(), 0u);
  // The server goes on serving the others.
  ControlClientOptions good = ClientOptions("good");
  good.cluster_token = kToken;
  auto good_client = Connect(good);
  ASSERT_NE(good_client, nullptr);
  ExpectEcho(*good_client);
}

TEST_F(ControlServerTest, ClientWithoutTokenIsToldToSetOne) {
  ControlServerOptions options;
  options.cluster_token = kToken;
  StartServer(options);
  auto client = ControlClient::Connect(ClientOptions());
  ASSERT_FALSE(client.ok());
  EXPECT_THAT(client.status().message(), HasSubstr("requires authentication"));
  EXPECT_THAT(client.status().message(), HasSubstr("KVT_CLUSTER_TOKEN"));
}

TEST_F(ControlServerTest, NoAuthResponseWithinTheTimeout) {
  ControlServerOptions options;
  options.cluster_token = kToken;
  options.limits.handshake_timeout = 300ms;
  StartServer(options);
  RawClient raw(server_->port());
  StatusOr<v1::Envelope> challenge = raw.ReadFrame();
  ASSERT_TRUE(challenge.ok()) << challenge.status();
  ASSERT_TRUE(challenge->has_auth_challenge());
  EXPECT_TRUE(challenge->auth_challenge().auth_required());
  EXPECT_EQ(challenge->auth_challenge().nonce().size(), kAuthNonceBytes);
  const auto start = std::chrono::steady_clock::now();
  StatusOr<v1::Error> error = raw.ReadError();
  ASSERT_TRUE(error.ok()) << error.status();
  EXPECT_EQ(error->code(), v1::STATUS_CODE_UNAUTHENTICATED);
  EXPECT_THAT(error->message(), HasSubstr("authentication timed out"));
  EXPECT_TRUE(raw.WaitForClose());
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
  EXPECT_EQ(handler_.connects(), 0u);
}

TEST_F(ControlServerTest, MessagesBeforeAuthAreRefused) {
  ControlServerOptions options;
  options.cluster_token = kToken;
  StartServer(options);
  RawClient raw(server_->port());
  ASSERT_TRUE(raw.SendEnvelope(testing::MakeTransferRequest()));
  StatusOr<v1::Error> error = raw.ReadError();
  ASSERT_TRUE(error.ok()) << error.status();
  EXPECT_EQ(error->code(), v1::STATUS_CODE_UNAUTHENTICATED);
  EXPECT_THAT(error->message(), HasSubstr("must be auth_response, got transfer_request"));
  EXPECT_TRUE(raw.WaitForClose());
  EXPECT_TRUE(handler_.messages().empty());
}

TEST_F(ControlServerTest, ClientWithTokenRefusesUnauthenticatedServer) {
  StartServer();
  ControlClientOptions client_options = ClientOptions();
  client_options.cluster_token = kToken;
  auto client = ControlClient::Connect(client_options);
  ASSERT_FALSE(client.ok());
  EXPECT_THAT(client.status().message(), HasSubstr("does not authenticate"));
  client_options.require_server_proof = false;
  auto lenient = Connect(client_options);
  ASSERT_NE(lenient, nullptr);
  ExpectEcho(*lenient);
}

// A TCP listener on 127.0.0.1 with a port of the kernel's choice (`*port`); -1 on failure.
int LoopbackListener(uint16_t* port) {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (listener < 0 || ::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(listener, 1) != 0 ||
      ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    if (listener >= 0) ::close(listener);
    return -1;
  }
  *port = ntohs(addr.sin_port);
  return listener;
}

// A fake server that knows a different token: the client's mutual check must catch it.
TEST(ControlClientTest, RefusesServerThatCannotProveTheToken) {
  uint16_t listen_port = 0;
  const int listener = LoopbackListener(&listen_port);
  ASSERT_GE(listener, 0);
  const uint16_t port = listen_port;

  std::thread fake([listener] {
    int fd = ::accept(listener, nullptr, nullptr);
    if (fd < 0) return;
    timeval tv{};
    tv.tv_sec = 5;
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    v1::Envelope challenge;
    challenge.mutable_auth_challenge()->set_auth_required(true);
    challenge.mutable_auth_challenge()->set_nonce(std::string(kAuthNonceBytes, 'n'));
    challenge.mutable_auth_challenge()->set_server_id("impostor");
    const std::string frame = *EncodeFrame(challenge);
    (void)::send(fd, frame.data(), frame.size(), MSG_NOSIGNAL);
    char buffer[1024];
    (void)::recv(fd, buffer, sizeof(buffer), 0);  // the client's AuthResponse
    v1::Envelope result;
    result.mutable_auth_result()->set_server_mac(std::string(kAuthMacBytes, '\0'));
    const std::string reply = *EncodeFrame(result);
    (void)::send(fd, reply.data(), reply.size(), MSG_NOSIGNAL);
    while (::recv(fd, buffer, sizeof(buffer), 0) > 0) {
    }
    ::close(fd);
  });
  ControlClientOptions options;
  options.port = port;
  options.cluster_token = kToken;
  options.connect_timeout = 2000ms;
  options.limits.handshake_timeout = 2000ms;
  auto client = ControlClient::Connect(options);
  fake.join();
  ::close(listener);
  ASSERT_FALSE(client.ok());
  EXPECT_THAT(client.status().message(), HasSubstr("failed to prove the cluster token"));
}

// A peer that greets without authentication and then never reads: the client's send queue must
// fill up and refuse, not grow without bound, except for frames exempt from its limits.
TEST(ControlClientTest, SendQueueIsBounded) {
  uint16_t listen_port = 0;
  const int listener = LoopbackListener(&listen_port);
  ASSERT_GE(listener, 0);
  std::atomic<bool> done{false};
  std::thread silent([listener, &done] {
    int fd = ::accept(listener, nullptr, nullptr);
    if (fd < 0) return;
    v1::Envelope challenge;
    challenge.mutable_auth_challenge()->set_server_id("silent");
    const std::string frame = *EncodeFrame(challenge);
    (void)::send(fd, frame.data(), frame.size(), MSG_NOSIGNAL);
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (!done.load() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(10ms);
    }
    ::close(fd);
  });
  ControlClientOptions options;
  options.port = listen_port;
  options.limits.max_queued_bytes = 4u << 20;
  options.limits.close_linger = 100ms;
  auto client = ControlClient::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  v1::Envelope big = MakeErrorEnvelope(v1::STATUS_CODE_INTERNAL, "x");
  big.mutable_error()->set_message(std::string(256u << 10, 'b'));
  Status status;
  int sent = 0;
  for (; sent < 1000 && status.ok(); ++sent) status = (*client)->Send(big);
  EXPECT_EQ(status.code(), StatusCode::kResourceExhausted) << "sent " << sent << " frames";
  EXPECT_THAT(status.message(), HasSubstr("the peer reads too slowly"));
  // A frame the protocol cannot do without is queued past the limits; the limits hold again
  // for the next ordinary one.
  v1::Envelope final_message;
  final_message.mutable_transfer_done()->set_room_id("r");
  EXPECT_TRUE((*client)->Send(final_message, QueueLimit::kExempt).ok());
  EXPECT_EQ((*client)->Send(big).code(), StatusCode::kResourceExhausted);
  (*client)->Close();
  done.store(true);
  silent.join();
  ::close(listener);
}

// Frames one thread sends arrive in the order it sent them, also while the socket backs up
// and the connection switches between writing on the caller's thread and on its strand (a
// reader that reads in small bursts with pauses keeps the send buffer full and emptying).
TEST(ControlClientTest, FramesFromOneThreadArriveInOrderAgainstASlowReader) {
  uint16_t listen_port = 0;
  const int listener = LoopbackListener(&listen_port);
  ASSERT_GE(listener, 0);
  // A small receive window, so that the sender's socket backs up within a few frames.
  const int window = 8 << 10;
  ::setsockopt(listener, SOL_SOCKET, SO_RCVBUF, &window, sizeof(window));
  constexpr uint64_t kFrames = 20000;
  std::vector<uint64_t> ids;
  std::string failure;
  std::thread reader([&] {
    int fd = ::accept(listener, nullptr, nullptr);
    if (fd < 0) {
      failure = "accept failed";
      return;
    }
    v1::Envelope challenge;
    challenge.mutable_auth_challenge()->set_server_id("slow");
    const std::string frame = *EncodeFrame(challenge);
    (void)::send(fd, frame.data(), frame.size(), MSG_NOSIGNAL);
    timeval tv{};
    tv.tv_sec = 5;
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    FrameDecoder decoder;
    std::string pending;
    char buffer[2048];
    size_t since_pause = 0;
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (ids.size() < kFrames && std::chrono::steady_clock::now() < deadline) {
      const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
      if (n <= 0) {
        failure = "recv ended after " + std::to_string(ids.size()) + " frames";
        break;
      }
      pending.append(buffer, static_cast<size_t>(n));
      while (!pending.empty()) {
        StatusOr<size_t> used = decoder.Feed(pending);
        if (!used.ok()) {
          failure = used.status().ToString();
          break;
        }
        pending.erase(0, *used);
        if (!decoder.frame_ready()) break;
        v1::Envelope envelope;
        if (Status taken = decoder.Take(&envelope); !taken.ok()) {
          failure = taken.ToString();
          break;
        }
        if (envelope.has_transfer_request()) ids.push_back(envelope.id());
      }
      if (!failure.empty()) break;
      since_pause += static_cast<size_t>(n);
      if (since_pause > (8u << 10)) {  // a pause every 8 KiB: the sender's buffer fills again
        since_pause = 0;
        std::this_thread::sleep_for(20us);
      }
    }
    ::close(fd);
  });
  ControlClientOptions options;
  options.port = listen_port;
  options.limits.max_queued_bytes = 256u << 20;
  options.limits.max_queued_frames = 2 * kFrames;
  options.limits.close_linger = 100ms;
  auto client = ControlClient::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  v1::Envelope request = testing::MakeTransferRequest("ordered");
  for (int page = 0; page < 600; ++page) request.mutable_transfer_request()->add_dst_page_ids(page);
  for (uint64_t id = 1; id <= kFrames; ++id) {
    request.set_id(id);
    Status sent = (*client)->Send(request);
    ASSERT_TRUE(sent.ok()) << "frame " << id << ": " << sent;
  }
  reader.join();
  (*client)->Close();
  ::close(listener);
  EXPECT_EQ(failure, "");
  ASSERT_EQ(ids.size(), kFrames);
  for (uint64_t i = 0; i < kFrames; ++i) {
    ASSERT_EQ(ids[i], i + 1) << "the reader's frame number " << i + 1 << " is the one sent as "
                             << ids[i] << ": out of order";
  }
}

TEST(ControlClientTest, ConnectToAClosedPortFailsFast) {
  int probe = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(probe, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(probe, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(probe);  // bound, never listened: connecting is refused
  ControlClientOptions options;
  options.port = ntohs(addr.sin_port);
  options.connect_timeout = 2000ms;
  auto client = ControlClient::Connect(options);
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), StatusCode::kUnavailable);
}

TEST_F(ControlServerTest, RefusesConnectionsBeyondTheLimit) {
  ControlServerOptions options;
  options.max_connections = 1;
  StartServer(options);
  auto first = Connect(ClientOptions("first"));
  ASSERT_NE(first, nullptr);
  auto second = ControlClient::Connect(ClientOptions("second"));
  ASSERT_FALSE(second.ok());
  EXPECT_THAT(second.status().message(), HasSubstr("too many connections"));
  ExpectEcho(*first);
}

TEST_F(ControlServerTest, HeartbeatsKeepAnIdleConnectionOpen) {
  ControlServerOptions options;
  options.limits.idle_timeout = 300ms;
  StartServer(options);
  ControlClientOptions client_options = ClientOptions();
  client_options.limits.heartbeat_interval = 50ms;
  auto client = Connect(client_options);
  ASSERT_NE(client, nullptr);
  std::this_thread::sleep_for(900ms);
  EXPECT_TRUE(client->connected());
  ExpectEcho(*client);
  EXPECT_TRUE(handler_.messages().size() == 1u) << "heartbeats must not reach the handler";
}

TEST_F(ControlServerTest, SilentClientHitsTheIdleTimeout) {
  ControlServerOptions options;
  options.limits.idle_timeout = 300ms;
  StartServer(options);
  auto client = Connect(ClientOptions());
  ASSERT_NE(client, nullptr);
  StatusOr<v1::Envelope> error = client->Receive(kWait);
  ASSERT_TRUE(error.ok()) << error.status();
  ASSERT_TRUE(error->has_error());
  EXPECT_THAT(error->error().message(), HasSubstr("idle timeout"));
  StatusOr<v1::Envelope> after = client->Receive(kWait);
  EXPECT_FALSE(after.ok());
  EXPECT_FALSE(client->connected());
}

// Before authentication only a small frame (an auth_response) is accepted: a 15 MiB length
// prefix is refused from its 4 header bytes, so nothing is buffered for it.
TEST_F(ControlServerTest, LargeFrameBeforeAuthIsRefusedAtTheHeader) {
  ControlServerOptions options;
  options.cluster_token = kToken;
  options.limits.handshake_timeout = 10s;  // far beyond the waits below
  StartServer(options);
  RawClient raw(server_->port());
  StatusOr<v1::Envelope> challenge = raw.ReadFrame();
  ASSERT_TRUE(challenge.ok()) << challenge.status();
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(raw.SendBytes(Header(15u << 20)));  // no payload follows
  StatusOr<v1::Error> error = raw.ReadError();
  ASSERT_TRUE(error.ok()) << error.status();
  EXPECT_EQ(error->code(), v1::STATUS_CODE_MALFORMED_FRAME);
  EXPECT_THAT(error->message(), HasSubstr("15728640 bytes exceeds max_handshake_frame_bytes"));
  EXPECT_TRUE(raw.WaitForClose());
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  EXPECT_EQ(handler_.connects(), 0u);
}

// Sends one byte every `every` until the server closes the connection; returns how long that
// took (or `give_up`).
std::chrono::steady_clock::duration TrickleUntilClosed(RawClient& raw, std::string_view bytes,
                                                       std::chrono::milliseconds every,
                                                       std::chrono::milliseconds give_up) {
  const auto start = std::chrono::steady_clock::now();
  size_t next = 0;
  while (std::chrono::steady_clock::now() - start < give_up) {
    if (!raw.SendBytes(bytes.substr(next % bytes.size(), 1))) break;
    ++next;
    std::this_thread::sleep_for(every);
  }
  return std::chrono::steady_clock::now() - start;
}

// A frame trickled a byte at a time never completes the handshake: the deadline counts from the
// connect, and bytes do not reset it; without a token as with one.
TEST_F(ControlServerTest, TricklerWithoutTokenIsClosedAtTheHandshakeDeadline) {
  ControlServerOptions options;
  options.limits.handshake_timeout = 500ms;
  StartServer(options);
  RawClient raw(server_->port());
  const auto took = TrickleUntilClosed(raw, Header(100) + std::string(100, 'x'), 50ms, 5000ms);
  EXPECT_LT(took, 2s);
  StatusOr<v1::Error> error = raw.ReadError();
  ASSERT_TRUE(error.ok()) << error.status();
  EXPECT_EQ(error->code(), v1::STATUS_CODE_DEADLINE_EXCEEDED);
  EXPECT_THAT(error->message(), HasSubstr("no complete frame within 500 ms"));
}

TEST_F(ControlServerTest, TricklerWithTokenIsClosedAtTheHandshakeDeadline) {
  ControlServerOptions options;
  options.cluster_token = kToken;
  options.limits.handshake_timeout = 500ms;
  StartServer(options);
  RawClient raw(server_->port());
  const auto took = TrickleUntilClosed(raw, Header(100) + std::string(100, 'x'), 50ms, 5000ms);
  EXPECT_LT(took, 2s);
  StatusOr<v1::Error> error = raw.ReadError();
  ASSERT_TRUE(error.ok()) << error.status();
  EXPECT_EQ(error->code(), v1::STATUS_CODE_UNAUTHENTICATED);
  EXPECT_EQ(handler_.connects(), 0u);
}

// After the handshake, a frame must still complete within frame_timeout once it has begun:
// bytes that keep the idle timer fed do not keep a frame open forever.
TEST_F(ControlServerTest, FrameTrickledAfterTheHandshakeHitsTheFrameTimeout) {
  ControlServerOptions options;
  options.limits.frame_timeout = 500ms;
  StartServer(options);
  RawClient raw(server_->port());
  ASSERT_TRUE(raw.SendEnvelope(testing::MakeAgentRegistration()));  // a complete first frame
  ASSERT_TRUE(handler_.WaitFor([&] { return handler_.messages_locked() == 1; }));
  const auto took = TrickleUntilClosed(raw, Header(100) + std::string(100, 'x'), 50ms, 5000ms);
  EXPECT_LT(took, 2s);
  StatusOr<v1::Error> error = raw.ReadError();
  ASSERT_TRUE(error.ok()) << error.status();
  EXPECT_EQ(error->code(), v1::STATUS_CODE_DEADLINE_EXCEEDED);
  EXPECT_THAT(error->message(), HasSubstr("frame_timeout"));
}

// Connections that never authenticate fill max_connections; an authenticated client still gets
// in at once (the oldest connection still in its handshake makes room), and is served.
TEST_F(ControlServerTest, FloodOfUnauthenticatedConnectionsDoesNotLockOutClients) {
  ControlServerOptions options;
  options.cluster_token = kToken;
  options.max_connections = 8;
  options.limits.handshake_timeout = 3000ms;
  StartServer(options);
  std::vector<std::unique_ptr<RawClient>> flood;
  for (size_t i = 0; i < 2 * options.max_connections; ++i) {
    flood.push_back(std::make_unique<RawClient>(server_->port()));
    ASSERT_TRUE(flood.back()->SendBytes(Header(100)));  // a frame begun, never finished
  }
  ControlClientOptions client_options = ClientOptions("good");
  client_options.cluster_token = kToken;
  const auto start = std::chrono::steady_clock::now();
  auto client = Connect(client_options);
  ASSERT_NE(client, nullptr);
  ExpectEcho(*client);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s);
  EXPECT_LE(server_->connection_count(), 4 * options.max_connections);
}

TEST_F(ControlServerTest, StopDisconnectsEveryone) {
  StartServer();
  auto a = Connect(ClientOptions("a"));
  auto b = Connect(ClientOptions("b"));
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(handler_.WaitFor([&] { return handler_.connects_locked() == 2; }));
  server_->Stop();
  EXPECT_EQ(handler_.disconnects().size(), 2u);
  for (const auto& [id, why] : handler_.disconnects()) EXPECT_EQ(why.code(), StatusCode::kAborted);
  StatusOr<v1::Envelope> after = a->Receive(kWait);
  EXPECT_FALSE(after.ok());
  EXPECT_NE(after.status().code(), StatusCode::kDeadlineExceeded) << after.status();
  server_->Stop();  // idempotent
}

TEST_F(ControlServerTest, SendRefusesOversizedEnvelopes) {
  StartServer();
  ControlClientOptions client_options = ClientOptions();
  client_options.limits.max_frame_bytes = 256;
  auto client = Connect(client_options);
  ASSERT_NE(client, nullptr);
  Status status = client->Send(testing::MakeHello());
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("max_frame_bytes = 256"));
  EXPECT_EQ(client->Send(v1::Envelope()).code(), StatusCode::kInvalidArgument);
}

TEST(ControlServerOptionsTest, RefusesRemoteBindWithoutToken) {
  RecordingHandler handler;
  ControlServerOptions options;
  options.bind_address = "0.0.0.0";
  auto server = ControlServer::Create(options, &handler);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(server.status().message(), HasSubstr("without a cluster token"));
  EXPECT_THAT(server.status().message(), HasSubstr("KVT_CLUSTER_TOKEN"));
}

TEST(ControlServerOptionsTest, RefusesBadOptions) {
  RecordingHandler handler;
  ControlServerOptions options;
  options.cluster_token = "short";
  EXPECT_THAT(ControlServer::Create(options, &handler).status().message(),
              HasSubstr("cluster token is 5 bytes"));
  options = {};
  options.bind_address = "not-an-address";
  EXPECT_THAT(ControlServer::Create(options, &handler).status().message(),
              HasSubstr("is not an IP address"));
  options = {};
  EXPECT_FALSE(ControlServer::Create(options, nullptr).ok());
  options.num_threads = 0;
  EXPECT_FALSE(ControlServer::Create(options, &handler).ok());
  options = {};
  options.limits.max_handshake_frame_bytes = 100;
  EXPECT_THAT(ControlServer::Create(options, &handler).status().message(),
              HasSubstr("limits.max_handshake_frame_bytes = 100"));
  options = {};
  options.limits.handshake_timeout = 0ms;
  EXPECT_THAT(ControlServer::Create(options, &handler).status().message(),
              HasSubstr("limits.handshake_timeout = 0 ms"));
  options = {};
  options.limits.frame_timeout = -1ms;
  EXPECT_THAT(ControlServer::Create(options, &handler).status().message(),
              HasSubstr("limits.frame_timeout = -1 ms"));
}

// Busy polling (BusyPollOptions): frames flow both ways with polling io threads; while the hint
// says frames are expected the idle io threads keep polling (the hint is asked over and over),
// and once it says no they go back to sleep in the reactor (the count stops moving); Wake() and
// shutdown work while they poll. Bounded waits rather than fixed sleeps: a loaded machine may
// deschedule a polling thread for a while.
TEST_F(ControlServerTest, BusyPollingEndpointsPollWhileExpectingAndSleepOtherwise) {
  std::atomic<bool> server_expects{false}, client_expects{false};
  std::atomic<uint64_t> server_asked{0}, client_asked{0};
  ControlServerOptions options;
  options.busy_poll.window = 300us;
  options.busy_poll.hint = [&] {
    server_asked.fetch_add(1);
    return server_expects.load();
  };
  StartServer(options);
  ControlClientOptions copts = ClientOptions();
  copts.busy_poll.window = 300us;
  copts.busy_poll.hint = [&] {
    client_asked.fetch_add(1);
    return client_expects.load();
  };
  std::unique_ptr<ControlClient> client = Connect(copts);
  ASSERT_NE(client, nullptr);
  for (uint64_t id = 1; id <= 5; ++id) ExpectEcho(*client, id);

  // True once `count` grew by more than `by` (within 5 s).
  auto grows = [](const std::atomic<uint64_t>& count, uint64_t by) {
    const uint64_t from = count.load();
    const auto give_up = std::chrono::steady_clock::now() + 5s;
    while (count.load() - from <= by) {
      if (std::chrono::steady_clock::now() > give_up) return false;
      std::this_thread::sleep_for(1ms);
    }
    return true;
  };
  // True once `count` stood still for 30 ms (within 5 s).
  auto settles = [](const std::atomic<uint64_t>& count) {
    const auto give_up = std::chrono::steady_clock::now() + 5s;
    while (std::chrono::steady_clock::now() < give_up) {
      const uint64_t before = count.load();
      std::this_thread::sleep_for(30ms);
      if (count.load() == before) return true;
    }
    return false;
  };

  // Expecting: the io threads poll, asking the hint again and again with nothing arriving.
  server_expects = true;
  client_expects = true;
  client->Wake();
  server_->Wake();
  EXPECT_TRUE(grows(server_asked, 1000)) << "the server's io thread did not poll";
  EXPECT_TRUE(grows(client_asked, 1000)) << "the client's io thread did not poll";
  ExpectEcho(*client, 6);

  // Not expecting: after the window the threads sleep in the reactor; the hint is asked only
  // when a handler runs (none do while the connection is quiet).
  server_expects = false;
  client_expects = false;
  EXPECT_TRUE(settles(server_asked)) << "the server's io thread kept polling";
  EXPECT_TRUE(settles(client_asked)) << "the client's io thread kept polling";
  ExpectEcho(*client, 7);

  // Shutting down while polling.
  server_expects = true;
  client_expects = true;
  client->Wake();
  ExpectEcho(*client, 8);
  client.reset();
  ASSERT_TRUE(handler_.WaitFor([&] { return handler_.disconnects_locked() == 1; }));
  server_->Stop();
}

TEST(ControlServerOptionsTest, BusyPollingNeedsOneServerThread) {
  RecordingHandler handler;
  ControlServerOptions options;
  options.busy_poll.window = 100us;
  options.num_threads = 2;
  EXPECT_THAT(ControlServer::Create(options, &handler).status().message(),
              HasSubstr("busy_poll with num_threads = 2"));
}

TEST(ControlServerOptionsTest, NegativeBusyPollWindowIsRefused) {
  RecordingHandler handler;
  ControlServerOptions options;
  options.busy_poll.window = std::chrono::microseconds(-5);
  EXPECT_THAT(ControlServer::Create(options, &handler).status().message(),
              HasSubstr("busy_poll.window = -5 us"));
  ControlClientOptions copts;
  copts.port = 1;
  copts.busy_poll.window = std::chrono::microseconds(-5);
  EXPECT_THAT(ControlClient::Connect(copts).status().message(),
              HasSubstr("busy_poll.window = -5 us"));
}

TEST(ControlServerOptionsTest, LocalhostAndIpv6LoopbackAreLoopback) {
  RecordingHandler handler;
  ControlServerOptions options;
  options.bind_address = "localhost";
  auto server = ControlServer::Create(options, &handler);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_NE((*server)->port(), 0);
}

// ---- Lanes (BusyPollOptions::lanes): shared memory between co-located polling endpoints ----

// A HelloAck of `num_layers` layers (about 240 bytes per layer): the client offers its lane once
// one comes back (the echo handler returns it).
v1::Envelope LaneHelloAck(uint32_t num_layers = 4) {
  v1::Envelope ack;
  ack.mutable_hello_ack()->set_protocol_version(kProtocolVersion);
  *ack.mutable_hello_ack()->mutable_peer() = testing::MakePeerInfo("decode-0", num_layers);
  return ack;
}

// True once `done` holds (within 5 s).
bool Eventually(const std::function<bool()>& done) {
  const auto give_up = std::chrono::steady_clock::now() + kWait;
  while (!done()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

class LaneTest : public ControlServerTest {
 protected:
  // Both ends poll for `window` after each frame and then sleep (no hint): frames that arrive
  // while a reader sleeps take the doorbell.
  void StartPolling(uint32_t ring_bytes = 4u << 10, std::chrono::microseconds window = 300us) {
    ControlServerOptions options;
    options.busy_poll.window = window;
    options.busy_poll.lane_ring_bytes = ring_bytes;
    StartServer(options);
    copts_ = ClientOptions();
    copts_.busy_poll.window = window;
    copts_.busy_poll.lane_ring_bytes = ring_bytes;
  }

  std::unique_ptr<ControlClient> ConnectWithLane() {
    std::unique_ptr<ControlClient> client = Connect(copts_);
    if (client == nullptr) return nullptr;
    EXPECT_TRUE(client->Send(LaneHelloAck()).ok());
    StatusOr<v1::Envelope> echo = client->Receive(kWait);
    EXPECT_TRUE(echo.ok() && echo->has_hello_ack()) << echo.status();
    EXPECT_TRUE(Eventually([&] { return client->using_lane(); })) << "no lane";
    return client;
  }

  // The LaneOffer of `lane`.
  static v1::Envelope OfferOf(const internal::Lane& lane) {
    v1::Envelope offer;
    offer.mutable_lane_offer()->set_name(lane.name());
    offer.mutable_lane_offer()->set_nonce(lane.nonce());
    offer.mutable_lane_offer()->set_ring_bytes(lane.ring_bytes());
    return offer;
  }

  // A raw client's side of the lane setup: offers `lane` (4 KiB rings), waits for the server to
  // accept it and switches its own frames to it.
  static Status SwitchToLane(RawClient& raw, const internal::Lane& lane) {
    if (!raw.SendEnvelope(OfferOf(lane))) return Unavailable("sending the lane offer failed");
    for (int i = 0; i < 10; ++i) {
      KVT_ASSIGN_OR_RETURN(v1::Envelope e, raw.ReadFrame());
      if (!e.has_lane_reply()) continue;
      if (!e.lane_reply().accepted()) {
        return FailedPrecondition("lane declined: " + e.lane_reply().reason());
      }
      v1::Envelope lane_switch;
      lane_switch.mutable_lane_switch();
      if (!raw.SendEnvelope(lane_switch)) return Unavailable("sending the lane switch failed");
      return OkStatus();
    }
    return Internal("no lane reply among 10 frames");
  }

  // A raw client's hello-ack, lane (4 KiB rings) and switch: the server polls its lane from now.
  static StatusOr<std::unique_ptr<internal::Lane>> OpenRawLane(RawClient& raw) {
    if (!raw.connected() || !raw.SendEnvelope(LaneHelloAck())) {
      return Unavailable("the raw client could not connect and send its hello-ack");
    }
    KVT_ASSIGN_OR_RETURN(std::unique_ptr<internal::Lane> lane, internal::Lane::Create(4096));
    KVT_RETURN_IF_ERROR(SwitchToLane(raw, *lane));
    return lane;
  }

  // The test's own mapping of a raw client's lane segment (4 KiB rings), to corrupt it.
  struct SegmentView {
    static constexpr size_t kBytes = 64 + 2 * (192 + 4096);
    void* base = nullptr;
    ~SegmentView() {
      if (base != nullptr) ::munmap(base, kBytes);
    }
  };

  // OpenRawLane, with the segment also mapped by the test, before the server removes its name.
  static void OpenViewedLane(RawClient& raw, std::unique_ptr<internal::Lane>& lane,
                             SegmentView& segment) {
    ASSERT_TRUE(raw.connected());
    ASSERT_TRUE(raw.SendEnvelope(LaneHelloAck()));
    auto created = internal::Lane::Create(4096);
    ASSERT_TRUE(created.ok()) << created.status();
    lane = std::move(created).value();
    const int fd = ::shm_open(lane->name().c_str(), O_RDWR, 0);
    ASSERT_GE(fd, 0);
    void* view = ::mmap(nullptr, SegmentView::kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    ASSERT_NE(view, MAP_FAILED);
    segment.base = view;
    const Status switched = SwitchToLane(raw, *lane);
    ASSERT_TRUE(switched.ok()) << switched;
  }

  ControlClientOptions copts_;
};

// Frames go both ways through the lane, in order, byte-exact, including frames several times
// the ring's size (they stream through it) sent back to back, and frames sent while the other
// end sleeps (the doorbell wakes it).
TEST_F(LaneTest, FramesFlowThroughTheLaneInOrderAndWakeASleepingReader) {
  StartPolling();
  std::unique_ptr<ControlClient> client = ConnectWithLane();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(Eventually([&] { return server_->lane_count() == 1; }));
  // 60 frames back to back, every third one ~15 KiB (a 64-layer HelloAck) through a 4 KiB ring.
  std::vector<v1::Envelope> sent;
  for (uint64_t i = 1; i <= 60; ++i) {
    v1::Envelope e = i % 3 == 0 ? LaneHelloAck(64) : testing::MakeAgentRegistration();
    e.set_id(1000 + i);
    ASSERT_TRUE(client->Send(e).ok()) << i;
    sent.push_back(e);
  }
  for (const v1::Envelope& e : sent) {
    StatusOr<v1::Envelope> echo = client->Receive(kWait);
    ASSERT_TRUE(echo.ok()) << echo.status();
    EXPECT_EQ(echo->reply_to(), e.id());
    v1::Envelope expected = e;
    expected.set_reply_to(e.id());
    EXPECT_EQ(echo->SerializeAsString(), expected.SerializeAsString()) << e.id();
  }
  // Both io threads go to sleep (nothing expected, the window passes); each frame then rings.
  for (uint64_t id = 1; id <= 5; ++id) {
    std::this_thread::sleep_for(20ms);
    ExpectEcho(*client, id);
  }
  EXPECT_TRUE(client->using_lane());
  EXPECT_EQ(server_->lane_count(), 1u);
}

// A frame the server puts in the lane while the write of its previous socket frame has not
// completed on its io thread (the bytes went out at once; the completion waits for the thread,
// busy in a handler) still rings the doorbell when the reader sleeps: that frame may have
// reached the reader already, which read the lane, found nothing and went to sleep.
TEST_F(LaneTest, ASleepingReaderIsRungWhileTheSwitchsWriteIsStillCompleting) {
  StartPolling();
  std::promise<void> entered, release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<bool> entered_once{false};
  handler_.set_before_echo([&](const v1::Envelope& e) {
    if (e.id() != 4242 || entered_once.exchange(true)) return;
    entered.set_value();
    (void)released.wait_for(10s);  // bounded: the test releases it within seconds
  });
  RawClient raw(server_->port());
  ASSERT_TRUE(raw.connected());
  ASSERT_TRUE(raw.SendEnvelope(LaneHelloAck()));
  for (int i = 0;; ++i) {  // the challenge, then the hello-ack's echo
    ASSERT_LT(i, 10);
    StatusOr<v1::Envelope> e = raw.ReadFrame();
    ASSERT_TRUE(e.ok()) << e.status();
    if (e->has_hello_ack()) break;
  }
  auto lane = internal::Lane::Create(4096);
  ASSERT_TRUE(lane.ok()) << lane.status();
  const v1::Envelope offer = OfferOf(**lane);
  v1::Envelope held = testing::MakeAgentRegistration();
  held.set_id(4242);
  // One send: the server reads both frames at once and handles the registration (held in the
  // hook) right after it queued the lane reply, before that write's completion runs.
  ASSERT_TRUE(raw.SendBytes(*EncodeFrame(offer) + *EncodeFrame(held)));
  const bool in_handler =
      entered.get_future().wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  if (!in_handler) release.set_value();
  ASSERT_TRUE(in_handler);
  bool accepted = false;
  for (int i = 0; i < 10 && !accepted; ++i) {
    StatusOr<v1::Envelope> e = raw.ReadFrame();
    if (!e.ok()) break;
    accepted = e->has_lane_reply() && e->lane_reply().accepted();
  }
  if (!accepted) release.set_value();
  ASSERT_TRUE(accepted) << "the lane reply went out at once";
  char buffer[64];
  auto n = (*lane)->Read(buffer, sizeof(buffer));
  ASSERT_TRUE(n.ok() && *n == 0);
  const bool arrived = (*lane)->Sleep();  // the reader sleeps: the next frame must ring
  release.set_value();
  ASSERT_FALSE(arrived);
  ASSERT_TRUE(Eventually([&] { return (*lane)->Readable(); })) << "the echo is in the lane";
  StatusOr<v1::Envelope> bell = raw.ReadFrame();
  ASSERT_TRUE(bell.ok()) << "no doorbell for a sleeping reader: " << bell.status();
  EXPECT_TRUE(bell->has_lane_doorbell());
}

// What a client put in the lane before it closed arrives before the disconnect.
TEST_F(LaneTest, FramesInTheLaneBeforeTheSocketEndsAreHandledFirst) {
  StartPolling();
  std::unique_ptr<ControlClient> client = ConnectWithLane();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(Eventually([&] { return server_->lane_count() == 1; }));
  handler_.set_server(nullptr);  // no echoes: the client is going away
  const size_t before = handler_.messages().size();
  for (uint64_t i = 1; i <= 100; ++i) {
    v1::Envelope e = i % 10 == 0 ? LaneHelloAck(64) : testing::MakeAgentRegistration();
    e.set_id(i);
    ASSERT_TRUE(client->Send(e).ok());
  }
  client->Close();
  ASSERT_TRUE(handler_.WaitFor([&] { return handler_.disconnects_locked() == 1; }));
  const auto messages = handler_.messages();
  ASSERT_EQ(messages.size(), before + 100);
  for (uint64_t i = 1; i <= 100; ++i) EXPECT_EQ(messages[before + i - 1].second.id(), i);
}

// A server that does not poll declines: frames stay on the socket and flow as before; so with
// lanes turned off on either side.
TEST_F(LaneTest, EndpointsThatDoNotPollOrRefuseLanesKeepTheSocket) {
  StartServer();  // sleeps in epoll
  ControlClientOptions polling = ClientOptions();
  polling.busy_poll.window = 300us;
  std::unique_ptr<ControlClient> client = Connect(polling);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->Send(LaneHelloAck()).ok());
  ASSERT_TRUE(client->Receive(kWait).ok());
  for (uint64_t id = 1; id <= 3; ++id) ExpectEcho(*client, id);
  EXPECT_FALSE(client->using_lane());
  EXPECT_EQ(server_->lane_count(), 0u);
  server_->Stop();

  ControlServerOptions no_lanes;
  no_lanes.busy_poll.window = 300us;
  no_lanes.busy_poll.lanes = false;
  StartServer(no_lanes);
  polling.port = server_->port();
  client = Connect(polling);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->Send(LaneHelloAck()).ok());
  ASSERT_TRUE(client->Receive(kWait).ok());
  for (uint64_t id = 4; id <= 6; ++id) ExpectEcho(*client, id);
  EXPECT_FALSE(client->using_lane());
}

// A raw peer's lane frames: offers the server cannot open are declined with the reason and the
// connection goes on; a malformed offer and a switch to a lane nobody accepted close it, naming
// the rule.
TEST_F(LaneTest, BadLaneFramesAreDeclinedOrRefusedNamingWhy) {
  StartPolling();
  // One offer per connection: each offer on a connection of its own.
  std::vector<std::unique_ptr<RawClient>> raws;
  auto reply_to = [&](const v1::Envelope& offer) -> StatusOr<v1::LaneReply> {
    raws.push_back(std::make_unique<RawClient>(server_->port()));
    RawClient& raw = *raws.back();
    if (!raw.connected() || !raw.SendEnvelope(LaneHelloAck()) || !raw.SendEnvelope(offer)) {
      return Unavailable("connecting or sending failed");
    }
    for (int i = 0; i < 10; ++i) {
      KVT_ASSIGN_OR_RETURN(v1::Envelope e, raw.ReadFrame());
      if (e.has_lane_reply()) return e.lane_reply();
      if (e.has_error()) return Internal(e.error().message());
    }
    return Internal("no lane_reply");
  };
  v1::Envelope missing;
  missing.mutable_lane_offer()->set_name("/kvt-lane-0123456789abcdef0123456789abcdef");
  missing.mutable_lane_offer()->set_nonce(std::string(16, 'n'));
  missing.mutable_lane_offer()->set_ring_bytes(4096);
  StatusOr<v1::LaneReply> declined = reply_to(missing);
  ASSERT_TRUE(declined.ok()) << declined.status();
  EXPECT_FALSE(declined->accepted());
  EXPECT_THAT(declined->reason(), HasSubstr("cannot be opened here"));
  v1::Envelope escape = missing;
  escape.mutable_lane_offer()->set_name("/../../etc/passwd");
  declined = reply_to(escape);
  ASSERT_TRUE(declined.ok()) << declined.status();
  EXPECT_FALSE(declined->accepted());
  EXPECT_THAT(declined->reason(), HasSubstr("lane name '/../../etc/passwd' is not /kvt-lane-"));
  v1::Envelope odd_ring = missing;
  odd_ring.mutable_lane_offer()->set_ring_bytes(5000);
  declined = reply_to(odd_ring);
  ASSERT_TRUE(declined.ok()) << declined.status();
  EXPECT_THAT(declined->reason(), HasSubstr("ring_bytes = 5000"));
  // Still serving.
  RawClient& raw = *raws.back();
  v1::Envelope registration = testing::MakeAgentRegistration();
  registration.set_id(9);
  ASSERT_TRUE(raw.SendEnvelope(registration));
  StatusOr<v1::Envelope> echo = raw.ReadFrame();
  ASSERT_TRUE(echo.ok()) << echo.status();
  EXPECT_EQ(echo->reply_to(), 9u);
  // A switch to no lane: refused, and the connection closes.
  v1::Envelope lane_switch;
  lane_switch.mutable_lane_switch();
  ASSERT_TRUE(raw.SendEnvelope(lane_switch));
  StatusOr<v1::Error> error = raw.ReadError();
  ASSERT_TRUE(error.ok()) << error.status();
  EXPECT_EQ(error->code(), v1::STATUS_CODE_FAILED_PRECONDITION);
  EXPECT_THAT(error->message(),
              HasSubstr("unexpected lane_switch: no accepted lane is waiting for it"));
  EXPECT_TRUE(raw.WaitForClose());

  RawClient short_nonce(server_->port());
  ASSERT_TRUE(short_nonce.connected());
  v1::Envelope bad = missing;
  bad.mutable_lane_offer()->set_nonce("abc");
  ASSERT_TRUE(short_nonce.SendEnvelope(bad));
  error = short_nonce.ReadError();
  ASSERT_TRUE(error.ok()) << error.status();
  EXPECT_THAT(error->message(), HasSubstr("lane_offer.nonce = 3 bytes: must be 16 bytes"));
}

// A one-shot gate an io thread waits at (bounded) until the test opens it. Held through a
// shared_ptr by whoever waits, so that a thread still leaving Wait() never outlives it.
class Gate {
 public:
  void Open() {
    std::call_once(once_, [&] { open_.set_value(); });
  }
  // Long enough for every step the test takes while a thread waits here, however slow the
  // machine: OpenOnExit opens the gate when the test ends, whatever happened.
  bool Wait() const { return opened_.wait_for(60s) == std::future_status::ready; }

 private:
  std::once_flag once_;
  std::promise<void> open_;
  std::shared_future<void> opened_ = open_.get_future().share();
};

// Opens the gates when it goes: a failed assertion leaves no io thread waiting at one (declare it
// after what joins those threads, so that it goes first).
struct OpenOnExit {
  std::vector<std::shared_ptr<Gate>> gates;
  ~OpenOnExit() {
    for (const std::shared_ptr<Gate>& gate : gates) gate->Open();
  }
};

// The names (shm_open's form) of the lane files in /dev/shm of `bytes` bytes.
std::set<std::string> LaneFiles(uintmax_t bytes) {
  std::set<std::string> names;
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator("/dev/shm", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    const std::string file = it->path().filename().string();
    std::error_code size_ec;
    if (file.rfind("kvt-lane-", 0) == 0 && it->file_size(size_ec) == bytes && !size_ec) {
      names.insert("/" + file);
    }
  }
  return names;
}

bool ShmExists(const std::string& name) {
  const int fd = ::shm_open(name.c_str(), O_RDONLY, 0);
  if (fd >= 0) ::close(fd);
  return fd >= 0;
}

// A server that declines a lane answers even when the connection's send queue is full (the
// client reads nothing meanwhile): the client learns of the decline and removes its segment.
// Dropping the answer would leave the segment in /dev/shm until the connection ends.
TEST_F(LaneTest, ADeclineIsAnsweredWhenTheSendQueueIsFull) {
  ControlServerOptions options;  // no busy polling: the server declines every lane
  options.limits.max_queued_frames = 32;
  StartServer(options);
  handler_.set_server(nullptr);  // no echoes: the test decides what the server sends
  // Hold the server's io thread in the handler of message 4242, and the client's in the
  // handler of message 7.
  auto server_gate = std::make_shared<Gate>();
  auto client_gate = std::make_shared<Gate>();
  std::promise<void> server_held, client_saw_hello, client_held;
  std::atomic<bool> server_held_once{false};
  handler_.set_before_echo([&, server_gate](const v1::Envelope& e) {
    if (e.id() != 4242 || server_held_once.exchange(true)) return;
    server_held.set_value();
    (void)server_gate->Wait();
  });
  struct Handler : ControlClient::Handler {
    std::shared_ptr<Gate> gate;
    std::promise<void>* saw_hello = nullptr;
    std::promise<void>* held = nullptr;
    std::atomic<size_t> fillers{0};
    void OnMessage(const v1::Envelope& envelope) override {
      if (envelope.id() >= 1000) {
        fillers.fetch_add(1);
      } else if (envelope.has_hello_ack()) {
        saw_hello->set_value();  // the client offers its lane on return, on this thread
      } else if (envelope.id() == 7) {
        held->set_value();
        (void)gate->Wait();
      }
    }
    void OnDisconnect(const Status&) override {}
  } client_handler;
  client_handler.gate = client_gate;
  client_handler.saw_hello = &client_saw_hello;
  client_handler.held = &client_held;
  // An 8 KiB ring, which no other test uses: its segment's size tells its file apart from the
  // lanes of tests running beside this one.
  constexpr uint32_t kRingBytes = 8u << 10;
  constexpr uintmax_t kSegmentBytes = 64 + 2 * (192 + kRingBytes);
  ControlClientOptions copts = ClientOptions();
  copts.busy_poll.window = 300us;
  copts.busy_poll.lane_ring_bytes = kRingBytes;
  auto connected = ControlClient::Connect(copts, &client_handler);
  ASSERT_TRUE(connected.ok()) << connected.status();
  std::unique_ptr<ControlClient> client = std::move(connected).value();
  OpenOnExit open_gates{{server_gate, client_gate}};
  ASSERT_TRUE(handler_.WaitFor([&] { return handler_.connects_locked() == 1; }));
  const ConnectionId id = handler_.connect_infos()[0].id;
  const std::set<std::string> before = LaneFiles(kSegmentBytes);

  // The server's io thread waits in a handler: the client's offer waits, unread, in its socket.
  v1::Envelope hold_server = testing::MakeAgentRegistration();
  hold_server.set_id(4242);
  ASSERT_TRUE(client->Send(hold_server).ok());
  ASSERT_EQ(server_held.get_future().wait_for(kWait), std::future_status::ready);
  // The hello-ack makes the client offer its lane; the client then stops reading, held in the
  // handler of message 7. Message 7 goes once the hello-ack was handled, so that it arrives in a
  // later read, after the offer's write completed on the client's io thread: the client's own
  // frames (4243 below) then go straight to the socket instead of waiting behind that write.
  ASSERT_TRUE(server_->Send(id, LaneHelloAck()).ok());
  ASSERT_EQ(client_saw_hello.get_future().wait_for(kWait), std::future_status::ready);
  v1::Envelope hold_client = testing::MakeAgentRegistration();
  hold_client.set_id(7);
  ASSERT_TRUE(server_->Send(id, hold_client).ok());
  ASSERT_EQ(client_held.get_future().wait_for(kWait), std::future_status::ready);
  std::vector<std::string> offered;
  for (const std::string& name : LaneFiles(kSegmentBytes)) {
    if (before.count(name) == 0) offered.push_back(name);
  }
  ASSERT_EQ(offered.size(), 1u) << "the client's offered segment in /dev/shm";
  const std::string segment = offered[0];

  // Fill the server's send queue: nobody reads the socket, so nothing leaves it.
  size_t sent = 0;
  Status full;
  const auto give_up = std::chrono::steady_clock::now() + kWait;
  while (full.ok() && std::chrono::steady_clock::now() < give_up) {
    v1::Envelope filler = LaneHelloAck(64);  // about 15 KiB
    filler.set_id(1000 + sent);
    full = server_->Send(id, filler);
    if (full.ok()) ++sent;
  }
  ASSERT_EQ(full.code(), StatusCode::kResourceExhausted) << full;

  // Message 4243 follows the offer on the socket: once the server handled it, it handled the
  // offer too, with its queue full.
  v1::Envelope after_offer = testing::MakeAgentRegistration();
  after_offer.set_id(4243);
  ASSERT_TRUE(client->Send(after_offer).ok());
  server_gate->Open();
  ASSERT_TRUE(handler_.WaitFor([&] { return handler_.messages_locked() == 2; }));
  ASSERT_EQ(handler_.messages().back().second.id(), 4243u);
  EXPECT_TRUE(ShmExists(segment)) << "the client removed its segment before the reply came";

  // The client reads again: every filler, then the decline, which removes the segment.
  client_gate->Open();
  EXPECT_TRUE(Eventually([&] { return !ShmExists(segment); }))
      << "the decline never reached the client: its segment " << segment << " is still there";
  EXPECT_TRUE(Eventually([&] { return client_handler.fillers.load() == sent; }))
      << client_handler.fillers.load() << " of " << sent << " frames arrived";
  EXPECT_TRUE(client->connected());
  EXPECT_FALSE(client->using_lane());
  EXPECT_EQ(server_->connection_count(), 1u);
  EXPECT_TRUE(handler_.disconnects().empty());
}

// Every offer is answered past the queue's limits, so a client offers at most one lane per
// connection: a second offer, after a decline or after an acceptance, fails the connection
// naming the repeated offer.
TEST_F(LaneTest, ASecondLaneOfferOnAConnectionIsRefused) {
  for (const bool accept : {false, true}) {
    SCOPED_TRACE(accept ? "after an acceptance" : "after a decline");
    if (server_) server_->Stop();
    if (accept) {
      StartPolling();
    } else {
      StartServer();  // no busy polling: declines
    }
    RawClient raw(server_->port());
    ASSERT_TRUE(raw.connected());
    auto lane = internal::Lane::Create(4096);
    ASSERT_TRUE(lane.ok()) << lane.status();
    v1::Envelope offer = OfferOf(**lane);
    ASSERT_TRUE(raw.SendEnvelope(offer));
    std::optional<v1::LaneReply> reply;
    for (int i = 0; i < 10 && !reply; ++i) {  // the challenge, then the reply
      StatusOr<v1::Envelope> e = raw.ReadFrame();
      ASSERT_TRUE(e.ok()) << e.status();
      if (e->has_lane_reply()) reply = e->lane_reply();
    }
    ASSERT_TRUE(reply.has_value()) << "no lane_reply";
    ASSERT_EQ(reply->accepted(), accept) << reply->reason();

    const size_t disconnects = handler_.disconnects().size();
    offer.set_id(31);
    ASSERT_TRUE(raw.SendEnvelope(offer));
    ASSERT_TRUE(handler_.WaitFor([&] { return handler_.disconnects_locked() == disconnects + 1; }));
    const Status why = handler_.disconnects().back().second;
    EXPECT_EQ(why.code(), StatusCode::kFailedPrecondition) << why;
    EXPECT_THAT(why.message(),
                HasSubstr(std::string("unexpected lane_offer: a lane was already offered on this "
                                      "connection (and ") +
                          (accept ? "accepted" : "declined") + ")"))
        << why;
    EXPECT_THAT(why.message(), HasSubstr("a client offers at most one lane per connection")) << why;
    // The peer is told: on the socket after a decline; in the lane after an acceptance (every
    // frame of the server goes there from its reply on).
    v1::Error told;
    if (accept) {
      FrameDecoder decoder;
      std::string pending;
      char buffer[4096];
      ASSERT_TRUE(Eventually([&] {
        StatusOr<size_t> n = (*lane)->Read(buffer, sizeof(buffer));
        if (!n.ok()) return true;  // Take() below fails, naming nothing arrived
        pending.append(buffer, *n);
        while (!pending.empty() && !decoder.frame_ready()) {
          StatusOr<size_t> used = decoder.Feed(pending);
          if (!used.ok()) return true;
          pending.erase(0, *used);
        }
        return decoder.frame_ready();
      })) << "no frame in the lane";
      v1::Envelope e;
      const Status taken = decoder.Take(&e);
      ASSERT_TRUE(taken.ok()) << taken;
      ASSERT_TRUE(e.has_error()) << e.ShortDebugString();
      told = e.error();
    } else {
      StatusOr<v1::Error> error = raw.ReadError();
      ASSERT_TRUE(error.ok()) << error.status();
      told = *error;
    }
    EXPECT_EQ(told.code(), v1::STATUS_CODE_FAILED_PRECONDITION);
    EXPECT_THAT(told.message(), HasSubstr("a lane was already offered on this connection"));
    EXPECT_TRUE(raw.WaitForClose());
  }
}

// A peer that corrupts the shared segment (an impossible index) or writes garbage into it fails
// its own connection, with the reason; another connection goes on.
TEST_F(LaneTest, ACorruptedLaneFailsOnlyItsConnection) {
  StartPolling();
  std::unique_ptr<ControlClient> good = ConnectWithLane();
  ASSERT_NE(good, nullptr);
  for (const bool garbage : {false, true}) {
    SCOPED_TRACE(garbage ? "garbage frame" : "impossible index");
    const size_t disconnects = handler_.disconnects().size();
    RawClient raw(server_->port());
    std::unique_ptr<internal::Lane> lane;
    SegmentView segment;
    ASSERT_NO_FATAL_FAILURE(OpenViewedLane(raw, lane, segment));
    void* view = segment.base;
    if (garbage) {
      ASSERT_TRUE(lane->Write(std::string("\0\0\0\0junk", 8)).ok());  // a zero length prefix
    } else {
      auto* tail = reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(view) + 64 + 64);
      tail->store(1u << 20);  // more than the 4 KiB ring can hold
    }
    v1::Envelope doorbell;
    doorbell.mutable_lane_doorbell();
    ASSERT_TRUE(raw.SendEnvelope(doorbell));
    ASSERT_TRUE(handler_.WaitFor([&] { return handler_.disconnects_locked() == disconnects + 1; }));
    const Status why = handler_.disconnects().back().second;
    EXPECT_THAT(why.message(), HasSubstr(garbage ? "the shared-memory lane"
                                                 : "the writer's index 1048576 is impossible"))
        << why;
    EXPECT_TRUE(raw.WaitForClose());
    ExpectEcho(*good, 50 + (garbage ? 1 : 0));
    EXPECT_TRUE(good->using_lane());
  }
}

// The server's writes into the lane meet an impossible reader's index (the peer corrupted the
// segment): the connection fails with the reason, and only its Error follows on the socket. The
// echoes of the frames read in the same pass must not go to the socket instead of the broken
// lane: the peer would refuse them there as jumping the lane's order, and close with that reason.
TEST_F(LaneTest, AfterTheLanesWriteBreaksOnlyTheErrorFollowsOnTheSocket) {
  StartPolling();
  const size_t disconnects = handler_.disconnects().size();
  RawClient raw(server_->port());
  std::unique_ptr<internal::Lane> lane;
  SegmentView segment;
  ASSERT_NO_FATAL_FAILURE(OpenViewedLane(raw, lane, segment));
  void* view = segment.base;
  // The second ring (server to client): its reader's index far past anything written.
  auto* head = reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(view) + 64 + 192 + 4096);
  head->store(1u << 20);
  // Five frames in one write: the server reads them in one pass and echoes each.
  std::string frames;
  for (int i = 0; i < 5; ++i) {
    v1::Envelope e = testing::MakeAgentRegistration();
    e.set_id(500 + i);
    frames += *EncodeFrame(e);
  }
  ASSERT_TRUE(lane->Write(frames).ok());
  v1::Envelope doorbell;
  doorbell.mutable_lane_doorbell();
  ASSERT_TRUE(raw.SendEnvelope(doorbell));
  std::vector<v1::Envelope> after;  // what the socket carried after the switch
  while (true) {
    StatusOr<v1::Envelope> e = raw.ReadFrame();
    if (!e.ok()) break;  // closed (or silent for 5 s)
    after.push_back(*e);
  }
  ASSERT_TRUE(handler_.WaitFor([&] { return handler_.disconnects_locked() == disconnects + 1; }));
  const Status why = handler_.disconnects().back().second;
  EXPECT_THAT(why.message(), HasSubstr("1048576")) << why;
  size_t errors = 0;
  for (const v1::Envelope& e : after) {
    EXPECT_TRUE(e.has_error() || e.has_lane_doorbell())
        << "a frame of the broken lane went to the socket: " << e.ShortDebugString();
    errors += e.has_error() ? 1 : 0;
  }
  EXPECT_EQ(errors, 1u);
}

// After a peer's switch its frames come through the lane: a doorbell on the socket is taken,
// any other frame there would jump the lane's order and closes the connection, naming it;
// another connection goes on.
TEST_F(LaneTest, AFrameOnTheSocketAfterTheSwitchIsRefused) {
  StartPolling();
  std::unique_ptr<ControlClient> good = ConnectWithLane();
  ASSERT_NE(good, nullptr);
  RawClient raw(server_->port());
  auto lane = OpenRawLane(raw);
  ASSERT_TRUE(lane.ok()) << lane.status();
  const size_t messages = handler_.messages().size();
  const size_t disconnects = handler_.disconnects().size();
  v1::Envelope doorbell;
  doorbell.mutable_lane_doorbell();
  ASSERT_TRUE(raw.SendEnvelope(doorbell));
  v1::Envelope registration = testing::MakeAgentRegistration();
  registration.set_id(77);
  ASSERT_TRUE(raw.SendEnvelope(registration));
  ASSERT_TRUE(handler_.WaitFor([&] { return handler_.disconnects_locked() == disconnects + 1; }));
  const Status why = handler_.disconnects().back().second;
  EXPECT_EQ(why.code(), StatusCode::kFailedPrecondition) << why;
  EXPECT_THAT(why.message(),
              HasSubstr("register_agent #77 arrived on the socket after the peer moved its "
                        "frames to the shared-memory lane"))
      << why;
  EXPECT_EQ(handler_.messages().size(), messages) << "the frame was handled";
  EXPECT_TRUE(raw.WaitForClose());
  ExpectEcho(*good, 60);
  EXPECT_TRUE(good->using_lane());
}

// A frame begun in the lane and never finished hits frame_timeout as one on the socket does,
// and the error says it came through the lane.
TEST_F(LaneTest, AFrameLeftIncompleteInTheLaneHitsTheFrameTimeout) {
  ControlServerOptions options;
  options.busy_poll.window = 300us;
  options.busy_poll.lane_ring_bytes = 4096;
  options.limits.frame_timeout = 300ms;
  StartServer(options);
  RawClient raw(server_->port());
  auto lane = OpenRawLane(raw);
  ASSERT_TRUE(lane.ok()) << lane.status();
  const size_t disconnects = handler_.disconnects().size();
  ASSERT_TRUE((*lane)->Write(Header(100) + std::string(10, 'x')).ok());  // 10 of 100 bytes
  v1::Envelope doorbell;
  doorbell.mutable_lane_doorbell();
  ASSERT_TRUE(raw.SendEnvelope(doorbell));
  ASSERT_TRUE(handler_.WaitFor([&] { return handler_.disconnects_locked() == disconnects + 1; }));
  const Status why = handler_.disconnects().back().second;
  EXPECT_THAT(why.message(), HasSubstr("frame incomplete after 300 ms (frame_timeout)")) << why;
  EXPECT_THAT(why.message(), HasSubstr("14 bytes of it arrived through the shared-memory lane"))
      << why;
  EXPECT_TRUE(raw.WaitForClose());
}

// A peer that stops reading its lane leaves the server's replies waiting for room in the ring;
// the server retries less and less often instead of keeping its io thread awake: the process
// uses a small part of a core meanwhile.
TEST_F(LaneTest, AReaderThatStopsReadingCostsTheWriterLittleCpu) {
  StartPolling(4096, 300us);
  RawClient raw(server_->port());
  auto lane = OpenRawLane(raw);
  ASSERT_TRUE(lane.ok()) << lane.status();
  // Forty requests of about 1 KiB, written as a client does (a doorbell when the server sleeps):
  // their echoes overfill the 4 KiB ring nobody reads.
  const size_t messages = handler_.messages().size();
  v1::Envelope doorbell;
  doorbell.mutable_lane_doorbell();
  const auto give_up = std::chrono::steady_clock::now() + kWait;
  for (int i = 0; i < 40; ++i) {
    v1::Envelope request = LaneHelloAck(16);
    request.set_id(100 + i);
    std::string frame = *EncodeFrame(request);
    while (!frame.empty()) {
      ASSERT_LT(std::chrono::steady_clock::now(), give_up) << "request " << i << " did not fit";
      StatusOr<size_t> n = (*lane)->Write(frame);
      ASSERT_TRUE(n.ok()) << n.status();
      frame.erase(0, *n);
      if ((*lane)->TakeDoorbell()) {
        ASSERT_TRUE(raw.SendEnvelope(doorbell));
      }
      if (!frame.empty()) std::this_thread::sleep_for(1ms);  // the server reads it
    }
  }
  ASSERT_TRUE(handler_.WaitFor([&] { return handler_.messages_locked() >= messages + 40; }));
  std::this_thread::sleep_for(100ms);  // the retries' delay grows
  rusage before{};
  ::getrusage(RUSAGE_SELF, &before);
  std::this_thread::sleep_for(500ms);
  rusage after{};
  ::getrusage(RUSAGE_SELF, &after);
  const auto cpu_us = [](const rusage& r) {
    return (r.ru_utime.tv_sec + r.ru_stime.tv_sec) * 1000000LL + r.ru_utime.tv_usec +
           r.ru_stime.tv_usec;
  };
  const long long used = cpu_us(after) - cpu_us(before);
  EXPECT_LT(used, 150000) << "the process used " << used << " µs of CPU in 500 ms while its "
                          << "only connection waited for a reader that stopped";
  EXPECT_EQ(server_->connection_count(), 1u);  // waiting is not a failure
}

TEST(ControlServerOptionsTest, BadLaneRingSizesAreRefused) {
  RecordingHandler handler;
  ControlServerOptions options;
  options.bind_address = "127.0.0.1";
  options.busy_poll.window = 100us;
  options.busy_poll.lane_ring_bytes = 3000;
  auto server = ControlServer::Create(options, &handler);
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(server.status().message(),
              HasSubstr("busy_poll.lane_ring_bytes = 3000: must be a power of two"));
  ControlClientOptions copts;
  copts.port = 1;
  copts.busy_poll.lane_ring_bytes = 1u << 30;
  auto client = ControlClient::Connect(copts);
  ASSERT_FALSE(client.ok());
  EXPECT_THAT(client.status().message(), HasSubstr("busy_poll.lane_ring_bytes = 1073741824"));
  options.busy_poll.lanes = false;  // the size does not matter then
  EXPECT_TRUE(ControlServer::Create(options, &handler).ok());
}

}  // namespace
}  // namespace kvt::control

#include "kvt/transfer/registry.h"

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>

#include "control/control_client.h"
#include "control/control_server.h"
#include "control/protocol.h"
#include "kvt/common/log.h"

namespace kvt::transfer {
namespace {

using Clock = std::chrono::steady_clock;
using Key = std::tuple<std::string, int, uint32_t>;  // name, role, tp_rank

v1::Role ToProto(AgentRole role) {
  switch (role) {
    case AgentRole::kAny:
      return v1::ROLE_UNSPECIFIED;
    case AgentRole::kPrefill:
      return v1::ROLE_PREFILL;
    case AgentRole::kDecode:
      return v1::ROLE_DECODE;
    case AgentRole::kTool:
      return v1::ROLE_TOOL;
  }
  return v1::ROLE_UNSPECIFIED;
}

// ROLE_BOOTSTRAP never registers and is no role a user asks for: it reads as kAny.
AgentRole FromProto(v1::Role role) {
  switch (role) {
    case v1::ROLE_PREFILL:
      return AgentRole::kPrefill;
    case v1::ROLE_DECODE:
      return AgentRole::kDecode;
    case v1::ROLE_TOOL:
      return AgentRole::kTool;
    default:
      return AgentRole::kAny;
  }
}

std::string DescribeRole(v1::Role role) {
  if (role == v1::ROLE_PREFILL || role == v1::ROLE_DECODE || role == v1::ROLE_TOOL) {
    return AgentRoleName(FromProto(role));
  }
  return v1::Role_Name(role).empty() ? std::to_string(static_cast<int>(role)) : v1::Role_Name(role);
}

StatusOr<v1::AgentInfo> ToProto(const AgentEntry& entry) {
  v1::AgentInfo info;
  info.set_name(entry.name);
  info.set_role(ToProto(entry.role));
  info.set_tp_rank(entry.tp_rank);
  info.set_tp_size(entry.tp_size);
  info.set_control_address(entry.control_address);
  info.set_host_id(entry.host_id);
  if (entry.layout) {
    const AgentLayout& l = *entry.layout;
    StatusOr<v1::DType> dtype = control::ToProtoDType(l.dtype);
    if (!dtype.ok()) {
      return InvalidArgument("agent '" + entry.name +
                             "': layout.dtype = " + std::string(DTypeName(l.dtype)) +
                             " is no pool dtype; give the pool's element type (bf16, fp16, fp32, "
                             "fp8_e4m3 or fp8_e5m2)");
    }
    v1::Layout* out = info.mutable_layout();
    out->set_num_layers(l.num_layers);
    out->set_page_size(l.page_size);
    out->set_dtype(*dtype);
    out->set_head_num(l.head_num);
    out->set_head_dim(l.head_dim);
    out->set_tp_rank(l.tp_rank);
    out->set_tp_size(l.tp_size);
    out->set_num_pages(l.num_pages);
    out->set_num_tokens(l.num_tokens);
    out->set_total_kv_heads(l.total_kv_heads);
  }
  return info;
}

// Entries reaching this have passed the control plane's validation (a valid dtype among them).
StatusOr<AgentEntry> FromProto(const v1::AgentInfo& info) {
  AgentEntry entry;
  entry.name = info.name();
  entry.role = FromProto(info.role());
  entry.tp_rank = info.tp_rank();
  entry.tp_size = info.tp_size();
  entry.control_address = info.control_address();
  entry.host_id = info.host_id();
  if (info.has_layout()) {
    const v1::Layout& l = info.layout();
    KVT_ASSIGN_OR_RETURN(DType dtype, control::FromProtoDType(l.dtype()));
    entry.layout = AgentLayout{.num_layers = l.num_layers(),
                               .page_size = l.page_size(),
                               .dtype = dtype,
                               .head_num = l.head_num(),
                               .head_dim = l.head_dim(),
                               .tp_rank = l.tp_rank(),
                               .tp_size = l.tp_size(),
                               .num_pages = l.num_pages(),
                               .num_tokens = l.num_tokens(),
                               .total_kv_heads = l.total_kv_heads()};
  }
  return entry;
}

}  // namespace

const char* AgentRoleName(AgentRole role) {
  switch (role) {
    case AgentRole::kAny:
      return "any";
    case AgentRole::kPrefill:
      return "prefill";
    case AgentRole::kDecode:
      return "decode";
    case AgentRole::kTool:
      return "tool";
  }
  return "unknown";
}

// ------------------------------------------------------------------------------- server ----
class RegistryServer::Impl : public control::ControlHandler {
 public:
  explicit Impl(const RegistryServerOptions& options) : options_(options) {}
  ~Impl() override {
    if (server_) server_->Stop();
  }

  Status Init() {
    if (options_.heartbeat_interval.count() <= 0 || options_.missed_heartbeats < 1) {
      return InvalidArgument(
          "heartbeat_interval=" + std::to_string(options_.heartbeat_interval.count()) +
          " ms and missed_heartbeats=" + std::to_string(options_.missed_heartbeats) +
          " must be positive");
    }
    control::ControlServerOptions server = options_.server;
    if (server.server_id == "kvt") server.server_id = "kvt-bootstrap";
    KVT_ASSIGN_OR_RETURN(server_, control::ControlServer::Create(server, this));
    return OkStatus();
  }

  uint16_t port() const { return server_->port(); }

  // The matching entries as they travel (Entry::info) or as the C++ API gives them
  // (Entry::entry).
  template <typename T>
  std::vector<T> Lookup(const std::string& name, v1::Role role,
                        std::optional<uint32_t> rank) const {
    std::lock_guard<std::mutex> lock(mu_);
    ExpireLocked();
    std::vector<T> out;
    for (const auto& [key, entry] : entries_) {
      if (!name.empty() && entry.info.name() != name) continue;
      if (role != v1::ROLE_UNSPECIFIED && entry.info.role() != role) continue;
      if (rank && entry.info.tp_rank() != *rank) continue;
      if constexpr (std::is_same_v<T, AgentEntry>) {
        out.push_back(entry.entry);
      } else {
        out.push_back(entry.info);
      }
    }
    return out;
  }

  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    ExpireLocked();
    return entries_.size();
  }

  void OnMessage(control::ConnectionId conn, const v1::Envelope& envelope) override {
    v1::Envelope reply;
    reply.set_reply_to(envelope.id());
    if (envelope.has_register_agent()) {
      const v1::AgentInfo& agent = envelope.register_agent().agent();
      auto* r = reply.mutable_register_agent_reply();
      StatusOr<AgentEntry> converted = FromProto(agent);
      if (agent.role() != v1::ROLE_PREFILL && agent.role() != v1::ROLE_DECODE) {
        r->set_status(v1::STATUS_CODE_INVALID_ARGUMENT);
        r->set_message("agent '" + agent.name() + "' registers with role " +
                       DescribeRole(agent.role()) + "; only prefill and decode agents register");
      } else if (!converted.ok()) {
        r->set_status(v1::STATUS_CODE_INVALID_ARGUMENT);
        r->set_message("agent '" + agent.name() + "': " + converted.status().message());
      } else {
        std::lock_guard<std::mutex> lock(mu_);
        Entry& entry = entries_[Key{agent.name(), agent.role(), agent.tp_rank()}];
        const bool fresh = !entry.info.IsInitialized() || entry.info.name().empty();
        entry.info = agent;
        entry.entry = std::move(converted).value();
        entry.refreshed = Clock::now();
        if (fresh) {
          KVT_LOG_INFO("ctl", "registered {} '{}' rank {}/{} at {}", DescribeRole(agent.role()),
                       agent.name(), agent.tp_rank(), agent.tp_size(), agent.control_address());
        }
        r->set_status(v1::STATUS_CODE_OK);
        r->set_heartbeat_interval_ms(static_cast<uint32_t>(options_.heartbeat_interval.count()));
      }
    } else if (envelope.has_lookup_agents()) {
      const v1::LookupAgents& q = envelope.lookup_agents();
      auto agents = Lookup<v1::AgentInfo>(
          q.name(), q.role(),
          q.has_tp_rank() ? std::optional<uint32_t>(q.tp_rank()) : std::nullopt);
      for (auto& a : agents) *reply.mutable_lookup_agents_reply()->add_agents() = std::move(a);
      reply.mutable_lookup_agents_reply();  // an empty answer is still an answer
    } else {
      reply = control::MakeErrorEnvelope(
          v1::STATUS_CODE_INVALID_ARGUMENT,
          "the bootstrap registry answers RegisterAgent and LookupAgents, not " +
              std::string(control::BodyName(envelope)));
    }
    (void)server_->Send(conn, reply);
  }

  void OnDisconnect(control::ConnectionId, const Status&) override {}

 private:
  struct Entry {
    v1::AgentInfo info;  // as registered, for look-ups over the wire
    AgentEntry entry;    // the same, for RegistryServer::Lookup
    Clock::time_point refreshed;
  };

  void ExpireLocked() const {
    const auto ttl = options_.heartbeat_interval * options_.missed_heartbeats;
    const auto now = Clock::now();
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (now - it->second.refreshed > ttl) {
        KVT_LOG_INFO("ctl", "expired '{}' ({} without a heartbeat)", it->second.info.name(),
                     std::to_string(ttl.count()) + " ms");
        it = entries_.erase(it);
      } else {
        ++it;
      }
    }
  }

  const RegistryServerOptions options_;
  std::unique_ptr<control::ControlServer> server_;
  mutable std::mutex mu_;  // guards entries_
  mutable std::map<Key, Entry> entries_;
};

RegistryServer::RegistryServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RegistryServer::~RegistryServer() = default;
StatusOr<std::unique_ptr<RegistryServer>> RegistryServer::Create(
    const RegistryServerOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  KVT_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<RegistryServer>(new RegistryServer(std::move(impl)));
}
uint16_t RegistryServer::port() const { return impl_->port(); }
std::vector<AgentEntry> RegistryServer::Lookup(const std::string& name, AgentRole role,
                                               std::optional<uint32_t> tp_rank) const {
  return impl_->Lookup<AgentEntry>(name, ToProto(role), tp_rank);
}
size_t RegistryServer::size() const { return impl_->size(); }

// ------------------------------------------------------------------------------- client ----
namespace {

control::ControlClientOptions ClientOptions(const RegistryClientOptions& o) {
  control::ControlClientOptions c;
  c.host = o.host;
  c.port = o.port;
  c.client_id = o.client_id;
  c.role = ToProto(o.role);
  c.cluster_token = o.cluster_token;
  c.connect_timeout = o.timeout;
  return c;
}

// Sends `request` and waits for the answer (an Error frame becomes its Status).
StatusOr<v1::Envelope> Call(control::ControlClient& client, const v1::Envelope& request,
                            std::chrono::milliseconds timeout) {
  KVT_RETURN_IF_ERROR(client.Send(request));
  KVT_ASSIGN_OR_RETURN(v1::Envelope reply, client.Receive(timeout));
  if (reply.has_error()) return control::StatusFromError(reply.error());
  return reply;
}

}  // namespace

class RegistryClient::Impl {
 public:
  Impl(const RegistryClientOptions& options, v1::AgentInfo self)
      : options_(options), self_(std::move(self)) {}

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  Status Init() {
    KVT_RETURN_IF_ERROR(RegisterOnce().WithContext("registering with the bootstrap at " +
                                                   options_.host + ":" +
                                                   std::to_string(options_.port)));
    thread_ = std::thread([this] { RefreshLoop(); });
    return OkStatus();
  }

  uint64_t refreshes() const { return refreshes_.load(); }

 private:
  Status RegisterOnce() {
    if (!client_ || !client_->connected()) {
      client_.reset();
      KVT_ASSIGN_OR_RETURN(client_, control::ControlClient::Connect(ClientOptions(options_)));
    }
    v1::Envelope request;
    request.set_id(++next_id_);
    *request.mutable_register_agent()->mutable_agent() = self_;
    StatusOr<v1::Envelope> reply = Call(*client_, request, options_.timeout);
    if (!reply.ok()) {
      client_.reset();
      return reply.status();
    }
    if (!reply->has_register_agent_reply()) {
      return Internal("the bootstrap answered RegisterAgent with " +
                      std::string(control::BodyName(*reply)));
    }
    const v1::RegisterAgentReply& r = reply->register_agent_reply();
    if (r.status() != v1::STATUS_CODE_OK) {
      return Status(control::FromProtoCode(r.status()), r.message());
    }
    if (r.heartbeat_interval_ms() > 0) {
      interval_ = std::chrono::milliseconds(r.heartbeat_interval_ms());
    }
    ++refreshes_;
    return OkStatus();
  }

  void RefreshLoop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, interval_);
      if (stop_) break;
      lock.unlock();
      Status st = RegisterOnce();
      if (!st.ok()) {
        KVT_LOG_WARN("ctl", "bootstrap refresh failed ({}); retrying", st.ToString());
      }
      lock.lock();
    }
  }

  const RegistryClientOptions options_;
  const v1::AgentInfo self_;
  std::unique_ptr<control::ControlClient> client_;  // used by Init, then the refresh thread only
  uint64_t next_id_ = 0;
  std::chrono::milliseconds interval_{1000};
  std::atomic<uint64_t> refreshes_{0};
  std::thread thread_;
  std::mutex mu_;  // guards stop_
  std::condition_variable cv_;
  bool stop_ = false;
};

RegistryClient::RegistryClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RegistryClient::~RegistryClient() = default;
StatusOr<std::unique_ptr<RegistryClient>> RegistryClient::Start(
    const RegistryClientOptions& options, const AgentEntry& self) {
  KVT_ASSIGN_OR_RETURN(v1::AgentInfo info, ToProto(self));
  auto impl = std::make_unique<Impl>(options, std::move(info));
  KVT_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<RegistryClient>(new RegistryClient(std::move(impl)));
}
uint64_t RegistryClient::refreshes() const { return impl_->refreshes(); }

StatusOr<std::vector<AgentEntry>> RegistryClient::Lookup(const RegistryClientOptions& options,
                                                         const std::string& name, AgentRole role,
                                                         std::optional<uint32_t> tp_rank) {
  KVT_ASSIGN_OR_RETURN(auto client, control::ControlClient::Connect(ClientOptions(options)));
  v1::Envelope request;
  request.set_id(1);
  request.mutable_lookup_agents()->set_name(name);
  request.mutable_lookup_agents()->set_role(ToProto(role));
  if (tp_rank) request.mutable_lookup_agents()->set_tp_rank(*tp_rank);
  KVT_ASSIGN_OR_RETURN(v1::Envelope reply, Call(*client, request, options.timeout));
  if (!reply.has_lookup_agents_reply()) {
    return Internal("the bootstrap answered LookupAgents with " +
                    std::string(control::BodyName(reply)));
  }
  std::vector<AgentEntry> agents;
  agents.reserve(reply.lookup_agents_reply().agents_size());
  for (const v1::AgentInfo& info : reply.lookup_agents_reply().agents()) {
    StatusOr<AgentEntry> entry = FromProto(info);
    if (!entry.ok()) {
      return entry.status().WithContext("the bootstrap's entry for '" + info.name() + "'");
    }
    agents.push_back(std::move(entry).value());
  }
  return agents;
}

}  // namespace kvt::transfer

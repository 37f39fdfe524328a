#include "cluster.h"

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "agent_command.h"
#include "control/protocol.h"

namespace kvt::integration {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// Agents start in well under a second here; the bound only matters when the machine is loaded
// by parallel builds.
constexpr auto kReadyTimeout = 30s;
constexpr auto kRpcTimeout = 10s;

StatusOr<nlohmann::json> ParseReady(const std::string& text, const std::string& path) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return DataLoss("ready file '" + path + "' is not JSON: " + text);
  return j;
}

// $env when set; else `name` beside the test binary (binaries copied into one folder); else
// `in_build` relative to it (a build folder copied whole); else the path baked in.
StatusOr<std::string> FindBinary(const char* env, const std::string& name,
                                 const std::string& in_build, const std::string& built) {
  const char* given = getenv(env);
  if (given != nullptr && *given != '\0') return tools::FindTool(name, {given});
  return tools::FindTool(name, {name, in_build, built});
}

}  // namespace

// In a build folder the test binaries live in tests/integration, the tools in tools/<tool>.
StatusOr<std::string> AgentBinary() {
  return FindBinary(kAgentBinEnv, "kvt-agent", "../../tools/agent/kvt-agent", KVT_AGENT_PATH);
}

StatusOr<std::string> BootstrapBinary() {
  return FindBinary(kBootstrapBinEnv, "kvt-bootstrap", "../../tools/bootstrap/kvt-bootstrap",
                    KVT_BOOTSTRAP_PATH);
}

StatusOr<std::unique_ptr<Cluster>> Cluster::Create() {
  std::unique_ptr<Cluster> cluster(new Cluster());
  const char* tmp = getenv("TMPDIR");
  std::string tmpl = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/kvt-it-XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) return Unavailable("cannot create a scratch folder " + tmpl);
  cluster->dir_ = tmpl;
  const std::string ready = cluster->dir_ + "/bootstrap.json";
  KVT_ASSIGN_OR_RETURN(const std::string bootstrap, BootstrapBinary());
  tools::BootstrapCommand command;
  command.binary = bootstrap;
  command.ready_file = ready;
  command.heartbeat_ms = 200;
  KVT_ASSIGN_OR_RETURN(cluster->bootstrap_, tools::ChildProcess::Spawn(
                                                command.Argv(), cluster->dir_ + "/bootstrap.log"));
  KVT_ASSIGN_OR_RETURN(std::string text,
                       tools::WaitReadyFile(ready, kReadyTimeout, cluster->bootstrap_.pid()));
  KVT_ASSIGN_OR_RETURN(nlohmann::json j, ParseReady(text, ready));
  cluster->bootstrap_port_ = j.value("port", 0);
  if (cluster->bootstrap_port_ == 0) return DataLoss("no port in " + ready + ": " + text);
  return cluster;
}

Cluster::~Cluster() {
  // Agents before the registry they heartbeat to; newest first.
  while (!agents_.empty()) agents_.pop_back();
  bootstrap_.Stop();
  if (!keep_scratch_ && !dir_.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
}

std::string FileStem(const AgentSpec& spec) {
  return spec.tp_size > 1 ? spec.name + ".rank" + std::to_string(spec.tp_rank) : spec.name;
}

StatusOr<std::vector<AgentProcess*>> Cluster::StartAgents(const std::vector<AgentSpec>& specs) {
  KVT_ASSIGN_OR_RETURN(const std::string agent_binary, AgentBinary());
  std::vector<AgentProcess*> started;
  for (const AgentSpec& spec : specs) {
    auto agent = std::make_unique<AgentProcess>();
    agent->spec = spec;
    agent->log_path = dir_ + "/" + FileStem(spec) + ".log";
    const AgentLayout& l = spec.layout;
    tools::AgentCommand command;
    command.binary = agent_binary;
    command.role = spec.role;
    command.name = spec.name;
    command.bootstrap = "127.0.0.1:" + std::to_string(bootstrap_port_);
    command.ready_file = dir_ + "/" + FileStem(spec) + ".json";
    command.device = spec.device;
    command.backend = spec.backend;
    command.layers = l.layers;
    command.heads = l.heads;
    command.head_dim = l.head_dim;
    command.tokens = l.tokens;
    command.dtype = "bf16";
    command.page_size = l.page_size;
    command.deadline_ms = spec.deadline_ms;
    command.layer_time_us = spec.layer_time_us;
    command.ucx_cuda_mode = spec.ucx_cuda_mode;
    command.tp_rank = spec.tp_rank;
    command.tp_size = spec.tp_size;
    KVT_ASSIGN_OR_RETURN(agent->process,
                         tools::ChildProcess::Spawn(command.Argv(), agent->log_path));
    agents_.push_back(std::move(agent));
    started.push_back(agents_.back().get());
  }
  for (AgentProcess* agent : started) {
    const std::string ready = dir_ + "/" + FileStem(agent->spec) + ".json";
    KVT_ASSIGN_OR_RETURN(std::string text,
                         tools::WaitReadyFile(ready, kReadyTimeout, agent->process.pid()));
    KVT_ASSIGN_OR_RETURN(nlohmann::json j, ParseReady(text, ready));
    agent->ready_json = text;
    agent->rpc_port = j.value("rpc_port", 0);
    agent->engine_port = j.value("engine_port", 0);
    if (agent->rpc_port == 0) return DataLoss("no rpc_port in " + ready + ": " + text);
  }
  return started;
}

StatusOr<AgentProcess*> Cluster::StartAgent(const AgentSpec& spec) {
  KVT_ASSIGN_OR_RETURN(std::vector<AgentProcess*> started, StartAgents({spec}));
  return started.front();
}

std::string Cluster::LogTails(size_t lines_per_log) const {
  std::string out = "scratch folder: " + dir_ + "\n  bootstrap.log:\n" +
                    tools::LogTail(dir_ + "/bootstrap.log", lines_per_log);
  for (const auto& agent : agents_) {
    out += "  " + agent->spec.name + ".log:\n" + tools::LogTail(agent->log_path, lines_per_log);
  }
  return out;
}

bool LogContains(const AgentProcess& agent, const std::string& text) {
  std::ifstream in(agent.log_path);
  for (std::string line; std::getline(in, line);) {
    if (line.find(text) != std::string::npos) return true;
  }
  return false;
}

StatusOr<tools::RpcClient> ConnectRpc(uint16_t port, const std::string& client_id) {
  return tools::RpcClient::Connect("127.0.0.1", port, client_id, 5s);
}

SubmitArgs ForPrefill(std::string room, uint64_t tokens) {
  SubmitArgs args;
  args.room = std::move(room);
  args.tokens = tokens;
  return args;
}

SubmitArgs ForDecode(std::string room, uint64_t tokens, std::string prefill_name,
                     uint32_t deadline_ms) {
  SubmitArgs args = ForPrefill(std::move(room), tokens);
  args.prefill_name = std::move(prefill_name);
  args.deadline_ms = deadline_ms;
  return args;
}

SubmitArgs ForDecodeAt(std::string room, uint64_t tokens, std::string prefill_address) {
  SubmitArgs args = ForPrefill(std::move(room), tokens);
  args.prefill_address = std::move(prefill_address);
  return args;
}

StatusOr<v1::SubmitReply> Submit(tools::RpcClient& rpc, const SubmitArgs& args) {
  v1::Envelope e;
  v1::SubmitRequest* s = e.mutable_submit_request();
  s->set_room_id(args.room);
  s->set_num_tokens(args.tokens);
  s->set_prefill_name(args.prefill_name);
  s->set_prefill_address(args.prefill_address);
  s->set_deadline_ms(args.deadline_ms);
  KVT_ASSIGN_OR_RETURN(v1::Envelope reply, rpc.Call(e, kRpcTimeout));
  if (!reply.has_submit_reply()) {
    return Internal("SubmitRequest answered with " + std::string(control::BodyName(reply)));
  }
  return reply.submit_reply();
}

Status SubmitAccepted(tools::RpcClient& rpc, const SubmitArgs& args,
                      std::chrono::milliseconds timeout) {
  const auto until = Clock::now() + timeout;
  while (true) {
    KVT_ASSIGN_OR_RETURN(v1::SubmitReply reply, Submit(rpc, args));
    if (reply.status() == v1::STATUS_CODE_OK) return OkStatus();
    if (reply.status() != v1::STATUS_CODE_RESOURCE_EXHAUSTED) {
      return Status(control::FromProtoCode(reply.status()), reply.message())
          .WithContext("room '" + args.room + "' refused");
    }
    if (Clock::now() > until) {
      return DeadlineExceeded("room '" + args.room + "' found no free pages within " +
                              std::to_string(timeout.count()) + " ms: " + reply.message());
    }
    std::this_thread::sleep_for(2ms);
  }
}

StatusOr<v1::SubmitReply> AbortRoom(tools::RpcClient& rpc, const std::string& room,
                                    const std::string& reason) {
  v1::Envelope e;
  e.mutable_abort_room()->set_room_id(room);
  e.mutable_abort_room()->set_reason(reason);
  KVT_ASSIGN_OR_RETURN(v1::Envelope reply, rpc.Call(e, kRpcTimeout));
  if (!reply.has_submit_reply()) {
    return Internal("AbortRoom answered with " + std::string(control::BodyName(reply)));
  }
  return reply.submit_reply();
}

StatusOr<std::vector<v1::RequestReport>> Query(tools::RpcClient& rpc,
                                               const std::vector<std::string>& rooms) {
  v1::Envelope e;
  for (const std::string& room : rooms) e.mutable_query_requests()->add_room_ids(room);
  if (rooms.empty()) e.mutable_query_requests();
  KVT_ASSIGN_OR_RETURN(v1::Envelope reply, rpc.Call(e, kRpcTimeout));
  if (!reply.has_query_requests_reply()) {
    return Internal("QueryRequests answered with " + std::string(control::BodyName(reply)));
  }
  const auto& reports = reply.query_requests_reply().reports();
  return std::vector<v1::RequestReport>(reports.begin(), reports.end());
}

bool IsFinal(const v1::RequestReport& report) {
  return report.state() == v1::REQUEST_STATE_SUCCESS || report.state() == v1::REQUEST_STATE_FAILED;
}

std::string Describe(const v1::RequestReport& r) {
  return r.room_id() + ": " + v1::RequestState_Name(r.state()) + " " +
         v1::StatusCode_Name(r.status()) + " '" + r.message() + "' (" + std::to_string(r.bytes()) +
         " bytes, verified=" + (r.verified() ? "yes" : "no") +
         ", mismatches=" + std::to_string(r.mismatches()) + ")";
}

StatusOr<std::map<std::string, v1::RequestReport>> WaitFinal(tools::RpcClient& rpc,
                                                             const std::vector<std::string>& rooms,
                                                             std::chrono::milliseconds timeout) {
  const auto until = Clock::now() + timeout;
  std::map<std::string, v1::RequestReport> final_reports;
  std::vector<std::string> open = rooms;
  while (true) {
    KVT_ASSIGN_OR_RETURN(std::vector<v1::RequestReport> reports, Query(rpc, open));
    if (reports.size() != open.size()) {
      return Internal("asked for " + std::to_string(open.size()) + " reports, got " +
                      std::to_string(reports.size()));
    }
    // Reports come back in the order asked for; each also names its room.
    std::vector<std::string> still_open;
    std::string states;
    for (size_t i = 0; i < open.size(); ++i) {
      if (reports[i].room_id() != open[i]) {
        return Internal("report " + std::to_string(i) + " names room '" + reports[i].room_id() +
                        "', expected '" + open[i] + "'");
      }
      if (IsFinal(reports[i])) {
        final_reports[open[i]] = reports[i];
      } else {
        still_open.push_back(open[i]);
        if (states.size() < 1000) {
          states += " " + open[i] + "=" + RequestState_Name(reports[i].state());
        }
      }
    }
    open = std::move(still_open);
    if (open.empty()) return final_reports;
    if (Clock::now() > until) {
      return DeadlineExceeded(std::to_string(open.size()) + " rooms not final after " +
                              std::to_string(timeout.count()) + " ms:" + states);
    }
    std::this_thread::sleep_for(5ms);
  }
}

StatusOr<v1::RequestReport> WaitFinal(tools::RpcClient& rpc, const std::string& room,
                                      std::chrono::milliseconds timeout) {
  KVT_ASSIGN_OR_RETURN(auto reports, WaitFinal(rpc, std::vector<std::string>{room}, timeout));
  return reports.at(room);
}

StatusOr<v1::AgentStatsReply> Stats(tools::RpcClient& rpc) {
  v1::Envelope e;
  e.mutable_query_stats();
  KVT_ASSIGN_OR_RETURN(v1::Envelope reply, rpc.Call(e, kRpcTimeout));
  if (!reply.has_agent_stats_reply()) {
    return Internal("QueryStats answered with " + std::string(control::BodyName(reply)));
  }
  return reply.agent_stats_reply();
}

StatusOr<v1::RequestReport> RunRequest(tools::RpcClient& prefill, tools::RpcClient& decode,
                                       const SubmitArgs& args, std::chrono::milliseconds timeout) {
  SubmitArgs prefill_args = args;
  prefill_args.prefill_name.clear();
  prefill_args.prefill_address.clear();
  KVT_RETURN_IF_ERROR(SubmitAccepted(prefill, prefill_args, timeout));
  KVT_RETURN_IF_ERROR(SubmitAccepted(decode, args, timeout));
  return WaitFinal(decode, args.room, timeout);
}

}  // namespace kvt::integration

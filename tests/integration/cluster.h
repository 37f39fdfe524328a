// Test harness for the multi-process integration suite: a Cluster starts kvt-bootstrap and
// kvt-agent processes on loopback in a scratch folder (every port kernel-chosen, every process
// started with --exit-with-parent so nothing outlives the test binary even when it is killed),
// and a handful of driver helpers wrap the agents' RPC (submit, abort, query, stats) with
// bounded waits.
//
// Ownership: the Cluster owns its processes; destroying it stops them (SIGTERM, then SIGKILL)
// in reverse start order and removes the scratch folder unless KeepScratch() was called.
//
// The binaries: $KVT_AGENT_BIN / $KVT_BOOTSTRAP_BIN when set; else kvt-agent / kvt-bootstrap
// beside the test binary (binaries copied into one folder), else where a build folder keeps
// them relative to it (a build folder copied whole), else the paths baked in at build time.
// Thread safety: none; one test thread drives a Cluster.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvt/common/status.h"
#include "kvt/v1/agent.pb.h"
#include "rpc_client.h"
#include "tool_util.h"

namespace kvt::integration {

// Small on purpose: 4 layers x 2 heads x 64 x bf16 = 2 KiB of KV per token, so hundreds of
// requests move and verify in well under a second on two cores.
struct AgentLayout {
  int64_t layers = 4;
  int64_t heads = 2;
  int64_t head_dim = 64;
  int64_t page_size = 16;
  int64_t tokens = 8192;  // pool size in token slots
};

struct AgentSpec {
  std::string role = "prefill";  // "prefill" or "decode"
  std::string name;
  AgentLayout layout;
  int64_t layer_time_us = 0;    // prefill: simulated compute per layer
  int64_t deadline_ms = 20000;  // the agent's default request deadline
  std::string device = "host";  // --device: host or cuda:N
  std::string backend = "ucx";  // --backend
  std::string ucx_cuda_mode;    // --ucx-cuda-mode (empty: the agent's default)
  uint32_t tp_rank = 0;         // --tp-rank; ranks of one TP group share `name`
  uint32_t tp_size = 1;         // --tp-size
};

// The stem of an agent's log and ready file in the scratch folder: its name, and its rank when
// it is one of several TP ranks sharing the name.
std::string FileStem(const AgentSpec& spec);

// Environment variables that point the harness at other binaries.
inline constexpr char kAgentBinEnv[] = "KVT_AGENT_BIN";
inline constexpr char kBootstrapBinEnv[] = "KVT_BOOTSTRAP_BIN";

// The kvt-agent / kvt-bootstrap binary the cluster starts (see the header comment).
StatusOr<std::string> AgentBinary();
StatusOr<std::string> BootstrapBinary();

// One running kvt-agent, as its ready file described it.
struct AgentProcess {
  AgentSpec spec;
  tools::ChildProcess process;
  uint16_t rpc_port = 0;
  uint16_t engine_port = 0;  // prefill: the engine's control port
  std::string log_path;
  std::string ready_json;  // the ready file as the agent wrote it (memory, backend, ...)

  std::string engine_address() const { return "127.0.0.1:" + std::to_string(engine_port); }
};

// True when the agent's log holds `text` (for known problems recognised by their log line).
bool LogContains(const AgentProcess& agent, const std::string& text);

class Cluster {
 public:
  // Makes a scratch folder and starts kvt-bootstrap in it.
  static StatusOr<std::unique_ptr<Cluster>> Create();
  ~Cluster();
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  // Spawns every agent first and then waits for all of their ready files, so that the UCX and
  // pool start-up of several agents overlaps. The pointers stay valid for the Cluster's life.
  StatusOr<std::vector<AgentProcess*>> StartAgents(const std::vector<AgentSpec>& specs);
  StatusOr<AgentProcess*> StartAgent(const AgentSpec& spec);

  uint16_t bootstrap_port() const { return bootstrap_port_; }
  const std::string& dir() const { return dir_; }

  // Keeps the scratch folder (logs) after destruction; for failed tests.
  void KeepScratch() { keep_scratch_ = true; }
  // The last lines of every process's log, for failure messages.
  std::string LogTails(size_t lines_per_log = 15) const;

 private:
  Cluster() = default;

  std::string dir_;
  bool keep_scratch_ = false;
  tools::ChildProcess bootstrap_;
  uint16_t bootstrap_port_ = 0;
  std::vector<std::unique_ptr<AgentProcess>> agents_;
};

// ---- driver helpers (each call bounded by its timeout) --------------------------------------

StatusOr<tools::RpcClient> ConnectRpc(uint16_t port, const std::string& client_id = "it-driver");

struct SubmitArgs {
  std::string room;
  uint64_t tokens = 0;
  std::string prefill_name;     // decode: look the prefill up in the bootstrap
  std::string prefill_address;  // decode: or name its engine port directly
  uint32_t deadline_ms = 0;     // 0: the agent's default
};

// A request for a prefill agent.
SubmitArgs ForPrefill(std::string room, uint64_t tokens);
// A request for a decode agent that finds the prefill by its registered name.
SubmitArgs ForDecode(std::string room, uint64_t tokens, std::string prefill_name,
                     uint32_t deadline_ms = 0);
// A request for a decode agent that names the prefill engine's address.
SubmitArgs ForDecodeAt(std::string room, uint64_t tokens, std::string prefill_address);

// One SubmitRequest; the reply as the agent gave it (any status). Transport errors as Status.
StatusOr<v1::SubmitReply> Submit(tools::RpcClient& rpc, const SubmitArgs& args);

// Submits until the agent accepts (retrying while it answers RESOURCE_EXHAUSTED, i.e. no free
// pages right now); any other refusal becomes the returned Status with the agent's message.
Status SubmitAccepted(tools::RpcClient& rpc, const SubmitArgs& args,
                      std::chrono::milliseconds timeout = std::chrono::seconds(20));

StatusOr<v1::SubmitReply> AbortRoom(tools::RpcClient& rpc, const std::string& room,
                                    const std::string& reason);

StatusOr<std::vector<v1::RequestReport>> Query(tools::RpcClient& rpc,
                                               const std::vector<std::string>& rooms);

// Polls until every room is SUCCESS or FAILED; DeadlineExceeded naming the stragglers and
// their states otherwise.
StatusOr<std::map<std::string, v1::RequestReport>> WaitFinal(tools::RpcClient& rpc,
                                                             const std::vector<std::string>& rooms,
                                                             std::chrono::milliseconds timeout);
StatusOr<v1::RequestReport> WaitFinal(tools::RpcClient& rpc, const std::string& room,
                                      std::chrono::milliseconds timeout);

StatusOr<v1::AgentStatsReply> Stats(tools::RpcClient& rpc);

bool IsFinal(const v1::RequestReport& report);
// "room: STATE STATUS message (bytes, verified, mismatches)" for assertion messages.
std::string Describe(const v1::RequestReport& report);

// Runs one request through both agents (prefill first, as a router would) and waits for it:
// the decode side's final report.
StatusOr<v1::RequestReport> RunRequest(
    tools::RpcClient& prefill, tools::RpcClient& decode, const SubmitArgs& args,
    std::chrono::milliseconds timeout = std::chrono::seconds(20));

}  // namespace kvt::integration

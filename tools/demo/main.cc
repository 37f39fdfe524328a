// kvt-demo: the end-to-end demo. Starts a bootstrap registry, one prefill agent and one decode
// agent as separate processes on loopback, runs a mixed workload of requests through them (the
// prefill agent writes each request's KV layer by layer, the engine ships every layer as it is
// written, the decode agent verifies every byte it received), prints a table and exits 0 only
// when every request arrived intact. Every process it starts is stopped on every exit path (and
// the agents exit by themselves if the demo is killed). Its working folder (logs, ready files)
// is made under $TMPDIR (else /tmp) and removed on success and on SIGINT/SIGTERM; a failed run
// keeps it and says where.
//
// Memory and backend: with a CUDA device present both agents keep their pools on cuda:0 and
// move pages with cuda_ipc; without one, host pools and ucx. --device and --backend override;
// the header and the JSON say what was used.
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <thread>

#include "agent_command.h"
#include "cli_util.h"
#include "control/protocol.h"
#include "device_spec.h"
#include "kvt/common/dtype.h"
#include "kvt/common/log_level.h"
#include "kvt/kernels/cuda_util.h"
#include "rpc_client.h"
#include "tool_util.h"

namespace {

using namespace kvt;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

struct DemoOptions {
  int requests = 64;
  int64_t min_tokens = 16;
  int64_t max_tokens = 4096;
  int concurrency = 4;
  uint32_t seed = 1;
  std::string device;        // empty: cuda:0 when a CUDA device is present, else host
  std::string backend;       // empty: cuda_ipc for CUDA pools, ucx for host pools
  bool device_auto = false;  // the device was chosen, not given
  std::string ucx_tls;
  int64_t layers = 32, heads = 8, head_dim = 128, page_size = 16;
  std::string dtype = "bf16";
  int64_t pool_tokens = 8192;
  int64_t layer_time_us = 0;
  int timeout_s = 120;
  std::string json;
  std::string agent_path, bootstrap_path;
  bool keep_logs = false;
};

struct Result {
  std::string room;
  int64_t tokens = 0;
  v1::RequestReport report;
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(std::ceil(p * v.size())) - 1);
  return v[i];
}

class Demo {
 public:
  explicit Demo(DemoOptions o) : o_(std::move(o)) {}

  ~Demo() {
    // Children first (their destructors stop them), then the scratch folder.
    decode_ = {};
    prefill_ = {};
    bootstrap_ = {};
    if (!dir_.empty() && !o_.keep_logs && (ok_ || signal_ != 0)) {
      std::error_code ignored;
      std::filesystem::remove_all(dir_, ignored);
    }
  }

  int Run() {
    Status st = Start();
    if (!st.ok()) return Fail(st);
    st = Workload();
    if (!st.ok()) return Fail(st);
    return Report();
  }

 private:
  // True once SIGINT or SIGTERM arrived (they are blocked in main and picked up here).
  bool Interrupted() {
    if (signal_ == 0) signal_ = tools::WaitForTerminationSignalFor(std::chrono::milliseconds(0));
    return signal_ != 0;
  }

  int Fail(const Status& st) {
    if (Interrupted()) {
      std::cerr << "kvt-demo: stopped by " << (signal_ == SIGINT ? "SIGINT" : "SIGTERM")
                << "; the agents are stopped and " << dir_ << " is removed\n";
      return 128 + signal_;
    }
    std::cerr << "kvt-demo: " << st.ToString() << "\n";
    for (const char* who : {"bootstrap", "prefill", "decode"}) {
      const std::string log = dir_ + "/" + who + ".log";
      if (std::filesystem::exists(log)) {
        std::cerr << "  last lines of " << log << ":\n" << tools::LogTail(log, 8);
      }
    }
    std::cerr << "  logs kept in " << dir_ << "\n";
    return 1;
  }

  Status Start() {
    const char* tmp = getenv("TMPDIR");
    const std::string parent = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
    std::string tmpl = parent + "/kvt-demo-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) {
      return Unavailable("cannot create a working folder in " + parent + ": " +
                         std::strerror(errno) + "; set TMPDIR to a writable folder");
    }
    dir_ = tmpl;
    const auto stop = [this] { return Interrupted(); };
    std::string agent = o_.agent_path, bootstrap = o_.bootstrap_path;
    if (agent.empty()) {
      KVT_ASSIGN_OR_RETURN(agent,
                           tools::FindTool("kvt-agent", {"kvt-agent", "../agent/kvt-agent"}));
    }
    if (bootstrap.empty()) {
      KVT_ASSIGN_OR_RETURN(
          bootstrap,
          tools::FindTool("kvt-bootstrap", {"kvt-bootstrap", "../bootstrap/kvt-bootstrap"}));
    }
    tools::BootstrapCommand bootstrap_command;
    bootstrap_command.binary = bootstrap;
    bootstrap_command.ready_file = dir_ + "/bootstrap.json";
    KVT_ASSIGN_OR_RETURN(
        bootstrap_, tools::ChildProcess::Spawn(bootstrap_command.Argv(), dir_ + "/bootstrap.log"));
    KVT_ASSIGN_OR_RETURN(std::string ready, tools::WaitReadyFile(dir_ + "/bootstrap.json", 20s,
                                                                 bootstrap_.pid(), stop));
    const int bootstrap_port = nlohmann::json::parse(ready)["port"].get<int>();
    const std::string registry = "127.0.0.1:" + std::to_string(bootstrap_port);

    auto agent_argv = [&](const std::string& role) {
      tools::AgentCommand command;
      command.binary = agent;
      command.role = role;
      command.name = "demo-" + role;
      command.bootstrap = registry;
      command.ready_file = dir_ + "/" + role + ".json";
      command.backend = o_.backend;
      command.device = o_.device;
      command.layers = o_.layers;
      command.heads = o_.heads;
      command.head_dim = o_.head_dim;
      command.dtype = o_.dtype;
      command.page_size = o_.page_size;
      command.tokens = o_.pool_tokens;
      command.seed = o_.seed + (role == "decode");
      command.layer_time_us = o_.layer_time_us;
      command.deadline_ms = int64_t{o_.timeout_s} * 1000;
      command.ucx_tls = o_.ucx_tls;
      return command.Argv();
    };
    KVT_ASSIGN_OR_RETURN(prefill_,
                         tools::ChildProcess::Spawn(agent_argv("prefill"), dir_ + "/prefill.log"));
    KVT_ASSIGN_OR_RETURN(decode_,
                         tools::ChildProcess::Spawn(agent_argv("decode"), dir_ + "/decode.log"));
    KVT_ASSIGN_OR_RETURN(ready,
                         tools::WaitReadyFile(dir_ + "/prefill.json", 60s, prefill_.pid(), stop));
    prefill_info_ = nlohmann::json::parse(ready);
    KVT_ASSIGN_OR_RETURN(ready,
                         tools::WaitReadyFile(dir_ + "/decode.json", 60s, decode_.pid(), stop));
    decode_info_ = nlohmann::json::parse(ready);
    KVT_ASSIGN_OR_RETURN(prefill_rpc_, tools::RpcClient::Connect(
                                           "127.0.0.1", prefill_info_["rpc_port"], "demo", 5s));
    KVT_ASSIGN_OR_RETURN(
        decode_rpc_, tools::RpcClient::Connect("127.0.0.1", decode_info_["rpc_port"], "demo", 5s));
    return OkStatus();
  }

  // Submits to one agent; true when accepted, false when it has no free pages right now.
  StatusOr<bool> Submit(tools::RpcClient& rpc, const std::string& room, int64_t tokens,
                        bool decode) {
    v1::Envelope e;
    auto* s = e.mutable_submit_request();
    s->set_room_id(room);
    s->set_num_tokens(static_cast<uint64_t>(tokens));
    if (decode) s->set_prefill_name("demo-prefill");  // resolved through the bootstrap
    KVT_ASSIGN_OR_RETURN(v1::Envelope reply, rpc.Call(e, 10s));
    const v1::SubmitReply& r = reply.submit_reply();
    if (r.status() == v1::STATUS_CODE_OK) return true;
    if (r.status() == v1::STATUS_CODE_RESOURCE_EXHAUSTED) return false;
    return Status(control::FromProtoCode(r.status()), r.message())
        .WithContext(std::string(decode ? "decode" : "prefill") + " agent refused '" + room + "'");
  }

  Status Workload() {
    std::mt19937 rng(o_.seed);
    std::uniform_real_distribution<double> log_size(std::log(double(o_.min_tokens)),
                                                    std::log(double(o_.max_tokens)));
    std::vector<Result> all(o_.requests);
    for (int i = 0; i < o_.requests; ++i) {
      all[i].room = "demo-" + std::to_string(o_.seed) + "-" + std::to_string(i);
      all[i].tokens =
          std::clamp<int64_t>(std::llround(std::exp(log_size(rng))), o_.min_tokens, o_.max_tokens);
    }
    const auto deadline = Clock::now() + std::chrono::seconds(o_.timeout_s);
    start_ = Clock::now();
    size_t next = 0;
    std::map<std::string, size_t> outstanding;  // room -> index
    std::set<size_t> prefill_submitted;
    while (next < all.size() || !outstanding.empty()) {
      if (Interrupted()) return Aborted("stopped by a signal");
      if (Clock::now() > deadline) {
        return DeadlineExceeded(std::to_string(outstanding.size() + all.size() - next) +
                                " requests unfinished after " + std::to_string(o_.timeout_s) +
                                " s; raise --timeout-s or lower the load");
      }
      // Keep up to `concurrency` requests in flight. The prefill agent gets each request
      // first (as a router would); both sides may be out of pages for a while.
      while (next < all.size() && outstanding.size() < static_cast<size_t>(o_.concurrency)) {
        Result& r = all[next];
        if (!prefill_submitted.count(next)) {
          KVT_ASSIGN_OR_RETURN(bool accepted, Submit(prefill_rpc_, r.room, r.tokens, false));
          if (!accepted) break;
          prefill_submitted.insert(next);
        }
        KVT_ASSIGN_OR_RETURN(bool accepted, Submit(decode_rpc_, r.room, r.tokens, true));
        if (!accepted) break;
        outstanding[r.room] = next++;
      }
      if (outstanding.empty()) {
        std::this_thread::sleep_for(2ms);
        continue;
      }
      v1::Envelope q;
      for (const auto& [room, i] : outstanding) q.mutable_query_requests()->add_room_ids(room);
      KVT_ASSIGN_OR_RETURN(v1::Envelope reply, decode_rpc_.Call(q, 10s));
      for (const v1::RequestReport& rep : reply.query_requests_reply().reports()) {
        if (rep.state() != v1::REQUEST_STATE_SUCCESS && rep.state() != v1::REQUEST_STATE_FAILED) {
          continue;
        }
        auto it = outstanding.find(rep.room_id());
        if (it == outstanding.end()) continue;
        all[it->second].report = rep;
        outstanding.erase(it);
      }
      std::this_thread::sleep_for(1ms);
    }
    wall_s_ = std::chrono::duration<double>(Clock::now() - start_).count();
    results_ = std::move(all);
    return OkStatus();
  }

  StatusOr<v1::AgentStatsReply> Stats(tools::RpcClient& rpc) {
    v1::Envelope q;
    q.mutable_query_stats();
    KVT_ASSIGN_OR_RETURN(v1::Envelope reply, rpc.Call(q, 10s));
    return reply.agent_stats_reply();
  }

  int Report() {
    uint64_t bytes = 0, ok = 0, verified = 0;
    std::vector<double> latency_us;
    std::vector<const Result*> failed;
    for (const Result& r : results_) {
      bytes += r.report.bytes();
      latency_us.push_back(r.report.latency_us());
      if (r.report.state() == v1::REQUEST_STATE_SUCCESS &&
          r.report.status() == v1::STATUS_CODE_OK) {
        ++ok;
      } else {
        failed.push_back(&r);
      }
      if (r.report.verified()) ++verified;
    }
    auto prefill_stats = Stats(prefill_rpc_);
    auto decode_stats = Stats(decode_rpc_);
    const double gbps = wall_s_ > 0 ? bytes / wall_s_ / 1e9 : 0;
    // What the agents really run (their ready files), not what was asked for.
    const std::string memory = decode_info_.value("memory", std::string("?"));
    const std::string device_name = decode_info_.value("device_name", std::string());
    const std::string backend = decode_stats.ok() ? decode_stats->backend() : o_.backend;
    std::string memory_line = memory;
    if (!device_name.empty()) memory_line += " (" + device_name + ")";
    const std::string prefill_memory = prefill_info_.value("memory", std::string("?"));
    if (prefill_memory != memory) memory_line += ", prefill on " + prefill_memory;
    if (o_.device_auto) {
      memory_line += memory == "host" ? ", no CUDA device found"
                                      : ", picked automatically (--device host for host pools)";
    }
    const int64_t token_bytes =
        2 * o_.layers * o_.heads * o_.head_dim * ItemSize(*ParseDType(o_.dtype));
    std::printf("\nkvt demo: bootstrap + prefill agent + decode agent on loopback\n");
    std::printf(
        "  layout   %lld layers x %lld KV heads x %lld head_dim, %s, %lld tokens/page "
        "(%lld KiB of KV per token)\n",
        (long long)o_.layers, (long long)o_.heads, (long long)o_.head_dim, o_.dtype.c_str(),
        (long long)o_.page_size, (long long)(token_bytes / 1024));
    std::printf("  memory   %s\n", memory_line.c_str());
    std::printf("  backend  %s%s\n\n", backend.c_str(),
                o_.ucx_tls.empty() ? "" : (" (UCX_TLS " + o_.ucx_tls + ")").c_str());
    std::printf("  %-28s %s\n", "requests", std::to_string(results_.size()).c_str());
    std::printf("  %-28s %llu\n", "succeeded", (unsigned long long)ok);
    std::printf("  %-28s %llu of %zu (every byte checked)\n", "verified byte-exact",
                (unsigned long long)verified, results_.size());
    std::printf("  %-28s %.3f GB\n", "KV bytes moved", bytes / 1e9);
    std::printf("  %-28s %.2f s\n", "wall time", wall_s_);
    std::printf("  %-28s %.2f GB/s (incl. the simulated forward and the byte check)\n",
                "throughput", gbps);
    std::printf("  %-28s %.0f us\n", "latency p50", Percentile(latency_us, 0.50));
    std::printf("  %-28s %.0f us\n", "latency p99", Percentile(latency_us, 0.99));
    std::printf(
        "  (latency: decode side, request posted -> done seen, i.e. every byte visible in its "
        "pool)\n");
    for (size_t i = 0; i < failed.size() && i < 10; ++i) {
      std::printf("  FAILED %s (%lld tokens): %s %s\n", failed[i]->room.c_str(),
                  (long long)failed[i]->tokens,
                  v1::StatusCode_Name(failed[i]->report.status()).c_str(),
                  failed[i]->report.message().c_str());
    }
    if (!o_.json.empty()) {
      nlohmann::json j = {{"requests", results_.size()},
                          {"succeeded", ok},
                          {"verified", verified},
                          {"bytes", bytes},
                          {"wall_s", wall_s_},
                          {"gb_per_s", gbps},
                          {"latency_p50_us", Percentile(latency_us, 0.50)},
                          {"latency_p99_us", Percentile(latency_us, 0.99)},
                          {"backend", backend},
                          {"memory", memory},
                          {"device_name", device_name},
                          {"device_auto", o_.device_auto},
                          {"layers", o_.layers},
                          {"heads", o_.heads},
                          {"head_dim", o_.head_dim},
                          {"dtype", o_.dtype},
                          {"page_size", o_.page_size}};
      for (const Result& r : results_) {
        j["per_request"].push_back({{"room", r.room},
                                    {"tokens", r.tokens},
                                    {"state", v1::RequestState_Name(r.report.state())},
                                    {"bytes", r.report.bytes()},
                                    {"latency_us", r.report.latency_us()},
                                    {"verified", r.report.verified()}});
      }
      std::ofstream(o_.json) << j.dump(2) << "\n";
    }
    ok_ = ok == results_.size() && verified == results_.size();
    std::printf("\n%s\n", ok_ ? "PASS: every request arrived and every byte verified"
                              : "FAIL: some requests failed or did not verify");
    return ok_ ? 0 : 1;
  }

  const DemoOptions o_;
  std::string dir_;
  int signal_ = 0;  // SIGINT / SIGTERM once one arrived
  tools::ChildProcess bootstrap_, prefill_, decode_;
  nlohmann::json prefill_info_, decode_info_;
  tools::RpcClient prefill_rpc_, decode_rpc_;
  std::vector<Result> results_;
  Clock::time_point start_;
  double wall_s_ = 0;
  bool ok_ = false;
};

}  // namespace

int main(int argc, char** argv) {
  DemoOptions o;
  CLI::App app{"kvt-demo: bootstrap, prefill and decode agents moving and verifying KV pages"};
  app.add_option("--requests", o.requests, "number of requests")
      ->check(kvt::tools::IntRange(1, 100000));
  app.add_option("--min-tokens", o.min_tokens, "smallest request")
      ->check(kvt::tools::IntRange(1, 1 << 24));
  app.add_option("--max-tokens", o.max_tokens, "largest request")
      ->check(kvt::tools::IntRange(1, 1 << 24));
  app.add_option("--concurrency", o.concurrency, "requests in flight")
      ->check(kvt::tools::IntRange(1, 1024));
  app.add_option("--seed", o.seed, "workload seed");
  app.add_option("--device", o.device,
                 "pool memory of both agents: host or cuda:N (default: cuda:0 when a CUDA device "
                 "is present, else host)");
  app.add_option("--backend", o.backend, "ucx or cuda_ipc (default: cuda_ipc on CUDA, else ucx)")
      ->check(CLI::IsMember({"ucx", "cuda_ipc"}));
  app.add_option("--ucx-tls", o.ucx_tls, "UCX transports, e.g. shm,self or tcp");
  app.add_option("--layers", o.layers, "layers")->check(kvt::tools::IntRange(1, 4096));
  app.add_option("--heads", o.heads, "KV heads")->check(kvt::tools::IntRange(1, 65536));
  app.add_option("--head-dim", o.head_dim, "head dim")->check(kvt::tools::IntRange(1, 65536));
  app.add_option("--dtype", o.dtype, "bf16, fp16, fp32, fp8_e4m3, fp8_e5m2");
  app.add_option("--page-size", o.page_size, "tokens per page")
      ->check(kvt::tools::IntRange(1, 65536));
  app.add_option("--pool-tokens", o.pool_tokens, "token slots of each agent's pool")
      ->check(kvt::tools::IntAtLeast(1));
  app.add_option("--layer-time-us", o.layer_time_us, "simulated compute per layer")
      ->check(kvt::tools::IntAtLeast(0));
  app.add_option("--timeout-s", o.timeout_s, "give up after this long")
      ->check(kvt::tools::IntRange(1, 3600));
  app.add_option("--json", o.json, "also write the figures here");
  app.add_option("--agent", o.agent_path, "path of kvt-agent (default: beside kvt-demo)");
  app.add_option("--bootstrap", o.bootstrap_path, "path of kvt-bootstrap");
  app.add_flag("--keep-logs", o.keep_logs, "keep the agents' logs even on success");
  CLI11_PARSE(app, argc, argv);
  // Before any thread or child: SIGINT/SIGTERM are then picked up by the run, which stops the
  // agents and removes its working folder.
  kvt::tools::BlockTerminationSignals();
  if (const kvt::Status level = kvt::CheckLogLevelEnv(); !level.ok()) {
    std::cerr << "kvt-demo: " << level.ToString() << "\n";
    return 2;
  }
  if (o.min_tokens > o.max_tokens) {
    std::cerr << "kvt-demo: --min-tokens " << o.min_tokens << " exceeds --max-tokens "
              << o.max_tokens << "\n";
    return 2;
  }
  if (!kvt::ParseDType(o.dtype).ok()) {
    std::cerr << "kvt-demo: " << kvt::ParseDType(o.dtype).status().ToString() << "\n";
    return 2;
  }
  if (o.device.empty()) {
    o.device = kvt::cuda::HasDevice() ? "cuda:0" : "host";
    o.device_auto = true;
  }
  auto device = kvt::tools::ParseDeviceSpec(o.device);
  const kvt::Status device_ok =
      device.ok() ? kvt::tools::CheckDeviceSpec(*device) : device.status();
  if (!device_ok.ok()) {
    std::cerr << "kvt-demo: " << device_ok.WithContext("--device").ToString() << "\n";
    return 2;
  }
  if (o.backend.empty()) o.backend = kvt::tools::DefaultBackendFor(*device);
  if (!device->cuda() && o.backend == "cuda_ipc") {
    std::cerr << "kvt-demo: --backend cuda_ipc moves CUDA memory; it needs --device cuda:N "
                 "(this run uses host pools)\n";
    return 2;
  }
  if (o.max_tokens > o.pool_tokens) {
    std::cerr << "kvt-demo: --max-tokens " << o.max_tokens << " does not fit a pool of "
              << o.pool_tokens << " tokens; raise --pool-tokens\n";
    return 2;
  }
  return Demo(std::move(o)).Run();
}

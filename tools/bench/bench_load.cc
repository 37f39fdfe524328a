// `kvt-bench load`: many agents under many requests at once. Starts a kvt-bootstrap and
// --prefill + --decode kvt-agent processes on 127.0.0.1, keeps --in-flight requests in flight
// over every prefill -> decode pair (request i goes to pair i mod P*D), each request's tokens
// drawn from --token-dist, every byte verified by the decode agent, and reports requests/s,
// GB/s, the driver's latency percentiles (prefill submit sent -> the decode agent's final
// report seen), failures, and the peak RSS (VmHWM) of every agent and of this process. The
// ceiling (--ceiling pair) is the same workload through one prefill and one decode agent, in
// the same run, on the same machine.
//
// The driver is one thread: every agent's RPC connection hands its replies to one inbox; submits
// go out without waiting for their replies (matched by reply_to), and each decode agent is asked
// for the reports of its requests in flight at most every --poll-ms. A refusal for lack of free
// pages or RPC workers (RESOURCE_EXHAUSTED) is retried; any other refusal, a failed or unverified
// request, or an agent's failed/corrupted counter is a failure, and the command exits 1.
//
// Processes: every child is started with --exit-with-parent and stopped (SIGTERM to all, SIGKILL
// after a bounded grace) on every exit path; SIGINT/SIGTERM stop the run the same way. The
// working folder (ready files, logs) is under $TMPDIR (else /tmp), removed unless the run failed
// or --keep-logs. Not thread-safe beyond that (single-threaded tool).
#include <fmt/core.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "agent_command.h"
#include "bench_common.h"
#include "cli_util.h"
#include "commands.h"
#include "control/auth.h"
#include "control/control_client.h"
#include "control/protocol.h"
#include "device_spec.h"
#include "kvt/common/dtype.h"
#include "kvt/common/log.h"
#include "kvt/common/log_level.h"
#include "tool_util.h"

namespace kvt::bench {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;
using namespace std::chrono_literals;

// Submit RPCs one driver keeps outstanding at one agent (the agent queues at most 1024 and
// refuses the rest; staying below that keeps refusals for lack of pages).
constexpr int kMaxSubmitsPerAgent = 512;
// Delay before a refused (RESOURCE_EXHAUSTED) submit is sent again.
constexpr auto kRetryDelay = 5ms;
// Pool headroom over the mean share of requests in flight an agent holds.
constexpr double kPoolHeadroom = 1.5;

struct LoadOptions {
  int prefill = 8;
  int decode = 8;
  int in_flight = 2000;
  int64_t requests = 20000;
  int seconds = 0;  // > 0: submit for this long instead of --requests, then drain
  std::string token_dist = "lognormal";
  int64_t median_tokens = 512;
  double sigma = 1.0;
  int64_t min_tokens = 16;
  int64_t max_tokens = 4096;
  int64_t layers = 8, heads = 1, head_dim = 32, page_size = 16;
  std::string dtype = "bf16";
  int64_t pool_tokens = 0;  // 0: sized from the in-flight share
  std::string device = "host";
  std::string backend;  // empty: the agents' default for --device
  std::string ucx_tls;
  int64_t layer_time_us = 0;
  int deadline_s = 120;
  int timeout_s = 900;
  int poll_ms = 5;
  uint32_t seed = 1;
  std::string ceiling = "pair";
  std::string json_path;
  std::string agent_path, bootstrap_path;
  bool keep_logs = false;
};

// "VmHWM" of /proc/<pid>/status in KiB (pid 0: this process); -1 when unreadable.
int64_t PeakRssKiB(pid_t pid) {
  std::ifstream in(pid > 0 ? "/proc/" + std::to_string(pid) + "/status" : "/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::strtoll(line.c_str() + 6, nullptr, 10);
  }
  return -1;
}

// A "Name:   123 kB" field of a /proc file in KiB; -1 when absent.
int64_t ProcKiB(const std::string& path, const std::string& field) {
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(field + ":", 0) == 0) {
      return std::strtoll(line.c_str() + field.size() + 1, nullptr, 10);
    }
  }
  return -1;
}

// Where an agent's memory is now: its own (anonymous) pages, shared memory it has touched (its
// pool and, on a prefill agent, the decode pools it writes into, which UCX maps), and its
// proportional share (Pss: shared pages divided among the processes mapping them).
json MemoryNow(pid_t pid) {
  const std::string status = "/proc/" + std::to_string(pid) + "/status";
  return {{"rss_kib", ProcKiB(status, "VmRSS")},
          {"rss_anon_kib", ProcKiB(status, "RssAnon")},
          {"rss_shmem_kib", ProcKiB(status, "RssShmem")},
          {"pss_kib", ProcKiB("/proc/" + std::to_string(pid) + "/smaps_rollup", "Pss")}};
}

// User + system CPU seconds of a process so far; -1 when unreadable.
double CpuSeconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return -1;
  std::istringstream fields(stat.substr(paren + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::strtod(field.c_str(), nullptr);  // utime, stime
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(std::min(line.size(), colon + 2));
    }
  }
  return "unknown";
}

std::string LoadAverageNow() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return a + " " + b + " " + c;
}

// Token counts of the workload, in request order, from --seed.
class TokenSampler {
 public:
  explicit TokenSampler(const LoadOptions& o, uint32_t seed) : o_(o), rng_(seed) {}

  int64_t Next() {
    double t = 0;
    if (o_.token_dist == "fixed") {
      t = static_cast<double>(o_.median_tokens);
    } else if (o_.token_dist == "uniform") {
      t = std::uniform_real_distribution<double>(static_cast<double>(o_.min_tokens),
                                                 static_cast<double>(o_.max_tokens))(rng_);
    } else if (o_.token_dist == "loguniform") {
      t = std::exp(std::uniform_real_distribution<double>(
          std::log(static_cast<double>(o_.min_tokens)),
          std::log(static_cast<double>(o_.max_tokens)))(rng_));
    } else {  // lognormal
      t = std::exp(std::normal_distribution<double>(std::log(static_cast<double>(o_.median_tokens)),
                                                    o_.sigma)(rng_));
    }
    return std::clamp<int64_t>(std::llround(t), o_.min_tokens, o_.max_tokens);
  }

 private:
  const LoadOptions& o_;
  std::mt19937_64 rng_;
};

double MeanTokens(const LoadOptions& o) {
  TokenSampler sampler(o, o.seed ^ 0x5eedu);
  double sum = 0;
  constexpr int kDraws = 100000;
  for (int i = 0; i < kDraws; ++i) sum += static_cast<double>(sampler.Next());
  return sum / kDraws;
}

// Replies of every agent connection, in arrival order, for the driver thread.
class Inbox {
 public:
  struct Event {
    int agent = 0;
    bool disconnected = false;
    Status why;
    v1::Envelope envelope;
    Clock::time_point at;
  };

  void Push(Event e) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      events_.push_back(std::move(e));
    }
    cv_.notify_one();
  }

  // Everything received, waiting until `until` when nothing is there yet.
  std::deque<Event> Take(Clock::time_point until) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, until, [this] { return !events_.empty(); });
    std::deque<Event> out;
    out.swap(events_);
    return out;
  }

 private:
  std::mutex mu_;  // guards events_
  std::condition_variable cv_;
  std::deque<Event> events_;
};

class Link : public control::ControlClient::Handler {
 public:
  Link(int agent, Inbox* inbox) : agent_(agent), inbox_(inbox) {}
  void OnMessage(const v1::Envelope& envelope) override {
    inbox_->Push(Inbox::Event{agent_, false, OkStatus(), envelope, Clock::now()});
  }
  void OnDisconnect(const Status& why) override {
    inbox_->Push(Inbox::Event{agent_, true, why, v1::Envelope(), Clock::now()});
  }

 private:
  const int agent_;
  Inbox* const inbox_;
};

struct AgentProcess {
  std::string name;
  bool prefill = true;
  std::string log;
  tools::ChildProcess process;
  pid_t pid = -1;
  json ready;
  std::unique_ptr<Link> link;                   // outlives `rpc`
  std::unique_ptr<control::ControlClient> rpc;  // closed before the process stops
};

struct RunResult {
  std::string name;
  int prefill = 0, decode = 0;
  int64_t requests = 0, succeeded = 0, failed = 0, verified = 0;
  uint64_t bytes = 0;
  int64_t retries = 0;
  double wall_s = 0;
  std::vector<double> latency_ms, agent_latency_ms;
  std::vector<std::string> failures;  // the first few, in words
  json agents = json::array();
  int64_t agent_failed = 0, agent_corrupted = 0;  // summed over the agents' own counters
  double start_s = 0, warmup_s = 0, pool_mib = 0;

  double RequestsPerSecond() const { return wall_s > 0 ? requests / wall_s : 0; }
  double GBps() const { return wall_s > 0 ? static_cast<double>(bytes) / wall_s / 1e9 : 0; }
  int64_t Failures() const { return failed + agent_failed + agent_corrupted; }
};

// One cluster (bootstrap + agents) and the workload through it.
class LoadRun {
 public:
  LoadRun(const LoadOptions& o, std::string name, int prefill, int decode, std::string dir,
          std::string agent_bin, std::string bootstrap_bin, int* signal)
      : o_(o),
        dir_(std::move(dir)),
        agent_bin_(std::move(agent_bin)),
        bootstrap_bin_(std::move(bootstrap_bin)),
        signal_(signal) {
    r_.name = std::move(name);
    r_.prefill = prefill;
    r_.decode = decode;
  }

  ~LoadRun() { StopAll(); }

  // The run's figures; Status when it could not run to the end (failed requests are not an
  // error here: they are counted in the result).
  StatusOr<RunResult> Run() {
    KVT_RETURN_IF_ERROR(Start());
    // One request per pair first (untimed): each decode agent connects to each prefill agent
    // once, as a cluster does when it starts, before the timed load. At most --prefill of them
    // in flight, in pair order, so that a prefill agent takes about one new decode peer at a
    // time: its engine answers the hellos of new peers one after another, and eight at once
    // can outlast the 5 s handshake timeout of the last ones on a loaded machine. Its failures
    // count.
    KVT_RETURN_IF_ERROR(Workload(/*warm=*/true));
    KVT_RETURN_IF_ERROR(Workload(/*warm=*/false));
    KVT_RETURN_IF_ERROR(Settle());
    StopAll();
    return r_;
  }

  // What the agents' logs say last, for an error message.
  std::string LogTails() const {
    std::string out;
    for (const AgentProcess& a : agents_) {
      const std::string tail = tools::LogTail(a.log, 4);
      if (!tail.empty()) out += "  last lines of " + a.log + ":\n" + tail;
    }
    return out;
  }

 private:
  bool Interrupted() {
    if (*signal_ == 0) *signal_ = tools::WaitForTerminationSignalFor(0ms);
    return *signal_ != 0;
  }

  int64_t PoolTokens(double mean_tokens) const {
    if (o_.pool_tokens > 0) return o_.pool_tokens;
    const int sides = std::min(r_.prefill, r_.decode);
    const double share = std::ceil(static_cast<double>(o_.in_flight) / sides);
    int64_t tokens =
        static_cast<int64_t>(std::ceil(kPoolHeadroom * share * mean_tokens)) + 2 * o_.max_tokens;
    return (tokens + o_.page_size - 1) / o_.page_size * o_.page_size;
  }

  Status Start() {
    const auto start = Clock::now();
    const auto stop = [this] { return Interrupted(); };
    tools::BootstrapCommand bc;
    bc.binary = bootstrap_bin_;
    bc.ready_file = dir_ + "/" + r_.name + "-bootstrap.json";
    KVT_ASSIGN_OR_RETURN(
        bootstrap_, tools::ChildProcess::Spawn(bc.Argv(), dir_ + "/" + r_.name + "-bootstrap.log"));
    KVT_ASSIGN_OR_RETURN(std::string ready,
                         tools::WaitReadyFile(bc.ready_file, 20s, bootstrap_.pid(), stop));
    const std::string registry =
        "127.0.0.1:" + std::to_string(json::parse(ready)["port"].get<int>());

    const int64_t pool_tokens = PoolTokens(MeanTokens(o_));
    const int64_t token_bytes =
        2 * o_.layers * o_.heads * o_.head_dim * ItemSize(*ParseDType(o_.dtype));
    r_.pool_mib = static_cast<double>(pool_tokens * token_bytes) / (1 << 20);
    pool_tokens_ = pool_tokens;
    for (int i = 0; i < r_.prefill + r_.decode; ++i) {
      AgentProcess a;
      a.prefill = i < r_.prefill;
      a.name =
          r_.name + (a.prefill ? "-p" + std::to_string(i) : "-d" + std::to_string(i - r_.prefill));
      a.log = dir_ + "/" + a.name + ".log";
      tools::AgentCommand c;
      c.binary = agent_bin_;
      c.role = a.prefill ? "prefill" : "decode";
      c.name = a.name;
      c.bootstrap = registry;
      c.ready_file = dir_ + "/" + a.name + ".json";
      c.device = o_.device;
      c.backend = o_.backend;
      c.layers = o_.layers;
      c.heads = o_.heads;
      c.head_dim = o_.head_dim;
      c.dtype = o_.dtype;
      c.page_size = o_.page_size;
      c.tokens = pool_tokens;
      c.seed = o_.seed + static_cast<uint32_t>(i);
      c.layer_time_us = o_.layer_time_us;
      c.deadline_ms = int64_t{o_.deadline_s} * 1000;
      c.ucx_tls = o_.ucx_tls;
      KVT_ASSIGN_OR_RETURN(a.process, tools::ChildProcess::Spawn(c.Argv(), a.log));
      a.pid = a.process.pid();
      agents_.push_back(std::move(a));
    }
    for (size_t i = 0; i < agents_.size(); ++i) {
      AgentProcess& a = agents_[i];
      KVT_ASSIGN_OR_RETURN(ready,
                           tools::WaitReadyFile(dir_ + "/" + a.name + ".json", 120s, a.pid, stop));
      a.ready = json::parse(ready);
    }
    // Connected once every agent is up: an agent's RPC server closes a connection that stays
    // quiet for a minute, and starting sixteen pools may take about that long. Heartbeats keep
    // a connection open while the driver has nothing to ask that agent (the drain).
    for (size_t i = 0; i < agents_.size(); ++i) {
      AgentProcess& a = agents_[i];
      control::ControlClientOptions co;
      co.port = static_cast<uint16_t>(a.ready["rpc_port"].get<int>());
      co.client_id = "kvt-bench-load";
      co.cluster_token = control::ClusterTokenFromEnv();
      co.max_inbox_frames = 1u << 16;
      co.limits.idle_timeout = 0ms;  // the agent may have nothing to say for a while
      co.limits.heartbeat_interval = 5s;
      a.link = std::make_unique<Link>(static_cast<int>(i), &inbox_);
      KVT_ASSIGN_OR_RETURN(a.rpc, control::ControlClient::Connect(co, a.link.get()));
    }
    backend_ = agents_.front().ready.value("backend", std::string("?"));
    memory_ = agents_.front().ready.value("memory", std::string("?"));
    r_.start_s = std::chrono::duration<double>(Clock::now() - start).count();
    return OkStatus();
  }

  enum class Stage { kPrefillSubmit, kDecodeSubmit, kWaiting, kDone };
  struct Request {
    int64_t tokens = 0;
    int prefill = 0, decode = 0;  // agent indexes
    Stage stage = Stage::kPrefillSubmit;
    Clock::time_point start;
  };
  struct Pending {
    enum Kind { kSubmit, kQuery } kind = kSubmit;
    int64_t request = -1;
  };

  std::string Room(int64_t i) const {
    return "load-" + r_.name + "-" + phase_ + "-" + std::to_string(i);
  }
  int64_t RoomIndex(const std::string& room) const {
    const size_t dash = room.rfind('-');
    return dash == std::string::npos ? -1 : std::strtoll(room.c_str() + dash + 1, nullptr, 10);
  }

  Status Send(int agent, v1::Envelope e, Pending p) {
    const uint64_t id = ++next_id_;
    e.set_id(id);
    pending_[id] = p;
    Status sent = agents_[agent].rpc->Send(e);
    if (!sent.ok()) {
      pending_.erase(id);
      return sent.WithContext("RPC to agent " + agents_[agent].name);
    }
    if (p.kind == Pending::kSubmit) ++submits_out_[agent];
    return OkStatus();
  }

  Status SendSubmit(int64_t i) {
    Request& q = reqs_[i];
    const bool prefill = q.stage == Stage::kPrefillSubmit;
    v1::Envelope e;
    auto* s = e.mutable_submit_request();
    s->set_room_id(Room(i));
    s->set_num_tokens(static_cast<uint64_t>(q.tokens));
    if (!prefill) s->set_prefill_name(agents_[q.prefill].name);  // through the bootstrap
    return Send(prefill ? q.prefill : q.decode, std::move(e), Pending{Pending::kSubmit, i});
  }

  void Fail(int64_t i, const std::string& why) {
    Request& q = reqs_[i];
    if (q.stage == Stage::kDone) return;
    if (q.stage == Stage::kWaiting) waiting_[q.decode].erase(i);
    q.stage = Stage::kDone;
    --in_flight_;
    ++r_.failed;
    if (r_.failures.size() < 10) r_.failures.push_back(Room(i) + ": " + why);
  }

  void Finish(int64_t i, const v1::RequestReport& rep, Clock::time_point at) {
    Request& q = reqs_[i];
    if (q.stage != Stage::kWaiting) return;
    const bool ok = rep.state() == v1::REQUEST_STATE_SUCCESS &&
                    rep.status() == v1::STATUS_CODE_OK && rep.verified() && rep.mismatches() == 0;
    if (!ok) {
      Fail(i, v1::RequestState_Name(rep.state()) + " " + v1::StatusCode_Name(rep.status()) + " " +
                  rep.message() +
                  (rep.mismatches() > 0 ? " (" + std::to_string(rep.mismatches()) + " mismatches)"
                                        : std::string(rep.verified() ? "" : " (not verified)")));
      return;
    }
    waiting_[q.decode].erase(i);
    q.stage = Stage::kDone;
    --in_flight_;
    ++r_.succeeded;
    ++r_.verified;
    r_.bytes += rep.bytes();
    r_.latency_ms.push_back(std::chrono::duration<double, std::milli>(at - q.start).count());
    r_.agent_latency_ms.push_back(rep.latency_us() / 1000.0);
  }

  Status Handle(const Inbox::Event& ev) {
    AgentProcess& a = agents_[ev.agent];
    if (ev.disconnected) {
      return Unavailable("the RPC connection to agent " + a.name + " (pid " +
                         std::to_string(a.pid) + ") closed: " + ev.why.ToString());
    }
    const v1::Envelope& e = ev.envelope;
    auto it = pending_.find(e.reply_to());
    if (it == pending_.end()) {
      if (e.has_error()) {
        return Unavailable("agent " + a.name +
                           " sent an error: " + control::StatusFromError(e.error()).ToString());
      }
      return OkStatus();  // a reply nobody waits for any more
    }
    const Pending p = it->second;
    pending_.erase(it);
    if (p.kind == Pending::kQuery) {
      query_out_[ev.agent] = false;
      if (e.has_error()) {
        return Unavailable("agent " + a.name +
                           " refused a query: " + control::StatusFromError(e.error()).ToString());
      }
      for (const v1::RequestReport& rep : e.query_requests_reply().reports()) {
        if (rep.state() != v1::REQUEST_STATE_SUCCESS && rep.state() != v1::REQUEST_STATE_FAILED) {
          continue;
        }
        const int64_t i = RoomIndex(rep.room_id());
        if (i >= 0 && i < static_cast<int64_t>(reqs_.size()) && rep.room_id() == Room(i)) {
          Finish(i, rep, ev.at);
        }
      }
      return OkStatus();
    }
    --submits_out_[ev.agent];
    Request& q = reqs_[p.request];
    if (q.stage == Stage::kDone) return OkStatus();
    const bool prefill = q.stage == Stage::kPrefillSubmit;
    const std::string side = prefill ? "prefill" : "decode";
    if (e.has_error()) {
      Fail(p.request,
           side + " agent " + a.name + ": " + control::StatusFromError(e.error()).ToString());
      return OkStatus();
    }
    const v1::SubmitReply& reply = e.submit_reply();
    if (reply.status() == v1::STATUS_CODE_RESOURCE_EXHAUSTED) {
      ++r_.retries;
      retries_.push({ev.at + kRetryDelay, p.request});
      return OkStatus();
    }
    if (reply.status() != v1::STATUS_CODE_OK) {
      Fail(p.request, side + " agent " + a.name + " refused the submit: " +
                          v1::StatusCode_Name(reply.status()) + " " + reply.message());
      return OkStatus();
    }
    if (prefill) {
      q.stage = Stage::kDecodeSubmit;
      return SendSubmit(p.request);
    }
    q.stage = Stage::kWaiting;
    waiting_[q.decode].insert(p.request);
    return OkStatus();
  }

  Status CheckChildren() {
    if (!bootstrap_.running()) return Unavailable("kvt-bootstrap exited during the run");
    for (AgentProcess& a : agents_) {
      if (!a.process.running()) {
        return Unavailable("agent " + a.name + " (pid " + std::to_string(a.pid) +
                           ") exited during the run");
      }
    }
    return OkStatus();
  }

  // The timed load, or (warm) one request per prefill -> decode pair.
  Status Workload(bool warm) {
    const int n = r_.prefill + r_.decode;
    const int pairs = r_.prefill * r_.decode;
    const int64_t requests = warm ? pairs : o_.requests;
    const int seconds = warm ? 0 : o_.seconds;
    const int in_flight = warm ? r_.prefill : o_.in_flight;
    phase_ = warm ? "warm" : "timed";
    reqs_.clear();
    r_.succeeded = r_.verified = r_.retries = 0;
    r_.bytes = 0;
    r_.latency_ms.clear();
    r_.agent_latency_ms.clear();
    submits_out_.assign(n, 0);
    query_out_.assign(n, false);
    waiting_.assign(n, {});
    std::vector<Clock::time_point> next_poll(n, Clock::now());
    TokenSampler sampler(o_, o_.seed);
    const auto start = Clock::now();
    const auto give_up = start + std::chrono::seconds(o_.timeout_s);
    const auto submit_until = start + std::chrono::seconds(seconds);
    auto last_check = start;
    const auto poll = std::chrono::milliseconds(o_.poll_ms);
    while (true) {
      if (Interrupted()) return Aborted("stopped by a signal");
      const auto now = Clock::now();
      if (now > give_up) {
        return DeadlineExceeded(std::to_string(in_flight_) + " requests still in flight after " +
                                std::to_string(o_.timeout_s) +
                                " s; raise --timeout-s or lower --in-flight / --requests");
      }
      if (now - last_check > 250ms) {
        KVT_RETURN_IF_ERROR(CheckChildren());
        last_check = now;
      }
      const bool more =
          seconds > 0 ? now < submit_until : static_cast<int64_t>(reqs_.size()) < requests;
      // Admission: new requests while below --in-flight.
      if (more) {
        while (in_flight_ < in_flight &&
               (seconds > 0 ? Clock::now() < submit_until
                            : static_cast<int64_t>(reqs_.size()) < requests)) {
          const int64_t i = static_cast<int64_t>(reqs_.size());
          const int pair = static_cast<int>(i % pairs);
          const int p = pair % r_.prefill;
          if (submits_out_[p] >= kMaxSubmitsPerAgent) break;
          Request q;
          q.tokens = sampler.Next();
          q.prefill = p;
          q.decode = r_.prefill + pair / r_.prefill;
          q.start = Clock::now();
          reqs_.push_back(q);
          ++in_flight_;
          KVT_RETURN_IF_ERROR(SendSubmit(i));
        }
      } else if (in_flight_ == 0) {
        break;
      }
      // Refused submits whose delay has passed.
      while (!retries_.empty() && retries_.top().first <= Clock::now()) {
        const int64_t i = retries_.top().second;
        retries_.pop();
        if (reqs_[i].stage == Stage::kPrefillSubmit || reqs_[i].stage == Stage::kDecodeSubmit) {
          KVT_RETURN_IF_ERROR(SendSubmit(i));
        }
      }
      // Reports of the requests waiting on each decode agent.
      for (int d = r_.prefill; d < n; ++d) {
        if (query_out_[d] || waiting_[d].empty() || Clock::now() < next_poll[d]) continue;
        v1::Envelope e;
        for (int64_t i : waiting_[d]) e.mutable_query_requests()->add_room_ids(Room(i));
        KVT_RETURN_IF_ERROR(Send(d, std::move(e), Pending{Pending::kQuery, -1}));
        query_out_[d] = true;
        next_poll[d] = Clock::now() + poll;
      }
      auto until = Clock::now() + poll;
      if (!retries_.empty()) until = std::min(until, retries_.top().first);
      for (Inbox::Event& ev : inbox_.Take(until)) KVT_RETURN_IF_ERROR(Handle(ev));
    }
    if (warm) {
      r_.warmup_s = std::chrono::duration<double>(Clock::now() - start).count();
      return OkStatus();
    }
    r_.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
    r_.requests = static_cast<int64_t>(reqs_.size());
    return OkStatus();
  }

  // Sends `e` to every agent and returns their replies, by agent.
  StatusOr<std::vector<v1::Envelope>> CallAll(const v1::Envelope& e,
                                              std::chrono::milliseconds timeout) {
    std::map<uint64_t, int> ids;
    for (int a = 0; a < static_cast<int>(agents_.size()); ++a) {
      v1::Envelope copy = e;
      const uint64_t id = ++next_id_;
      copy.set_id(id);
      KVT_RETURN_IF_ERROR(agents_[a].rpc->Send(copy));
      ids[id] = a;
    }
    std::vector<v1::Envelope> replies(agents_.size());
    const auto until = Clock::now() + timeout;
    while (!ids.empty()) {
      if (Clock::now() > until) {
        return DeadlineExceeded("agent " + agents_[ids.begin()->second].name + " did not answer " +
                                std::string(control::BodyName(e)) + " within " +
                                std::to_string(timeout.count()) + " ms");
      }
      for (Inbox::Event& ev : inbox_.Take(std::min(until, Clock::now() + 100ms))) {
        if (ev.disconnected) KVT_RETURN_IF_ERROR(Handle(ev));
        auto it = ids.find(ev.envelope.reply_to());
        if (it == ids.end()) continue;
        if (ev.envelope.has_error()) {
          return control::StatusFromError(ev.envelope.error())
              .WithContext("agent " + agents_[it->second].name);
        }
        replies[it->second] = std::move(ev.envelope);
        ids.erase(it);
      }
    }
    return replies;
  }

  // Waits (bounded) until every prefill room is final too, then records each agent's counters,
  // peak RSS and CPU time.
  Status Settle() {
    v1::Envelope q;
    q.mutable_query_stats();
    std::vector<v1::Envelope> stats;
    const auto until = Clock::now() + 15s;
    while (true) {
      KVT_ASSIGN_OR_RETURN(stats, CallAll(q, 10s));
      bool settled = true;
      for (const v1::Envelope& s : stats) {
        const v1::AgentStatsReply& st = s.agent_stats_reply();
        if (st.succeeded() + st.failed() < st.submitted()) settled = false;
      }
      if (settled || Clock::now() > until || Interrupted()) break;
      std::this_thread::sleep_for(50ms);
    }
    for (size_t i = 0; i < agents_.size(); ++i) {
      const v1::AgentStatsReply& st = stats[i].agent_stats_reply();
      const AgentProcess& a = agents_[i];
      const int64_t unfinished =
          static_cast<int64_t>(st.submitted()) - static_cast<int64_t>(st.succeeded() + st.failed());
      r_.agent_failed += static_cast<int64_t>(st.failed()) + std::max<int64_t>(0, unfinished);
      r_.agent_corrupted += static_cast<int64_t>(st.corrupted());
      r_.agents.push_back({{"name", a.name},
                           {"role", a.prefill ? "prefill" : "decode"},
                           {"pid", a.pid},
                           {"peak_rss_kib", PeakRssKiB(a.pid)},
                           {"memory_at_end", MemoryNow(a.pid)},
                           {"cpu_s", CpuSeconds(a.pid)},
                           {"submitted", st.submitted()},
                           {"succeeded", st.succeeded()},
                           {"failed", st.failed()},
                           {"unfinished", unfinished},
                           {"verified", st.verified()},
                           {"corrupted", st.corrupted()},
                           {"bytes", st.bytes()},
                           {"total_pages", st.total_pages()}});
    }
    return OkStatus();
  }

 public:
  // Closes the RPC connections, then stops every agent and the bootstrap: SIGTERM to all at
  // once, SIGKILL to those still there after the grace. Idempotent.
  void StopAll() {
    for (AgentProcess& a : agents_) {
      if (a.rpc) a.rpc->Close();
      a.rpc.reset();
    }
    for (AgentProcess& a : agents_) a.process.Signal(SIGTERM);
    const auto until = Clock::now() + 5s;
    for (AgentProcess& a : agents_) {
      while (a.process.running() && Clock::now() < until) std::this_thread::sleep_for(5ms);
      a.process.Stop(0ms);  // SIGKILL when still there
    }
    bootstrap_.Stop(2s);
  }

  const std::string& backend() const { return backend_; }
  const std::string& memory() const { return memory_; }
  int64_t pool_tokens() const { return pool_tokens_; }

 private:
  const LoadOptions& o_;
  const std::string dir_, agent_bin_, bootstrap_bin_;
  int* const signal_;
  RunResult r_;
  tools::ChildProcess bootstrap_;
  std::vector<AgentProcess> agents_;
  Inbox inbox_;
  std::string backend_, memory_;
  int64_t pool_tokens_ = 0;

  std::string phase_;  // in room names: "warm" or "timed"
  std::vector<Request> reqs_;
  int in_flight_ = 0;
  uint64_t next_id_ = 0;
  std::map<uint64_t, Pending> pending_;
  std::vector<int> submits_out_;
  std::vector<bool> query_out_;
  std::vector<std::set<int64_t>> waiting_;
  std::priority_queue<std::pair<Clock::time_point, int64_t>,
                      std::vector<std::pair<Clock::time_point, int64_t>>, std::greater<>>
      retries_;
};

json RunJson(const RunResult& r) {
  return {{"name", r.name},
          {"prefill_agents", r.prefill},
          {"decode_agents", r.decode},
          {"requests", r.requests},
          {"succeeded", r.succeeded},
          {"failed", r.failed},
          {"verified", r.verified},
          {"agent_failed", r.agent_failed},
          {"agent_corrupted", r.agent_corrupted},
          {"failures", r.Failures()},
          {"first_failures", r.failures},
          {"submit_retries", r.retries},
          {"bytes", r.bytes},
          {"wall_s", r.wall_s},
          {"startup_s", r.start_s},
          {"warmup_s", r.warmup_s},
          {"requests_per_s", r.RequestsPerSecond()},
          {"gb_per_s", r.GBps()},
          {"latency_ms",
           {{"p50", Percentile(r.latency_ms, 0.50)},
            {"p90", Percentile(r.latency_ms, 0.90)},
            {"p99", Percentile(r.latency_ms, 0.99)},
            {"max", Percentile(r.latency_ms, 1.0)}}},
          {"agent_latency_ms",
           {{"p50", Percentile(r.agent_latency_ms, 0.50)},
            {"p99", Percentile(r.agent_latency_ms, 0.99)}}},
          {"pool_mib_per_agent", r.pool_mib},
          {"agents", r.agents}};
}

std::string RunRow(const RunResult& r) {
  return fmt::format(
      "{:<8} {:>3}+{:<3} {:>8} {:>6} {:>8.0f} {:>7.3f} {:>8.1f} {:>8.1f} {:>8.1f} {:>8.1f} "
      "{:>9.1f} {:>7.1f} {:>8}",
      r.name, r.prefill, r.decode, r.requests, r.Failures(), r.RequestsPerSecond(), r.GBps(),
      Percentile(r.latency_ms, 0.5), Percentile(r.latency_ms, 0.9), Percentile(r.latency_ms, 0.99),
      Percentile(r.latency_ms, 1.0), Percentile(r.agent_latency_ms, 0.5), r.wall_s, r.retries);
}

// Exit code of the command: 0 all verified, 1 a failure, 128+signal when interrupted.
int RunLoad(const LoadOptions& o) {
  int signal = 0;
  const auto interrupted = [&signal] {
    if (signal == 0) signal = tools::WaitForTerminationSignalFor(0ms);
    return signal != 0;
  };
  std::string agent_bin = o.agent_path, bootstrap_bin = o.bootstrap_path;
  if (agent_bin.empty()) {
    auto found = tools::FindTool("kvt-agent", {"kvt-agent", "../agent/kvt-agent"});
    if (!found.ok()) {
      fmt::print(stderr, "kvt-bench load: {} (or give --agent-bin)\n", found.status().ToString());
      return 1;
    }
    agent_bin = *found;
  }
  if (bootstrap_bin.empty()) {
    auto found = tools::FindTool("kvt-bootstrap", {"kvt-bootstrap", "../bootstrap/kvt-bootstrap"});
    if (!found.ok()) {
      fmt::print(stderr, "kvt-bench load: {} (or give --bootstrap-bin)\n",
                 found.status().ToString());
      return 1;
    }
    bootstrap_bin = *found;
  }
  const char* tmp = getenv("TMPDIR");
  const std::string parent = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
  std::string dir = parent + "/kvt-bench-load-XXXXXX";
  if (mkdtemp(dir.data()) == nullptr) {
    fmt::print(stderr,
               "kvt-bench load: cannot create a working folder in {}: {}; set TMPDIR to "
               "a writable folder\n",
               parent, std::strerror(errno));
    return 1;
  }
  const DType dtype = *ParseDType(o.dtype);
  const int64_t token_bytes = 2 * o.layers * o.heads * o.head_dim * ItemSize(dtype);
  const double mean_tokens = MeanTokens(o);

  json doc;
  doc["tool"] = "kvt-bench load";
  doc["date_utc"] = NowUtc();
  doc["command"] = CommandLine();
  doc["machine"] = DescribeMachine(false);
  doc["machine"]["cpu_model"] = CpuModel();
  doc["loadavg_start"] = LoadAverageNow();
  doc["config"] = {{"prefill_agents", o.prefill},
                   {"decode_agents", o.decode},
                   {"in_flight", o.in_flight},
                   {"requests", o.seconds > 0 ? json(nullptr) : json(o.requests)},
                   {"seconds", o.seconds},
                   {"token_dist", o.token_dist},
                   {"median_tokens", o.median_tokens},
                   {"sigma", o.sigma},
                   {"min_tokens", o.min_tokens},
                   {"max_tokens", o.max_tokens},
                   {"mean_tokens", mean_tokens},
                   {"layers", o.layers},
                   {"heads", o.heads},
                   {"head_dim", o.head_dim},
                   {"dtype", o.dtype},
                   {"page_size", o.page_size},
                   {"bytes_per_token", token_bytes},
                   {"device", o.device},
                   {"ucx_tls", o.ucx_tls},
                   {"layer_time_us", o.layer_time_us},
                   {"deadline_s", o.deadline_s},
                   {"poll_ms", o.poll_ms},
                   {"seed", o.seed},
                   {"ceiling", o.ceiling}};
  doc["notes"] =
      "latency_ms: driver's view, prefill SubmitRequest sent -> the decode agent's final, verified "
      "report received (reports are polled every poll_ms per decode agent, one query at a time). "
      "agent_latency_ms: the decode agent's own view (its submit -> final). requests_per_s and "
      "gb_per_s: completed requests and their KV bytes / wall time from the first submit to the "
      "last report. peak_rss_kib: VmHWM of /proc/<pid>/status just before the agent is stopped "
      "(the pool, allocated through UCX and prefaulted, included). The pair run is the ceiling: "
      "the same requests (same seed, same in-flight) through one prefill and one decode agent.";

  fmt::print("kvt-bench load ({}), {} prefill + {} decode agents on 127.0.0.1, {} in flight, {}\n",
             doc["date_utc"].get<std::string>(), o.prefill, o.decode, o.in_flight,
             o.seconds > 0 ? fmt::format("{} s of submits", o.seconds)
                           : fmt::format("{} requests", o.requests));
  fmt::print(
      "  layout {} layers x {} KV heads x {} head_dim, {}, {} tokens/page: {} B of KV per token; "
      "tokens {} (median {}, sigma {}, clamped to {}..{}; mean {:.0f})\n",
      o.layers, o.heads, o.head_dim, o.dtype, o.page_size, token_bytes, o.token_dist,
      o.median_tokens, o.sigma, o.min_tokens, o.max_tokens, mean_tokens);
  std::fflush(stdout);

  std::vector<std::pair<std::string, std::pair<int, int>>> plan = {{"load", {o.prefill, o.decode}}};
  if (o.ceiling == "pair") plan.push_back({"pair", {1, 1}});
  std::vector<RunResult> results;
  std::string first_error;
  std::string backend = "?", memory = "?";
  for (const auto& [name, sides] : plan) {
    if (interrupted()) break;
    LoadRun run(o, name, sides.first, sides.second, dir, agent_bin, bootstrap_bin, &signal);
    StatusOr<RunResult> r = run.Run();
    if (!r.ok()) {
      if (interrupted()) break;
      first_error = "the " + name + " run: " + r.status().ToString();
      fmt::print(stderr, "kvt-bench load: {}\n{}", first_error, run.LogTails());
      break;
    }
    backend = run.backend();
    memory = run.memory();
    fmt::print(
        "  {} run: {} agents up in {:.1f} s, pools of {} tokens ({:.0f} MiB) each; warm-up ({} "
        "requests, one per pair) {:.1f} s\n",
        name, sides.first + sides.second, r->start_s, run.pool_tokens(), r->pool_mib,
        sides.first * sides.second, r->warmup_s);
    std::fflush(stdout);
    results.push_back(std::move(r).value());
  }
  if (signal != 0) {
    fmt::print(stderr, "kvt-bench load: stopped by {}; the agents are stopped and {} is removed\n",
               signal == SIGINT ? "SIGINT" : "SIGTERM", dir);
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
    return 128 + signal;
  }

  int64_t failures = 0;
  json runs = json::array();
  for (const RunResult& r : results) {
    failures += r.Failures();
    runs.push_back(RunJson(r));
    int64_t pss = 0;
    for (const json& a : r.agents) pss += a["memory_at_end"]["pss_kib"].get<int64_t>();
    runs.back()["agents_pss_total_kib"] = pss;
  }
  doc["backend"] = backend;
  doc["memory"] = memory;
  doc["runs"] = runs;
  doc["failures"] = failures;
  doc["bench_peak_rss_kib"] = PeakRssKiB(0);
  doc["loadavg_end"] = LoadAverageNow();
  if (!first_error.empty()) doc["error"] = first_error;
  double ratio = 0;
  if (results.size() == 2 && results[1].RequestsPerSecond() > 0) {
    ratio = results[0].RequestsPerSecond() / results[1].RequestsPerSecond();
    doc["ratio_to_pair"] = ratio;
  }

  fmt::print("  backend {}, memory {}{}\n\n", backend, memory,
             o.ucx_tls.empty() ? "" : ", UCX_TLS " + o.ucx_tls);
  fmt::print("{:<8} {:>7} {:>8} {:>6} {:>8} {:>7} {:>8} {:>8} {:>8} {:>8} {:>9} {:>7} {:>8}\n",
             "run", "agents", "requests", "failed", "req/s", "GB/s", "p50 ms", "p90 ms", "p99 ms",
             "max ms", "agent p50", "wall s", "refused");
  for (const RunResult& r : results) fmt::print("{}\n", RunRow(r));
  if (ratio > 0) fmt::print("\nload / pair (requests/s, same requests): {:.3f}\n", ratio);
  for (const RunResult& r : results) {
    fmt::print(
        "\n{} run, per agent: peak RSS (VmHWM; shared memory touched included), at the end its "
        "own pages (anon), shared memory touched (shm) and proportional share (Pss), MiB; CPU; "
        "counters (the warm-up's one request per pair included)\n",
        r.name);
    fmt::print("  {:<10} {:<7} {:>8} {:>9} {:>7} {:>7} {:>7} {:>7} {:>9} {:>9} {:>6} {:>9}\n",
               "agent", "role", "pid", "peak MiB", "anon", "shm", "Pss", "cpu s", "submitted",
               "succeeded", "failed", "corrupted");
    for (const json& a : r.agents) {
      const json& m = a["memory_at_end"];
      fmt::print(
          "  {:<10} {:<7} {:>8} {:>9.1f} {:>7.1f} {:>7.1f} {:>7.1f} {:>7.1f} {:>9} {:>9} "
          "{:>6} {:>9}\n",
          a["name"].get<std::string>(), a["role"].get<std::string>(), a["pid"].get<int>(),
          a["peak_rss_kib"].get<int64_t>() / 1024.0, m["rss_anon_kib"].get<int64_t>() / 1024.0,
          m["rss_shmem_kib"].get<int64_t>() / 1024.0, m["pss_kib"].get<int64_t>() / 1024.0,
          a["cpu_s"].get<double>(), a["submitted"].get<uint64_t>(), a["succeeded"].get<uint64_t>(),
          a["failed"].get<uint64_t>(), a["corrupted"].get<uint64_t>());
    }
    int64_t pss = 0;
    for (const json& a : r.agents) pss += a["memory_at_end"]["pss_kib"].get<int64_t>();
    fmt::print("  all agents' Pss at the end: {:.0f} MiB\n", pss / 1024.0);
    for (const std::string& f : r.failures) fmt::print("  FAILED {}\n", f);
  }
  fmt::print("\nkvt-bench itself: peak RSS {:.1f} MiB; load average at start {}, at end {}\n",
             PeakRssKiB(0) / 1024.0, doc["loadavg_start"].get<std::string>(),
             doc["loadavg_end"].get<std::string>());
  fmt::print(
      "latency = prefill submit sent -> the decode agent's verified report seen by this driver "
      "(polled every {} ms); agent p50 = the decode agent's own submit -> final; GB/s = 1e9 bytes "
      "of KV per second of wall time; refused = submits an agent refused for lack of free pages "
      "(RESOURCE_EXHAUSTED), each sent again {} ms later.\n",
      o.poll_ms, kRetryDelay.count());
  if (!o.json_path.empty()) {
    Status written = WriteJson(o.json_path, doc);
    if (!written.ok()) {
      fmt::print(stderr, "kvt-bench load: {}\n", written.ToString());
      return 1;
    }
    fmt::print("wrote {}\n", o.json_path);
  }
  const bool ok = first_error.empty() && failures == 0;
  if (ok) {
    fmt::print("PASS: {} requests, every one arrived and every byte verified\n",
               results.empty() ? 0 : results[0].requests);
    if (!o.keep_logs) {
      std::error_code ignored;
      std::filesystem::remove_all(dir, ignored);
    }
  } else {
    fmt::print("FAIL: {}; logs kept in {}\n",
               first_error.empty() ? std::to_string(failures) + " failures" : first_error, dir);
  }
  return ok ? 0 : 1;
}

// Checks the options that depend on each other; the message says what to change.
Status Validate(LoadOptions& o) {
  if (o.min_tokens > o.max_tokens) {
    return InvalidArgument("--min-tokens " + std::to_string(o.min_tokens) +
                           " exceeds --max-tokens " + std::to_string(o.max_tokens) +
                           "; lower --min-tokens or raise --max-tokens");
  }
  if ((o.token_dist == "lognormal" || o.token_dist == "fixed") &&
      (o.median_tokens < o.min_tokens || o.median_tokens > o.max_tokens)) {
    return InvalidArgument("--median-tokens " + std::to_string(o.median_tokens) +
                           " is outside --min-tokens..--max-tokens (" +
                           std::to_string(o.min_tokens) + ".." + std::to_string(o.max_tokens) +
                           "); give a median inside that range");
  }
  if (!(o.sigma >= 0 && o.sigma <= 4)) {
    return InvalidArgument(fmt::format("--sigma {}", o.sigma) +
                           " is not allowed; use a number in 0..4 (1 is a long-tailed prompt mix)");
  }
  if (auto d = ParseDType(o.dtype); !d.ok()) return d.status().WithContext("--dtype");
  auto device = tools::ParseDeviceSpec(o.device);
  if (!device.ok()) return device.status().WithContext("--device");
  if (o.backend.empty()) o.backend = tools::DefaultBackendFor(*device);
  if (o.backend == "cuda_ipc" && !device->cuda()) {
    return InvalidArgument(
        "--backend cuda_ipc moves CUDA pools; add --device cuda:N, or use --backend ucx for "
        "host pools");
  }
  if (Status st = tools::CheckDeviceSpec(*device); !st.ok()) return st.WithContext("--device");
  if (!o.ucx_tls.empty() && o.backend != "ucx") {
    return InvalidArgument("--ucx-tls applies to --backend ucx only (this run uses " + o.backend +
                           ")");
  }
  if (o.pool_tokens > 0 && o.pool_tokens < o.max_tokens) {
    return InvalidArgument("--pool-tokens " + std::to_string(o.pool_tokens) +
                           " cannot hold a request of --max-tokens " +
                           std::to_string(o.max_tokens) +
                           "; raise --pool-tokens or leave it out (0: sized from --in-flight)");
  }
  return OkStatus();
}

}  // namespace

void AddLoadCommand(CLI::App& app, int& exit_code) {
  auto o = std::make_shared<LoadOptions>();
  CLI::App* cmd = app.add_subcommand(
      "load",
      "a bootstrap and --prefill + --decode kvt-agent processes on 127.0.0.1 under --in-flight "
      "requests at once, every byte verified: requests/s, GB/s, latency p50/p90/p99/max, "
      "failures (exit 1 if any), peak RSS of each agent; ceiling: the same requests through one "
      "prefill and one decode agent");
  cmd->add_option("--prefill", o->prefill, "prefill agents")
      ->capture_default_str()
      ->check(tools::IntRange(1, 64));
  cmd->add_option("--decode", o->decode, "decode agents")
      ->capture_default_str()
      ->check(tools::IntRange(1, 64));
  cmd->add_option("--in-flight", o->in_flight,
                  "requests kept in flight (prefill submit sent -> decode report final)")
      ->capture_default_str()
      ->check(tools::IntRange(1, 65536));
  cmd->add_option("--requests", o->requests, "requests in all (ignored with --seconds)")
      ->capture_default_str()
      ->check(tools::IntRange(1, 10'000'000));
  cmd->add_option("--seconds", o->seconds,
                  "submit new requests for this long instead of --requests, then drain (0: use "
                  "--requests)")
      ->capture_default_str()
      ->check(tools::IntRange(0, 86400));
  cmd->add_option("--token-dist", o->token_dist,
                  "tokens per request: lognormal (--median-tokens, --sigma), loguniform or "
                  "uniform (--min-tokens..--max-tokens), fixed (--median-tokens); always clamped "
                  "to --min-tokens..--max-tokens")
      ->capture_default_str()
      ->check(CLI::IsMember({"lognormal", "loguniform", "uniform", "fixed"}));
  cmd->add_option("--median-tokens", o->median_tokens, "lognormal: median; fixed: every request")
      ->capture_default_str()
      ->check(tools::IntRange(1, 1 << 24));
  cmd->add_option("--sigma", o->sigma, "lognormal: sigma of ln(tokens), 0..4")
      ->capture_default_str();
  cmd->add_option("--min-tokens", o->min_tokens, "smallest request")
      ->capture_default_str()
      ->check(tools::IntRange(1, 1 << 24));
  cmd->add_option("--max-tokens", o->max_tokens, "largest request")
      ->capture_default_str()
      ->check(tools::IntRange(1, 1 << 24));
  cmd->add_option("--layers", o->layers, "layers")
      ->capture_default_str()
      ->check(tools::IntRange(1, 4096));
  cmd->add_option("--heads", o->heads, "KV heads")
      ->capture_default_str()
      ->check(tools::IntRange(1, 65536));
  cmd->add_option("--head-dim", o->head_dim, "elements per head")
      ->capture_default_str()
      ->check(tools::IntRange(1, 65536));
  cmd->add_option("--dtype", o->dtype, "bf16, fp16, fp32, fp8_e4m3, fp8_e5m2")
      ->capture_default_str();
  cmd->add_option("--page-size", o->page_size, "tokens per page")
      ->capture_default_str()
      ->check(tools::IntRange(1, 65536));
  cmd->add_option("--pool-tokens", o->pool_tokens,
                  "token slots of each agent's pool (0: 1.5 x its mean share of the requests in "
                  "flight + 2 x --max-tokens)")
      ->capture_default_str()
      ->check(tools::IntAtLeast(0));
  cmd->add_option("--device", o->device, "pool memory of every agent: host or cuda:N")
      ->capture_default_str();
  cmd->add_option("--backend", o->backend,
                  "ucx or cuda_ipc (default: ucx for host pools, cuda_ipc for CUDA pools)")
      ->check(CLI::IsMember({"ucx", "cuda_ipc"}));
  cmd->add_option("--ucx-tls", o->ucx_tls, "UCX transports (UCX_TLS syntax), e.g. shm,self or tcp");
  cmd->add_option("--layer-time-us", o->layer_time_us, "prefill: simulated compute per layer")
      ->capture_default_str()
      ->check(tools::IntRange(0, 10'000'000));
  cmd->add_option("--deadline-s", o->deadline_s, "the agents' request deadline")
      ->capture_default_str()
      ->check(tools::IntRange(1, 3600));
  cmd->add_option("--timeout-s", o->timeout_s, "give a run up after this long")
      ->capture_default_str()
      ->check(tools::IntRange(1, 86400));
  cmd->add_option("--poll-ms", o->poll_ms,
                  "ask each decode agent for its requests' reports at most this often")
      ->capture_default_str()
      ->check(tools::IntRange(1, 1000));
  cmd->add_option("--seed", o->seed, "workload seed")->capture_default_str();
  cmd->add_option("--ceiling", o->ceiling,
                  "pair: also run the same requests through 1 prefill + 1 decode agent and print "
                  "the ratio; none: skip it")
      ->capture_default_str()
      ->check(CLI::IsMember({"pair", "none"}));
  cmd->add_option("--json", o->json_path, "write all figures to this JSON file");
  cmd->add_option("--agent-bin", o->agent_path, "path of kvt-agent (default: beside kvt-bench)");
  cmd->add_option("--bootstrap-bin", o->bootstrap_path,
                  "path of kvt-bootstrap (default: beside kvt-bench)");
  cmd->add_flag("--keep-logs", o->keep_logs, "keep the agents' logs even when the run passes");
  cmd->callback([o, &exit_code] {
    // Before any thread or child: SIGINT/SIGTERM are then picked up by the run, which stops
    // the agents and removes its working folder.
    tools::BlockTerminationSignals();
    Status st = CheckLogLevelEnv();
    if (st.ok()) st = Validate(*o);
    if (!st.ok()) {
      fmt::print(stderr, "kvt-bench load: {}\n", st.ToString());
      exit_code = 2;
      return;
    }
    exit_code = RunLoad(*o);
  });
}

}  // namespace kvt::bench

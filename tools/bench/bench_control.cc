// `kvt-bench control`: the control plane alone, the floor under a request's two control
// messages. A client and a server in this process, each with its own io thread, exchange a
// TransferRequest (the decode side's, naming --pages pages) and a TransferDone (the prefill
// side's answer) back to back: each answer is handled on the client's io thread, which sends
// the next request at once. Round trips are timed one by one; half a round trip is what one
// control message costs, which `kvt-bench transfer` reports as its to-prefill and done phases
// (there with the engines' handling added).
//
// Modes: "socket" (io threads block in epoll between frames, the default of the engines),
// "socket-poll" (io threads busy-poll their sockets for --window-us after each frame) and
// "lane" (busy-polling, frames through a shared-memory lane: docs/protocol.md, "Lanes"). Two
// polling io threads need two free cores; on a machine with fewer the figures measure the
// scheduler.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.h"
#include "commands.h"
#include "control/control_client.h"
#include "control/control_server.h"
#include "control/protocol.h"
#include "engine/layout_codec.h"
#include "kvt/transfer/backends.h"
#include "kvt/transfer/layout.h"

namespace kvt::bench {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

struct ControlOptions {
  std::string modes = "socket,socket-poll,lane";
  int messages = 20000;
  int warmup = 2000;
  int window_us = 1000;
  int pages = 1;
  std::string json_path;
};

// A valid PeerInfo (what a HelloAck carries) of a tiny host layout registered with the loopback
// backend: the client offers a lane only once the server's HelloAck has passed validation.
struct Identity {
  std::vector<uint8_t> memory;
  v1::PeerInfo info;
};

StatusOr<Identity> MakeIdentity(int pages) {
  constexpr int kLayers = 2;
  constexpr uint32_t kHeadDim = 8;  // bf16: 16 bytes per token per buffer
  const uint64_t item = kHeadDim * 2;
  const uint64_t buffer_bytes = item * (static_cast<uint64_t>(pages) + 1);  // page 0: dummy
  Identity id;
  id.memory.assign(2 * kLayers * buffer_bytes, 0);
  std::vector<uint64_t> ptrs;
  std::vector<int64_t> lens, items;
  for (int b = 0; b < 2 * kLayers; ++b) {
    ptrs.push_back(reinterpret_cast<uint64_t>(id.memory.data() + b * buffer_bytes));
    lens.push_back(static_cast<int64_t>(buffer_bytes));
    items.push_back(static_cast<int64_t>(item));
  }
  transfer::TransferLayout::BufInfoOptions o;
  o.page_size = 1;
  o.head_num = 1;
  o.head_dim = kHeadDim;
  KVT_ASSIGN_OR_RETURN(transfer::TransferLayout layout,
                       transfer::TransferLayout::FromBufInfos(ptrs, lens, items, o));
  KVT_ASSIGN_OR_RETURN(v1::Layout proto, transfer::LayoutToProto(layout));
  const std::vector<transfer::LocalRegion> regions =
      transfer::LocalRegionsOf(layout, layout.Flatten());
  KVT_ASSIGN_OR_RETURN(std::unique_ptr<transfer::Backend> backend,
                       transfer::CreateBackend("loopback"));
  KVT_ASSIGN_OR_RETURN(transfer::PeerDescriptor descriptor, backend->Register(regions));
  id.info = transfer::MakePeerInfo("kvt-bench-control", true, proto, descriptor, regions);
  return id;
}

// Answers a Hello with a HelloAck and every TransferRequest with a TransferDone.
class Answerer : public control::ControlHandler {
 public:
  explicit Answerer(const v1::PeerInfo& info) {
    ack_.mutable_hello_ack()->set_protocol_version(control::kProtocolVersion);
    *ack_.mutable_hello_ack()->mutable_peer() = info;
  }
  void set_server(control::ControlServer* server) { server_.store(server); }
  void OnMessage(control::ConnectionId id, const v1::Envelope& e) override {
    control::ControlServer* server = server_.load();
    if (server == nullptr) return;
    if (e.has_hello()) {
      (void)server->Send(id, ack_);
    } else if (e.has_transfer_request()) {
      v1::Envelope done;
      done.mutable_transfer_done()->set_room_id(e.transfer_request().room_id());
      done.mutable_transfer_done()->set_status(v1::STATUS_CODE_OK);
      (void)server->Send(id, done);
    }
  }
  void OnDisconnect(control::ConnectionId, const Status&) override {}

 private:
  std::atomic<control::ControlServer*> server_{nullptr};
  v1::Envelope ack_;
};

// Sends the next request from the io thread as each answer comes, stamping every answer.
class Pinger : public control::ControlClient::Handler {
 public:
  Pinger(const v1::Envelope& request, int rounds) : request_(request), rounds_(rounds) {
    stamps_.reserve(static_cast<size_t>(rounds) + 1);
  }
  void Begin(control::ControlClient* client) {
    client_.store(client);
    stamps_.push_back(Clock::now());
    if (Status s = client->Send(request_); !s.ok()) Finish(s);
  }
  void OnMessage(const v1::Envelope& e) override {
    if (e.has_hello_ack()) {
      std::lock_guard<std::mutex> lock(mu_);
      hello_acked_ = true;
      cv_.notify_all();
      return;
    }
    if (!e.has_transfer_done()) return;
    stamps_.push_back(Clock::now());
    if (static_cast<int>(stamps_.size()) > rounds_) return Finish(OkStatus());
    if (Status s = client_.load()->Send(request_); !s.ok()) Finish(s);
  }
  void OnDisconnect(const Status& why) override { Finish(Unavailable(why.ToString())); }
  bool WaitHelloAck(std::chrono::seconds bound) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, bound, [&] { return hello_acked_; });
  }
  StatusOr<std::vector<double>> WaitRounds(std::chrono::seconds bound) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, bound, [&] { return finished_; })) {
      return DeadlineExceeded(
          fmt::format("{} of {} round trips in {} s", stamps_.size() - 1, rounds_, bound.count()));
    }
    KVT_RETURN_IF_ERROR(status_);
    std::vector<double> rtt;
    for (size_t i = 1; i < stamps_.size(); ++i) {
      rtt.push_back(std::chrono::duration<double, std::micro>(stamps_[i] - stamps_[i - 1]).count());
    }
    return rtt;
  }

 private:
  void Finish(const Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return;
    finished_ = true;
    status_ = s;
    cv_.notify_all();
  }
  const v1::Envelope request_;
  const int rounds_;
  std::atomic<control::ControlClient*> client_{nullptr};
  std::vector<Clock::time_point> stamps_;  // the io thread's alone until finished_
  std::mutex mu_;
  std::condition_variable cv_;
  bool hello_acked_ = false;
  bool finished_ = false;
  Status status_;
};

StatusOr<json> RunMode(const ControlOptions& o, const std::string& mode, const Identity& id) {
  const bool poll = mode != "socket";
  control::BusyPollOptions busy;
  busy.window = poll ? std::chrono::microseconds(o.window_us) : std::chrono::microseconds(0);
  busy.lanes = mode == "lane";
  Answerer answerer(id.info);
  control::ControlServerOptions sopts;
  sopts.busy_poll = busy;
  KVT_ASSIGN_OR_RETURN(std::unique_ptr<control::ControlServer> server,
                       control::ControlServer::Create(sopts, &answerer));
  answerer.set_server(server.get());

  v1::Envelope request;
  v1::TransferRequest* r = request.mutable_transfer_request();
  r->set_room_id("room-000001");
  r->set_mode(v1::TRANSFER_MODE_PUSH);
  r->set_deadline_ms(30000);
  std::string le32;
  for (int p = 1; p <= o.pages; ++p) {
    const uint32_t v = static_cast<uint32_t>(p);
    le32.append(reinterpret_cast<const char*>(&v), 4);  // little-endian hosts only (x86, arm)
  }
  r->set_dst_page_ids_le32(le32);
  Pinger pinger(request, o.warmup + o.messages);
  control::ControlClientOptions copts;
  copts.host = "127.0.0.1";
  copts.port = server->port();
  copts.client_id = "kvt-bench-control";
  copts.busy_poll = busy;
  KVT_ASSIGN_OR_RETURN(std::unique_ptr<control::ControlClient> client,
                       control::ControlClient::Connect(copts, &pinger));
  v1::Envelope hello;
  hello.mutable_hello()->set_protocol_version(control::kProtocolVersion);
  *hello.mutable_hello()->mutable_peer() = id.info;
  KVT_RETURN_IF_ERROR(client->Send(hello));
  if (!pinger.WaitHelloAck(std::chrono::seconds(10))) {
    return DeadlineExceeded("the server did not answer the hello in 10 s");
  }
  if (busy.lanes) {
    const auto give_up = Clock::now() + std::chrono::seconds(5);
    while (!client->using_lane() && Clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (!client->using_lane()) {
      return FailedPrecondition(
          "mode 'lane': no lane came up in 5 s (POSIX shared memory unavailable? the log says "
          "why); run the other modes");
    }
  }
  pinger.Begin(client.get());
  KVT_ASSIGN_OR_RETURN(std::vector<double> rtt, pinger.WaitRounds(std::chrono::seconds(120)));
  client->Close();
  server->Stop();
  rtt.erase(rtt.begin(), rtt.begin() + o.warmup);
  const double p50 = Percentile(rtt, 0.5);
  return json{{"mode", mode},
              {"round_trips", rtt.size()},
              {"request_bytes", request.ByteSizeLong()},
              {"rtt_us_p50", p50},
              {"rtt_us_p90", Percentile(rtt, 0.9)},
              {"rtt_us_p99", Percentile(rtt, 0.99)},
              {"rtt_us_max", Percentile(rtt, 1.0)},
              {"one_message_us_p50", p50 / 2}};
}

Status RunControl(const ControlOptions& o) {
  const std::vector<std::string> modes = SplitList(o.modes);
  for (const std::string& m : modes) {
    if (m != "socket" && m != "socket-poll" && m != "lane") {
      return InvalidArgument(
          fmt::format("--modes has '{}'; give socket, socket-poll or lane (a list)", m));
    }
  }
  if (o.messages < 10 || o.messages > 10'000'000) {
    return InvalidArgument(fmt::format("--messages is {}; give 10..10000000", o.messages));
  }
  if (o.warmup < 0 || o.warmup > 1'000'000) {
    return InvalidArgument(fmt::format("--warmup is {}; give 0..1000000", o.warmup));
  }
  if (o.window_us < 1 || o.window_us > 1'000'000) {
    return InvalidArgument(
        fmt::format("--window-us is {}; give 1..1000000 (the polling modes' window)", o.window_us));
  }
  if (o.pages < 1 || o.pages > 65536) {
    return InvalidArgument(fmt::format("--pages is {}; give 1..65536", o.pages));
  }
  KVT_ASSIGN_OR_RETURN(const Identity id, MakeIdentity(o.pages));
  json doc;
  doc["tool"] = "kvt-bench control";
  doc["date_utc"] = NowUtc();
  doc["command"] = CommandLine();
  doc["machine"] = DescribeMachine(false);
  doc["machine"]["cpu_threads"] = std::thread::hardware_concurrency();
  doc["config"] = json{{"messages", o.messages},
                       {"warmup", o.warmup},
                       {"window_us", o.window_us},
                       {"pages", o.pages}};
  doc["notes"] =
      "round trip = a TransferRequest naming `pages` pages, client to server, and the server's "
      "TransferDone back, each handled on the receiving io thread (the next request is sent from "
      "the client's io thread as the answer is handled); one message = half of it. In one "
      "process, two io threads.";
  fmt::print(
      "kvt-bench control ({}), {} hardware threads, {} round trips per mode after {} "
      "warm-up, TransferRequest of {} pages\n",
      doc["date_utc"].get<std::string>(), std::thread::hardware_concurrency(), o.messages, o.warmup,
      o.pages);
  fmt::print("{:>12} {:>10} {:>10} {:>10} {:>10} {:>12}\n", "mode", "rtt p50", "rtt p90", "rtt p99",
             "rtt max", "message p50");
  json results = json::array();
  bool failed = false;
  for (const std::string& m : modes) {
    StatusOr<json> r = RunMode(o, m, id);
    if (!r.ok()) {
      fmt::print("{:>12} {}\n", m, r.status().ToString());
      results.push_back(json{{"mode", m}, {"error", r.status().ToString()}});
      failed = true;
      continue;
    }
    fmt::print("{:>12} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f} {:>12.2f}\n", m,
               (*r)["rtt_us_p50"].get<double>(), (*r)["rtt_us_p90"].get<double>(),
               (*r)["rtt_us_p99"].get<double>(), (*r)["rtt_us_max"].get<double>(),
               (*r)["one_message_us_p50"].get<double>());
    results.push_back(*r);
  }
  doc["results"] = results;
  fmt::print(
      "microseconds; rtt = TransferRequest out and TransferDone back, io thread to io thread; "
      "message = rtt / 2, the floor under `kvt-bench transfer`'s to-prefill and done phases.\n");
  if (!o.json_path.empty()) {
    KVT_RETURN_IF_ERROR(WriteJson(o.json_path, doc));
    fmt::print("wrote {}\n", o.json_path);
  }
  return failed ? Internal("a mode failed (above)") : OkStatus();
}

}  // namespace

void AddControlCommand(CLI::App& app, int& exit_code) {
  auto opts = std::make_shared<ControlOptions>();
  CLI::App* cmd = app.add_subcommand(
      "control",
      "the control plane alone: TransferRequest / TransferDone round trips between two io "
      "threads over a socket (sleeping or busy-polling) or a shared-memory lane");
  cmd->add_option("--modes", opts->modes, "socket, socket-poll, lane (a list)")
      ->capture_default_str();
  cmd->add_option("--messages", opts->messages, "timed round trips per mode")
      ->capture_default_str();
  cmd->add_option("--warmup", opts->warmup, "round trips before the timed ones")
      ->capture_default_str();
  cmd->add_option("--window-us", opts->window_us, "busy-poll window of the polling modes")
      ->capture_default_str();
  cmd->add_option("--pages", opts->pages, "pages the TransferRequest names")->capture_default_str();
  cmd->add_option("--json", opts->json_path, "write all figures to this JSON file");
  cmd->callback([opts, &exit_code] {
    Status s = RunControl(*opts);
    if (!s.ok()) {
      fmt::print(stderr, "kvt-bench control: {}\n", s.ToString());
      exit_code = 1;
    }
  });
}

}  // namespace kvt::bench

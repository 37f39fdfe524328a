// kvt-agent: a prefill or decode node agent. It owns a KV pool, runs a transfer engine,
// registers with the bootstrap registry (when given) and serves a driver RPC (SubmitRequest,
// QueryRequests, QueryStats). Runs until SIGINT/SIGTERM (or its parent exits, with
// --exit-with-parent), then stops serving and removes its registry entry.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "advertise.h"
#include "agent.h"
#include "agent_rpc.h"
#include "cli_util.h"
#include "control/auth.h"
#include "device_spec.h"
#include "kvt/common/log.h"
#include "kvt/common/log_level.h"
#include "kvt/transfer/backends.h"
#include "kvt/transfer/registry.h"
#include "tool_util.h"

namespace {

using namespace kvt;

// How long a stopping agent waits for the bootstrap to remove its entry.
constexpr std::chrono::milliseconds kUnregisterTimeout{1000};

int Fail(const Status& status) {
  std::cerr << "kvt-agent: " << status.ToString() << "\n";
  return 1;
}

// Registers with the bootstrap, retrying while it cannot be reached (it may start after the
// agents, or restart) or holds this key for an agent that went away (until that entry
// expires): the delay doubles from 100 ms up to 5 s, for at most `wait` in all.
// Other refusals (authentication, a rejected registration) are returned at once. Aborted when
// SIGINT/SIGTERM arrives meanwhile.
StatusOr<std::unique_ptr<transfer::RegistryClient>> RegisterWithRetry(
    const transfer::RegistryClientOptions& options, const transfer::AgentEntry& self,
    std::chrono::seconds wait) {
  using Clock = std::chrono::steady_clock;
  const std::string where = options.host + ":" + std::to_string(options.port);
  const auto give_up = Clock::now() + wait;
  std::chrono::milliseconds delay(100);
  for (int attempt = 1;; ++attempt) {
    auto client = transfer::RegistryClient::Start(options, self);
    if (client.ok()) {
      if (attempt > 1) {
        KVT_LOG_INFO("tool", "the bootstrap at {} is back: registered on attempt {}", where,
                     attempt);
      }
      return client;
    }
    const StatusCode code = client.status().code();
    if (code != StatusCode::kUnavailable && code != StatusCode::kDeadlineExceeded) return client;
    if (Clock::now() + delay > give_up) {
      return Unavailable(
          "could not register with the bootstrap at " + where + " within " +
          std::to_string(wait.count()) + " s; the last attempt: " + client.status().ToString() +
          ". If the bootstrap cannot be reached, start kvt-bootstrap there; if it says another "
          "agent holds this name and rank, stop that agent or give this one another --name / "
          "--tp-rank; or raise --bootstrap-wait-s");
    }
    // Unavailable comes from a bootstrap that cannot be reached, or from one that holds this
    // key for an agent whose connection closed until its entry expires: both pass with time.
    KVT_LOG_WARN("tool", "not registered with the bootstrap at {} yet ({}); retrying in {} ms",
                 where, client.status().ToString(), delay.count());
    if (const int sig = tools::WaitForTerminationSignalFor(delay); sig != 0) {
      return Aborted("stopped by signal " + std::to_string(sig) +
                     " while waiting for the bootstrap at " + where);
    }
    delay = std::min<std::chrono::milliseconds>(2 * delay, std::chrono::seconds(5));
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvt-agent: a prefill or decode node agent moving KV pages"};
  std::string role = "prefill";
  std::string name;
  std::string listen = "127.0.0.1:0";
  std::string rpc = "127.0.0.1:0";
  std::string bootstrap;
  std::string advertise;
  std::string backend;  // empty: DefaultBackendFor(the device)
  std::string ucx_tls;
  std::string ucx_cuda_mode = "auto";
  std::string ucx_host_path = "auto";
  std::string device = "host";
  std::string dtype = "bf16";
  std::string ready_file;
  int64_t layers = 32, heads = 8, head_dim = 128, page_size = 16, tokens = 65536;
  int64_t deadline_ms = 30000, layer_time_us = 0, control_busy_poll_us = 0, bootstrap_wait_s = 60;
  int64_t peer_timeout_ms = transfer::EngineOptions{}.peer_timeout.count();
  int64_t engine_heartbeat_ms = transfer::EngineOptions{}.heartbeat_interval.count();
  uint32_t tp_rank = 0, tp_size = 1, seed = 1;
  int ucx_copy_threads = transfer::UcxOptions{}.copy_threads;
  int ucx_staging_slots = transfer::UcxOptions{}.staging_slots;
  int64_t ucx_staging_slot_bytes = static_cast<int64_t>(transfer::UcxOptions{}.staging_slot_bytes);
  bool ucx_staging_in_place = transfer::UcxOptions{}.staging_in_place;
  bool exit_with_parent = false, no_shuffle = false, no_verify = false, skip_fill = false,
       no_control_lanes = false;
  app.add_option("--role", role, "prefill or decode")->check(CLI::IsMember({"prefill", "decode"}));
  app.add_option("--name", name, "agent (instance) name; default kvt-<role>");
  app.add_option("--listen", listen, "engine control address (prefill), host:port");
  app.add_option("--rpc", rpc, "driver RPC address, host:port");
  app.add_option("--bootstrap", bootstrap, "bootstrap registry host:port (optional)");
  app.add_option("--advertise", advertise,
                 "HOST[:PORT] other hosts reach this agent's engine at, as registered with the "
                 "bootstrap (PORT: the bound control port; decode agents give HOST only). "
                 "Default: the --listen host, or with a wildcard --listen (0.0.0.0, ::) and on "
                 "decode agents the address of the interface toward the bootstrap");
  app.add_option("--bootstrap-wait-s", bootstrap_wait_s,
                 "how long to keep retrying while the bootstrap cannot be reached at start "
                 "(0: try once)")
      ->capture_default_str()
      ->check(tools::IntRange(0, 86400));
  app.add_option("--backend", backend,
                 "transfer backend: ucx, cuda_ipc or loopback (default: cuda_ipc for CUDA pools, "
                 "ucx for host pools)");
  app.add_option("--ucx-tls", ucx_tls, "UCX transports (UCX_TLS syntax), e.g. shm,self or tcp");
  app.add_option("--ucx-cuda-mode", ucx_cuda_mode,
                 "ucx with CUDA pools: auto, staged (pinned bounce buffers) or direct")
      ->check(CLI::IsMember({"auto", "staged", "direct"}));
  app.add_option("--ucx-host-path", ucx_host_path,
                 "ucx with host pools a peer has not mapped: auto (active messages where UCX "
                 "has no native RMA, as over tcp; puts otherwise), put or am")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "put", "am"}));
  app.add_option("--ucx-copy-threads", ucx_copy_threads,
                 "ucx on one host: threads copying a large write into the peer's shared memory "
                 "(0: half the cores, 2..8)")
      ->capture_default_str()
      ->check(tools::IntRange(0, 64));
  app.add_option("--ucx-staging-slots", ucx_staging_slots,
                 "ucx staging CUDA pools (UCX without CUDA support): bounce slots each way")
      ->capture_default_str()
      ->check(tools::IntRange(1, 4096));
  app.add_option("--ucx-staging-slot-bytes", ucx_staging_slot_bytes,
                 "ucx staging: bytes per bounce slot (the pool pins 2 x slots x this of host "
                 "memory and holds slots x this of device memory)")
      ->capture_default_str()
      ->check(tools::IntRange(4096, int64_t{1} << 32));
  app.add_option("--ucx-staging-in-place", ucx_staging_in_place,
                 "ucx staging on one host: read the sender's slots in place (true) or receive "
                 "every chunk into this side's slots first (false)")
      ->capture_default_str();
  app.add_option("--device", device, "pool memory: host or cuda:N (CUDA device N)");
  app.add_option("--layers", layers, "layers")->check(tools::IntRange(1, 4096));
  app.add_option("--heads", heads, "KV heads of this rank")->check(tools::IntRange(1, 65536));
  app.add_option("--head-dim", head_dim, "elements per head")->check(tools::IntRange(1, 65536));
  app.add_option("--dtype", dtype, "bf16, fp16, fp32, fp8_e4m3, fp8_e5m2");
  app.add_option("--page-size", page_size, "tokens per page")->check(tools::IntRange(1, 65536));
  app.add_option("--tokens", tokens, "pool size in token slots")->check(tools::IntAtLeast(1));
  app.add_option("--tp-rank", tp_rank,
                 "tensor-parallel rank (0..tp-size-1); a decode rank takes its shard from the "
                 "prefill rank of the same number")
      ->check(tools::IntRange(0, 65535));
  app.add_option("--tp-size", tp_size, "tensor-parallel size")->check(tools::IntRange(1, 65536));
  app.add_option("--deadline-ms", deadline_ms, "default request deadline")
      ->check(tools::IntRange(1, 3600000));
  app.add_option("--peer-timeout-ms", peer_timeout_ms,
                 "an engine peer that sends nothing (not even a heartbeat) for this long is lost: "
                 "its requests fail, and a prefill engine posts no write to it any more")
      ->capture_default_str()
      ->check(tools::IntRange(100, 3600000));
  app.add_option("--engine-heartbeat-ms", engine_heartbeat_ms,
                 "heartbeat interval of engine control connections (below --peer-timeout-ms)")
      ->capture_default_str()
      ->check(tools::IntRange(10, 600000));
  app.add_option("--layer-time-us", layer_time_us, "prefill: simulated compute per layer")
      ->check(tools::IntAtLeast(0));
  app.add_option("--control-busy-poll-us", control_busy_poll_us,
                 "engine control threads poll instead of sleeping while requests are in flight "
                 "and this long after, at most 1000000 (0: sleep; default: 1000 on CUDA pools, "
                 "whose nodes have cores to spare, 0 on host pools)");
  app.add_flag("--no-control-lanes", no_control_lanes,
               "keep control messages on the TCP socket even with a busy-polling peer on this "
               "host (default: such peers use a shared-memory lane)");
  app.add_option("--seed", seed, "page shuffling seed");
  app.add_flag("--no-shuffle", no_shuffle, "hand pages out in ascending order");
  app.add_flag("--no-verify", no_verify, "decode: skip the byte check (benchmarks)");
  app.add_flag("--skip-fill", skip_fill, "prefill: do not write the pattern (benchmarks)");
  app.add_option("--ready-file", ready_file, "write the bound ports here as JSON when ready");
  app.add_flag("--exit-with-parent", exit_with_parent, "exit when the parent process exits");
  CLI11_PARSE(app, argc, argv);

  tools::BlockTerminationSignals();
  if (Status st = CheckLogLevelEnv(); !st.ok()) return Fail(st);
  if (tp_rank >= tp_size) {
    return Fail(InvalidArgument("--tp-rank " + std::to_string(tp_rank) +
                                " is not below --tp-size " + std::to_string(tp_size) +
                                "; ranks of a group of " + std::to_string(tp_size) + " are 0.." +
                                std::to_string(tp_size - 1)));
  }
  if (exit_with_parent) {
    if (Status st = tools::ExitWithParent(); !st.ok()) return Fail(st);
  }
  const bool prefill = role == "prefill";
  if (name.empty()) name = "kvt-" + role;
  // The device: its spelling, then whether the backend can move its memory (both need no
  // GPU), then whether it exists here.
  auto device_spec = tools::ParseDeviceSpec(device);
  if (!device_spec.ok()) return Fail(device_spec.status().WithContext("--device"));
  if (backend.empty()) backend = tools::DefaultBackendFor(*device_spec);
  if (device_spec->cuda() && backend == "loopback") {
    return Fail(FailedPrecondition(
        "--backend loopback copies host memory inside one process and "
        "cannot move a CUDA pool (--device " +
        device_spec->ToString() + "); use --backend cuda_ipc or ucx, or --device host"));
  }
  if (Status st = tools::CheckDeviceSpec(*device_spec); !st.ok()) {
    return Fail(st.WithContext("--device"));
  }
  auto parsed_dtype = ParseDType(dtype);
  if (!parsed_dtype.ok()) return Fail(parsed_dtype.status().WithContext("--dtype"));
  auto listen_at = tools::ParseHostPort(listen);
  if (!listen_at.ok()) return Fail(listen_at.status().WithContext("--listen"));
  auto rpc_at = tools::ParseHostPort(rpc);
  if (!rpc_at.ok()) return Fail(rpc_at.status().WithContext("--rpc"));
  StatusOr<tools::HostPort> bootstrap_at = tools::HostPort{};
  if (!bootstrap.empty()) bootstrap_at = tools::ParseHostPort(bootstrap);
  if (!bootstrap_at.ok()) return Fail(bootstrap_at.status().WithContext("--bootstrap"));
  std::optional<tools::Advertise> advertise_as;
  if (!advertise.empty()) {
    auto parsed = tools::ParseAdvertise(advertise);
    if (!parsed.ok()) return Fail(parsed.status());
    if (!prefill && parsed->port) {
      return Fail(InvalidArgument("--advertise " + advertise +
                                  ": a decode agent's engine accepts no connections, so it "
                                  "advertises no port; give --advertise " +
                                  parsed->host));
    }
    advertise_as = *parsed;
  }
  if (tokens < page_size) {
    return Fail(InvalidArgument("--tokens " + std::to_string(tokens) +
                                " holds no whole page of --page-size " + std::to_string(page_size) +
                                " tokens; give --tokens >= " + std::to_string(page_size)));
  }
  const std::string token = control::ClusterTokenFromEnv();

  tools::AgentOptions options;
  options.name = name;
  options.prefill = prefill;
  options.pool.size = tokens;
  options.pool.page_size = page_size;
  options.pool.head_num = heads;
  options.pool.head_dim = head_dim;
  options.pool.layer_num = layers;
  options.pool.dtype = *parsed_dtype;
  options.pool.memory = device_spec->memory;
  options.pool.device = device_spec->index;
  options.pool.pin_host_memory = false;      // host backends do not need page-locked memory
  options.pool.prefault_host_memory = true;  // no page faults on the transfer path
  auto backend_config = transfer::DefaultBackendConfig(backend);
  if (!backend_config.ok()) return Fail(backend_config.status().WithContext("--backend"));
  if (auto* ucx = std::get_if<transfer::UcxOptions>(&*backend_config)) {
    auto cuda_mode = transfer::ParseUcxCudaMode(ucx_cuda_mode);
    if (!cuda_mode.ok()) return Fail(cuda_mode.status().WithContext("--ucx-cuda-mode"));
    ucx->transports = ucx_tls;
    ucx->cuda_mode = *cuda_mode;
    auto host_path = transfer::ParseUcxHostPath(ucx_host_path);
    if (!host_path.ok()) return Fail(host_path.status().WithContext("--ucx-host-path"));
    ucx->host_path = *host_path;
    ucx->copy_threads = ucx_copy_threads;
    ucx->staging_slots = ucx_staging_slots;
    ucx->staging_slot_bytes = static_cast<size_t>(ucx_staging_slot_bytes);
    ucx->staging_in_place = ucx_staging_in_place;
  }
  options.engine.backend = *backend_config;
  options.engine.server.bind_address = listen_at->host;
  options.engine.server.port = listen_at->port;
  options.engine.server.cluster_token = token;
  options.engine.cluster_token = token;
  options.engine.default_deadline = std::chrono::milliseconds(deadline_ms);
  if (engine_heartbeat_ms >= peer_timeout_ms) {
    return Fail(
        InvalidArgument("--engine-heartbeat-ms " + std::to_string(engine_heartbeat_ms) +
                        " must be below --peer-timeout-ms " + std::to_string(peer_timeout_ms) +
                        ", or every idle peer is declared lost; a third of it or less is usual"));
  }
  options.engine.peer_timeout = std::chrono::milliseconds(peer_timeout_ms);
  options.engine.heartbeat_interval = std::chrono::milliseconds(engine_heartbeat_ms);
  if (control_busy_poll_us < 0 || control_busy_poll_us > transfer::kMaxControlBusyPoll.count()) {
    return Fail(InvalidArgument("--control-busy-poll-us " + std::to_string(control_busy_poll_us) +
                                ": must be in 0 .. " +
                                std::to_string(transfer::kMaxControlBusyPoll.count()) +
                                " (a second at most; or leave it out for the default)"));
  }
  if (app.count("--control-busy-poll-us") == 0) {
    control_busy_poll_us = device_spec->cuda() ? 1000 : 0;
  }
  options.engine.control_busy_poll = std::chrono::microseconds(control_busy_poll_us);
  options.engine.control_lanes = !no_control_lanes;
  options.engine.tp_rank = tp_rank;
  options.engine.tp_size = tp_size;
  options.shuffle_pages = !no_shuffle;
  options.seed = seed;
  options.layer_time = std::chrono::microseconds(layer_time_us);
  options.skip_fill = skip_fill;
  options.verify = !no_verify;
  auto agent = tools::Agent::Create(options);
  if (!agent.ok()) return Fail(agent.status());

  std::optional<transfer::RegistryClientOptions> registry;
  std::optional<transfer::AgentLayout> layout;  // checked against prefill entries (decode)
  std::unique_ptr<transfer::RegistryClient> registration;
  if (!bootstrap.empty()) {
    transfer::RegistryClientOptions r;
    r.host = bootstrap_at->host;
    r.port = bootstrap_at->port;
    r.client_id = name;
    r.role = prefill ? transfer::AgentRole::kPrefill : transfer::AgentRole::kDecode;
    r.cluster_token = token;
    registry = r;
    transfer::AgentEntry self;
    self.name = name;
    self.role = r.role;
    self.tp_rank = tp_rank;
    self.tp_size = tp_size;
    auto control_address = tools::AdvertisedControlAddress(
        tools::AdvertiseInputs{.prefill = prefill,
                               .advertise = advertise_as,
                               .listen_host = listen_at->host,
                               .bound_port = prefill ? (*agent)->engine_port() : uint16_t{0},
                               .registry_host = bootstrap_at->host,
                               .registry_port = bootstrap_at->port});
    if (!control_address.ok()) return Fail(control_address.status());
    self.control_address = *control_address;
    self.layout = transfer::AgentLayout{
        .num_layers = static_cast<uint32_t>(layers),
        .page_size = static_cast<uint32_t>(page_size),
        .dtype = *parsed_dtype,
        .head_num = static_cast<uint32_t>(heads),
        .head_dim = static_cast<uint32_t>(head_dim),
        .tp_rank = tp_rank,
        .tp_size = tp_size,
        .num_pages = static_cast<uint64_t>(tokens / page_size + 1),
        .num_tokens = static_cast<uint64_t>(tokens),
    };
    layout = self.layout;
    KVT_LOG_INFO("tool", "kvt-agent {} registers as {} with the bootstrap at {}", name,
                 self.control_address, bootstrap);
    auto client = RegisterWithRetry(r, self, std::chrono::seconds(bootstrap_wait_s));
    if (!client.ok()) {
      if (client.status().code() == StatusCode::kAborted) return 0;  // stopped by a signal
      return Fail(client.status().WithContext("--bootstrap"));
    }
    registration = std::move(client).value();
  }

  tools::AgentRpc handler(agent->get(), name, prefill, tp_rank, tp_size, registry, layout);
  control::ControlServerOptions rpc_options;
  rpc_options.bind_address = rpc_at->host;
  rpc_options.port = rpc_at->port;
  rpc_options.server_id = name + "-rpc";
  rpc_options.cluster_token = token;
  auto server = handler.Serve(rpc_options);
  if (!server.ok()) return Fail(server.status().WithContext("--rpc"));
  // Declared after `server`, so destroyed before it on every return: the handler's submit
  // workers reply through the server and use the agent.
  struct StopRpcWorkers {
    tools::AgentRpc* handler;
    ~StopRpcWorkers() { handler->Stop(); }
  } stop_rpc_workers{&handler};

  nlohmann::json ready = {{"name", name},
                          {"role", role},
                          {"pid", getpid()},
                          {"rpc_port", (*server)->port()},
                          {"engine_port", (*agent)->engine_port()},
                          {"backend", std::string((*agent)->engine().backend_name())},
                          {"memory", device_spec->ToString()}};
  if (device_spec->cuda()) ready["device_name"] = tools::CudaDeviceName(device_spec->index);
  KVT_LOG_INFO("tool", "kvt-agent {} ready: {}", name, ready.dump());
  if (!ready_file.empty()) {
    if (Status st = tools::WriteReadyFile(ready_file, ready.dump()); !st.ok()) return Fail(st);
  }
  const int sig = tools::WaitForTerminationSignal();
  KVT_LOG_INFO("tool", "kvt-agent {} stopping on signal {}", name, sig);
  (*server)->Stop();
  handler.Stop();
  if (registration != nullptr) {
    // The key is free for a successor at once; a registry that cannot be reached only delays
    // that until the entry expires.
    const Status unregistered = registration->Unregister(kUnregisterTimeout);
    if (unregistered.ok()) {
      KVT_LOG_INFO("tool", "kvt-agent {} unregistered from the bootstrap at {}", name, bootstrap);
    } else {
      KVT_LOG_WARN("tool", "kvt-agent {} could not unregister: {}", name, unregistered.ToString());
    }
  }
  registration.reset();
  agent->reset();
  return 0;
}

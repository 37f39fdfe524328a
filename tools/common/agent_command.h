// The command lines of kvt-agent and kvt-bootstrap as the programs that start them (kvt-demo, the
// integration tests) build them: one place that knows the flags, so a renamed flag breaks the
// build of every starter at once instead of one of them at run time.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kvt::tools {

// A kvt-agent command line. Unset optional fields leave the agent's own default.
struct AgentCommand {
  std::string binary;  // path of kvt-agent
  std::string role;    // "prefill" or "decode"
  std::string name;
  std::string bootstrap;   // "host:port" of kvt-bootstrap
  std::string ready_file;  // where the agent writes its ports once it serves
  std::string device = "host";
  std::string backend;  // empty: the agent's default
  int64_t layers = 0;   // 0: the agent's default, likewise heads, head_dim, tokens
  int64_t heads = 0;
  int64_t head_dim = 0;
  int64_t tokens = 0;  // pool size in token slots
  std::string dtype;   // empty: the agent's default
  std::optional<int64_t> page_size;
  std::optional<uint64_t> seed;
  std::optional<int64_t> layer_time_us;
  std::optional<int64_t> deadline_ms;
  std::optional<int64_t> peer_timeout_ms;      // --peer-timeout-ms
  std::optional<int64_t> engine_heartbeat_ms;  // --engine-heartbeat-ms
  std::string ucx_tls;        // empty: UCX's choice
  std::string ucx_cuda_mode;  // empty: the agent's default
  uint32_t tp_rank = 0;       // passed when not the single-rank 0 of 1
  uint32_t tp_size = 1;
  bool exit_with_parent = true;
  std::vector<std::string> extra;  // further flags, appended as given

  std::vector<std::string> Argv() const {
    std::vector<std::string> argv = {binary, "--role", role, "--name", name};
    auto add = [&argv](const char* flag, const std::string& value) {
      if (value.empty()) return;
      argv.push_back(flag);
      argv.push_back(value);
    };
    auto add_number = [&add](const char* flag, auto value) { add(flag, std::to_string(value)); };
    add("--bootstrap", bootstrap);
    add("--device", device);
    add("--backend", backend);
    if (layers > 0) add_number("--layers", layers);
    if (heads > 0) add_number("--heads", heads);
    if (head_dim > 0) add_number("--head-dim", head_dim);
    add("--dtype", dtype);
    if (page_size) add_number("--page-size", *page_size);
    if (tokens > 0) add_number("--tokens", tokens);
    if (seed) add_number("--seed", *seed);
    if (layer_time_us) add_number("--layer-time-us", *layer_time_us);
    if (deadline_ms) add_number("--deadline-ms", *deadline_ms);
    if (peer_timeout_ms) add_number("--peer-timeout-ms", *peer_timeout_ms);
    if (engine_heartbeat_ms) add_number("--engine-heartbeat-ms", *engine_heartbeat_ms);
    add("--ucx-tls", ucx_tls);
    add("--ucx-cuda-mode", ucx_cuda_mode);
    if (tp_size != 1 || tp_rank != 0) {
      add_number("--tp-rank", tp_rank);
      add_number("--tp-size", tp_size);
    }
    add("--ready-file", ready_file);
    if (exit_with_parent) argv.push_back("--exit-with-parent");
    argv.insert(argv.end(), extra.begin(), extra.end());
    return argv;
  }
};

// A kvt-bootstrap command line.
struct BootstrapCommand {
  std::string binary;                  // path of kvt-bootstrap
  std::string listen = "127.0.0.1:0";  // port 0: the kernel chooses; the ready file says which
  std::string ready_file;
  std::optional<int64_t> heartbeat_ms;  // unset: the bootstrap's default
  bool exit_with_parent = true;

  std::vector<std::string> Argv() const {
    std::vector<std::string> argv = {binary, "--listen", listen};
    if (!ready_file.empty()) {
      argv.push_back("--ready-file");
      argv.push_back(ready_file);
    }
    if (heartbeat_ms) {
      argv.push_back("--heartbeat-ms");
      argv.push_back(std::to_string(*heartbeat_ms));
    }
    if (exit_with_parent) argv.push_back("--exit-with-parent");
    return argv;
  }
};

}  // namespace kvt::tools

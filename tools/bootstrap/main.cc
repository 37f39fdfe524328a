// kvt-bootstrap: the registry server. Agents register and heartbeat, and unregister when they
// stop; look-ups by name, role and rank; entries expire when heartbeats stop; a key held by a
// live agent is not taken over by another; at most --max-entries live entries. Runs until
// SIGINT/SIGTERM.
#include <CLI/CLI.hpp>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "kvt/common/log.h"
#include "kvt/common/log_level.h"
#include "kvt/transfer/control_options.h"
#include "kvt/transfer/registry.h"
#include "tool_util.h"

int main(int argc, char** argv) {
  using namespace kvt;
  CLI::App app{"kvt-bootstrap: the registry where kvt agents find each other"};
  std::string listen = "127.0.0.1:0";
  std::string ready_file;
  int64_t heartbeat_ms = 1000;
  int missed = 3;
  int64_t max_entries = static_cast<int64_t>(transfer::RegistryServerOptions{}.max_entries);
  bool exit_with_parent = false;
  app.add_option("--listen", listen, "host:port to listen on (port 0: any)");
  app.add_option("--heartbeat-ms", heartbeat_ms, "heartbeat interval asked of agents")
      ->check(tools::IntAtLeast(1));
  app.add_option("--missed-heartbeats", missed,
                 "entries expire after this many missed (>= 2: a client refreshes every "
                 "interval plus a round trip)")
      ->check(tools::IntAtLeast(2));
  app.add_option("--max-entries", max_entries,
                 "live entries held at most (one per agent TP rank); a registration of a new "
                 "name/role/rank beyond it is refused naming this flag")
      ->capture_default_str()
      ->check(tools::IntRange(1, int64_t{1} << 20));
  app.add_option("--ready-file", ready_file, "write the bound port here as JSON when ready");
  app.add_flag("--exit-with-parent", exit_with_parent, "exit when the parent process exits");
  CLI11_PARSE(app, argc, argv);

  tools::BlockTerminationSignals();
  auto fail = [](const Status& st) {
    std::cerr << "kvt-bootstrap: " << st.ToString() << "\n";
    return 1;
  };
  if (Status st = CheckLogLevelEnv(); !st.ok()) return fail(st);
  if (exit_with_parent) {
    if (Status st = tools::ExitWithParent(); !st.ok()) return fail(st);
  }
  auto at = tools::ParseHostPort(listen);
  if (!at.ok()) return fail(at.status().WithContext("--listen"));
  transfer::RegistryServerOptions options;
  options.server.bind_address = at->host;
  options.server.port = at->port;
  options.server.server_id = "kvt-bootstrap";
  options.server.cluster_token = control::ClusterTokenFromEnv();
  options.heartbeat_interval = std::chrono::milliseconds(heartbeat_ms);
  options.missed_heartbeats = missed;
  options.max_entries = static_cast<size_t>(max_entries);
  auto server = transfer::RegistryServer::Create(options);
  if (!server.ok()) return fail(server.status());
  nlohmann::json ready = {{"pid", getpid()}, {"port", (*server)->port()}};
  KVT_LOG_INFO("tool", "kvt-bootstrap listening on {}:{}", at->host, (*server)->port());
  if (!ready_file.empty()) {
    if (Status st = tools::WriteReadyFile(ready_file, ready.dump()); !st.ok()) return fail(st);
  }
  tools::WaitForTerminationSignal();
  server->reset();
  return 0;
}

// Scenarios the integration suites run on more than one configuration (host pools over ucx,
// CUDA pools over cuda_ipc or staged ucx): each starts its agents in the given Cluster from the
// given specs, drives them and checks the outcome with gtest assertions (a fatal failure
// returns from the scenario; callers need not check anything afterwards).
#pragma once

#include <cstdint>

#include "cluster.h"

namespace kvt::integration {

struct RandomWorkload {
  int requests = 200;
  size_t concurrency = 8;
  uint32_t seed = 20261202;
  double max_tokens = 1024;  // sizes are log-uniform in [1, max_tokens]
};

// Starts `prefill` and `decode` (decode requests name the prefill through the bootstrap) and
// runs the workload: every request arrives byte-exact with the expected size, the prefill
// side finishes every room too, both agents' counters agree with the reports, and every page
// returns to both allocators. `wall_s` (optional) receives the workload's wall time.
void ExpectRandomWorkloadByteExact(Cluster& cluster, const AgentSpec& prefill,
                                   const AgentSpec& decode, const RandomWorkload& workload,
                                   double* wall_s = nullptr);

// Starts two prefill agents (`doomed`, `alive`; layer_time_us should make each room's forward
// take ~200 ms) and `decode`, puts 4 requests on each prefill, SIGKILLs `doomed` 100 ms in:
// exactly its in-flight requests fail UNAVAILABLE (quickly, not at their deadline), the
// survivor's all arrive intact, the decode agent keeps working and gets every page back.
// Skips (after checking the rest) when the decode log shows the known liveness-probe race.
void ExpectKilledPrefillFailsOnlyItsRequests(Cluster& cluster, const AgentSpec& doomed,
                                             const AgentSpec& alive, const AgentSpec& decode);

// The KV bytes one request moves: whole pages, K and V of every layer (bf16).
uint64_t ExpectedBytes(const AgentLayout& layout, uint64_t tokens);

}  // namespace kvt::integration

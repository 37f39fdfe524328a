// Agent: a prefill or decode node's work around a TransferEngine, as kvt-agent runs it.
//
// Prefill: Submit(room, tokens) allocates pages, declares them to the engine and simulates the
// model's forward on a worker thread: layer by layer it writes the deterministic pattern of the
// request's tokens (seeded by the room and the TP rank, so each rank's shard is distinct) and then
// hands the layer to the engine. Decode: Submit(room, tokens, prefill address) allocates pages and
// asks the prefill engine for the KV; when the request succeeds every received byte is verified
// against the pattern. Pages return to the allocator once the request is final and no write can
// land (prefill: and the forward no longer writes them).
//
// Host pools run the CPU kernels, and a layer's simulated compute is a CPU sleep. CUDA pools
// (PoolOptions::memory = kCuda, on PoolOptions::device) run the CUDA kernels on one stream per
// agent: per layer a GPU-side spin of layer_time, the pattern fill and an event handed to
// LayersReady, all enqueued without waiting, so the CPU never blocks on a forward; page lists
// and base tables are device-resident (a preallocated arena, no cudaMalloc per request). CUDA
// pools need a device backend ("cuda_ipc" or "ucx"); "loopback" is refused.
//
// Thread safety: every public method may be called from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvt/common/status.h"
#include "kvt/pool/kv_pool.h"
#include "kvt/transfer/engine.h"

namespace kvt::tools {

struct AgentOptions {
  std::string name = "agent";
  bool prefill = true;
  pool::PoolOptions pool;
  transfer::EngineOptions engine;  // name and role are taken from the fields above
  // Hand pages out in a random order (as a busy pool does) instead of ascending ids.
  bool shuffle_pages = true;
  uint32_t seed = 1;
  // Prefill: simulated compute time per layer before its pattern is written (0: none).
  std::chrono::microseconds layer_time{0};
  // Prefill: verify nothing, just mark layers ready without writing the pattern (benchmarks
  // that measure the transfer alone).
  bool skip_fill = false;
  // Decode: verify every received byte (off for benchmarks that measure the transfer alone).
  bool verify = true;
  // Reports of finished requests kept for QueryRequests; the oldest are dropped beyond this.
  size_t max_reports = 65536;
};

struct SubmitSpec {
  std::string room;
  int64_t tokens = 0;
  std::string prefill_host;   // decode only
  uint16_t prefill_port = 0;  // decode only
  // Both sides: the room fails (and its pages return) when not done by then; 0: the engine's
  // default. A prefill room whose decode request never comes thus frees its pages too.
  std::chrono::milliseconds deadline{0};
};

struct RequestReport {
  std::string room;
  transfer::RequestState state = transfer::RequestState::kBootstrapping;
  Status status;
  int64_t tokens = 0;
  uint64_t bytes = 0;
  double latency_us = 0;  // this side: submitted -> final
  bool verified = false;  // decode: the pattern check ran and found no mismatch
  uint64_t mismatches = 0;
  std::string first_mismatch;      // where, when mismatches > 0
  bool pages_quarantined = false;  // decode: failed, pages not reusable yet
};

struct AgentStats {
  uint64_t submitted = 0;
  uint64_t succeeded = 0;
  uint64_t failed = 0;
  uint64_t verified = 0;
  uint64_t corrupted = 0;  // decode: requests with mismatching bytes
  uint64_t bytes = 0;
  int64_t free_pages = 0;
  int64_t total_pages = 0;
};

class Agent {
 public:
  static StatusOr<std::unique_ptr<Agent>> Create(const AgentOptions& options);
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  // Claims `room` for a submit that is still being prepared (waiting for a worker, looking up
  // or connecting to its prefill agent): from then on Abort finds the room, Reports show it
  // Bootstrapping, and another Claim or Submit of it is AlreadyExists. Submit of a claimed room
  // takes the claim over; Release gives it up when no Submit follows. Unclaimed rooms are
  // claimed by Submit itself.
  Status Claim(const std::string& room, int64_t tokens);
  // Gives up a claim whose Submit will not come. Returns the Aborted status the room ended with
  // when it was aborted meanwhile (its report stays), OK otherwise (the room leaves no trace).
  Status Release(const std::string& room);
  // Decode: connects to the prefill engine at host:port for claimed `room` (Submit then finds
  // the connection open). For callers that must tell a failed connect from other failures, e.g.
  // to drop an address they looked up. Aborted when the room is aborted before or during the
  // connect; the connect's own error otherwise.
  Status ConnectPrefill(const std::string& room, const std::string& host, uint16_t port);
  // ResourceExhausted when the pool has too few free pages now (retry later). Aborted when the
  // room is aborted while claimed or during this call: before its engine has it (a decode room
  // connecting to its peer) nothing is sent; after, the engine aborts it and tells the peer.
  Status Submit(const SubmitSpec& spec);
  // Aborts a room. A started room's engine tells the peer. A room that is claimed or still in
  // Submit (connecting to its peer) is stopped before anything is sent: its pages return now,
  // its report says it was aborted, and its Submit returns Aborted. FailedPrecondition naming
  // the state (and status) for a room that already ended; NotFound for unknown rooms.
  Status Abort(const std::string& room, const std::string& reason);
  // Reports for these rooms (all known rooms when empty); unknown rooms are NotFound entries.
  std::vector<RequestReport> Reports(const std::vector<std::string>& rooms) const;
  AgentStats Stats() const;

  uint16_t engine_port() const;
  const transfer::TransferEngine& engine() const;
  const pool::KvPool& pool() const;

 private:
  class Impl;
  explicit Agent(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvt::tools

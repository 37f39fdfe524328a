// Creating backends by name. Names: "ucx", "cuda_ipc", "nccl", "loopback". Thread-safe.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvt/common/status.h"
#include "kvt/pool/host_allocator.h"
#include "kvt/transfer/backend.h"

namespace kvt::transfer {

struct BackendOptions {
  // ucx: UCX transports to allow (UCX_TLS syntax, e.g. "shm,self" or "tcp"); empty = UCX's
  // default choice (or the UCX_TLS environment variable when set).
  std::string ucx_transports;
  // ucx: the progress thread spins this long without work before it sleeps on the worker's
  // event fd; longer spins trade a CPU core for lower latency.
  int ucx_spin_us = 200;
  // ucx: when UCX maps a peer's buffers into this process (shared memory on the same host,
  // ucp_rkey_ptr), write them with plain copies instead of one UCX put per run.
  bool ucx_direct_shm = true;
  // ucx: writes of at most this many bytes are copied (peer mapped here) or posted as UCX puts
  // (network) on the posting thread; larger ones on the backend's copy threads or its poster
  // thread, so that posting (often the control plane's thread, or the model's in LayersReady,
  // under the engine's lock) never waits for a bulk copy or send.
  size_t ucx_direct_inline_bytes = size_t{256} << 10;
  // ucx, direct copies: threads that copy a large write, each a slice of its runs (1..64, or 0
  // for half the machine's cores, at least 2 and at most 8; a write gets at most one slice per
  // MiB). A 1024-page request of 32 KiB pages: two threads 1.4–1.9x as fast as one on the 2-core
  // development VM; 1 / 2 / 4 / 8 threads 4.9 / 11.0 / 16.1 / 31.1 GB/s on a 16-core host
  // (docs/transfer-bench.md).
  int ucx_copy_threads = 0;
  // loopback: a posted write completes (its bytes are copied) only once this much time has
  // passed, so tests can abort or time out writes in flight. 0 copies at post time.
  int loopback_delay_us = 0;
  // loopback: report page_writes and take PostPages (CPU gather/scatter), so the engine's page
  // path runs without a GPU.
  bool loopback_page_writes = false;
  // ucx on CUDA pools: "auto" registers device memory directly when the UCX build handles CUDA
  // memory and stages through pinned host bounce buffers otherwise; "staged" always stages;
  // "direct" refuses CUDA pools unless UCX handles CUDA memory.
  std::string ucx_cuda_mode = "auto";
  // ucx staging: bounce slots per side and bytes per slot (bounded memory; the sender holds a
  // credit per receiver slot).
  int ucx_staging_slots = 8;
  size_t ucx_staging_slot_bytes = size_t{4} << 20;
  // nccl: bytes of one device staging slot per step (a page of one layer, K and V, must fit),
  // how long a pair's communicator may take to come up, and how long a posted step may stall
  // before the pair is declared dead (its communicator aborted).
  uint64_t nccl_slot_bytes = uint64_t{8} << 20;
  int nccl_connect_timeout_ms = 60000;
  int nccl_stall_timeout_ms = 30000;
};

// The backend names this build knows, in priority order.
std::vector<std::string> BackendNames();

// A new backend instance. Unknown names → InvalidArgument listing the known ones.
StatusOr<std::unique_ptr<Backend>> CreateBackend(std::string_view name,
                                                 const BackendOptions& options = {});

// An allocator for host pools (PoolOptions::host_allocator) that takes memory from `backend`,
// keeping the backend alive until the last block is freed; null when the backend has no host
// allocator of its own (then pools use ordinary memory).
std::shared_ptr<pool::HostAllocator> BackendHostAllocator(std::shared_ptr<Backend> backend);

}  // namespace kvt::transfer

// `kvt-bench transfer`: the host path of TransferEngine between two processes, beside the
// ceilings measured in the same run.
//
// The parent is the decode side: it owns a host pool, a decode TransferEngine and the clock.
// The child (this binary re-executed with the hidden `transfer-peer` subcommand; a thread of the
// same process for the in-process loopback backend) is a "prefill server": its engine answers
// every TransferRequest from on_transfer_request by picking random source pages, Send and
// LayersReady(L) at once, so a request's latency is pure transfer + control plane.
//
// Per page-token size it measures, on the decode side, request posted (before Receive) -> done
// seen (RequestInfo::finished; also when WaitRequest returned):
//   - kvt: requests of --tokens tokens, random pages on both sides: GB/s of the median request
//     and over the whole run, p50 / p99 latency, copy runs per request (prefill EngineStats);
//   - ceilings: (a) one-thread memcpy of the same bytes in this process, (b) one contiguous put
//     of the same bytes between the same two processes through the raw Backend (post -> flush
//     complete, timed in the child), and as a diagnostic (c) the raw Backend posting exactly the
//     runs a kvt request turns into (what the backend costs without engine and control plane);
//   - with --ucx-tls tcp (UCX reaches the peer over TCP only), the plain-socket ceiling: one TCP
//     connection on 127.0.0.1 from the child to the parent, the same bytes as one request in
//     1 MiB send() calls into a receive buffer of the request's size, first byte sent -> the
//     receiver's one-byte answer read, timed in the child (socket_ceiling.h);
//   - one-page requests: p50 / p99 over --latency-requests requests.
// Everything is bounded: per-request deadlines, reply timeouts on the parent <-> child pipe,
// and the child dies with its parent (PR_SET_PDEATHSIG) and exits when the pipe closes.
//
// CUDA pools (`--backend cuda_ipc`, or `--backend ucx --device cuda:N` for UCX's staged path):
// both processes on one GPU, pools in device memory, >= 1 GiB per request by default. The
// request is timed as above; the ceilings are measured in the prefill child on the same device:
//   - contiguous device-to-device cudaMemcpyAsync of the request's bytes (cuda_ipc's ceiling);
//   - the peers' ways through CUDA IPC mappings of the decode pool (the parent exports its pool's
//     allocations with cudaIpcGetMemHandle, the child opens them): one cudaMemcpyAsync per
//     (buffer, page) and one cudaMemcpyBatchAsync over the same list, on an evenly spread subset
//     of the request's (buffer, page) items, scaled by bytes (the output says how many);
//   - staged UCX: contiguous device-to-host (and host-to-device) copies of the same bytes with
//     pinned host memory: the PCIe ceiling.
// Layerwise: the child runs a simulated forward per request (per layer a spin kernel of
// --layer-time-us, then the layer's pattern fill, an event, LayersReady(room, l + 1, event)); a
// thread of the child spins on each layer's event and stamps its completion on the host clock
// (CLOCK_MONOTONIC, shared by both processes), and the parent compares the last layer's stamp
// with the moment the decode engine saw the request done.
//
// Memory (--memory): kvt's own KvPool on both sides (pool), or what a serving engine brings
// (external): one allocation per side (one cudaMalloc, or plain page-aligned host memory)
// carved into the pool's 2L buffers at 256-byte-aligned offsets, registered through
// TransferLayout::FromBufInfos. Fills, verification and ceilings use whichever buffer infos
// are in use (KvMemory).
//
// Hand-written here (no library does it): the length-prefixed JSON framing on the socketpair
// between parent and child, and the PeerDescriptor <-> JSON (hex) encoding.
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.h"
#include "bench_gpu.h"
#include "commands.h"
#include "kvt/common/dtype.h"
#include "kvt/common/log.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/kernels/kernels.h"
#include "kvt/pool/kv_pool.h"
#include "kvt/pool/page_allocator.h"
#include "kvt/pool/pool_layout.h"
#include "kvt/pool/pool_options.h"
#include "kvt/transfer/backend.h"
#include "kvt/transfer/backends.h"
#include "kvt/transfer/engine.h"
#include "kvt/transfer/plan.h"
#include "socket_ceiling.h"

namespace kvt::bench {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
using transfer::Backend;
using transfer::CopyRun;
using transfer::PeerDescriptor;

constexpr char kPeerCommand[] = "transfer-peer";

struct TransferOptions {
  std::string json_path;
  std::string backend = "ucx";
  std::string ucx_tls;  // empty: UCX's default (or UCX_TLS from the environment)
  int ucx_spin_us = 200;
  int ucx_copy_threads = 0;                   // UcxOptions::copy_threads (both sides; 0 = auto)
  std::string ucx_host_path = "auto";         // UcxOptions::host_path (both sides)
  std::string ucx_am_message_bytes = "1MiB";  // UcxOptions::am_message_bytes (both sides)
  int64_t control_busy_poll_us = 0;           // both engines' EngineOptions::control_busy_poll
  bool control_lanes = true;                  // both engines' EngineOptions::control_lanes
  bool cuda_ipc_completion_word = true;       // CudaIpcOptions::completion_word (both sides)
  std::string page_tokens = "1,16,64";
  int64_t tokens = 0;  // 0: 1024 on host pools, >= 1 GiB per request on CUDA pools
  int iters = 10;
  int warmup = 2;
  int latency_requests = 1000;
  int inflight = 4;             // pipelined figure: requests kept in flight (<= 1: not measured)
  int pipelined_requests = 64;  // pipelined figure: requests timed
  int layers = 32;
  int heads = 8;
  int head_dim = 128;
  std::string dtype = "bf16";
  std::string pool_bytes;       // per side; empty: 1GiB on host, two requests + a page on CUDA
  std::string memory = "pool";  // "pool": kvt's KvPool; "external": the bench's own allocation
  int timeout_s = 30;           // per request, and per reply of the peer
  uint32_t seed = 1;
  bool verify = false;
  // CUDA pools.
  std::string device;  // "cuda:N"; empty: cuda:0 for cuda_ipc, host pools otherwise
  std::string ucx_cuda_mode = "staged";
  int ucx_staging_slots = 8;
  std::string ucx_staging_slot_bytes = "16MiB";
  bool ucx_staging_in_place = true;
  int64_t peer_items = 16384;  // per-page / batch peers: items timed (0: all)
  double layer_time_us = 200;  // simulated forward: spin per layer
  int layerwise_requests = 10;
  int spin_blocks = 0;          // 0: one per multiprocessor
  int64_t device_spin_us = -1;  // prefill engine's device_spin; < 0: its default
  // CUDA pools: the prefill side as a thread of this process instead of a child process (the
  // cuda_ipc backend then writes the pool directly, without CUDA IPC mappings; diagnostic).
  bool same_process = false;
};

constexpr int64_t kGpuRequestBytes = int64_t{1} << 30;  // default request size on CUDA pools

struct AlignedFree {
  void operator()(uint8_t* p) const { std::free(p); }
};
using HostSlab = std::unique_ptr<uint8_t, AlignedFree>;

// Page-aligned and touched, so that neither the ceilings nor registration measure page faults.
StatusOr<HostSlab> AllocTouched(int64_t bytes, uint8_t fill) {
  const size_t rounded = (static_cast<size_t>(bytes) + 4095) & ~size_t{4095};
  HostSlab slab(static_cast<uint8_t*>(std::aligned_alloc(4096, rounded)));
  if (!slab)
    return ResourceExhausted(fmt::format("cannot allocate {} bytes of host memory", bytes));
  std::memset(slab.get(), fill, rounded);
  return slab;
}

// ---- Framing on the parent <-> peer socket ----------------------------------------------------
// A message is a 4-byte little-endian length and that many bytes of JSON.

Status WriteAll(int fd, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return Unavailable(fmt::format("peer pipe write failed: {}", std::strerror(errno)));
    p += w;
    n -= static_cast<size_t>(w);
  }
  return OkStatus();
}

Status ReadAll(int fd, void* data, size_t n, Clock::time_point until) {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
    if (left.count() <= 0) return DeadlineExceeded("no answer on the peer pipe in time");
    pollfd pfd = {fd, POLLIN, 0};
    const int ready = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
    if (ready < 0 && errno != EINTR) {
      return Unavailable(fmt::format("peer pipe poll failed: {}", std::strerror(errno)));
    }
    if (ready <= 0) continue;
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) return Unavailable("the peer closed the pipe");
    if (r < 0) return Unavailable(fmt::format("peer pipe read failed: {}", std::strerror(errno)));
    p += r;
    n -= static_cast<size_t>(r);
  }
  return OkStatus();
}

Status SendMessage(int fd, const json& message) {
  const std::string body = message.dump();
  const uint32_t len = static_cast<uint32_t>(body.size());
  uint8_t header[4] = {static_cast<uint8_t>(len), static_cast<uint8_t>(len >> 8),
                       static_cast<uint8_t>(len >> 16), static_cast<uint8_t>(len >> 24)};
  KVT_RETURN_IF_ERROR(WriteAll(fd, header, sizeof(header)));
  return WriteAll(fd, body.data(), body.size());
}

StatusOr<json> ReceiveMessage(int fd, std::chrono::milliseconds timeout) {
  const auto until = Clock::now() + timeout;
  uint8_t header[4];
  KVT_RETURN_IF_ERROR(ReadAll(fd, header, sizeof(header), until));
  const uint32_t len =
      header[0] | (header[1] << 8) | (header[2] << 16) | (static_cast<uint32_t>(header[3]) << 24);
  if (len > (256u << 20)) return DataLoss(fmt::format("peer message of {} bytes refused", len));
  std::string body(len, '\0');
  KVT_RETURN_IF_ERROR(ReadAll(fd, body.data(), len, until));
  json message = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (message.is_discarded()) return DataLoss("the peer sent a message that is not JSON");
  return message;
}

// ---- PeerDescriptor as JSON ---------------------------------------------------------------------

std::string Hex(const std::string& bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

StatusOr<std::string> Unhex(const std::string& hex) {
  if (hex.size() % 2 != 0) return DataLoss("odd-length hex string from the peer");
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  std::string out(hex.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return DataLoss("bad hex digit from the peer");
    out[i] = static_cast<char>(hi << 4 | lo);
  }
  return out;
}

json DescriptorToJson(const PeerDescriptor& d) {
  json regions = json::array();
  for (const transfer::RemoteRegion& r : d.regions) {
    regions.push_back(
        {{"base", r.base}, {"length", r.length}, {"item_len", r.item_len}, {"key", Hex(r.key)}});
  }
  return {{"backend", d.backend}, {"address", Hex(d.address)}, {"regions", regions}};
}

StatusOr<PeerDescriptor> DescriptorFromJson(const json& j) {
  PeerDescriptor d;
  try {
    d.backend = j.at("backend").get<std::string>();
    KVT_ASSIGN_OR_RETURN(d.address, Unhex(j.at("address").get<std::string>()));
    for (const json& r : j.at("regions")) {
      transfer::RemoteRegion region;
      region.base = r.at("base").get<uint64_t>();
      region.length = r.at("length").get<uint64_t>();
      region.item_len = r.at("item_len").get<uint64_t>();
      KVT_ASSIGN_OR_RETURN(region.key, Unhex(r.at("key").get<std::string>()));
      d.regions.push_back(std::move(region));
    }
  } catch (const json::exception& e) {
    return DataLoss(std::string("malformed peer descriptor: ") + e.what());
  }
  return d;
}

// ---- What both sides build from the configuration ---------------------------------------------

struct SideConfig {
  std::string backend;
  std::string ucx_tls;
  int ucx_spin_us = 200;
  int ucx_copy_threads = 0;
  std::string ucx_host_path = "auto";
  int64_t ucx_am_message_bytes = int64_t{1} << 20;
  int64_t control_busy_poll_us = 0;
  bool control_lanes = true;
  bool cuda_ipc_completion_word = true;
  int page_tokens = 0;
  int64_t pool_tokens = 0;
  std::string memory = "pool";  // TransferOptions::memory
  int layers = 0, heads = 0, head_dim = 0;
  std::string dtype;
  int64_t contiguous_bytes = 0;  // the raw-backend ceiling's region
  uint32_t seed = 1;
  int timeout_s = 30;
  // CUDA pools (cuda = false: host pools, everything below unused).
  bool cuda = false;
  int device = 0;
  std::string ucx_cuda_mode = "staged";
  int ucx_staging_slots = 8;
  int64_t ucx_staging_slot_bytes = int64_t{16} << 20;
  bool ucx_staging_in_place = true;
  int64_t layer_time_ns = 200000;
  int spin_blocks = 0;
  int64_t device_spin_us = -1;  // prefill EngineOptions::device_spin; < 0: the engine's default

  json ToJson() const {
    return {{"backend", backend},
            {"ucx_tls", ucx_tls},
            {"ucx_spin_us", ucx_spin_us},
            {"ucx_copy_threads", ucx_copy_threads},
            {"ucx_host_path", ucx_host_path},
            {"ucx_am_message_bytes", ucx_am_message_bytes},
            {"control_busy_poll_us", control_busy_poll_us},
            {"control_lanes", control_lanes},
            {"cuda_ipc_completion_word", cuda_ipc_completion_word},
            {"page_tokens", page_tokens},
            {"pool_tokens", pool_tokens},
            {"memory", memory},
            {"layers", layers},
            {"heads", heads},
            {"head_dim", head_dim},
            {"dtype", dtype},
            {"contiguous_bytes", contiguous_bytes},
            {"seed", seed},
            {"timeout_s", timeout_s},
            {"cuda", cuda},
            {"device", device},
            {"ucx_cuda_mode", ucx_cuda_mode},
            {"ucx_staging_slots", ucx_staging_slots},
            {"ucx_staging_slot_bytes", ucx_staging_slot_bytes},
            {"ucx_staging_in_place", ucx_staging_in_place},
            {"layer_time_ns", layer_time_ns},
            {"spin_blocks", spin_blocks},
            {"device_spin_us", device_spin_us}};
  }
  static StatusOr<SideConfig> FromJson(const json& j) {
    SideConfig c;
    try {
      c.backend = j.at("backend");
      c.ucx_tls = j.at("ucx_tls");
      c.ucx_spin_us = j.at("ucx_spin_us");
      c.ucx_copy_threads = j.value("ucx_copy_threads", 0);
      c.ucx_host_path = j.value("ucx_host_path", std::string("auto"));
      c.ucx_am_message_bytes = j.value("ucx_am_message_bytes", int64_t{1} << 20);
      c.control_busy_poll_us = j.value("control_busy_poll_us", int64_t{0});
      c.control_lanes = j.value("control_lanes", true);
      c.cuda_ipc_completion_word = j.value("cuda_ipc_completion_word", true);
      c.page_tokens = j.at("page_tokens");
      c.pool_tokens = j.at("pool_tokens");
      c.memory = j.at("memory");
      c.layers = j.at("layers");
      c.heads = j.at("heads");
      c.head_dim = j.at("head_dim");
      c.dtype = j.at("dtype");
      c.contiguous_bytes = j.at("contiguous_bytes");
      c.seed = j.at("seed");
      c.timeout_s = j.at("timeout_s");
      c.cuda = j.value("cuda", false);
      c.device = j.value("device", 0);
      c.ucx_cuda_mode = j.value("ucx_cuda_mode", std::string("staged"));
      c.ucx_staging_slots = j.value("ucx_staging_slots", 8);
      c.ucx_staging_slot_bytes = j.value("ucx_staging_slot_bytes", int64_t{16} << 20);
      c.ucx_staging_in_place = j.value("ucx_staging_in_place", true);
      c.layer_time_ns = j.value("layer_time_ns", int64_t{200000});
      c.spin_blocks = j.value("spin_blocks", 0);
      c.device_spin_us = j.value("device_spin_us", int64_t{-1});
    } catch (const json::exception& e) {
      return DataLoss(std::string("malformed peer configuration: ") + e.what());
    }
    return c;
  }
  // The backend both sides run, with this configuration's options.
  StatusOr<std::unique_ptr<Backend>> CreateBackend() const {
    KVT_ASSIGN_OR_RETURN(transfer::BackendConfig config, transfer::DefaultBackendConfig(backend));
    if (auto* ipc = std::get_if<transfer::CudaIpcOptions>(&config)) {
      ipc->completion_word = cuda_ipc_completion_word;
    }
    if (auto* ucx = std::get_if<transfer::UcxOptions>(&config)) {
      ucx->transports = ucx_tls;
      ucx->spin = std::chrono::microseconds(ucx_spin_us);
      ucx->copy_threads = ucx_copy_threads;
      KVT_ASSIGN_OR_RETURN(ucx->host_path, transfer::ParseUcxHostPath(ucx_host_path));
      ucx->am_message_bytes = static_cast<size_t>(ucx_am_message_bytes);
      if (cuda) {
        KVT_ASSIGN_OR_RETURN(ucx->cuda_mode, transfer::ParseUcxCudaMode(ucx_cuda_mode));
        ucx->staging_slots = ucx_staging_slots;
        ucx->staging_slot_bytes = static_cast<size_t>(ucx_staging_slot_bytes);
        ucx->staging_in_place = ucx_staging_in_place;
      }
    }
    return transfer::CreateBackend(config);
  }
  int64_t RowBytes() const {
    return static_cast<int64_t>(heads) * head_dim * ItemSize(ParseDType(dtype).value());
  }
};

// The pool this configuration describes (also the shape of the external memory).
StatusOr<pool::PoolOptions> PoolOptionsFor(const SideConfig& c) {
  KVT_ASSIGN_OR_RETURN(DType dtype, ParseDType(c.dtype));
  pool::PoolOptions p;
  p.size = c.pool_tokens;
  p.page_size = c.page_tokens;
  p.head_num = c.heads;
  p.head_dim = c.head_dim;
  p.layer_num = c.layers;
  p.dtype = dtype;
  p.pd_disaggregation_enabled = true;
  if (c.cuda) {
    p.memory = pool::MemoryKind::kCuda;
    p.device = c.device;
  }
  return p;
}

// `allocator`: where the pool's buffers come from (the engine backend's, so that UCX's
// shared-memory transports can write into them directly); null: the pool's own mmap.
StatusOr<std::unique_ptr<pool::KvPool>> MakePool(
    const SideConfig& c, std::shared_ptr<pool::HostAllocator> allocator = nullptr) {
  KVT_ASSIGN_OR_RETURN(pool::PoolOptions p, PoolOptionsFor(c));
  if (c.cuda) return pool::KvPool::Create(p);
  p.pin_host_memory = false;  // host path only; pinning would need a CUDA device
  // A serving pool has been written long before a transfer; without this the first requests
  // would time first-touch page faults instead of copies.
  p.prefault_host_memory = true;
  p.host_allocator = std::move(allocator);
  return pool::KvPool::Create(p);
}

// The K/V buffers one side moves: kvt's own KvPool (--memory pool), or memory this side
// allocates itself and describes with TransferLayout::FromBufInfos, as a serving engine
// registers the tensors of its own caching allocator (--memory external). Both give buffer
// infos in the pool's order and sizes (K of every layer, then V; page p of buffer i at
// data_ptrs[i] + p * item_lens[i]; page 0 the dummy page), so the fills, verification and
// ceilings work on either. Owns the memory; engines made by CreateEngine must be destroyed
// before it. Not thread-safe to construct; const access from any thread.
class KvMemory {
 public:
  // `backend`: the engine's backend; host pools take their buffers from its allocator, external
  // host memory deliberately does not (engines bring plain memory).
  static StatusOr<std::unique_ptr<KvMemory>> Create(const SideConfig& c,
                                                    const std::shared_ptr<Backend>& backend) {
    auto m = std::unique_ptr<KvMemory>(new KvMemory());
    if (c.memory == "pool") {
      KVT_ASSIGN_OR_RETURN(m->pool_,
                           MakePool(c, c.cuda ? nullptr : transfer::BackendHostAllocator(backend)));
      KVT_ASSIGN_OR_RETURN(m->infos_, m->pool_->GetContiguousBufInfos());
      m->num_pages_ = m->pool_->layout().num_pages();
      return m;
    }
    if (c.memory != "external") {
      return InvalidArgument("--memory is '" + c.memory + "'; use pool or external");
    }
    KVT_RETURN_IF_ERROR(m->AllocateExternal(c));
    return m;
  }

  // Usable page ids are 1..num_pages().
  int64_t num_pages() const { return num_pages_; }
  const pool::ContiguousBufInfos& infos() const { return infos_; }

  // An engine over these buffers: through the pool (its guards) or through the layout.
  StatusOr<std::unique_ptr<transfer::TransferEngine>> CreateEngine(
      const transfer::EngineOptions& e, std::shared_ptr<Backend> backend) {
    if (pool_ != nullptr) return transfer::TransferEngine::Create(e, pool_.get(), backend);
    return transfer::TransferEngine::Create(e, layout_, backend);
  }

 private:
  // Between buffers of the one allocation: a gap, then the next 256-byte boundary, as a caching
  // allocator places tensors (no buffer starts where the previous one ends or on a page).
  static constexpr uint64_t kAlignment = 256;
  static constexpr uint64_t kGap = 512;

  KvMemory() = default;

  // One allocation (one cudaMalloc, or page-aligned host memory) carved into the 2L buffers the
  // pool would have: same lengths, same page bytes.
  Status AllocateExternal(const SideConfig& c) {
    KVT_ASSIGN_OR_RETURN(pool::PoolOptions p, PoolOptionsFor(c));
    KVT_ASSIGN_OR_RETURN(pool::PoolLayout shape, pool::PoolLayout::Compute(p));
    KVT_ASSIGN_OR_RETURN(infos_.data_lens, shape.DataLens());
    KVT_ASSIGN_OR_RETURN(infos_.item_lens, shape.ItemLens());
    KVT_ASSIGN_OR_RETURN(std::vector<int64_t> unit_lens, shape.UnitLens());
    std::vector<uint64_t> offsets;
    uint64_t end = 0;
    for (int64_t len : infos_.data_lens) {
      const uint64_t start =
          offsets.empty() ? 0 : (end + kGap + kAlignment - 1) / kAlignment * kAlignment;
      offsets.push_back(start);
      end = start + static_cast<uint64_t>(len);
    }
    uint8_t* base = nullptr;
    if (c.cuda) {
      // Whole 2 MiB granules, as a caching allocator's segments are (PyTorch rounds large
      // segments up to 2 MiB): CUDA IPC peers write into other sizes several times slower.
      constexpr uint64_t kGranule = uint64_t{2} << 20;
      end = (end + kGranule - 1) / kGranule * kGranule;
      KVT_ASSIGN_OR_RETURN(device_, cuda::DeviceBuffer::Allocate(end, c.device));
      BENCH_CUDA(cudaMemset(device_.data(), 0, end));  // the pool zeroes its memory too
      base = device_.as<uint8_t>();
    } else {
      // Written once, as the pool prefaults its host memory: no first-touch faults in the timing.
      KVT_ASSIGN_OR_RETURN(host_, AllocTouched(static_cast<int64_t>(end), 0));
      base = host_.get();
    }
    for (uint64_t offset : offsets) {
      infos_.data_ptrs.push_back(reinterpret_cast<uint64_t>(base + offset));
    }
    transfer::TransferLayout::BufInfoOptions b;
    b.page_size = static_cast<uint32_t>(c.page_tokens);
    b.dtype = p.dtype;
    b.head_num = static_cast<uint32_t>(c.heads);
    b.head_dim = static_cast<uint32_t>(c.head_dim);
    b.device = c.cuda ? c.device : -1;
    b.unit_lens = unit_lens;
    KVT_ASSIGN_OR_RETURN(layout_, transfer::TransferLayout::FromBufInfos(
                                      infos_.data_ptrs, infos_.data_lens, infos_.item_lens, b));
    num_pages_ = shape.num_pages();
    return OkStatus();
  }

  std::unique_ptr<pool::KvPool> pool_;  // --memory pool
  cuda::DeviceBuffer device_;           // --memory external on CUDA: one cudaMalloc
  HostSlab host_;                       // --memory external on the host
  transfer::TransferLayout layout_;     // --memory external
  pool::ContiguousBufInfos infos_;
  int64_t num_pages_ = 0;
};

// A raw backend with the pool's 2L buffers plus one contiguous region (index 2L), registered in
// the same order on both sides so run buffer indices mean the same thing.
// A block from Backend::AllocateHost, returned on destruction (keeps its backend alive).
struct BackendBlock {
  BackendBlock() = default;
  BackendBlock(std::shared_ptr<Backend> b, void* p) : backend(std::move(b)), block(p) {}
  BackendBlock(BackendBlock&& o) noexcept : backend(std::move(o.backend)), block(o.block) {
    o.block = nullptr;
  }
  BackendBlock& operator=(BackendBlock&& o) noexcept {
    std::swap(backend, o.backend);
    std::swap(block, o.block);
    return *this;
  }
  ~BackendBlock() {
    if (block != nullptr) backend->FreeHost(block);
  }
  std::shared_ptr<Backend> backend;
  void* block = nullptr;
};

struct RawSide {
  HostSlab contiguous;               // used when the backend has no allocator of its own
  BackendBlock backend_memory;       // else the contiguous region comes from the backend
  std::shared_ptr<Backend> backend;  // declared after the memory it registers
  PeerDescriptor descriptor;
  transfer::PeerId peer = 0;
  uint32_t contiguous_index = 0;
};

StatusOr<RawSide> MakeRawSide(const SideConfig& c, const pool::ContiguousBufInfos& infos,
                              uint8_t fill) {
  RawSide raw;
  KVT_ASSIGN_OR_RETURN(raw.backend, c.CreateBackend());
  // The ceiling is a put into memory the backend reaches best, as the pools' memory is.
  uint8_t* contiguous = nullptr;
  const size_t rounded = (static_cast<size_t>(c.contiguous_bytes) + 4095) & ~size_t{4095};
  if (StatusOr<void*> block = raw.backend->AllocateHost(rounded); block.ok()) {
    raw.backend_memory = BackendBlock(raw.backend, *block);
    contiguous = static_cast<uint8_t*>(*block);
    std::memset(contiguous, fill, rounded);
  } else {
    KVT_ASSIGN_OR_RETURN(raw.contiguous, AllocTouched(c.contiguous_bytes, fill));
    contiguous = raw.contiguous.get();
  }
  std::vector<transfer::LocalRegion> regions;
  for (size_t i = 0; i < infos.data_ptrs.size(); ++i) {
    regions.push_back({infos.data_ptrs[i], static_cast<uint64_t>(infos.data_lens[i]),
                       static_cast<uint64_t>(infos.item_lens[i])});
    regions.back().layer = static_cast<int32_t>(i % static_cast<size_t>(c.layers));  // K, then V
  }
  raw.contiguous_index = static_cast<uint32_t>(regions.size());
  regions.push_back({reinterpret_cast<uint64_t>(contiguous),
                     static_cast<uint64_t>(c.contiguous_bytes),
                     static_cast<uint64_t>(c.contiguous_bytes)});
  regions.back().layer = c.layers;  // a transfer layer of its own: no page write of KV moves it
  KVT_ASSIGN_OR_RETURN(raw.descriptor, raw.backend->Register(regions));
  return raw;
}

// Posts `runs` as one write and waits (spinning on Check) until the backend reports it visible
// at the peer. Returns milliseconds from post to complete.
StatusOr<double> TimedWrite(Backend& backend, transfer::PeerId peer, std::span<const CopyRun> runs,
                            std::chrono::seconds timeout) {
  const auto t0 = Clock::now();
  KVT_ASSIGN_OR_RETURN(transfer::WriteId write, backend.PostWrite(peer, runs));
  Status st;
  while ((st = backend.Check(write)).code() == StatusCode::kInProgress) {
    if (Clock::now() - t0 > timeout) {
      backend.Release(write);
      return DeadlineExceeded(
          fmt::format("raw write of {} runs not complete in {} s", runs.size(), timeout.count()));
    }
  }
  const double ms = Ms(Clock::now() - t0);
  backend.Release(write);
  KVT_RETURN_IF_ERROR(st);
  return ms;
}

// The pattern of request `request` in `num_pages` pages, layers [first_layer, first_layer + n):
// `bases` is the 2L-entry table (K of every layer, then V), `pages` the page list, both in the
// memory the fill/verify runs on (host for the CPU versions, device for the CUDA ones).
kernels::PatternArgs PatternAt(const uint64_t* bases, const int32_t* pages, int64_t num_pages,
                               const SideConfig& c, uint64_t request, int64_t row_bytes,
                               int32_t first_layer = 0, int32_t num_layers = -1) {
  kernels::PatternArgs a;
  a.request = request;
  a.k_bases = bases + first_layer;
  a.v_bases = bases + c.layers + first_layer;
  a.first_layer = first_layer;
  a.num_layers = num_layers < 0 ? c.layers : num_layers;
  a.pages = pages;
  a.num_tokens = num_pages * c.page_tokens;
  a.page_size = c.page_tokens;
  a.row_bytes = row_bytes;
  return a;
}

kernels::PatternArgs PatternFor(const pool::ContiguousBufInfos& infos, const SideConfig& c,
                                uint64_t request, const std::vector<int32_t>& pages,
                                int64_t row_bytes) {
  return PatternAt(infos.data_ptrs.data(), pages.data(), static_cast<int64_t>(pages.size()), c,
                   request, row_bytes);
}

// `buffer` holds at least `bytes` bytes of device memory afterwards (contents undefined).
Status EnsureDeviceBytes(cuda::DeviceBuffer& buffer, size_t bytes, int device) {
  if (buffer.size() >= bytes) return OkStatus();
  buffer = cuda::DeviceBuffer();
  KVT_ASSIGN_OR_RETURN(buffer, cuda::DeviceBuffer::Allocate(bytes, device));
  return OkStatus();
}

// Copies a host table into (grown) device memory, synchronously.
template <typename T>
Status UploadTable(cuda::DeviceBuffer& buffer, const std::vector<T>& table, int device) {
  const size_t bytes = std::max<size_t>(table.size() * sizeof(T), 1);
  KVT_RETURN_IF_ERROR(EnsureDeviceBytes(buffer, bytes, device));
  if (table.empty()) return OkStatus();
  return cuda::Copy(buffer.data(), table.data(), table.size() * sizeof(T));
}

int64_t SteadyNs(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// ---- The prefill peer -------------------------------------------------------------------------
// Serves one page-token size: answers the parent's messages until "quit" or the pipe closes.
// Messages: config -> ready{port, raw}; connect{raw}; put{bytes, iters}; runs{dst_pages, iters};
// socket{port, bytes, iters} (the plain-socket ceiling's sending end); stats{reset}; quit. CUDA
// pools instead: config -> ready{port}; ipc{allocs, buffers} (open the decode pool's allocations);
// gpu_ceilings{dst_pages, iters, warmup, peer_items}; forward_stats{reset}. Every reply carries
// "error" when something failed.
class PrefillPeer {
 public:
  explicit PrefillPeer(int fd) : fd_(fd) {}
  ~PrefillPeer() {
    // The forward thread uses the engine; the engine (its backend's IPC mappings) and ours must
    // be gone before the parent frees the pool they map.
    StopForwardThread();
    engine_.reset();
    ipc_mappings_.clear();
  }
  PrefillPeer(const PrefillPeer&) = delete;
  PrefillPeer& operator=(const PrefillPeer&) = delete;

  Status Serve() {
    KVT_ASSIGN_OR_RETURN(json first, ReceiveMessage(fd_, std::chrono::seconds(60)));
    KVT_ASSIGN_OR_RETURN(config_, SideConfig::FromJson(first));
    Status setup = Setup();
    if (!setup.ok()) {
      (void)SendMessage(fd_, {{"error", setup.ToString()}});
      return setup;
    }
    json ready = {{"port", engine_->port()}};
    if (!config_.cuda) ready["raw"] = DescriptorToJson(raw_.descriptor);
    KVT_RETURN_IF_ERROR(SendMessage(fd_, ready));
    while (true) {
      // The parent talks at least once per phase; a long silence means it is stuck or gone.
      StatusOr<json> message = ReceiveMessage(fd_, std::chrono::minutes(15));
      if (!message.ok()) return OkStatus();  // pipe closed (parent done or dead) or silent
      const std::string type = message->value("type", "");
      if (type == "quit") return OkStatus();
      StatusOr<json> reply = Handle(type, *message);
      KVT_RETURN_IF_ERROR(
          SendMessage(fd_, reply.ok() ? *reply : json{{"error", reply.status().ToString()}}));
    }
  }

 private:
  Status Setup() {
    if (config_.cuda) BENCH_CUDA(cudaSetDevice(config_.device));
    KVT_ASSIGN_OR_RETURN(std::shared_ptr<Backend> backend, config_.CreateBackend());
    KVT_ASSIGN_OR_RETURN(memory_, KvMemory::Create(config_, backend));
    infos_ = memory_->infos();
    row_bytes_ = config_.RowBytes();
    num_pages_ = memory_->num_pages();
    permutation_.resize(static_cast<size_t>(num_pages_));
    std::iota(permutation_.begin(), permutation_.end(), 1);
    rng_.seed(config_.seed * 7919u + 17u);
    std::shuffle(permutation_.begin(), permutation_.end(), rng_);
    if (config_.cuda) {
      KVT_RETURN_IF_ERROR(SetupGpu());
    } else {
      KVT_ASSIGN_OR_RETURN(raw_, MakeRawSide(config_, infos_, 0x5A));
    }

    transfer::EngineOptions e;
    e.name = "bench-prefill";
    e.prefill = true;
    e.server.bind_address = "127.0.0.1";
    e.default_deadline = std::chrono::seconds(config_.timeout_s);
    // Final rooms are kept for the timelines the stats reply carries (pipelined runs last seconds).
    e.retention = std::chrono::minutes(2);
    e.control_busy_poll = std::chrono::microseconds(config_.control_busy_poll_us);
    e.control_lanes = config_.control_lanes;
    if (config_.device_spin_us >= 0) {
      e.device_spin = std::chrono::microseconds(config_.device_spin_us);
    }
    e.on_transfer_request = [this](const std::string& room, size_t num_pages) {
      OnTransferRequest(room, num_pages);
    };
    KVT_ASSIGN_OR_RETURN(engine_, memory_->CreateEngine(e, backend));
    if (config_.cuda) forward_thread_ = std::thread([this] { ForwardLoop(); });
    return OkStatus();
  }

  // Device tables, streams and the forward's events (two sets of one per layer, used in turn,
  // so an event is never re-recorded while the engine may still wait on it).
  Status SetupGpu() {
    KVT_RETURN_IF_ERROR(UploadTable(d_bases_, infos_.data_ptrs, config_.device));
    KVT_ASSIGN_OR_RETURN(fill_stream_, cuda::Stream::Create(config_.device));
    KVT_ASSIGN_OR_RETURN(forward_stream_, cuda::Stream::Create(config_.device));
    KVT_ASSIGN_OR_RETURN(fill_done_, cuda::Event::Create(/*timing=*/false));
    if (config_.spin_blocks <= 0) {  // one per multiprocessor, asked once
      BENCH_CUDA(cudaDeviceGetAttribute(&config_.spin_blocks, cudaDevAttrMultiProcessorCount,
                                        config_.device));
    }
    for (int i = 0; i < 2 * config_.layers; ++i) {
      KVT_ASSIGN_OR_RETURN(cuda::Event ev, cuda::Event::Create(/*timing=*/false));
      forward_events_.push_back(std::move(ev));
    }
    return OkStatus();
  }

  const uint64_t* DeviceBases() const { return d_bases_.as<const uint64_t>(); }

  // The prefill engine's timeline of every room seen since the last stats reset: room ->
  // [request_seen, source_ready, first_post, last_post, finished] in steady_clock ns (0: not
  // reached; rooms the engine already forgot are left out).
  json Timelines() {
    std::vector<std::string> rooms;
    {
      std::lock_guard<std::mutex> lock(mu_);
      rooms = rooms_seen_;
    }
    json out = json::object();
    auto ns = [](Clock::time_point t) { return t == Clock::time_point() ? 0 : SteadyNs(t); };
    for (const std::string& room : rooms) {
      StatusOr<transfer::RequestInfo> info = engine_->GetRequest(room);
      if (!info.ok()) continue;
      out[room] = {ns(info->request_seen), ns(info->source_ready), ns(info->first_post),
                   ns(info->last_post), ns(info->finished)};
    }
    return out;
  }

  // `n` distinct random pages: a window of the shuffled page ids at a random start.
  std::vector<int32_t> PickPages(size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    std::uniform_int_distribution<size_t> start(0, permutation_.size() - 1);
    const size_t s = start(rng_);
    // Two slices of the permutation (the window wraps around once at most): a real engine's
    // page list is ready when it calls Send, so the callback should not spend a division per page.
    std::vector<int32_t> pages;
    pages.reserve(n);
    const size_t first = std::min(n, permutation_.size() - s);
    pages.insert(pages.end(), permutation_.begin() + static_cast<std::ptrdiff_t>(s),
                 permutation_.begin() + static_cast<std::ptrdiff_t>(s + first));
    pages.insert(pages.end(), permutation_.begin(),
                 permutation_.begin() + static_cast<std::ptrdiff_t>(n - first));
    return pages;
  }

  void RecordError(const Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    ++errors_;
    if (first_error_.empty()) first_error_ = s.ToString();
  }

  // On a control thread: the "forward pass" is already done, so Send and mark every layer ready.
  // Rooms named "v<id>" are verification requests: their pages get the pattern of request <id>
  // first (outside any timed request). On CUDA pools, rooms named "f<id>" go to the forward
  // thread (a simulated forward writing one layer at a time, pattern <id>).
  void OnTransferRequest(const std::string& room, size_t num_pages) {
    const auto t0 = Clock::now();
    {
      std::lock_guard<std::mutex> lock(mu_);
      rooms_seen_.push_back(room);
    }
    if (num_pages > permutation_.size()) {
      RecordError(OutOfRange(fmt::format("room '{}' asks for {} pages; the pool has {}", room,
                                         num_pages, permutation_.size())));
      (void)engine_->Abort(room, "more pages than the prefill pool has");
      return;
    }
    if (config_.cuda && !room.empty() && room[0] == 'f') {
      std::lock_guard<std::mutex> lock(forward_mu_);
      forward_jobs_.push_back({room, num_pages});
      forward_cv_.notify_one();
      return;
    }
    std::vector<int32_t> pages = PickPages(num_pages);
    cudaEvent_t ready = nullptr;
    if (!room.empty() && room[0] == 'v') {
      const uint64_t request = std::strtoull(room.c_str() + 1, nullptr, 10);
      Status filled =
          config_.cuda
              ? FillOnDevice(request, pages, &ready)
              : kernels::FillPatternCpu(PatternFor(infos_, config_, request, pages, row_bytes_));
      if (!filled.ok()) RecordError(filled);
    }
    Status s = engine_->Send(room, std::move(pages));
    if (s.ok()) s = engine_->LayersReady(room, config_.layers, ready);
    if (!s.ok()) RecordError(s.WithContext("room '" + room + "'"));
    const double ms = Ms(Clock::now() - t0);
    std::lock_guard<std::mutex> lock(mu_);
    post_ms_.push_back(ms);
  }

  // Pattern of `request` into `pages` of every layer, enqueued on the fill stream; `ready` gets
  // the event recorded after it (the engine's copy waits for it on the GPU).
  Status FillOnDevice(uint64_t request, const std::vector<int32_t>& pages, cudaEvent_t* ready) {
    BENCH_CUDA(cudaSetDevice(config_.device));  // control threads are not ours
    KVT_RETURN_IF_ERROR(UploadTable(d_fill_pages_, pages, config_.device));
    KVT_RETURN_IF_ERROR(kernels::FillPatternCuda(
        PatternAt(DeviceBases(), d_fill_pages_.as<const int32_t>(),
                  static_cast<int64_t>(pages.size()), config_, request, row_bytes_),
        fill_stream_.get()));
    KVT_RETURN_IF_ERROR(fill_done_.Record(fill_stream_.get()));
    *ready = fill_done_.get();
    return OkStatus();
  }

  // ---- Simulated forward (CUDA pools) ---------------------------------------------------------
  struct ForwardJob {
    std::string room;
    size_t num_pages = 0;
  };

  void StopForwardThread() {
    {
      std::lock_guard<std::mutex> lock(forward_mu_);
      forward_stop_ = true;
    }
    forward_cv_.notify_all();
    if (forward_thread_.joinable()) forward_thread_.join();
  }

  void ForwardLoop() {
    Status device = cuda::ToStatus(cudaSetDevice(config_.device), "cudaSetDevice");
    while (true) {
      ForwardJob job;
      {
        std::unique_lock<std::mutex> lock(forward_mu_);
        forward_cv_.wait(lock, [this] { return forward_stop_ || !forward_jobs_.empty(); });
        if (forward_stop_) return;
        job = std::move(forward_jobs_.front());
        forward_jobs_.pop_front();
      }
      json record = {{"room", job.room}};
      Status s = device.ok() ? RunForward(job, record) : device;
      if (!s.ok()) {
        record["error"] = s.ToString();
        RecordError(s.WithContext("forward of room '" + job.room + "'"));
        (void)engine_->Abort(job.room, "the simulated forward failed");
      }
      std::lock_guard<std::mutex> lock(mu_);
      forward_records_.push_back(std::move(record));
    }
  }

  // Per layer: spin for the layer time, write the layer's pages (pattern), record the layer's
  // event, LayersReady(l + 1, event) — all enqueued without waiting. Then stamps each event's
  // completion on the host clock by spinning on cudaEventQuery.
  Status RunForward(const ForwardJob& job, json& record) {
    const uint64_t request = std::strtoull(job.room.c_str() + 1, nullptr, 10);
    std::vector<int32_t> pages = PickPages(job.num_pages);
    const int64_t num_pages = static_cast<int64_t>(pages.size());
    KVT_RETURN_IF_ERROR(UploadTable(d_forward_pages_, pages, config_.device));
    KVT_RETURN_IF_ERROR(engine_->Send(job.room, std::move(pages)));
    const int32_t layers = config_.layers;
    cuda::Event* events = &forward_events_[static_cast<size_t>((forward_count_++ % 2) * layers)];
    cudaStream_t stream = forward_stream_.get();
    const auto start = Clock::now();
    for (int32_t l = 0; l < layers; ++l) {
      KVT_RETURN_IF_ERROR(LaunchSpin(config_.layer_time_ns, config_.spin_blocks, stream));
      KVT_RETURN_IF_ERROR(
          kernels::FillPatternCuda(PatternAt(DeviceBases(), d_forward_pages_.as<const int32_t>(),
                                             num_pages, config_, request, row_bytes_, l, 1),
                                   stream));
      KVT_RETURN_IF_ERROR(events[l].Record(stream));
      KVT_RETURN_IF_ERROR(engine_->LayersReady(job.room, l + 1, events[l].get()));
    }
    const auto enqueued = Clock::now();
    const auto deadline = start + std::chrono::seconds(config_.timeout_s);
    // live[l]: the poller saw layer l pending at least once, so its stamp is the completion
    // (give or take one poll), not the moment the poller got to an event already done.
    json done = json::array(), live = json::array();
    for (int32_t l = 0; l < layers; ++l) {
      bool waited = false;
      while (true) {
        const cudaError_t e = cudaEventQuery(events[l].get());
        if (e == cudaSuccess) break;
        waited = true;
        if (e != cudaErrorNotReady) return cuda::ToStatus(e, "cudaEventQuery (layer event)");
        if (Clock::now() > deadline) {
          return DeadlineExceeded(
              fmt::format("layer {} of the forward not done in {} s", l, config_.timeout_s));
        }
      }
      done.push_back(SteadyNs(Clock::now()));
      live.push_back(waited);
    }
    record["start_ns"] = SteadyNs(start);
    record["layer_live"] = live;
    record["enqueued_ns"] = SteadyNs(enqueued);
    record["layer_done_ns"] = done;
    return OkStatus();
  }

  // ---- CUDA IPC mappings of the decode pool and the GPU ceilings ------------------------------
  Status OpenIpc(const json& m) {
    BENCH_CUDA(cudaSetDevice(config_.device));
    std::vector<void*> bases;
    for (const json& hex : m.at("allocs")) {
      KVT_ASSIGN_OR_RETURN(std::string bytes, Unhex(hex.get<std::string>()));
      KVT_ASSIGN_OR_RETURN(cudaIpcMemHandle_t handle, IpcHandleFromBytes(bytes));
      KVT_ASSIGN_OR_RETURN(IpcMapping mapping, IpcMapping::Open(handle, config_.device));
      bases.push_back(mapping.data());
      ipc_mappings_.push_back(std::move(mapping));
    }
    std::vector<uint64_t> remote;
    for (const json& b : m.at("buffers")) {
      const size_t alloc = b.at(0).get<size_t>();
      const uint64_t offset = b.at(1).get<uint64_t>();
      if (alloc >= bases.size()) return DataLoss("IPC buffer names an allocation not sent");
      remote.push_back(reinterpret_cast<uint64_t>(bases[alloc]) + offset);
    }
    if (remote.size() != infos_.data_ptrs.size()) {
      return DataLoss(fmt::format("the decode pool exported {} buffers; this pool has {}",
                                  remote.size(), infos_.data_ptrs.size()));
    }
    remote_bases_ = std::move(remote);
    return OkStatus();
  }

  static json Figure(const StatusOr<double>& ms, double bytes, const std::vector<double>& samples) {
    if (!ms.ok()) return {{"error", ms.status().ToString()}};
    return {{"median_ms", *ms}, {"gbps", GBps(bytes, *ms)}, {"samples_ms", samples}};
  }

  // The same-run ceilings and the peers' ways for requests of dst_pages.size() pages.
  StatusOr<json> GpuCeilings(const json& m) {
    BENCH_CUDA(cudaSetDevice(config_.device));
    const std::vector<int32_t> dst = m.at("dst_pages");
    const int iters = m.at("iters");
    const int warmup = std::max(1, m.at("warmup").get<int>());
    const int64_t peer_items = m.at("peer_items");
    const int64_t n = static_cast<int64_t>(dst.size());
    const int64_t item = infos_.item_lens[0];
    const int32_t buffers = static_cast<int32_t>(infos_.data_ptrs.size());
    const int64_t bytes = n * item * buffers;
    KVT_ASSIGN_OR_RETURN(cuda::Stream stream_obj, cuda::Stream::Create(config_.device));
    cudaStream_t stream = stream_obj.get();
    json out = {{"bytes", bytes}};
    std::vector<double> samples;
    {
      // (a) contiguous device-to-device copy of the same bytes, this process, same device.
      KVT_ASSIGN_OR_RETURN(cuda::DeviceBuffer src,
                           cuda::DeviceBuffer::Allocate(bytes, config_.device));
      KVT_ASSIGN_OR_RETURN(cuda::DeviceBuffer dst_buf,
                           cuda::DeviceBuffer::Allocate(bytes, config_.device));
      BENCH_CUDA(cudaMemsetAsync(src.data(), 0x5A, bytes, stream));
      BENCH_CUDA(cudaMemsetAsync(dst_buf.data(), 0xA5, bytes, stream));
      auto ms = TimeGpu(
          stream, warmup, iters,
          [&] {
            return cuda::ToStatus(cudaMemcpyAsync(dst_buf.data(), src.data(), bytes,
                                                  cudaMemcpyDeviceToDevice, stream),
                                  "cudaMemcpyAsync D2D");
          },
          &samples);
      KVT_RETURN_IF_ERROR(ms.status());
      out["contiguous_d2d"] = Figure(ms, static_cast<double>(bytes), samples);
    }
    if (config_.backend == "ucx") {
      // (b) the PCIe ceiling: contiguous device-to-host (and back) with pinned host memory.
      KVT_ASSIGN_OR_RETURN(cuda::DeviceBuffer dev,
                           cuda::DeviceBuffer::Allocate(bytes, config_.device));
      KVT_ASSIGN_OR_RETURN(cuda::PinnedBuffer host, cuda::PinnedBuffer::Allocate(bytes));
      BENCH_CUDA(cudaMemsetAsync(dev.data(), 0x5A, bytes, stream));
      std::memset(host.data(), 0xA5, static_cast<size_t>(bytes));
      auto d2h = TimeGpu(
          stream, warmup, iters,
          [&] {
            return cuda::ToStatus(
                cudaMemcpyAsync(host.data(), dev.data(), bytes, cudaMemcpyDeviceToHost, stream),
                "cudaMemcpyAsync D2H");
          },
          &samples);
      out["contiguous_d2h"] = Figure(d2h, static_cast<double>(bytes), samples);
      auto h2d = TimeGpu(
          stream, warmup, iters,
          [&] {
            return cuda::ToStatus(
                cudaMemcpyAsync(dev.data(), host.data(), bytes, cudaMemcpyHostToDevice, stream),
                "cudaMemcpyAsync H2D");
          },
          &samples);
      out["contiguous_h2d"] = Figure(h2d, static_cast<double>(bytes), samples);
      KVT_RETURN_IF_ERROR(d2h.status());
    }
    if (!remote_bases_.empty()) {
      // (c) through the IPC mappings of the decode pool, from random pages of ours.
      const std::vector<int32_t> src = PickPages(dst.size());
      CopyList per_buffer;  // diagnostic: one contiguous copy per buffer (pages 1..n)
      for (int32_t b = 0; b < buffers; ++b) {
        per_buffer.Add(reinterpret_cast<void*>(remote_bases_[b] + item),
                       reinterpret_cast<const void*>(infos_.data_ptrs[b] + item),
                       static_cast<size_t>(n * item));
      }
      auto contiguous_ipc = TimeGpu(
          stream, warmup, iters, [&] { return MemcpyEach(per_buffer, stream); }, &samples);
      out["contiguous_per_buffer_into_ipc"] = Figure(contiguous_ipc, per_buffer.bytes(), samples);
      out["contiguous_per_buffer_into_ipc"]["copies"] = per_buffer.size();

      const int64_t total_items = n * buffers;
      const std::vector<int64_t> subset = EvenSubset(total_items, peer_items);
      CopyList list;
      for (int64_t k : subset) {
        const int64_t b = k / n, i = k % n;  // buffer-major, as the engine's layers
        list.Add(reinterpret_cast<void*>(remote_bases_[b] + dst[i] * item),
                 reinterpret_cast<const void*>(infos_.data_ptrs[b] + src[i] * item),
                 static_cast<size_t>(item));
      }
      const int peer_iters = std::max(1, std::min(iters, 5));
      auto each = TimeGpu(
          stream, 1, peer_iters, [&] { return MemcpyEach(list, stream); }, &samples);
      out["memcpy_async_per_page"] = Figure(each, list.bytes(), samples);
      auto batch = TimeGpu(
          stream, 1, peer_iters, [&] { return MemcpyBatch(list, stream); }, &samples);
      out["memcpy_batch_async"] = Figure(batch, list.bytes(), samples);
      for (const char* key : {"memcpy_async_per_page", "memcpy_batch_async"}) {
        out[key]["items_timed"] = list.size();
        out[key]["items_per_request"] = total_items;
        out[key]["item_bytes"] = item;
      }
    }
    BENCH_CUDA(cudaStreamSynchronize(stream));
    return out;
  }

  StatusOr<json> Handle(const std::string& type, const json& m) {
    try {
      if (config_.cuda &&
          (type == "connect" || type == "put" || type == "runs" || type == "socket")) {
        return FailedPrecondition("'" + type + "' is a host-pool message");
      }
      if (type == "ipc") {
        KVT_RETURN_IF_ERROR(OpenIpc(m));
        return json{{"ok", true}, {"mapped_allocations", ipc_mappings_.size()}};
      }
      if (type == "gpu_ceilings") return GpuCeilings(m);
      if (type == "forward_stats") {
        std::lock_guard<std::mutex> lock(mu_);
        json reply = {{"records", forward_records_}};
        if (m.value("reset", false)) forward_records_.clear();
        return reply;
      }
      if (type == "connect") {
        KVT_ASSIGN_OR_RETURN(PeerDescriptor d, DescriptorFromJson(m.at("raw")));
        KVT_ASSIGN_OR_RETURN(raw_.peer, raw_.backend->Connect(d));
        return json{{"ok", true}};
      }
      if (type == "put") {
        const uint64_t bytes = m.at("bytes");
        const int iters = m.at("iters");
        const CopyRun run{raw_.contiguous_index, 0, 0, bytes};
        json ms = json::array();
        for (int i = 0; i < iters; ++i) {
          KVT_ASSIGN_OR_RETURN(double t, TimedWrite(*raw_.backend, raw_.peer, {&run, 1},
                                                    std::chrono::seconds(config_.timeout_s)));
          ms.push_back(t);
        }
        return json{{"ms", ms}};
      }
      if (type == "socket") {
        KVT_ASSIGN_OR_RETURN(
            std::vector<double> ms,
            SendSocketRequests(m.at("port").get<uint16_t>(), m.at("bytes"), m.at("iters"),
                               std::chrono::seconds(config_.timeout_s)));
        return json{{"ms", ms}};
      }
      if (type == "runs") {
        const std::vector<int32_t> dst = m.at("dst_pages");
        const int iters = m.at("iters");
        json ms = json::array();
        size_t runs = 0;
        for (int i = 0; i < iters; ++i) {
          const std::vector<int32_t> src = PickPages(dst.size());
          transfer::PlanSpec spec;
          spec.src_pages = src;
          spec.dst_pages = dst;
          spec.num_layers = config_.layers;
          spec.layer_begin = 0;
          spec.layer_end = config_.layers;
          spec.src_item_len = spec.dst_item_len = static_cast<uint64_t>(infos_.item_lens[0]);
          spec.src_buffer_len = spec.dst_buffer_len = static_cast<uint64_t>(infos_.data_lens[0]);
          KVT_ASSIGN_OR_RETURN(transfer::Plan plan, transfer::BuildPlan(spec));
          runs = plan.runs.size();
          KVT_ASSIGN_OR_RETURN(double t, TimedWrite(*raw_.backend, raw_.peer, plan.runs,
                                                    std::chrono::seconds(config_.timeout_s)));
          ms.push_back(t);
        }
        return json{{"ms", ms}, {"runs", runs}};
      }
      if (type == "stats") {
        const transfer::EngineStats s = engine_->stats();
        json reply = {{"timelines", Timelines()}};
        std::lock_guard<std::mutex> lock(mu_);
        reply.update({{"requests_succeeded", s.requests_succeeded},
                      {"requests_failed", s.requests_failed},
                      {"bytes", s.bytes},
                      {"writes_posted", s.writes_posted},
                      {"runs_posted", s.runs_posted},
                      {"post_ms_p50", Percentile(post_ms_, 0.5)},
                      {"post_ms_p99", Percentile(post_ms_, 0.99)},
                      {"post_count", post_ms_.size()},
                      {"callback_errors", errors_},
                      {"first_callback_error", first_error_}});
        if (m.value("reset", false)) {
          post_ms_.clear();
          rooms_seen_.clear();
        }
        return reply;
      }
    } catch (const json::exception& e) {
      return DataLoss(fmt::format("malformed '{}' message: {}", type, e.what()));
    }
    return InvalidArgument("unknown peer message '" + type + "'");
  }

  const int fd_;
  SideConfig config_;
  // Destroyed in reverse order: engine and raw backend before the memory they registered.
  std::unique_ptr<KvMemory> memory_;
  pool::ContiguousBufInfos infos_;
  RawSide raw_;
  // CUDA pools: tables and streams for the pattern fills and the forward, the decode pool's IPC
  // mappings (ceilings only; the engine's backend maps it on its own).
  cuda::DeviceBuffer d_bases_, d_fill_pages_, d_forward_pages_;
  cuda::Stream fill_stream_, forward_stream_;
  cuda::Event fill_done_;
  std::vector<cuda::Event> forward_events_;
  std::vector<IpcMapping> ipc_mappings_;
  std::vector<uint64_t> remote_bases_;
  std::unique_ptr<transfer::TransferEngine> engine_;
  int64_t row_bytes_ = 0;
  int64_t num_pages_ = 0;

  std::mutex forward_mu_;  // guards the job queue and the stop flag
  std::condition_variable forward_cv_;
  std::deque<ForwardJob> forward_jobs_;
  bool forward_stop_ = false;
  uint64_t forward_count_ = 0;  // forward thread only
  std::thread forward_thread_;

  std::mutex mu_;  // guards everything below (control threads and the message loop)
  std::mt19937 rng_;
  std::vector<int32_t> permutation_;
  std::vector<double> post_ms_;          // per request: Send + LayersReady (posting every run)
  std::vector<std::string> rooms_seen_;  // since the last stats reset
  json forward_records_ = json::array();
  uint64_t errors_ = 0;
  std::string first_error_;
};

// ---- The parent's handle on the peer ----------------------------------------------------------
// Owns the parent's end of the socketpair and the child process (or thread). The destructor
// closes the pipe (the peer exits on EOF), then reaps: a child that does not exit in 5 s gets
// SIGKILL. The child also gets SIGKILL from the kernel if the parent dies (PR_SET_PDEATHSIG).
class PeerLink {
 public:
  static StatusOr<std::unique_ptr<PeerLink>> Start(bool in_process) {
    int fds[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
      return Unavailable(fmt::format("socketpair: {}", std::strerror(errno)));
    }
    auto link = std::unique_ptr<PeerLink>(new PeerLink(fds[0]));
    if (in_process) {
      // The loopback backend only reaches backends of its own process.
      const int peer_fd = fds[1];
      link->thread_ = std::thread([peer_fd] {
        Status s = PrefillPeer(peer_fd).Serve();
        if (!s.ok()) KVT_LOG_ERROR("tool", "in-process prefill peer: {}", s.ToString());
        ::close(peer_fd);
      });
      return link;
    }
    // Everything the child needs is built before fork: after it only async-signal-safe calls.
    const pid_t parent = ::getpid();
    // The real path (not /proc/self/exe) so the child shows up under its own name in ps/top.
    char self[4096] = {};
    const ssize_t self_len = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
    const std::string exe = self_len > 0 ? std::string(self, static_cast<size_t>(self_len))
                                         : std::string("/proc/self/exe");
    const std::string fd_arg = std::to_string(fds[1]);
    std::vector<std::string> args = {"kvt-bench", kPeerCommand, "--fd", fd_arg};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) {
      ::close(fds[1]);
      return Unavailable(fmt::format("fork: {}", std::strerror(errno)));
    }
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(3);  // the parent died before prctl
      ::fcntl(fds[1], F_SETFD, 0);            // keep the child's end across exec
      ::execv(exe.c_str(), argv.data());
      ::_exit(127);
    }
    ::close(fds[1]);
    link->pid_ = pid;
    return link;
  }

  ~PeerLink() {
    if (fd_ >= 0) {
      (void)SendMessage(fd_, {{"type", "quit"}});
      ::close(fd_);
    }
    if (thread_.joinable()) thread_.join();
    if (pid_ > 0) {
      const auto give_up = Clock::now() + std::chrono::seconds(5);
      while (::waitpid(pid_, nullptr, WNOHANG) == 0) {
        if (Clock::now() > give_up) {
          ::kill(pid_, SIGKILL);
          ::waitpid(pid_, nullptr, 0);
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  }
  PeerLink(const PeerLink&) = delete;
  PeerLink& operator=(const PeerLink&) = delete;

  // Sends `message` and waits for the reply; a reply with "error" becomes that error.
  StatusOr<json> Call(const json& message, std::chrono::milliseconds timeout) {
    KVT_RETURN_IF_ERROR(SendMessage(fd_, message));
    return Reply(timeout);
  }
  StatusOr<json> Reply(std::chrono::milliseconds timeout) {
    KVT_ASSIGN_OR_RETURN(json reply, ReceiveMessage(fd_, timeout));
    if (reply.contains("error")) {
      return Internal("prefill peer: " + reply["error"].get<std::string>());
    }
    return reply;
  }
  int fd() const { return fd_; }

 private:
  explicit PeerLink(int fd) : fd_(fd) {}
  int fd_ = -1;
  pid_t pid_ = -1;
  std::thread thread_;
};

// ---- The decode side (parent) -----------------------------------------------------------------

struct Sample {
  double engine_ms = 0;  // Receive called -> the engine saw TransferDone (RequestInfo::finished)
  double caller_ms = 0;  // Receive called -> WaitRequest returned
  Clock::time_point posted, finished;
  Clock::time_point request_sent;  // the decode engine handed the TransferRequest to the wire
  std::string room;
};

struct Latencies {
  std::vector<double> engine_ms, caller_ms;
  void Add(const Sample& s) {
    engine_ms.push_back(s.engine_ms);
    caller_ms.push_back(s.caller_ms);
  }
  json ToJson(double scale, const char* unit) const {
    return {{"unit", unit},
            {"count", engine_ms.size()},
            {"p50", Percentile(engine_ms, 0.5) * scale},
            {"p99", Percentile(engine_ms, 0.99) * scale},
            {"max", Percentile(engine_ms, 1.0) * scale},
            {"caller_p50", Percentile(caller_ms, 0.5) * scale},
            {"caller_p99", Percentile(caller_ms, 0.99) * scale}};
  }
};

class DecodeSide {
 public:
  static StatusOr<std::unique_ptr<DecodeSide>> Create(const SideConfig& c, uint16_t port,
                                                      const json& peer_raw) {
    auto d = std::unique_ptr<DecodeSide>(new DecodeSide(c));
    if (c.cuda) BENCH_CUDA(cudaSetDevice(c.device));
    KVT_ASSIGN_OR_RETURN(std::shared_ptr<Backend> backend, c.CreateBackend());
    KVT_ASSIGN_OR_RETURN(d->memory_, KvMemory::Create(c, backend));
    d->infos_ = d->memory_->infos();
    KVT_ASSIGN_OR_RETURN(d->allocator_, pool::PageAllocator::Create(d->memory_->num_pages()));
    // Random pages: take all, shuffle, give back in that order; the allocator is LIFO, so later
    // allocations come out in the shuffled order.
    KVT_ASSIGN_OR_RETURN(std::vector<int32_t> all,
                         d->allocator_->Allocate(d->allocator_->num_pages()));
    std::mt19937 rng(c.seed);
    std::shuffle(all.begin(), all.end(), rng);
    KVT_RETURN_IF_ERROR(d->allocator_->Free(all));

    if (c.cuda) {
      KVT_RETURN_IF_ERROR(UploadTable(d->d_bases_, d->infos_.data_ptrs, c.device));
      KVT_ASSIGN_OR_RETURN(d->stream_, cuda::Stream::Create(c.device));
    } else {
      KVT_ASSIGN_OR_RETURN(d->raw_, MakeRawSide(c, d->infos_, 0xC3));
      KVT_ASSIGN_OR_RETURN(PeerDescriptor peer, DescriptorFromJson(peer_raw));
      (void)peer;  // the child connects to us (it writes); ours goes to it in "connect"
    }

    transfer::EngineOptions e;
    e.name = "bench-decode";
    e.prefill = false;
    e.default_deadline = std::chrono::seconds(c.timeout_s);
    e.control_busy_poll = std::chrono::microseconds(c.control_busy_poll_us);
    e.control_lanes = c.control_lanes;
    KVT_ASSIGN_OR_RETURN(d->engine_, d->memory_->CreateEngine(e, backend));
    KVT_ASSIGN_OR_RETURN(d->peer_, d->engine_->ConnectPeer("127.0.0.1", port));
    return d;
  }

  // A request whose Receive was called and whose end is not yet waited for.
  struct Pending {
    std::string room;
    std::vector<int32_t> dst;
    Clock::time_point t0;
    uint64_t verify_id = 0;
  };

  // One request of `num_pages` pages; room names starting with 'v' are verification requests.
  StatusOr<Sample> Request(const std::string& room, int64_t num_pages, uint64_t verify_id = 0) {
    KVT_ASSIGN_OR_RETURN(Pending p, Start(room, num_pages, verify_id));
    return Finish(std::move(p));
  }

  // Allocates the pages and calls Receive; Finish waits for the request (in Start order, so
  // several may be in flight).
  StatusOr<Pending> Start(const std::string& room, int64_t num_pages, uint64_t verify_id = 0) {
    if (engine_ == nullptr) return FailedPrecondition("the decode engine was shut down");
    Pending p;
    p.room = room;
    p.verify_id = verify_id;
    KVT_ASSIGN_OR_RETURN(std::vector<int32_t> pages, allocator_->Allocate(num_pages));
    p.dst = pages;
    p.t0 = Clock::now();
    Status posted = engine_->Receive(room, peer_, std::move(pages));
    if (!posted.ok()) {
      (void)allocator_->Free(p.dst);
      return posted.WithContext("Receive of room '" + room + "'");
    }
    return p;
  }

  StatusOr<Sample> Finish(Pending p) {
    const std::string& room = p.room;
    const std::vector<int32_t>& dst = p.dst;
    const auto t0 = p.t0;
    StatusOr<transfer::RequestInfo> info =
        engine_->WaitRequest(room, std::chrono::seconds(config_.timeout_s + 5));
    const auto t2 = Clock::now();
    if (!info.ok()) {
      (void)engine_->Abort(room, "the benchmark gave up waiting");
      // Pages stay allocated: a write into them may still land.
      return info.status();
    }
    if (info->state != transfer::RequestState::kSuccess) {
      if (info->pages_reusable) (void)allocator_->Free(dst);
      return info->status.WithContext("room '" + room + "' failed");
    }
    Sample s{Ms(info->finished - t0), Ms(t2 - t0), t0, info->finished, info->request_sent, room};
    const uint64_t verify_id = p.verify_id;
    if (verify_id != 0) {
      KVT_ASSIGN_OR_RETURN(kernels::PatternCheck check, Verify(verify_id, dst));
      verified_mismatches_ += check.mismatches;
      if (check.mismatches != 0 && first_mismatch_.empty()) {
        first_mismatch_ = fmt::format(
            "room '{}': {} wrong bytes, first at layer {} kv {} token {} byte {} (expected "
            "{:#04x}, "
            "got {:#04x})",
            room, check.mismatches, check.layer, check.kv, check.token, check.byte, check.expected,
            check.actual);
      }
    }
    (void)engine_->Forget(room);
    KVT_RETURN_IF_ERROR(allocator_->Free(dst));
    return s;
  }

  std::vector<int32_t> SomePages(int64_t n) {
    StatusOr<std::vector<int32_t>> pages = allocator_->Allocate(n);
    if (!pages.ok()) return {};
    (void)allocator_->Free(*pages);
    return *pages;
  }

  // CUDA pools: every allocation behind the pool's buffers as a CUDA IPC handle, and each
  // buffer as (allocation, offset), for the child's peer ceilings.
  StatusOr<json> ExportIpc() const {
    BENCH_CUDA(cudaSetDevice(config_.device));
    std::vector<uint64_t> alloc_bases;
    json allocs = json::array(), buffers = json::array();
    for (uint64_t ptr : infos_.data_ptrs) {
      KVT_ASSIGN_OR_RETURN(cuda::Allocation range, cuda::FindAllocation(ptr));
      auto it = std::find(alloc_bases.begin(), alloc_bases.end(), range.base);
      if (it == alloc_bases.end()) {
        cudaIpcMemHandle_t handle{};
        BENCH_CUDA(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(range.base)));
        allocs.push_back(Hex(IpcHandleBytes(handle)));
        alloc_bases.push_back(range.base);
        it = alloc_bases.end() - 1;
      }
      buffers.push_back(json::array({it - alloc_bases.begin(), ptr - range.base}));
    }
    return json{{"allocs", allocs}, {"buffers", buffers}};
  }

  // Stops the engine (and its connection) but keeps the pool: on CUDA pools the child must
  // close its mappings of the pool before it is freed.
  void ShutdownEngine() { engine_.reset(); }

  int64_t num_pages() const { return allocator_->num_pages(); }
  const RawSide& raw() const { return raw_; }
  uint64_t verified_mismatches() const { return verified_mismatches_; }
  const std::string& first_mismatch() const { return first_mismatch_; }

 private:
  explicit DecodeSide(const SideConfig& c) : config_(c) {}

  StatusOr<kernels::PatternCheck> Verify(uint64_t request, const std::vector<int32_t>& pages) {
    if (!config_.cuda) {
      return kernels::VerifyPatternCpu(
          PatternFor(infos_, config_, request, pages, config_.RowBytes()));
    }
    BENCH_CUDA(cudaSetDevice(config_.device));
    KVT_RETURN_IF_ERROR(UploadTable(d_pages_, pages, config_.device));
    return kernels::VerifyPatternCuda(
        PatternAt(d_bases_.as<const uint64_t>(), d_pages_.as<const int32_t>(),
                  static_cast<int64_t>(pages.size()), config_, request, config_.RowBytes()),
        stream_.get());
  }

  const SideConfig config_;
  std::unique_ptr<KvMemory> memory_;
  pool::ContiguousBufInfos infos_;
  std::unique_ptr<pool::PageAllocator> allocator_;
  RawSide raw_;
  cuda::DeviceBuffer d_bases_, d_pages_;  // CUDA pools: verification tables
  cuda::Stream stream_;
  std::unique_ptr<transfer::TransferEngine> engine_;  // before the pool it registered goes
  transfer::PeerHandle peer_ = 0;
  uint64_t verified_mismatches_ = 0;
  std::string first_mismatch_;
};

double SafeRatio(double a, double b) { return (std::isfinite(a) && b > 0) ? a / b : NAN; }

std::string Cell(double v, int precision = 2) {
  return std::isfinite(v) ? fmt::format("{:.{}f}", v, precision) : "-";
}

// The side configuration of one page-token size, host or CUDA pools alike.
SideConfig BaseSideConfig(const TransferOptions& o, int pt, int64_t pool_tokens,
                          int64_t request_bytes) {
  SideConfig c;
  c.backend = o.backend;
  c.ucx_tls = o.ucx_tls;
  c.ucx_spin_us = o.ucx_spin_us;
  c.ucx_copy_threads = o.ucx_copy_threads;
  c.ucx_host_path = o.ucx_host_path;
  // Checked with the other options before any side starts.
  const StatusOr<int64_t> am_bytes = ParseBytes(o.ucx_am_message_bytes);
  c.ucx_am_message_bytes = am_bytes.ok() ? *am_bytes : int64_t{1} << 20;
  c.control_busy_poll_us = o.control_busy_poll_us;
  c.control_lanes = o.control_lanes;
  c.cuda_ipc_completion_word = o.cuda_ipc_completion_word;
  c.page_tokens = pt;
  c.pool_tokens = pool_tokens;
  c.memory = o.memory;
  c.layers = o.layers;
  c.heads = o.heads;
  c.head_dim = o.head_dim;
  c.dtype = o.dtype;
  c.contiguous_bytes = request_bytes;
  c.seed = o.seed + static_cast<uint32_t>(pt);
  c.timeout_s = o.timeout_s;
  return c;
}

// o.iters timed whole requests after o.warmup untimed ones, and the prefill peer's stats from
// just before and just after the timed ones.
struct WholeRequests {
  Latencies latencies;
  std::vector<Sample> samples;
  double wall_ms = 0;
  json before, after;
};

StatusOr<WholeRequests> RunWholeRequests(const TransferOptions& o, PeerLink& link,
                                         DecodeSide& decode, int64_t pages_per_request) {
  for (int i = 0; i < o.warmup; ++i) {
    KVT_RETURN_IF_ERROR(decode.Request(fmt::format("w{}", i), pages_per_request).status());
  }
  WholeRequests whole;
  KVT_ASSIGN_OR_RETURN(whole.before,
                       link.Call({{"type", "stats"}, {"reset", true}}, std::chrono::seconds(30)));
  const auto run_t0 = Clock::now();
  for (int i = 0; i < o.iters; ++i) {
    KVT_ASSIGN_OR_RETURN(Sample s, decode.Request(fmt::format("t{}", i), pages_per_request));
    whole.latencies.Add(s);
    whole.samples.push_back(std::move(s));
  }
  whole.wall_ms = Ms(Clock::now() - run_t0);
  KVT_ASSIGN_OR_RETURN(whole.after,
                       link.Call({{"type", "stats"}, {"reset", true}}, std::chrono::seconds(30)));
  return whole;
}

json PhaseBreakdown(const std::vector<Sample>& samples, const json& timelines, int pt,
                    std::string& row);

// o.pipelined_requests whole requests with o.inflight of them in flight at once (Receive of the
// next ones before the oldest is done, as a decode node serving many requests does): GB/s = all
// their bytes / the wall time from the first Receive to the last done (the first request's
// latency and the last one's drain included). Empty when o.inflight <= 1.
StatusOr<json> RunPipelined(const TransferOptions& o, PeerLink& link, DecodeSide& decode,
                            int64_t pages_per_request, double request_bytes, int pt,
                            std::string& phase_row) {
  if (o.inflight <= 1) return json();
  // Untimed first: a full window, so that every page the window uses was written once (the
  // sequential requests reuse one request's worth of pages; first touches of shared memory
  // mappings cost page faults, not transfer time).
  {
    std::deque<DecodeSide::Pending> warm;
    Status failed;
    for (int i = 0; i < o.inflight && failed.ok(); ++i) {
      StatusOr<DecodeSide::Pending> p = decode.Start(fmt::format("q{}", i), pages_per_request);
      if (p.ok()) {
        warm.push_back(std::move(p).value());
      } else {
        failed = p.status();
      }
    }
    for (DecodeSide::Pending& p : warm) {
      StatusOr<Sample> s = decode.Finish(std::move(p));
      if (failed.ok() && !s.ok()) failed = s.status();
    }
    KVT_RETURN_IF_ERROR(failed.WithContext("pipelined warm-up"));
  }
  KVT_RETURN_IF_ERROR(
      link.Call({{"type", "stats"}, {"reset", true}}, std::chrono::seconds(30)).status());
  std::deque<DecodeSide::Pending> window;
  Latencies latencies;
  std::vector<Sample> samples;
  Status failed;
  const auto t0 = Clock::now();
  const int total = o.pipelined_requests;
  for (int started = 0, finished = 0; finished < total;) {
    while (failed.ok() && started < total && static_cast<int>(window.size()) < o.inflight) {
      StatusOr<DecodeSide::Pending> p =
          decode.Start(fmt::format("p{}", started), pages_per_request);
      if (!p.ok()) {
        failed = p.status();
        break;
      }
      window.push_back(std::move(p).value());
      ++started;
    }
    if (window.empty()) break;
    StatusOr<Sample> s = decode.Finish(std::move(window.front()));
    window.pop_front();
    ++finished;
    if (!s.ok()) {
      if (failed.ok()) failed = s.status();
      continue;  // drain the rest of the window before reporting
    }
    latencies.Add(*s);
    samples.push_back(std::move(s).value());
  }
  const double wall_ms = Ms(Clock::now() - t0);
  KVT_RETURN_IF_ERROR(
      failed.WithContext(fmt::format("pipelined requests ({} in flight)", o.inflight)));
  KVT_ASSIGN_OR_RETURN(json stats,
                       link.Call({{"type", "stats"}, {"reset", true}}, std::chrono::seconds(30)));
  json phases = PhaseBreakdown(samples, stats.at("timelines"), pt, phase_row);
  phase_row += fmt::format("  ({} in flight)", o.inflight);
  // Every request's stamps, µs from the first Receive: how the requests overlapped.
  json per_request = json::array();
  const int64_t origin = SteadyNs(t0);
  auto us = [origin](int64_t ns) { return ns == 0 ? json(nullptr) : json((ns - origin) / 1e3); };
  for (const Sample& s : samples) {
    json r = {{"room", s.room},
              {"receive", us(SteadyNs(s.posted))},
              {"request_sent", us(SteadyNs(s.request_sent))},
              {"done_seen", us(SteadyNs(s.finished))}};
    if (stats.at("timelines").contains(s.room)) {
      const std::vector<int64_t> t = stats.at("timelines").at(s.room);
      const char* names[] = {"prefill_request_seen", "prefill_source_ready", "prefill_first_post",
                             "prefill_last_post", "prefill_finished"};
      for (size_t k = 0; k < t.size() && k < 5; ++k) r[names[k]] = us(t[k]);
    }
    per_request.push_back(r);
  }
  return json{{"inflight", o.inflight},
              {"requests", total},
              {"wall_ms", wall_ms},
              {"gbps", GBps(request_bytes * total, wall_ms)},
              {"latency", latencies.ToJson(1.0, "ms")},
              {"phases", phases},
              {"per_request_us", per_request}};
}

// Where a whole request's time went, p50 over `samples` (decode side) joined with the prefill
// engine's timelines (`stats` reply): both processes stamp with steady_clock (CLOCK_MONOTONIC,
// one clock per host), so the cross-process phases are direct differences.
json PhaseBreakdown(const std::vector<Sample>& samples, const json& timelines, int pt,
                    std::string& row) {
  static constexpr const char* kNames[] = {"receive_us", "to_prefill_us", "source_us",
                                           "post_us",    "copy_us",       "done_us"};
  std::vector<double> phase[6], total;
  for (const Sample& s : samples) {
    if (!timelines.contains(s.room)) continue;
    const std::vector<int64_t> t = timelines.at(s.room);
    if (t.size() != 5 || std::find(t.begin(), t.end(), 0) != t.end()) continue;
    const int64_t stamps[7] = {
        SteadyNs(s.posted), SteadyNs(s.request_sent), t[0], t[1], t[3], t[4], SteadyNs(s.finished)};
    for (int k = 0; k < 6; ++k)
      phase[k].push_back(static_cast<double>(stamps[k + 1] - stamps[k]) / 1e3);
    total.push_back(static_cast<double>(stamps[6] - stamps[0]) / 1e3);
  }
  json out = {{"requests", total.size()},
              {"total_us_p50", Percentile(total, 0.5)},
              {"meaning",
               "receive: decode Receive -> TransferRequest handed to the connection; to_prefill: "
               "-> the prefill engine saw it; source: -> Send and LayersReady to the last layer "
               "were in (the application's callback); post: -> the backend accepted the last "
               "write; copy: -> every write visible (the copy and its completion detection); "
               "done: -> the decode engine processed TransferDone"}};
  row = fmt::format("{:>6} {:>8}", pt, total.size());
  for (int k = 0; k < 6; ++k) {
    out[std::string(kNames[k]) + "_p50"] = Percentile(phase[k], 0.5);
    out[std::string(kNames[k]) + "_p99"] = Percentile(phase[k], 0.99);
    row += fmt::format(" {:>10}", Cell(Percentile(phase[k], 0.5), 1));
  }
  row += fmt::format(" {:>10}", Cell(Percentile(total, 0.5), 1));
  return out;
}

const char* kPhaseHeader =
    "where a whole request's time goes, p50 microseconds (decode Receive -> ... -> decode done)";

std::string PhaseColumns() {
  return fmt::format("{:>6} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}", "tokens",
                     "requests", "receive", "to-prefill", "source", "post", "copy", "done",
                     "total");
}

// One-page requests: their latencies, the prefill peer's stats over them, and where their time
// went (PhaseBreakdown, its table row marked "(one page)").
struct OnePage {
  Latencies latencies;
  json prefill_stats;
  json phases;
  std::string phase_row;
};

// o.latency_requests one-page requests (a few untimed first) of `pt` tokens per page.
StatusOr<OnePage> RunOnePageRequests(const TransferOptions& o, PeerLink& link, DecodeSide& decode,
                                     int pt) {
  for (int i = 0; i < std::min(o.latency_requests, 20); ++i) {
    KVT_RETURN_IF_ERROR(decode.Request(fmt::format("x{}", i), 1).status());
  }
  KVT_RETURN_IF_ERROR(
      link.Call({{"type", "stats"}, {"reset", true}}, std::chrono::seconds(30)).status());
  OnePage out;
  std::vector<Sample> samples;
  for (int i = 0; i < o.latency_requests; ++i) {
    KVT_ASSIGN_OR_RETURN(Sample s, decode.Request(fmt::format("l{}", i), 1));
    out.latencies.Add(s);
    samples.push_back(std::move(s));
  }
  KVT_ASSIGN_OR_RETURN(out.prefill_stats,
                       link.Call({{"type", "stats"}, {"reset", true}}, std::chrono::seconds(30)));
  out.phases = PhaseBreakdown(samples, out.prefill_stats.at("timelines"), pt, out.phase_row);
  out.phase_row += "  (one page)";
  return out;
}

// A whole and a one-page request whose bytes the decode side checks; out["verified_mismatches"].
Status VerifyRequests(DecodeSide& decode, int pt, int64_t pages_per_request, json& out) {
  KVT_RETURN_IF_ERROR(decode
                          .Request("v" + std::to_string(1000 + pt), pages_per_request,
                                   static_cast<uint64_t>(1000 + pt))
                          .status());
  KVT_RETURN_IF_ERROR(
      decode.Request("v" + std::to_string(2000 + pt), 1, static_cast<uint64_t>(2000 + pt))
          .status());
  out["verified_mismatches"] = decode.verified_mismatches();
  return OkStatus();
}

// Whether --ucx-tls names tcp and nothing else but self: UCX then reaches the other process over
// TCP only, and the plain-socket ceiling is measured.
bool TcpOnly(const TransferOptions& o) {
  if (o.backend != "ucx") return false;
  bool tcp = false;
  size_t begin = 0;
  while (begin <= o.ucx_tls.size()) {
    const size_t end = std::min(o.ucx_tls.find(',', begin), o.ucx_tls.size());
    const std::string name = o.ucx_tls.substr(begin, end - begin);
    if (name == "tcp") {
      tcp = true;
    } else if (name != "self") {
      return false;
    }
    begin = end + 1;
  }
  return tcp;
}

// The plain-socket ceiling (socket_ceiling.h): the child sends o.warmup + o.iters requests of
// `bytes` to this process over one loopback TCP connection; the timed ones' milliseconds.
StatusOr<std::vector<double>> MeasureSocketCeiling(const TransferOptions& o, PeerLink& link,
                                                   int64_t bytes) {
  const int requests = o.warmup + o.iters;
  const std::chrono::milliseconds timeout = std::chrono::seconds(o.timeout_s);
  KVT_ASSIGN_OR_RETURN(std::unique_ptr<SocketCeilingReceiver> receiver,
                       SocketCeilingReceiver::Listen());
  KVT_RETURN_IF_ERROR(SendMessage(
      link.fd(),
      {{"type", "socket"}, {"port", receiver->port()}, {"bytes", bytes}, {"iters", requests}}));
  const Status received = receiver->Receive(bytes, requests, timeout);
  // The child's reply comes either way (its own steps are bounded by the same timeout), and
  // names its failure when it had one: a refused connect explains a receiver that timed out.
  StatusOr<json> reply = link.Reply(timeout + std::chrono::seconds(10));
  if (!reply.ok()) return reply.status().WithContext("socket ceiling, sending end (prefill child)");
  KVT_RETURN_IF_ERROR(received.WithContext("socket ceiling, receiving end (decode parent)"));
  std::vector<double> ms = reply->at("ms");
  ms.erase(ms.begin(), ms.begin() + o.warmup);
  return ms;
}

// One page-token size, start to end. Fills `out` and the two table rows.
Status RunPageSize(const TransferOptions& o, int pt, int64_t per_token_bytes, json& out,
                   std::string& bw_row, std::string& lat_row, std::string& phase_row) {
  const int64_t pages_per_request = (o.tokens + pt - 1) / pt;
  const int64_t request_tokens = pages_per_request * pt;
  const int64_t request_bytes = request_tokens * per_token_bytes;
  KVT_ASSIGN_OR_RETURN(int64_t pool_bytes, ParseBytes(o.pool_bytes));
  int64_t pool_tokens = pool_bytes / per_token_bytes / pt * pt;
  // Room for two requests at least, so random pages have somewhere to come from, and for the
  // pipelined requests in flight.
  pool_tokens = std::max(pool_tokens, std::max(2, o.inflight + 1) * request_tokens + pt);

  SideConfig c = BaseSideConfig(o, pt, pool_tokens, request_bytes);
  const auto reply_timeout = std::chrono::seconds(o.timeout_s * (o.iters + o.warmup + 2) + 60);

  out = json{{"page_tokens", pt},
             {"pages_per_request", pages_per_request},
             {"request_tokens", request_tokens},
             {"request_bytes", request_bytes},
             {"pool_tokens_per_side", pool_tokens},
             {"pool_bytes_per_side", pool_tokens * per_token_bytes}};

  KVT_ASSIGN_OR_RETURN(std::unique_ptr<PeerLink> link, PeerLink::Start(o.backend == "loopback"));
  KVT_RETURN_IF_ERROR(SendMessage(link->fd(), c.ToJson()));
  KVT_ASSIGN_OR_RETURN(json ready, link->Reply(std::chrono::seconds(120)));
  KVT_ASSIGN_OR_RETURN(std::unique_ptr<DecodeSide> decode,
                       DecodeSide::Create(c, ready.at("port").get<uint16_t>(), ready.at("raw")));
  KVT_RETURN_IF_ERROR(
      link->Call({{"type", "connect"}, {"raw", DescriptorToJson(decode->raw().descriptor)}},
                 std::chrono::seconds(60))
          .status());

  // (a) one-thread memcpy of the same bytes, contiguous, in this process.
  std::vector<double> memcpy_ms;
  {
    KVT_ASSIGN_OR_RETURN(HostSlab src, AllocTouched(request_bytes, 0x11));
    KVT_ASSIGN_OR_RETURN(HostSlab dst, AllocTouched(request_bytes, 0x22));
    for (int i = 0; i < o.warmup + o.iters; ++i) {
      const auto t0 = Clock::now();
      std::memcpy(dst.get(), src.get(), static_cast<size_t>(request_bytes));
      if (i >= o.warmup) memcpy_ms.push_back(Ms(Clock::now() - t0));
    }
  }
  // (b) one contiguous put of the same bytes, child -> parent, post -> flush complete.
  KVT_ASSIGN_OR_RETURN(
      json put,
      link->Call({{"type", "put"}, {"bytes", request_bytes}, {"iters", o.warmup + o.iters}},
                 reply_timeout));
  std::vector<double> put_ms = put.at("ms");
  put_ms.erase(put_ms.begin(), put_ms.begin() + o.warmup);
  // (d) UCX over TCP only: the plain-socket ceiling of the same bytes, child -> parent.
  std::vector<double> socket_ms;
  if (TcpOnly(o)) {
    KVT_ASSIGN_OR_RETURN(socket_ms, MeasureSocketCeiling(o, *link, request_bytes));
  }
  // (c) the raw backend posting the runs of a request of this size (random pages both sides).
  KVT_ASSIGN_OR_RETURN(json runs, link->Call({{"type", "runs"},
                                              {"dst_pages", decode->SomePages(pages_per_request)},
                                              {"iters", o.warmup + o.iters}},
                                             reply_timeout));
  std::vector<double> runs_ms = runs.at("ms");
  runs_ms.erase(runs_ms.begin(), runs_ms.begin() + o.warmup);

  // kvt: whole requests.
  KVT_ASSIGN_OR_RETURN(WholeRequests whole, RunWholeRequests(o, *link, *decode, pages_per_request));
  const Latencies& big = whole.latencies;
  const double run_ms = whole.wall_ms;
  const json& before = whole.before;
  const json& after = whole.after;
  const double runs_per_request = static_cast<double>(after.at("runs_posted").get<uint64_t>() -
                                                      before.at("runs_posted").get<uint64_t>()) /
                                  o.iters;
  const json big_post = after;
  out["phases"] = PhaseBreakdown(whole.samples, after.at("timelines"), pt, phase_row);
  std::string pipe_phase_row;
  KVT_ASSIGN_OR_RETURN(json pipelined,
                       RunPipelined(o, *link, *decode, pages_per_request,
                                    static_cast<double>(request_bytes), pt, pipe_phase_row));
  if (!pipe_phase_row.empty()) phase_row += "\n" + pipe_phase_row;

  // One-page requests.
  KVT_ASSIGN_OR_RETURN(OnePage one_page, RunOnePageRequests(o, *link, *decode, pt));
  const Latencies& small = one_page.latencies;
  const json& small_post = one_page.prefill_stats;
  phase_row += "\n" + one_page.phase_row;

  if (o.verify) KVT_RETURN_IF_ERROR(VerifyRequests(*decode, pt, pages_per_request, out));
  if (after.at("callback_errors").get<uint64_t>() != 0) {
    return Internal("prefill peer callback failed: " +
                    after.at("first_callback_error").get<std::string>());
  }

  const double bytes = static_cast<double>(request_bytes);
  const double kvt_p50 = Percentile(big.engine_ms, 0.5);
  const double kvt_gbps = GBps(bytes, kvt_p50);
  const double aggregate_gbps = GBps(bytes * o.iters, run_ms);
  const double memcpy_gbps = GBps(bytes, Median(memcpy_ms));
  const double put_gbps = GBps(bytes, Median(put_ms));
  const double raw_runs_gbps = GBps(bytes, Median(runs_ms));
  const double ratio = put_gbps > 0 ? kvt_gbps / put_gbps : NAN;
  const double one_page_bytes = static_cast<double>(pt * per_token_bytes);

  out["kvt"] = json{{"gbps_p50_request", kvt_gbps},
                    {"gbps_aggregate", aggregate_gbps},
                    {"latency", big.ToJson(1.0, "ms")},
                    {"runs_per_request", runs_per_request},
                    {"prefill_post_ms_p50", big_post.at("post_ms_p50")},
                    {"prefill_post_ms_p99", big_post.at("post_ms_p99")}};
  out["ceiling_memcpy"] = json{{"gbps", memcpy_gbps}, {"ms_median", Median(memcpy_ms)}};
  out["ceiling_contiguous_put"] = json{{"gbps", put_gbps}, {"ms_median", Median(put_ms)}};
  out["raw_backend_same_runs"] =
      json{{"gbps", raw_runs_gbps}, {"ms_median", Median(runs_ms)}, {"runs", runs.at("runs")}};
  out["ratio_kvt_to_contiguous_put"] = ratio;
  const double pipe_gbps = pipelined.is_null() ? NAN : pipelined.at("gbps").get<double>();
  const double socket_gbps = socket_ms.empty() ? NAN : GBps(bytes, Median(socket_ms));
  if (!socket_ms.empty()) {
    out["ceiling_socket"] = json{{"gbps", socket_gbps},
                                 {"ms_median", Median(socket_ms)},
                                 {"write_bytes", kSocketWriteBytes}};
    out["ratio_kvt_to_socket"] = SafeRatio(kvt_gbps, socket_gbps);
  }
  if (!pipelined.is_null()) {
    pipelined["ratio_to_contiguous_put"] = SafeRatio(pipe_gbps, put_gbps);
    if (!socket_ms.empty()) pipelined["ratio_to_socket"] = SafeRatio(pipe_gbps, socket_gbps);
    out["kvt_pipelined"] = pipelined;
  }
  out["ratio_kvt_to_memcpy"] = memcpy_gbps > 0 ? kvt_gbps / memcpy_gbps : NAN;
  out["ratio_kvt_to_raw_same_runs"] = raw_runs_gbps > 0 ? kvt_gbps / raw_runs_gbps : NAN;
  out["one_page"] = small.ToJson(1000.0, "us");
  out["one_page"]["bytes"] = one_page_bytes;
  out["one_page"]["prefill_post_us_p50"] = small_post.at("post_ms_p50").get<double>() * 1000;
  out["one_page"]["phases"] = one_page.phases;

  bw_row = fmt::format(
      "{:>6} {:>8.0f} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>8} {:>8}", pt,
      runs_per_request, Cell(kvt_gbps), Cell(aggregate_gbps), Cell(kvt_p50, 1),
      Cell(Percentile(big.engine_ms, 0.99), 1), Cell(memcpy_gbps), Cell(put_gbps),
      Cell(raw_runs_gbps), Cell(ratio), Cell(big_post.at("post_ms_p50").get<double>(), 1),
      Cell(pipe_gbps), Cell(SafeRatio(pipe_gbps, put_gbps)));
  if (!socket_ms.empty()) {
    bw_row +=
        fmt::format(" {:>8} {:>8} {:>9}", Cell(socket_gbps), Cell(SafeRatio(kvt_gbps, socket_gbps)),
                    Cell(SafeRatio(pipe_gbps, socket_gbps)));
  }
  lat_row = fmt::format("{:>6} {:>9.0f} {:>8} {:>8} {:>9} {:>9} {:>9}", pt, one_page_bytes,
                        Cell(Percentile(small.engine_ms, 0.5) * 1000, 0),
                        Cell(Percentile(small.engine_ms, 0.99) * 1000, 0),
                        Cell(Percentile(small.caller_ms, 0.5) * 1000, 0),
                        Cell(Percentile(small.caller_ms, 0.99) * 1000, 0),
                        Cell(small_post.at("post_ms_p50").get<double>() * 1000, 0));
  if (o.verify && decode->verified_mismatches() != 0) {
    return DataLoss(
        fmt::format("{} bytes arrived wrong at page size {}", decode->verified_mismatches(), pt));
  }
  return OkStatus();
}

// The 1/5/15-minute load averages: the machine is shared, so every result says how busy it was.
std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return a + " " + b + " " + c;
}

void QuietLibraryLogs() {
  // The engines log every connection at info; keep the table readable unless asked otherwise.
  if (std::getenv("KVT_LOG_LEVEL") != nullptr) return;
  for (const char* tag : {"xfer", "ucx", "ctl", "pool", "kern"}) {
    Logger(tag)->set_level(spdlog::level::warn);
  }
}

// ---- CUDA pools -------------------------------------------------------------------------------

// GB/s of a ceiling figure from the child (NaN when it failed or is absent).
double FigureGbps(const json& ceilings, const char* key) {
  if (!ceilings.contains(key) || ceilings[key].contains("error")) return NAN;
  return ceilings[key].value("gbps", NAN);
}

std::string RatioX(double r) { return std::isfinite(r) ? fmt::format("{:.0f}x", r) : "-"; }

// One target: `value` against `threshold` (at least, or at most when `at_most`).
json Target(const std::string& name, int page_tokens, double value, double threshold,
            bool at_most = false) {
  const bool pass = std::isfinite(value) && (at_most ? value <= threshold : value >= threshold);
  return {{"name", name},
          {"page_tokens", page_tokens},
          {"value", std::isfinite(value) ? json(value) : json(nullptr)},
          {"threshold", threshold},
          {"at_most", at_most},
          {"pass", pass}};
}

struct GpuRows {
  std::string bw, lat, layerwise, phase;
  std::vector<std::string> targets;
};

// The simulated-forward requests: per request, the last layer's event completion (prefill host
// clock) against the decode engine's done; layer time = median interval between consecutive
// layers' completions that the child's poller saw live (pending at least once before it
// completed; the poller starts once the whole forward is enqueued).
StatusOr<json> RunLayerwise(const TransferOptions& o, const SideConfig& c, PeerLink& link,
                            DecodeSide& decode, int64_t pages_per_request, std::string& row) {
  const int pt = c.page_tokens;
  const uint64_t base_id = 100000 + static_cast<uint64_t>(pt) * 1000;
  // One untimed forward first (first launches of the spin and fill kernels).
  KVT_RETURN_IF_ERROR(decode.Request(fmt::format("f{}", base_id), pages_per_request).status());
  std::map<std::string, Sample> samples;
  for (int i = 0; i < o.layerwise_requests; ++i) {
    const uint64_t id = base_id + 1 + static_cast<uint64_t>(i);
    const std::string room = fmt::format("f{}", id);
    StatusOr<Sample> s = decode.Request(room, pages_per_request, o.verify ? id : 0);
    if (!s.ok()) {
      // The child's record says why when its forward failed.
      StatusOr<json> fs =
          link.Call({{"type", "forward_stats"}, {"reset", false}}, std::chrono::seconds(30));
      if (fs.ok()) {
        for (const json& r : fs->value("records", json::array())) {
          if (r.value("room", "") == room && r.contains("error")) {
            return s.status().WithContext("forward: " + r["error"].get<std::string>());
          }
        }
      }
      return s.status();
    }
    samples[room] = *s;
  }
  // The child's poller pushes a record once it stamped the last layer, which may trail the
  // decode side's done by a little: wait until every timed room has one.
  std::map<std::string, json> records;
  const auto give_up = Clock::now() + std::chrono::seconds(10);
  while (true) {
    KVT_ASSIGN_OR_RETURN(
        json fs, link.Call({{"type", "forward_stats"}, {"reset", true}}, std::chrono::seconds(30)));
    for (const json& r : fs.at("records")) {
      const std::string room = r.at("room");
      if (r.contains("error")) {
        return Internal("simulated forward of room '" + room +
                        "': " + r["error"].get<std::string>());
      }
      if (samples.count(room)) records[room] = r;
    }
    if (records.size() == samples.size()) break;
    if (Clock::now() > give_up) {
      return DeadlineExceeded(
          fmt::format("{} of {} forward records arrived", records.size(), samples.size()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  // The prefill engine's timeline splits the tail: last layer written -> the prefill engine saw
  // every write complete and sent TransferDone (the last layer's copy and its detection), then
  // -> the decode engine processed it (the control message).
  KVT_ASSIGN_OR_RETURN(json stats,
                       link.Call({{"type", "stats"}, {"reset", false}}, std::chrono::seconds(30)));
  const json& timelines = stats.at("timelines");
  std::vector<double> intervals_us, tail_us, forward_ms, lag_us, enqueue_ms;
  std::vector<double> tail_prefill_us, tail_message_us;
  auto pct = [](const std::vector<double>& v, double p) {
    return v.empty() ? NAN : Percentile(v, p);
  };
  int last_live = 0;  // requests whose last layer the poller saw complete live
  json per_request = json::array();
  for (const auto& [room, r] : records) {
    const std::vector<int64_t> done = r.at("layer_done_ns");
    const std::vector<bool> live = r.at("layer_live");
    const int64_t enqueued = r.at("enqueued_ns"), start = r.at("start_ns");
    if (done.size() != static_cast<size_t>(c.layers) || live.size() != done.size()) {
      return DataLoss("short forward record");
    }
    std::vector<double> mine;  // intervals whose first layer the poller saw complete live
    for (size_t l = 1; l < done.size(); ++l) {
      if (live[l - 1] && live[l]) {
        mine.push_back(static_cast<double>(done[l] - done[l - 1]) / 1e3);
      }
    }
    if (live.back()) ++last_live;
    intervals_us.insert(intervals_us.end(), mine.begin(), mine.end());
    const Sample& s = samples.at(room);
    const double tail = static_cast<double>(SteadyNs(s.finished) - done.back()) / 1e3;
    tail_us.push_back(tail);
    forward_ms.push_back(static_cast<double>(done.back() - start) / 1e6);
    lag_us.push_back(static_cast<double>(start - SteadyNs(s.posted)) / 1e3);
    enqueue_ms.push_back(static_cast<double>(enqueued - start) / 1e6);
    json prefill_part = nullptr, message_part = nullptr;  // null: no prefill timeline
    if (timelines.contains(room)) {
      const std::vector<int64_t> t = timelines.at(room);
      if (t.size() == 5 && t[4] != 0) {
        tail_prefill_us.push_back(static_cast<double>(t[4] - done.back()) / 1e3);
        tail_message_us.push_back(static_cast<double>(SteadyNs(s.finished) - t[4]) / 1e3);
        prefill_part = tail_prefill_us.back();
        message_part = tail_message_us.back();
      }
    }
    per_request.push_back({{"room", room},
                           {"tail_us", tail},
                           {"tail_prefill_us", prefill_part},
                           {"tail_done_message_us", message_part},
                           {"last_layer_seen_live", live.back()},
                           {"layer_us_median", mine.empty() ? json(nullptr) : json(Median(mine))},
                           {"forward_ms", forward_ms.back()},
                           {"enqueue_ms", enqueue_ms.back()},
                           {"receive_to_forward_start_us", lag_us.back()},
                           {"request_ms", s.engine_ms}});
  }
  // The layer time the target is read against: measured when the poller saw layers complete
  // live; the set spin time otherwise (the forward completed before the poller got to it, i.e.
  // enqueueing, not the GPU, paced it: see enqueue_ms). A tail whose last layer was not seen
  // live is measured from a late stamp, so it is too short: last_layer_seen_live says so.
  const double layer_us_measured = intervals_us.empty() ? NAN : Median(intervals_us);
  const double layer_us_set = static_cast<double>(c.layer_time_ns) / 1e3;
  const bool measured = std::isfinite(layer_us_measured);
  const double layer_us = measured ? layer_us_measured : layer_us_set;
  const double tail_p50 = Percentile(tail_us, 0.5), tail_max = Percentile(tail_us, 1.0);
  json out = {{"requests", samples.size()},
              {"layer_time_us_set", layer_us_set},
              {"layer_time_us_measured", measured ? json(layer_us_measured) : json(nullptr)},
              {"layer_time_source", measured ? "measured" : "set"},
              {"layer_intervals_counted", intervals_us.size()},
              {"requests_last_layer_seen_live", last_live},
              {"tail_us_p50", tail_p50},
              {"tail_us_p99", Percentile(tail_us, 0.99)},
              {"tail_us_max", tail_max},
              {"tail_prefill_us_p50", pct(tail_prefill_us, 0.5)},
              {"tail_prefill_us_max", pct(tail_prefill_us, 1.0)},
              {"tail_done_message_us_p50", pct(tail_message_us, 0.5)},
              {"tail_done_message_us_max", pct(tail_message_us, 1.0)},
              {"tail_to_layer_time_p50", SafeRatio(tail_p50, layer_us)},
              {"tail_to_layer_time_max", SafeRatio(tail_max, layer_us)},
              {"forward_ms_p50", Percentile(forward_ms, 0.5)},
              {"enqueue_ms_p50", Percentile(enqueue_ms, 0.5)},
              {"receive_to_forward_start_us_p50", Percentile(lag_us, 0.5)},
              {"per_request", per_request}};
  row = fmt::format(
      "{:>6} {:>8.0f} {:>9}{} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} {:>9} {:>7}/{:<7} {:>7}/{:<7}",
      pt, layer_us_set, Cell(layer_us_measured, 1), measured ? " " : "*", Cell(tail_p50, 1),
      Cell(tail_max, 1), Cell(SafeRatio(tail_p50, layer_us)), Cell(SafeRatio(tail_max, layer_us)),
      Cell(Percentile(forward_ms, 0.5), 2), Cell(Percentile(enqueue_ms, 0.5), 2),
      Cell(Percentile(lag_us, 0.5), 0), Cell(pct(tail_prefill_us, 0.5), 0),
      Cell(pct(tail_prefill_us, 1.0), 0), Cell(pct(tail_message_us, 0.5), 0),
      Cell(pct(tail_message_us, 1.0), 0));
  return out;
}

Status RunGpuPageSizeBody(const TransferOptions& o, const SideConfig& c, int64_t pages_per_request,
                          int64_t request_bytes, std::unique_ptr<PeerLink>& link,
                          std::unique_ptr<DecodeSide>& decode, json& out, GpuRows& rows) {
  const int pt = c.page_tokens;
  const bool ipc = c.backend == "cuda_ipc";
  const auto reply_timeout = std::chrono::seconds(o.timeout_s * (o.iters + o.warmup + 2) + 120);

  KVT_ASSIGN_OR_RETURN(link, PeerLink::Start(o.same_process));
  KVT_RETURN_IF_ERROR(SendMessage(link->fd(), c.ToJson()));
  KVT_ASSIGN_OR_RETURN(json ready, link->Reply(std::chrono::seconds(180)));
  KVT_ASSIGN_OR_RETURN(decode, DecodeSide::Create(c, ready.at("port").get<uint16_t>(), json()));
  if (ipc) {
    KVT_ASSIGN_OR_RETURN(json handles, decode->ExportIpc());
    out["ipc_allocations"] = handles.at("allocs").size();
    handles["type"] = "ipc";
    // Without the mappings only the peers' figures are lost: say so and measure the rest.
    if (Status opened = link->Call(handles, std::chrono::seconds(60)).status(); !opened.ok()) {
      out["ipc_error"] = opened.ToString();
      fmt::print("page_tokens {}: no per-page / batch peers: {}\n", pt, opened.ToString());
    }
  }

  // Ceilings and the peers' ways, in the child on the same device (before any request).
  KVT_ASSIGN_OR_RETURN(json ceilings,
                       link->Call({{"type", "gpu_ceilings"},
                                   {"dst_pages", decode->SomePages(pages_per_request)},
                                   {"iters", o.iters},
                                   {"warmup", o.warmup},
                                   {"peer_items", o.peer_items}},
                                  reply_timeout));
  out["ceilings"] = ceilings;

  // kvt: whole requests.
  KVT_ASSIGN_OR_RETURN(WholeRequests whole, RunWholeRequests(o, *link, *decode, pages_per_request));
  const Latencies& big = whole.latencies;
  const double run_ms = whole.wall_ms;
  const json& before = whole.before;
  const json& after = whole.after;
  auto per_request = [&](const char* key) {
    return static_cast<double>(after.at(key).get<uint64_t>() - before.at(key).get<uint64_t>()) /
           o.iters;
  };
  const double writes_per_request = per_request("writes_posted");
  const double runs_per_request = per_request("runs_posted");
  out["phases"] = PhaseBreakdown(whole.samples, after.at("timelines"), pt, rows.phase);
  std::string pipe_phase_row;
  KVT_ASSIGN_OR_RETURN(json pipelined,
                       RunPipelined(o, *link, *decode, pages_per_request,
                                    static_cast<double>(request_bytes), pt, pipe_phase_row));
  if (!pipe_phase_row.empty()) rows.phase += "\n" + pipe_phase_row;
  const double pipe_gbps = pipelined.is_null() ? NAN : pipelined.at("gbps").get<double>();

  // One-page requests: the fixed cost (control plane, posting, completion) of a request.
  KVT_ASSIGN_OR_RETURN(OnePage one_page, RunOnePageRequests(o, *link, *decode, pt));
  const Latencies& small = one_page.latencies;
  const json& small_post = one_page.prefill_stats;
  rows.phase += "\n" + one_page.phase_row;

  // Layerwise: a simulated forward per request.
  double tail_ratio_max = NAN;
  if (o.layerwise_requests > 0) {
    KVT_ASSIGN_OR_RETURN(json lw,
                         RunLayerwise(o, c, *link, *decode, pages_per_request, rows.layerwise));
    tail_ratio_max = lw.value("tail_to_layer_time_max", NAN);
    out["layerwise"] = lw;
  }

  if (o.verify) KVT_RETURN_IF_ERROR(VerifyRequests(*decode, pt, pages_per_request, out));
  KVT_ASSIGN_OR_RETURN(json last,
                       link->Call({{"type", "stats"}, {"reset", true}}, std::chrono::seconds(30)));
  for (const json* s : std::initializer_list<const json*>{&after, &small_post, &last}) {
    if (s->at("callback_errors").get<uint64_t>() != 0) {
      return Internal("prefill peer callback failed: " +
                      s->at("first_callback_error").get<std::string>());
    }
  }

  const double bytes = static_cast<double>(request_bytes);
  const double kvt_p50 = Percentile(big.engine_ms, 0.5);
  const double kvt_gbps = GBps(bytes, kvt_p50);
  const double aggregate_gbps = GBps(bytes * o.iters, run_ms);
  const double contiguous = FigureGbps(ceilings, "contiguous_d2d");
  const double post_ms = after.at("post_ms_p50").get<double>();
  out["kvt"] = json{{"gbps_p50_request", kvt_gbps},
                    {"gbps_aggregate", aggregate_gbps},
                    {"latency", big.ToJson(1.0, "ms")},
                    {"writes_per_request", writes_per_request},
                    {"runs_per_request", runs_per_request},
                    {"prefill_post_ms_p50", post_ms},
                    {"prefill_post_ms_p99", after.at("post_ms_p99")}};
  out["one_page"] = small.ToJson(1000.0, "us");
  out["one_page"]["bytes"] = static_cast<double>(request_bytes / pages_per_request);
  out["one_page"]["prefill_post_us_p50"] = small_post.at("post_ms_p50").get<double>() * 1000;
  out["one_page"]["phases"] = one_page.phases;
  json ratios = {{"kvt_to_contiguous_d2d", SafeRatio(kvt_gbps, contiguous)}};
  if (!pipelined.is_null()) {
    pipelined["ratio_to_contiguous_d2d"] = SafeRatio(pipe_gbps, contiguous);
    out["kvt_pipelined"] = pipelined;
    ratios["kvt_pipelined_to_contiguous_d2d"] = SafeRatio(pipe_gbps, contiguous);
  }
  const std::string check =
      !o.verify ? "-" : (decode->verified_mismatches() == 0 ? "ok" : "MISMATCH");
  if (ipc) {
    const double per_page = FigureGbps(ceilings, "memcpy_async_per_page");
    const double batch = FigureGbps(ceilings, "memcpy_batch_async");
    ratios["kvt_to_memcpy_async_per_page"] = SafeRatio(kvt_gbps, per_page);
    ratios["kvt_to_memcpy_batch_async"] = SafeRatio(kvt_gbps, batch);
    rows.bw = fmt::format(
        "{:>6} {:>7.0f} {:>9} {:>8} {:>8} {:>8} {:>9} {:>8} {:>9} {:>8} {:>8} {:>8} {:>8} {:>6} "
        "{:>8} {:>8}",
        pt, writes_per_request, Cell(kvt_gbps, 1), Cell(aggregate_gbps, 1), Cell(kvt_p50, 3),
        Cell(Percentile(big.engine_ms, 0.99), 3), Cell(contiguous, 1),
        Cell(SafeRatio(kvt_gbps, contiguous), 3), Cell(per_page, 2),
        RatioX(SafeRatio(kvt_gbps, per_page)), Cell(batch, 2), RatioX(SafeRatio(kvt_gbps, batch)),
        Cell(post_ms, 3), check, Cell(pipe_gbps, 1), Cell(SafeRatio(pipe_gbps, contiguous), 3));
    // The targets set for cuda_ipc on one GPU (docs/performance.md).
    const std::map<int, double> contiguous_target = {{1, 0.80}, {16, 0.90}, {64, 0.90}};
    json targets = json::array();
    if (auto it = contiguous_target.find(pt); it != contiguous_target.end()) {
      targets.push_back(Target("kvt / contiguous D2D, one request at a time (p50)", pt,
                               SafeRatio(kvt_gbps, contiguous), it->second));
      if (!pipelined.is_null()) {
        targets.push_back(Target(
            fmt::format("kvt / contiguous D2D, {} requests in flight (aggregate)", o.inflight), pt,
            SafeRatio(pipe_gbps, contiguous), it->second));
      }
    }
    if (pt == 16) {
      targets.push_back(
          Target("kvt / cudaMemcpyAsync per page", pt, SafeRatio(kvt_gbps, per_page), 100.0));
    }
    if (o.layerwise_requests > 0) {
      targets.push_back(Target("layerwise: (done - last layer written) / layer time, worst request",
                               pt, tail_ratio_max, 1.0, /*at_most=*/true));
    }
    for (const json& t : targets) {
      rows.targets.push_back(fmt::format(
          "  page tokens {:>3}: {:<66} {:>9} {} {:<5} {}", pt, t["name"].get<std::string>(),
          t["value"].is_null() ? std::string("-") : fmt::format("{:.3f}", t["value"].get<double>()),
          t["at_most"].get<bool>() ? "<=" : ">=", t["threshold"].get<double>(),
          t["pass"].get<bool>() ? "PASS" : "MISS"));
    }
    out["targets"] = targets;
  } else {
    const double d2h = FigureGbps(ceilings, "contiguous_d2h");
    const double h2d = FigureGbps(ceilings, "contiguous_h2d");
    ratios["kvt_to_contiguous_d2h"] = SafeRatio(kvt_gbps, d2h);
    ratios["kvt_to_contiguous_h2d"] = SafeRatio(kvt_gbps, h2d);
    rows.bw = fmt::format(
        "{:>6} {:>7.0f} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>8} {:>8} {:>6} {:>8} "
        "{:>8}",
        pt, writes_per_request, Cell(kvt_gbps, 2), Cell(aggregate_gbps, 2), Cell(kvt_p50, 2),
        Cell(Percentile(big.engine_ms, 0.99), 2), Cell(d2h, 1), Cell(SafeRatio(kvt_gbps, d2h), 3),
        Cell(h2d, 1), Cell(contiguous, 1), Cell(SafeRatio(kvt_gbps, contiguous), 4),
        Cell(post_ms, 2), check, Cell(pipe_gbps, 2), Cell(SafeRatio(pipe_gbps, d2h), 3));
    out["targets"] = json::array();  // none are set for the staged path here
  }
  out["ratios"] = ratios;
  rows.lat = fmt::format("{:>6} {:>9.0f} {:>8} {:>8} {:>9} {:>9} {:>9}", pt,
                         out["one_page"]["bytes"].get<double>(),
                         Cell(Percentile(small.engine_ms, 0.5) * 1000, 0),
                         Cell(Percentile(small.engine_ms, 0.99) * 1000, 0),
                         Cell(Percentile(small.caller_ms, 0.5) * 1000, 0),
                         Cell(Percentile(small.caller_ms, 0.99) * 1000, 0),
                         Cell(small_post.at("post_ms_p50").get<double>() * 1000, 0));
  if (o.verify && decode->verified_mismatches() != 0) {
    return DataLoss(fmt::format("{} bytes arrived wrong at page size {}; {}",
                                decode->verified_mismatches(), pt, decode->first_mismatch()));
  }
  return OkStatus();
}

// One page-token size on CUDA pools. Tears down in the order CUDA IPC needs on every path: the
// decode engine, then the child (its engine's and our IPC mappings of the decode pool), then the
// decode pool.
Status RunGpuPageSize(const TransferOptions& o, int pt, int device, int64_t per_token_bytes,
                      int64_t tokens, json& out, GpuRows& rows) {
  const int64_t pages_per_request = (tokens + pt - 1) / pt;
  const int64_t request_tokens = pages_per_request * pt;
  const int64_t request_bytes = request_tokens * per_token_bytes;
  // Random pages need room to come from, and the pipelined requests room to be in flight.
  int64_t pool_tokens = std::max(2, o.inflight + 1) * request_tokens + pt;
  if (!o.pool_bytes.empty()) {
    KVT_ASSIGN_OR_RETURN(int64_t pool_bytes, ParseBytes(o.pool_bytes));
    pool_tokens = std::max(pool_tokens, pool_bytes / per_token_bytes / pt * pt);
  }
  SideConfig c = BaseSideConfig(o, pt, pool_tokens, request_bytes);
  c.cuda = true;
  c.device = device;
  c.ucx_cuda_mode = o.ucx_cuda_mode;
  c.ucx_staging_slots = o.ucx_staging_slots;
  KVT_ASSIGN_OR_RETURN(c.ucx_staging_slot_bytes, ParseBytes(o.ucx_staging_slot_bytes));
  c.ucx_staging_in_place = o.ucx_staging_in_place;
  c.layer_time_ns = static_cast<int64_t>(std::llround(o.layer_time_us * 1000));
  c.spin_blocks = o.spin_blocks;
  c.device_spin_us = o.device_spin_us;

  out = json{{"page_tokens", pt},
             {"pages_per_request", pages_per_request},
             {"request_tokens", request_tokens},
             {"request_bytes", request_bytes},
             {"items_per_request", pages_per_request * 2 * o.layers},
             {"item_bytes", request_bytes / (pages_per_request * 2 * o.layers)},
             {"pool_tokens_per_side", pool_tokens},
             {"pool_bytes_per_side", pool_tokens * per_token_bytes}};
  std::unique_ptr<PeerLink> link;
  std::unique_ptr<DecodeSide> decode;
  Status s = RunGpuPageSizeBody(o, c, pages_per_request, request_bytes, link, decode, out, rows);
  if (decode) decode->ShutdownEngine();
  link.reset();
  decode.reset();
  return s;
}

// The configuration both modes (host and CUDA pools) record in their JSON.
json CommonConfig(const TransferOptions& o, DType dtype, int64_t row_bytes, int64_t per_token_bytes,
                  int64_t tokens) {
  const char* env_tls = std::getenv("UCX_TLS");
  return json{{"backend", o.backend},
              {"memory", o.memory},
              {"ucx_tls", o.ucx_tls.empty() ? "(UCX default)" : o.ucx_tls},
              {"env_UCX_TLS", env_tls ? env_tls : ""},
              {"layers", o.layers},
              {"heads", o.heads},
              {"head_dim", o.head_dim},
              {"dtype", std::string(DTypeName(dtype))},
              {"bytes_per_token_per_buffer", row_bytes},
              {"bytes_per_token", per_token_bytes},
              {"tokens", tokens},
              {"iters", o.iters},
              {"warmup", o.warmup},
              {"latency_requests", o.latency_requests},
              {"inflight", o.inflight},
              {"pipelined_requests", o.pipelined_requests},
              {"control_busy_poll_us", o.control_busy_poll_us},
              {"control_lanes", o.control_lanes},
              {"cuda_ipc_completion_word", o.cuda_ipc_completion_word},
              {"seed", o.seed}};
}

Status RunTransferGpu(const TransferOptions& o, int device) {
  KVT_ASSIGN_OR_RETURN(std::vector<int> page_tokens, ParseIntList(o.page_tokens));
  KVT_ASSIGN_OR_RETURN(DType dtype, ParseDType(o.dtype));
  if (o.ucx_cuda_mode != "auto" && o.ucx_cuda_mode != "staged" && o.ucx_cuda_mode != "direct") {
    return InvalidArgument("--ucx-cuda-mode is '" + o.ucx_cuda_mode +
                           "'; use auto, staged or direct");
  }
  if (o.ucx_staging_slots <= 0 || o.layer_time_us < 0 || o.layerwise_requests < 0 ||
      o.peer_items < 0) {
    return InvalidArgument(fmt::format(
        "--ucx-staging-slots ({}) must be > 0; --layer-time-us ({}), --layerwise-requests ({}) "
        "and --peer-items ({}) >= 0",
        o.ucx_staging_slots, o.layer_time_us, o.layerwise_requests, o.peer_items));
  }
  KVT_RETURN_IF_ERROR(ParseBytes(o.ucx_staging_slot_bytes).status());
  if (!o.pool_bytes.empty()) KVT_RETURN_IF_ERROR(ParseBytes(o.pool_bytes).status());
  const cuda::DeviceCountResult devices = cuda::DeviceCount();
  if (devices.count == 0) {
    return FailedPrecondition(
        fmt::format("--backend {} on cuda:{} needs a CUDA device, but this machine has none ({}); "
                    "run it on a GPU machine, or measure the host path with --backend ucx "
                    "(no --device)",
                    o.backend, device, devices.reason));
  }
  if (device >= devices.count) {
    return InvalidArgument(
        fmt::format("--device cuda:{} does not exist; this process sees {} CUDA "
                    "device(s)",
                    device, devices.count));
  }
  BENCH_CUDA(cudaSetDevice(device));
  QuietLibraryLogs();
  const int64_t row_bytes = static_cast<int64_t>(o.heads) * o.head_dim * ItemSize(dtype);
  const int64_t per_token_bytes = row_bytes * 2 * o.layers;
  const int64_t tokens =
      o.tokens > 0 ? o.tokens : (kGpuRequestBytes + per_token_bytes - 1) / per_token_bytes;
  const bool ipc = o.backend == "cuda_ipc";

  json doc;
  doc["tool"] = "kvt-bench transfer";
  doc["mode"] = ipc ? "cuda_ipc" : "ucx_staged";
  doc["memory"] = o.memory;
  doc["date_utc"] = NowUtc();
  doc["command"] = CommandLine();
  doc["machine"] = DescribeMachine(true);
  doc["machine"]["device"] = device;
  doc["loadavg_start"] = LoadAverage();
  doc["config"] = CommonConfig(o, dtype, row_bytes, per_token_bytes, tokens);
  doc["config"].update(
      json{{"device", fmt::format("cuda:{}", device)},
           {"ucx_cuda_mode", o.ucx_cuda_mode},
           {"ucx_staging_slots", o.ucx_staging_slots},
           {"ucx_staging_slot_bytes", o.ucx_staging_slot_bytes},
           {"ucx_staging_in_place", o.ucx_staging_in_place},
           {"peer_items", o.peer_items},
           {"layer_time_us", o.layer_time_us},
           {"layerwise_requests", o.layerwise_requests},
           {"spin_blocks", o.spin_blocks},
           {"device_spin_us", o.device_spin_us},
           {"same_process", o.same_process},
           {"pool_per_side", o.pool_bytes.empty() ? "2 requests + 1 page" : o.pool_bytes},
           {"verify", o.verify}});
  doc["notes"] =
      "Both processes on one GPU, pools in device memory, random pages on both sides. Latency: "
      "decode side, before Receive -> the decode engine saw TransferDone (RequestInfo::finished); "
      "kvt GB/s = request bytes / p50 latency; aggregate = all timed requests' bytes / wall time "
      "of the sequential loop. Ceilings, timed with CUDA events in the prefill process on the "
      "same device, median: contiguous_d2d = one cudaMemcpyAsync of the request's bytes between "
      "two buffers of its own; memcpy_async_per_page / memcpy_batch_async = one cudaMemcpyAsync "
      "per (buffer, page) / one cudaMemcpyBatchAsync, from random pages of the prefill pool into "
      "random pages of the decode pool through CUDA IPC mappings of it, on items_timed of "
      "items_per_request items (an evenly spread subset), GB/s = bytes of those items / time; "
      "contiguous_per_buffer_into_ipc = one cudaMemcpyAsync per buffer of the same bytes into the "
      "mapped decode pool (diagnostic); contiguous_d2h / _h2d = one cudaMemcpyAsync with pinned "
      "host memory (staged UCX's PCIe ceiling). Layerwise: per request the prefill child enqueues "
      "per layer a spin kernel (layer_time_us_set) + the layer's pattern fill + an event + "
      "LayersReady(l + 1, event); a child thread spins on cudaEventQuery of each layer's event and "
      "stamps completion with steady_clock (CLOCK_MONOTONIC, shared by both processes); tail = "
      "decode RequestInfo::finished - last layer's stamp; layer_time_us_measured = median interval "
      "between consecutive layers' stamps where the poller saw both layers pending before they "
      "completed (it starts once the whole forward is enqueued). GB/s = 1e9 bytes/s.";
  fmt::print(
      "kvt-bench transfer ({}), backend {}{} on {} (cuda:{}), memory {}, {} buffers x {} B per "
      "token ({} KiB per token), {} tokens = {:.0f} MiB per request, {} iters\n",
      doc["date_utc"].get<std::string>(), o.backend,
      ipc ? "" : " (CUDA mode " + o.ucx_cuda_mode + ")",
      doc["machine"].value("gpu", std::string("?")), device, o.memory, 2 * o.layers, row_bytes,
      per_token_bytes / 1024, tokens, static_cast<double>(tokens * per_token_bytes) / (1 << 20),
      o.iters);

  json results = json::array(), targets = json::array();
  std::vector<GpuRows> all_rows;
  Status first_error;
  for (int pt : page_tokens) {
    json r;
    GpuRows rows;
    Status s = RunGpuPageSize(o, pt, device, per_token_bytes, tokens, r, rows);
    if (!s.ok()) {
      fmt::print("page_tokens {}: {}\n", pt, s.ToString());
      r["page_tokens"] = pt;
      r["error"] = s.ToString();
      if (first_error.ok()) first_error = s;
    } else {
      for (const json& t : r.value("targets", json::array())) targets.push_back(t);
      all_rows.push_back(rows);
    }
    results.push_back(r);
  }
  doc["results"] = results;
  doc["targets"] = targets;
  doc["loadavg_end"] = LoadAverage();

  if (ipc) {
    fmt::print(
        "\n{:>6} {:>7} {:>9} {:>8} {:>8} {:>8} {:>9} {:>8} {:>9} {:>8} {:>8} {:>8} {:>8} {:>6} "
        "{:>8} "
        "{:>8}\n",
        "tokens", "wr/req", "kvt GB/s", "aggr", "p50 ms", "p99 ms", "contig", "kvt/ctg", "per-page",
        "kvt/pp", "batch", "kvt/bat", "post ms", "check", "pipe", "pipe/ctg");
  } else {
    fmt::print(
        "\n{:>6} {:>7} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>8} {:>8} {:>6} {:>8} "
        "{:>8}\n",
        "tokens", "wr/req", "kvt GB/s", "aggr", "p50 ms", "p99 ms", "D2H", "kvt/D2H", "H2D", "D2D",
        "kvt/D2D", "post ms", "check", "pipe", "pipe/D2H");
  }
  for (const GpuRows& r : all_rows) fmt::print("{}\n", r.bw);
  fmt::print("\n{}\n{}\n", kPhaseHeader, PhaseColumns());
  for (const GpuRows& r : all_rows) fmt::print("{}\n", r.phase);
  if (o.layerwise_requests > 0) {
    fmt::print("\nlayerwise: simulated forward, {} requests per size, microseconds\n",
               o.layerwise_requests);
    fmt::print("{:>6} {:>8} {:>9}  {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} {:>9} {:>15} {:>15}\n",
               "tokens", "T set", "T meas", "tail p50", "tail max", "p50/T", "max/T", "fwd ms",
               "enq ms", "rcv->fwd", "prefill p50/max", "done-msg p50/max");
    for (const GpuRows& r : all_rows) fmt::print("{}\n", r.layerwise);
    fmt::print(
        "(T = T meas, the median interval between layers seen completing live; * = none seen live, "
        "so T = T set and enqueueing paced the forward: see enq ms and JSON "
        "last_layer_seen_live; the tail = prefill (last layer written -> the prefill engine saw "
        "every write complete and sent TransferDone) + done-msg (-> the decode engine had it))\n");
  }
  fmt::print("\none-page requests ({} each), microseconds\n", o.latency_requests);
  fmt::print("{:>6} {:>9} {:>8} {:>8} {:>9} {:>9} {:>9}\n", "tokens", "bytes", "p50", "p99",
             "wait p50", "wait p99", "post p50");
  for (const GpuRows& r : all_rows) fmt::print("{}\n", r.lat);
  if (!targets.empty()) {
    fmt::print("\ntargets (cuda_ipc on one GPU)\n");
    for (const GpuRows& r : all_rows) {
      for (const std::string& t : r.targets) fmt::print("{}\n", t);
    }
  }
  fmt::print("\nload average at start {}, at end {}\n", doc["loadavg_start"].get<std::string>(),
             doc["loadavg_end"].get<std::string>());
  if (ipc) {
    fmt::print(
        "\nkvt GB/s = request bytes / p50 latency (before Receive -> done seen on the decode "
        "side); "
        "contig = contiguous cudaMemcpyAsync D2D of the same bytes (prefill process, same GPU, "
        "CUDA events); per-page / batch = one cudaMemcpyAsync per (buffer, page) / "
        "cudaMemcpyBatchAsync into the decode pool through CUDA IPC, timed on {} items of each "
        "request (see JSON items_timed) and scaled by bytes; wr/req = backend writes per request; "
        "post ms = prefill Send + LayersReady; pipe = GB/s of {} requests with {} in flight (all "
        "bytes / wall time, first Receive -> last done). Layerwise: tail = decode done - last "
        "layer's event seen complete (host CLOCK_MONOTONIC in both processes); T meas = median "
        "layer interval.\n",
        o.peer_items == 0 ? std::string("all") : fmt::format("up to {}", o.peer_items),
        o.pipelined_requests, o.inflight);
  } else {
    fmt::print(
        "\nkvt GB/s = request bytes / p50 latency (before Receive -> done seen on the decode "
        "side); "
        "D2H / H2D = contiguous cudaMemcpyAsync of the same bytes with pinned host memory (the "
        "PCIe ceiling), D2D = contiguous device copy, all in the prefill process, same GPU, CUDA "
        "events. Both processes use the one GPU: unless they run under MPS, each gather and "
        "scatter also waits for the GPU to switch between them, which dominates the one-page "
        "latency (docs/performance.md, \"Staged UCX on CUDA pools\").\n");
  }
  if (!o.json_path.empty()) {
    KVT_RETURN_IF_ERROR(WriteJson(o.json_path, doc));
    fmt::print("wrote {}\n", o.json_path);
  }
  return first_error;
}

Status RunTransfer(const TransferOptions& options) {
  KVT_ASSIGN_OR_RETURN(std::vector<int> page_tokens, ParseIntList(options.page_tokens));
  KVT_ASSIGN_OR_RETURN(DType dtype, ParseDType(options.dtype));
  if (options.layers <= 0 || options.heads <= 0 || options.head_dim <= 0) {
    return InvalidArgument(
        fmt::format("--layers ({}), --heads ({}) and --head-dim ({}) must be > 0", options.layers,
                    options.heads, options.head_dim));
  }
  if (options.tokens < 0 || options.iters <= 0 || options.warmup < 0 ||
      options.latency_requests < 0 || options.timeout_s <= 0 ||
      (options.inflight > 1 && options.pipelined_requests <= 0)) {
    return InvalidArgument(fmt::format(
        "--iters ({}) and --timeout ({}) must be > 0, --tokens ({}; 0 = automatic), --warmup ({}) "
        "and --latency-requests ({}) >= 0, --pipelined-requests ({}) > 0 with --inflight > 1",
        options.iters, options.timeout_s, options.tokens, options.warmup, options.latency_requests,
        options.pipelined_requests));
  }
  if (options.backend != "ucx" && options.backend != "loopback" && options.backend != "cuda_ipc") {
    return InvalidArgument("--backend is '" + options.backend + "'; use ucx, loopback or cuda_ipc");
  }
  if (options.memory != "pool" && options.memory != "external") {
    return InvalidArgument("--memory is '" + options.memory +
                           "'; use pool (kvt's KvPool) or external (one allocation per side "
                           "carved into the K/V buffers, registered through "
                           "TransferLayout::FromBufInfos)");
  }
  if (options.backend != "ucx" && !options.ucx_tls.empty()) {
    return InvalidArgument("--ucx-tls only applies to --backend ucx");
  }
  KVT_ASSIGN_OR_RETURN(const int64_t am_bytes, ParseBytes(options.ucx_am_message_bytes));
  if (am_bytes < 4096 || am_bytes > (int64_t{64} << 20)) {
    return InvalidArgument("--ucx-am-message-bytes is " + options.ucx_am_message_bytes +
                           "; give 4KiB to 64MiB of data per active message");
  }
  // Where the pools live: CUDA pools for cuda_ipc (cuda:0 unless told) and with --device cuda:N.
  const std::string where = !options.device.empty()
                                ? options.device
                                : (options.backend == "cuda_ipc" ? std::string("cuda:0") : "host");
  if (where != "host" && where != "cpu") {
    KVT_ASSIGN_OR_RETURN(int device, ParseCudaDevice(where));
    if (options.backend == "loopback") {
      return InvalidArgument(
          "--backend loopback moves host pools only; use --backend cuda_ipc or ucx with --device " +
          where);
    }
    return RunTransferGpu(options, device);
  }
  if (options.backend == "cuda_ipc") {
    return InvalidArgument(
        "--backend cuda_ipc moves CUDA pools; use --device cuda:N (default "
        "cuda:0), or --backend ucx for host pools");
  }
  if (options.same_process || options.device_spin_us >= 0) {
    return InvalidArgument(
        "--same-process and --device-spin-us apply to CUDA pools only; add --device cuda:N (or "
        "use --backend cuda_ipc), or drop them for the host path");
  }
  // Host pools: the defaults as they always were.
  TransferOptions o = options;
  if (o.tokens == 0) o.tokens = 1024;
  if (o.pool_bytes.empty()) o.pool_bytes = "1GiB";
  QuietLibraryLogs();
  const int64_t row_bytes = static_cast<int64_t>(o.heads) * o.head_dim * ItemSize(dtype);
  const int64_t per_token_bytes = row_bytes * 2 * o.layers;  // K and V of every layer

  json doc;
  doc["tool"] = "kvt-bench transfer";
  doc["memory"] = o.memory;
  doc["date_utc"] = NowUtc();
  doc["command"] = CommandLine();
  doc["machine"] = DescribeMachine(false);
  doc["loadavg_start"] = LoadAverage();
  doc["config"] = CommonConfig(o, dtype, row_bytes, per_token_bytes, o.tokens);
  doc["config"].update(json{{"ucx_spin_us", o.ucx_spin_us},
                            {"ucx_copy_threads", o.ucx_copy_threads},
                            {"ucx_host_path", o.ucx_host_path},
                            {"ucx_am_message_bytes", o.ucx_am_message_bytes},
                            {"pool_per_side", o.pool_bytes}});
  doc["notes"] =
      "Latency: decode side, Receive called -> engine saw TransferDone (RequestInfo::finished); "
      "caller_* adds the WaitRequest wake-up. kvt GB/s = request bytes / p50 latency; aggregate "
      "= all timed requests' bytes / wall time of the sequential loop. Contiguous put: raw "
      "Backend, one run of the same bytes child -> parent, post -> flush complete, timed in the "
      "child, median. raw_backend_same_runs: the raw Backend posting the runs of one request of "
      "this size as one write (no engine, no control plane). memcpy: one thread, contiguous, "
      "median. ceiling_socket (--ucx-tls tcp only): one TCP connection on 127.0.0.1 between the "
      "same two processes, child -> parent, the request's bytes in 1 MiB send() calls into one "
      "receive buffer of the request's size, first byte sent -> the receiver's one-byte answer "
      "read, timed in the child, median. GB/s = 1e9 bytes/s.";
  fmt::print(
      "kvt-bench transfer ({}), backend {}{}, memory {}, {} buffers x {} B per token ({} KiB per "
      "token), {} tokens = {:.0f} MiB per request, {} iters\n",
      doc["date_utc"].get<std::string>(), o.backend,
      o.backend == "ucx" ? " tls " + (o.ucx_tls.empty() ? std::string("(UCX default)") : o.ucx_tls)
                         : "",
      o.memory, 2 * o.layers, row_bytes, per_token_bytes / 1024, o.tokens,
      static_cast<double>(o.tokens * per_token_bytes) / (1 << 20), o.iters);

  json results = json::array();
  std::vector<std::string> bw_rows, lat_rows, phase_rows;
  Status first_error;
  for (int pt : page_tokens) {
    json r;
    std::string bw, lat, phase;
    Status s = RunPageSize(o, pt, per_token_bytes, r, bw, lat, phase);
    if (!s.ok()) {
      fmt::print("page_tokens {}: {}\n", pt, s.ToString());
      r["page_tokens"] = pt;
      r["error"] = s.ToString();
      if (first_error.ok()) first_error = s;
    } else {
      bw_rows.push_back(bw);
      lat_rows.push_back(lat);
      phase_rows.push_back(phase);
    }
    results.push_back(r);
  }
  doc["results"] = results;
  doc["loadavg_end"] = LoadAverage();

  const bool socket_ceiling = TcpOnly(o);
  fmt::print("\n{:>6} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>8} {:>8}{}\n",
             "tokens", "runs/req", "kvt GB/s", "aggr", "p50 ms", "p99 ms", "memcpy", "ctg put",
             "raw runs", "kvt/put", "post ms", "pipe", "pipe/put",
             socket_ceiling ? fmt::format(" {:>8} {:>8} {:>9}", "socket", "kvt/sock", "pipe/sock")
                            : std::string());
  for (const std::string& row : bw_rows) fmt::print("{}\n", row);
  fmt::print("\n{}\n{}\n", kPhaseHeader, PhaseColumns());
  for (const std::string& row : phase_rows) fmt::print("{}\n", row);
  fmt::print("\none-page requests ({} each), microseconds\n", o.latency_requests);
  fmt::print("{:>6} {:>9} {:>8} {:>8} {:>9} {:>9} {:>9}\n", "tokens", "bytes", "p50", "p99",
             "wait p50", "wait p99", "post p50");
  for (const std::string& row : lat_rows) fmt::print("{}\n", row);
  fmt::print("\nload average at start {}, at end {}\n", doc["loadavg_start"].get<std::string>(),
             doc["loadavg_end"].get<std::string>());
  fmt::print(
      "\nkvt GB/s = request bytes / p50 latency (Receive -> done seen on the decode side); aggr = "
      "all requests / loop wall time; memcpy = one thread, contiguous; ctg put = raw backend, one "
      "contiguous run of the same bytes between the two processes; raw runs = raw backend posting "
      "the same runs as one kvt request; post ms = prefill Send+LayersReady (posting every "
      "run); pipe = GB/s of {} requests with {} in flight (all bytes / wall time, first Receive -> "
      "last done), pipe/put = pipe / ctg put.\n",
      o.pipelined_requests, o.inflight);
  if (socket_ceiling) {
    fmt::print(
        "socket = plain-socket ceiling (UCX over TCP only): one TCP connection on 127.0.0.1, "
        "prefill child -> decode parent, the request's bytes in 1 MiB send() calls into one "
        "receive buffer of the request's size, first byte sent -> one-byte answer read, median; "
        "kvt/sock = kvt GB/s / socket, pipe/sock = pipe / socket.\n");
  }
  if (!o.json_path.empty()) {
    KVT_RETURN_IF_ERROR(WriteJson(o.json_path, doc));
    fmt::print("wrote {}\n", o.json_path);
  }
  return first_error;
}

}  // namespace

void AddTransferCommand(CLI::App& app, int& exit_code) {
  auto opts = std::make_shared<TransferOptions>();
  CLI::App* cmd = app.add_subcommand(
      "transfer",
      "TransferEngine between two processes (decode here, prefill in a child) vs the ceilings of "
      "the same run: host pools (memcpy, contiguous put) or CUDA pools on one GPU (contiguous "
      "cudaMemcpy, the peers' per-page cudaMemcpyAsync / cudaMemcpyBatchAsync through CUDA IPC, "
      "PCIe for staged UCX; layerwise forward); one-page request latency");
  cmd->add_option("--json", opts->json_path, "write all figures to this JSON file");
  cmd->add_option("--backend", opts->backend,
                  "ucx (two processes), loopback (one process, host pools) or cuda_ipc (two "
                  "processes on one GPU)")
      ->capture_default_str();
  cmd->add_option("--device", opts->device,
                  "cuda:N for CUDA pools (default cuda:0 with cuda_ipc; with ucx: its staged CUDA "
                  "path), host for host pools");
  cmd->add_option("--ucx-tls", opts->ucx_tls,
                  "UCX transports, UCX_TLS syntax (e.g. shm,self or tcp); default: UCX's choice. "
                  "With tcp alone (or tcp,self) on host pools the table adds the plain-socket "
                  "ceiling: one TCP connection on 127.0.0.1 from the prefill child process to this "
                  "(decode) process, the same bytes in 1 MiB send() calls, median request time "
                  "first byte sent -> answer read");
  cmd->add_option("--control-busy-poll-us", opts->control_busy_poll_us,
                  "both engines' EngineOptions::control_busy_poll: their control io threads poll "
                  "instead of sleeping while requests are in flight and this long after (0: sleep, "
                  "the library's default; kvt-agent uses 1000 on CUDA pools)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{60'000'000}));
  cmd->add_option("--cuda-ipc-completion-word", opts->cuda_ipc_completion_word,
                  "cuda_ipc on both sides: each write also sets a completion word in mapped "
                  "pinned memory, which the engine's poller spins on (1), or completion is seen "
                  "through CUDA events alone (0); CudaIpcOptions::completion_word")
      ->capture_default_str();
  cmd->add_option("--control-lanes", opts->control_lanes,
                  "both engines' EngineOptions::control_lanes: with busy polling, the two "
                  "processes' control messages go through a shared-memory lane (1) or stay on "
                  "the TCP socket (0)")
      ->capture_default_str();
  cmd->add_option("--ucx-spin-us", opts->ucx_spin_us,
                  "UCX progress thread spin before it sleeps (UcxOptions::spin)")
      ->capture_default_str();
  cmd->add_option("--ucx-copy-threads", opts->ucx_copy_threads,
                  "threads copying a large write into a peer's mapped shared memory "
                  "(UcxOptions::copy_threads; 0: half the cores, 2..8)")
      ->capture_default_str()
      ->check(CLI::Range(0, 64));
  cmd->add_option("--ucx-host-path", opts->ucx_host_path,
                  "host pools a peer has not mapped (UcxOptions::host_path): auto (active "
                  "messages where UCX has no native RMA, as over tcp; puts otherwise), put or am")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "put", "am"}));
  cmd->add_option("--ucx-am-message-bytes", opts->ucx_am_message_bytes,
                  "data bytes per active message (UcxOptions::am_message_bytes, 4KiB..64MiB)")
      ->capture_default_str();
  cmd->add_option("--page-tokens", opts->page_tokens, "tokens per page, comma-separated")
      ->capture_default_str();
  cmd->add_option("--tokens", opts->tokens,
                  "tokens per request (0: 1024 on host pools, >= 1 GiB per request on CUDA pools)")
      ->capture_default_str();
  cmd->add_option("--iters", opts->iters, "timed requests per page size")->capture_default_str();
  cmd->add_option("--warmup", opts->warmup, "untimed requests first")->capture_default_str();
  cmd->add_option("--latency-requests", opts->latency_requests,
                  "one-page requests timed per page size")
      ->capture_default_str();
  cmd->add_option("--inflight", opts->inflight,
                  "pipelined figure: whole requests kept in flight at once (<= 1: not measured)")
      ->capture_default_str();
  cmd->add_option("--pipelined-requests", opts->pipelined_requests,
                  "pipelined figure: whole requests timed (first Receive -> last done)")
      ->capture_default_str();
  cmd->add_option("--layers", opts->layers, "layers (2 x layers buffers)")->capture_default_str();
  cmd->add_option("--heads", opts->heads, "KV heads")->capture_default_str();
  cmd->add_option("--head-dim", opts->head_dim, "head dimension")->capture_default_str();
  cmd->add_option("--dtype", opts->dtype, "element type (bf16, fp16, fp32, fp8_e4m3, ...)")
      ->capture_default_str();
  cmd->add_option("--pool", opts->pool_bytes,
                  "pool bytes per side, at least two requests (default 1GiB on host pools, two "
                  "requests + a page on CUDA pools)");
  cmd->add_option("--memory", opts->memory,
                  "where each side's K/V buffers come from: pool (kvt's KvPool; host pools take "
                  "their memory from the backend's allocator, so UCX's shared-memory transports "
                  "write into it directly) or external (what a serving engine brings: one "
                  "allocation per side carved into the 2 x layers buffers of the pool's sizes at "
                  "256-byte-aligned offsets with gaps, one cudaMalloc on CUDA, plain page-aligned "
                  "host memory on the host, not the backend's allocator; registered through "
                  "TransferLayout::FromBufInfos)")
      ->capture_default_str();
  cmd->add_option("--timeout", opts->timeout_s, "seconds per request and per peer reply")
      ->capture_default_str();
  cmd->add_option("--seed", opts->seed, "random page choice")->capture_default_str();
  cmd->add_flag("--verify", opts->verify,
                "after timing, check the pattern of one full and one one-page request (and, on "
                "CUDA pools, of every layerwise request)");
  cmd->add_option("--ucx-cuda-mode", opts->ucx_cuda_mode,
                  "ucx on CUDA pools: auto, staged or direct (UcxOptions::cuda_mode)")
      ->capture_default_str();
  cmd->add_option("--ucx-staging-slots", opts->ucx_staging_slots,
                  "ucx staging: bounce slots per side")
      ->capture_default_str();
  cmd->add_option("--ucx-staging-slot-bytes", opts->ucx_staging_slot_bytes,
                  "ucx staging: bytes per slot")
      ->capture_default_str();
  cmd->add_option("--ucx-staging-in-place", opts->ucx_staging_in_place,
                  "ucx staging on one host: the receiver reads the sender's slots in place "
                  "(UcxOptions::staging_in_place; 0: chunks travel as payloads)")
      ->capture_default_str();
  cmd->add_option("--peer-items", opts->peer_items,
                  "CUDA pools: (buffer, page) items timed for the per-page cudaMemcpyAsync and "
                  "cudaMemcpyBatchAsync peers, scaled by bytes (0: every item of a request)")
      ->capture_default_str();
  cmd->add_option("--layer-time-us", opts->layer_time_us,
                  "CUDA pools, layerwise: spin time of each simulated layer")
      ->capture_default_str();
  cmd->add_option("--layerwise-requests", opts->layerwise_requests,
                  "CUDA pools: simulated-forward requests timed per page size (0: none)")
      ->capture_default_str();
  cmd->add_flag("--same-process", opts->same_process,
                "CUDA pools: run the prefill side as a thread of this process (cuda_ipc then "
                "writes without CUDA IPC mappings; the per-page peers, which need them, are not "
                "measured); a diagnostic of what the mappings cost");
  cmd->add_option(
         "--device-spin-us", opts->device_spin_us,
         "CUDA pools: the prefill engine's EngineOptions::device_spin (how long its poller "
         "watches a device write between passes; < 0: the engine's default, 200)")
      ->capture_default_str();
  cmd->add_option("--spin-blocks", opts->spin_blocks,
                  "CUDA pools, layerwise: blocks of 32 threads of the spin kernel (0: one per SM)")
      ->capture_default_str();
  cmd->callback([opts, &exit_code] {
    Status s = RunTransfer(*opts);
    if (!s.ok()) {
      fmt::print(stderr, "kvt-bench transfer: {}\n", s.ToString());
      exit_code = 1;
    }
  });

  // The prefill side, started by `transfer` itself; hidden from --help.
  auto fd = std::make_shared<int>(-1);
  CLI::App* peer = app.add_subcommand(kPeerCommand, "");
  peer->group("");
  peer->add_option("--fd", *fd, "socket to the parent")->required();
  peer->callback([fd, &exit_code] {
    QuietLibraryLogs();
    Status s = PrefillPeer(*fd).Serve();
    ::close(*fd);
    if (!s.ok()) {
      fmt::print(stderr, "kvt-bench {}: {}\n", kPeerCommand, s.ToString());
      exit_code = 1;
    }
  });
}

}  // namespace kvt::bench

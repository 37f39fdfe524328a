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
//   - one-page requests: p50 / p99 over --latency-requests requests.
// Everything is bounded: per-request deadlines, reply timeouts on the parent <-> child pipe,
// and the child dies with its parent (PR_SET_PDEATHSIG) and exits when the pipe closes.
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
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.h"
#include "commands.h"
#include "kvt/common/dtype.h"
#include "kvt/common/log.h"
#include "kvt/kernels/kernels.h"
#include "kvt/pool/kv_pool.h"
#include "kvt/pool/page_allocator.h"
#include "kvt/pool/pool_options.h"
#include "kvt/transfer/backend.h"
#include "kvt/transfer/backends.h"
#include "kvt/transfer/engine.h"
#include "kvt/transfer/plan.h"

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
  std::string page_tokens = "1,16,64";
  int64_t tokens = 1024;
  int iters = 10;
  int warmup = 2;
  int latency_requests = 1000;
  int layers = 32;
  int heads = 8;
  int head_dim = 128;
  std::string dtype = "bf16";
  std::string pool_bytes = "1GiB";  // per side
  int timeout_s = 30;               // per request, and per reply of the peer
  uint32_t seed = 1;
  bool verify = false;
};

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// Nearest-rank percentile (p in [0, 1]) of unsorted values.
double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(values.size())));
  return values[std::clamp<size_t>(rank, 1, values.size()) - 1];
}

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
  int page_tokens = 0;
  int64_t pool_tokens = 0;
  int layers = 0, heads = 0, head_dim = 0;
  std::string dtype;
  int64_t contiguous_bytes = 0;  // the raw-backend ceiling's region
  uint32_t seed = 1;
  int timeout_s = 30;

  json ToJson() const {
    return {{"backend", backend},
            {"ucx_tls", ucx_tls},
            {"ucx_spin_us", ucx_spin_us},
            {"page_tokens", page_tokens},
            {"pool_tokens", pool_tokens},
            {"layers", layers},
            {"heads", heads},
            {"head_dim", head_dim},
            {"dtype", dtype},
            {"contiguous_bytes", contiguous_bytes},
            {"seed", seed},
            {"timeout_s", timeout_s}};
  }
  static StatusOr<SideConfig> FromJson(const json& j) {
    SideConfig c;
    try {
      c.backend = j.at("backend");
      c.ucx_tls = j.at("ucx_tls");
      c.ucx_spin_us = j.at("ucx_spin_us");
      c.page_tokens = j.at("page_tokens");
      c.pool_tokens = j.at("pool_tokens");
      c.layers = j.at("layers");
      c.heads = j.at("heads");
      c.head_dim = j.at("head_dim");
      c.dtype = j.at("dtype");
      c.contiguous_bytes = j.at("contiguous_bytes");
      c.seed = j.at("seed");
      c.timeout_s = j.at("timeout_s");
    } catch (const json::exception& e) {
      return DataLoss(std::string("malformed peer configuration: ") + e.what());
    }
    return c;
  }
  transfer::BackendOptions BackendOptions() const {
    transfer::BackendOptions b;
    b.ucx_transports = ucx_tls;
    b.ucx_spin_us = ucx_spin_us;
    return b;
  }
};

// `allocator`: where the pool's buffers come from (the engine backend's, so that UCX's
// shared-memory transports can write into them directly); null: the pool's own mmap.
StatusOr<std::unique_ptr<pool::KvPool>> MakePool(
    const SideConfig& c, std::shared_ptr<pool::HostAllocator> allocator = nullptr) {
  KVT_ASSIGN_OR_RETURN(DType dtype, ParseDType(c.dtype));
  pool::PoolOptions p;
  p.size = c.pool_tokens;
  p.page_size = c.page_tokens;
  p.head_num = c.heads;
  p.head_dim = c.head_dim;
  p.layer_num = c.layers;
  p.dtype = dtype;
  p.pd_disaggregation_enabled = true;
  p.pin_host_memory = false;  // host path only; pinning would need a CUDA device
  // A serving pool has been written long before a transfer; without this the first requests
  // would time first-touch page faults (measured: 10x slower loopback copies) instead of copies.
  p.prefault_host_memory = true;
  p.host_allocator = std::move(allocator);
  return pool::KvPool::Create(p);
}

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

StatusOr<RawSide> MakeRawSide(const SideConfig& c, const pool::KvPool& pool, uint8_t fill) {
  RawSide raw;
  KVT_ASSIGN_OR_RETURN(raw.backend, transfer::CreateBackend(c.backend, c.BackendOptions()));
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
  KVT_ASSIGN_OR_RETURN(pool::ContiguousBufInfos infos, pool.GetContiguousBufInfos());
  std::vector<transfer::LocalRegion> regions;
  for (size_t i = 0; i < infos.data_ptrs.size(); ++i) {
    regions.push_back({infos.data_ptrs[i], static_cast<uint64_t>(infos.data_lens[i]),
                       static_cast<uint64_t>(infos.item_lens[i])});
  }
  raw.contiguous_index = static_cast<uint32_t>(regions.size());
  regions.push_back({reinterpret_cast<uint64_t>(contiguous),
                     static_cast<uint64_t>(c.contiguous_bytes),
                     static_cast<uint64_t>(c.contiguous_bytes)});
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

kernels::PatternArgs PatternFor(const pool::ContiguousBufInfos& infos, const SideConfig& c,
                                uint64_t request, const std::vector<int32_t>& pages,
                                int64_t row_bytes) {
  kernels::PatternArgs a;
  a.request = request;
  a.k_bases = infos.data_ptrs.data();
  a.v_bases = infos.data_ptrs.data() + c.layers;
  a.first_layer = 0;
  a.num_layers = c.layers;
  a.pages = pages.data();
  a.num_tokens = static_cast<int64_t>(pages.size()) * c.page_tokens;
  a.page_size = c.page_tokens;
  a.row_bytes = row_bytes;
  return a;
}

// ---- The prefill peer -------------------------------------------------------------------------
// Serves one page-token size: answers the parent's messages until "quit" or the pipe closes.
// Messages: config -> ready{port, raw}; connect{raw}; put{bytes, iters}; runs{dst_pages, iters};
// stats{reset}; quit. Every reply carries "error" when something failed.
class PrefillPeer {
 public:
  explicit PrefillPeer(int fd) : fd_(fd) {}

  Status Serve() {
    KVT_ASSIGN_OR_RETURN(json first, ReceiveMessage(fd_, std::chrono::seconds(60)));
    KVT_ASSIGN_OR_RETURN(config_, SideConfig::FromJson(first));
    Status setup = Setup();
    if (!setup.ok()) {
      (void)SendMessage(fd_, {{"error", setup.ToString()}});
      return setup;
    }
    KVT_RETURN_IF_ERROR(
        SendMessage(fd_, {{"port", engine_->port()}, {"raw", DescriptorToJson(raw_.descriptor)}}));
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
    KVT_ASSIGN_OR_RETURN(std::shared_ptr<Backend> backend,
                         transfer::CreateBackend(config_.backend, config_.BackendOptions()));
    KVT_ASSIGN_OR_RETURN(pool_, MakePool(config_, transfer::BackendHostAllocator(backend)));
    KVT_ASSIGN_OR_RETURN(infos_, pool_->GetContiguousBufInfos());
    KVT_ASSIGN_OR_RETURN(DType dtype, ParseDType(config_.dtype));
    row_bytes_ = static_cast<int64_t>(config_.heads) * config_.head_dim * ItemSize(dtype);
    num_pages_ = pool_->layout().num_pages();
    permutation_.resize(static_cast<size_t>(num_pages_));
    std::iota(permutation_.begin(), permutation_.end(), 1);
    rng_.seed(config_.seed * 7919u + 17u);
    std::shuffle(permutation_.begin(), permutation_.end(), rng_);
    KVT_ASSIGN_OR_RETURN(raw_, MakeRawSide(config_, *pool_, 0x5A));

    transfer::EngineOptions e;
    e.name = "bench-prefill";
    e.prefill = true;
    e.backend = config_.backend;
    e.backend_options = config_.BackendOptions();
    e.server.bind_address = "127.0.0.1";
    e.default_deadline = std::chrono::seconds(config_.timeout_s);
    e.retention = std::chrono::milliseconds(0);  // the poller sweeps final rooms within ~1 s
    e.on_transfer_request = [this](const std::string& room, size_t num_pages) {
      OnTransferRequest(room, num_pages);
    };
    KVT_ASSIGN_OR_RETURN(engine_, transfer::TransferEngine::Create(e, pool_.get(), backend));
    return OkStatus();
  }

  // `n` distinct random pages: a window of the shuffled page ids at a random start.
  std::vector<int32_t> PickPages(size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    std::uniform_int_distribution<size_t> start(0, permutation_.size() - 1);
    const size_t s = start(rng_);
    std::vector<int32_t> pages(n);
    for (size_t i = 0; i < n; ++i) pages[i] = permutation_[(s + i) % permutation_.size()];
    return pages;
  }

  void RecordError(const Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    ++errors_;
    if (first_error_.empty()) first_error_ = s.ToString();
  }

  // On a control thread: the "forward pass" is already done, so Send and mark every layer ready.
  // Rooms named "v<id>" are verification requests: their pages get the pattern of request <id>
  // first (outside any timed request).
  void OnTransferRequest(const std::string& room, size_t num_pages) {
    const auto t0 = Clock::now();
    if (num_pages > permutation_.size()) {
      RecordError(OutOfRange(fmt::format("room '{}' asks for {} pages; the pool has {}", room,
                                         num_pages, permutation_.size())));
      (void)engine_->Abort(room, "more pages than the prefill pool has");
      return;
    }
    std::vector<int32_t> pages = PickPages(num_pages);
    if (!room.empty() && room[0] == 'v') {
      const uint64_t request = std::strtoull(room.c_str() + 1, nullptr, 10);
      Status filled =
          kernels::FillPatternCpu(PatternFor(infos_, config_, request, pages, row_bytes_));
      if (!filled.ok()) RecordError(filled);
    }
    Status s = engine_->Send(room, std::move(pages));
    if (s.ok()) s = engine_->LayersReady(room, config_.layers);
    if (!s.ok()) RecordError(s.WithContext("room '" + room + "'"));
    const double ms = Ms(Clock::now() - t0);
    std::lock_guard<std::mutex> lock(mu_);
    post_ms_.push_back(ms);
  }

  StatusOr<json> Handle(const std::string& type, const json& m) {
    try {
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
        std::lock_guard<std::mutex> lock(mu_);
        json reply = {{"requests_succeeded", s.requests_succeeded},
                      {"requests_failed", s.requests_failed},
                      {"bytes", s.bytes},
                      {"writes_posted", s.writes_posted},
                      {"runs_posted", s.runs_posted},
                      {"post_ms_p50", Percentile(post_ms_, 0.5)},
                      {"post_ms_p99", Percentile(post_ms_, 0.99)},
                      {"post_count", post_ms_.size()},
                      {"callback_errors", errors_},
                      {"first_callback_error", first_error_}};
        if (m.value("reset", false)) post_ms_.clear();
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
  std::unique_ptr<pool::KvPool> pool_;
  pool::ContiguousBufInfos infos_;
  RawSide raw_;
  std::unique_ptr<transfer::TransferEngine> engine_;
  int64_t row_bytes_ = 0;
  int64_t num_pages_ = 0;

  std::mutex mu_;  // guards everything below (control threads and the message loop)
  std::mt19937 rng_;
  std::vector<int32_t> permutation_;
  std::vector<double> post_ms_;  // per request: Send + LayersReady (posting every run)
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
    KVT_ASSIGN_OR_RETURN(std::shared_ptr<Backend> backend,
                         transfer::CreateBackend(c.backend, c.BackendOptions()));
    KVT_ASSIGN_OR_RETURN(d->pool_, MakePool(c, transfer::BackendHostAllocator(backend)));
    KVT_ASSIGN_OR_RETURN(d->infos_, d->pool_->GetContiguousBufInfos());
    KVT_ASSIGN_OR_RETURN(d->allocator_,
                         pool::PageAllocator::Create(d->pool_->layout().num_pages()));
    // Random pages: take all, shuffle, give back in that order; the allocator is LIFO, so later
    // allocations come out in the shuffled order.
    KVT_ASSIGN_OR_RETURN(std::vector<int32_t> all,
                         d->allocator_->Allocate(d->allocator_->num_pages()));
    std::mt19937 rng(c.seed);
    std::shuffle(all.begin(), all.end(), rng);
    KVT_RETURN_IF_ERROR(d->allocator_->Free(all));

    KVT_ASSIGN_OR_RETURN(d->raw_, MakeRawSide(c, *d->pool_, 0xC3));
    KVT_ASSIGN_OR_RETURN(PeerDescriptor peer, DescriptorFromJson(peer_raw));
    (void)peer;  // the child connects to us (it writes); ours goes to it in "connect"

    transfer::EngineOptions e;
    e.name = "bench-decode";
    e.prefill = false;
    e.backend = c.backend;
    e.backend_options = c.BackendOptions();
    e.default_deadline = std::chrono::seconds(c.timeout_s);
    KVT_ASSIGN_OR_RETURN(d->engine_, transfer::TransferEngine::Create(e, d->pool_.get(), backend));
    KVT_ASSIGN_OR_RETURN(d->peer_, d->engine_->ConnectPeer("127.0.0.1", port));
    return d;
  }

  // One request of `num_pages` pages; room names starting with 'v' are verification requests.
  StatusOr<Sample> Request(const std::string& room, int64_t num_pages, uint64_t verify_id = 0) {
    KVT_ASSIGN_OR_RETURN(std::vector<int32_t> pages, allocator_->Allocate(num_pages));
    const std::vector<int32_t> dst = pages;
    const auto t0 = Clock::now();
    Status posted = engine_->Receive(room, peer_, std::move(pages));
    if (!posted.ok()) {
      (void)allocator_->Free(dst);
      return posted.WithContext("Receive of room '" + room + "'");
    }
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
    Sample s{Ms(info->finished - t0), Ms(t2 - t0)};
    if (verify_id != 0) {
      KVT_ASSIGN_OR_RETURN(
          kernels::PatternCheck check,
          kernels::VerifyPatternCpu(PatternFor(infos_, config_, verify_id, dst, RowBytes())));
      verified_mismatches_ += check.mismatches;
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

  int64_t RowBytes() const {
    return static_cast<int64_t>(config_.heads) * config_.head_dim *
           ItemSize(ParseDType(config_.dtype).value());
  }
  int64_t num_pages() const { return allocator_->num_pages(); }
  const RawSide& raw() const { return raw_; }
  uint64_t verified_mismatches() const { return verified_mismatches_; }

 private:
  explicit DecodeSide(const SideConfig& c) : config_(c) {}

  const SideConfig config_;
  std::unique_ptr<pool::KvPool> pool_;
  pool::ContiguousBufInfos infos_;
  std::unique_ptr<pool::PageAllocator> allocator_;
  RawSide raw_;
  std::unique_ptr<transfer::TransferEngine> engine_;  // before the pool it registered goes
  transfer::PeerHandle peer_ = 0;
  uint64_t verified_mismatches_ = 0;
};

std::string Cell(double v, int precision = 2) {
  return std::isfinite(v) ? fmt::format("{:.{}f}", v, precision) : "-";
}

// One page-token size, start to end. Fills `out` and the two table rows.
Status RunPageSize(const TransferOptions& o, int pt, int64_t per_token_bytes, json& out,
                   std::string& bw_row, std::string& lat_row) {
  const int64_t pages_per_request = (o.tokens + pt - 1) / pt;
  const int64_t request_tokens = pages_per_request * pt;
  const int64_t request_bytes = request_tokens * per_token_bytes;
  KVT_ASSIGN_OR_RETURN(int64_t pool_bytes, ParseBytes(o.pool_bytes));
  int64_t pool_tokens = pool_bytes / per_token_bytes / pt * pt;
  // Room for two requests at least, so random pages have somewhere to come from.
  pool_tokens = std::max(pool_tokens, 2 * request_tokens + pt);

  SideConfig c;
  c.backend = o.backend;
  c.ucx_tls = o.ucx_tls;
  c.ucx_spin_us = o.ucx_spin_us;
  c.page_tokens = pt;
  c.pool_tokens = pool_tokens;
  c.layers = o.layers;
  c.heads = o.heads;
  c.head_dim = o.head_dim;
  c.dtype = o.dtype;
  c.contiguous_bytes = request_bytes;
  c.seed = o.seed + static_cast<uint32_t>(pt);
  c.timeout_s = o.timeout_s;
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
  // (c) the raw backend posting the runs of a request of this size (random pages both sides).
  KVT_ASSIGN_OR_RETURN(json runs, link->Call({{"type", "runs"},
                                              {"dst_pages", decode->SomePages(pages_per_request)},
                                              {"iters", o.warmup + o.iters}},
                                             reply_timeout));
  std::vector<double> runs_ms = runs.at("ms");
  runs_ms.erase(runs_ms.begin(), runs_ms.begin() + o.warmup);

  // kvt: whole requests.
  for (int i = 0; i < o.warmup; ++i) {
    KVT_RETURN_IF_ERROR(decode->Request(fmt::format("w{}", i), pages_per_request).status());
  }
  KVT_ASSIGN_OR_RETURN(json before,
                       link->Call({{"type", "stats"}, {"reset", true}}, std::chrono::seconds(30)));
  Latencies big;
  const auto run_t0 = Clock::now();
  for (int i = 0; i < o.iters; ++i) {
    KVT_ASSIGN_OR_RETURN(Sample s, decode->Request(fmt::format("t{}", i), pages_per_request));
    big.Add(s);
  }
  const double run_ms = Ms(Clock::now() - run_t0);
  KVT_ASSIGN_OR_RETURN(json after,
                       link->Call({{"type", "stats"}, {"reset", true}}, std::chrono::seconds(30)));
  const double runs_per_request = static_cast<double>(after.at("runs_posted").get<uint64_t>() -
                                                      before.at("runs_posted").get<uint64_t>()) /
                                  o.iters;
  const json big_post = after;

  // One-page requests.
  for (int i = 0; i < std::min(o.latency_requests, 20); ++i) {
    KVT_RETURN_IF_ERROR(decode->Request(fmt::format("x{}", i), 1).status());
  }
  KVT_RETURN_IF_ERROR(
      link->Call({{"type", "stats"}, {"reset", true}}, std::chrono::seconds(30)).status());
  Latencies small;
  for (int i = 0; i < o.latency_requests; ++i) {
    KVT_ASSIGN_OR_RETURN(Sample s, decode->Request(fmt::format("l{}", i), 1));
    small.Add(s);
  }
  KVT_ASSIGN_OR_RETURN(json small_post,
                       link->Call({{"type", "stats"}, {"reset", true}}, std::chrono::seconds(30)));

  if (o.verify) {
    KVT_RETURN_IF_ERROR(decode
                            ->Request("v" + std::to_string(1000 + pt), pages_per_request,
                                      static_cast<uint64_t>(1000 + pt))
                            .status());
    KVT_RETURN_IF_ERROR(
        decode->Request("v" + std::to_string(2000 + pt), 1, static_cast<uint64_t>(2000 + pt))
            .status());
    out["verified_mismatches"] = decode->verified_mismatches();
  }
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
  out["ratio_kvt_to_memcpy"] = memcpy_gbps > 0 ? kvt_gbps / memcpy_gbps : NAN;
  out["ratio_kvt_to_raw_same_runs"] = raw_runs_gbps > 0 ? kvt_gbps / raw_runs_gbps : NAN;
  out["one_page"] = small.ToJson(1000.0, "us");
  out["one_page"]["bytes"] = one_page_bytes;
  out["one_page"]["prefill_post_us_p50"] = small_post.at("post_ms_p50").get<double>() * 1000;

  bw_row = fmt::format("{:>6} {:>8.0f} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7}", pt,
                       runs_per_request, Cell(kvt_gbps), Cell(aggregate_gbps), Cell(kvt_p50, 1),
                       Cell(Percentile(big.engine_ms, 0.99), 1), Cell(memcpy_gbps), Cell(put_gbps),
                       Cell(raw_runs_gbps), Cell(ratio),
                       Cell(big_post.at("post_ms_p50").get<double>(), 1));
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

Status RunTransfer(const TransferOptions& o) {
  KVT_ASSIGN_OR_RETURN(std::vector<int> page_tokens, ParseIntList(o.page_tokens));
  KVT_ASSIGN_OR_RETURN(DType dtype, ParseDType(o.dtype));
  if (o.layers <= 0 || o.heads <= 0 || o.head_dim <= 0) {
    return InvalidArgument(
        fmt::format("--layers ({}), --heads ({}) and --head-dim ({}) must be > 0", o.layers,
                    o.heads, o.head_dim));
  }
  if (o.tokens <= 0 || o.iters <= 0 || o.warmup < 0 || o.latency_requests < 0 || o.timeout_s <= 0) {
    return InvalidArgument(
        fmt::format("--tokens ({}), --iters ({}) and --timeout ({}) must be > 0, --warmup ({}) "
                    "and --latency-requests ({}) >= 0",
                    o.tokens, o.iters, o.timeout_s, o.warmup, o.latency_requests));
  }
  if (o.backend != "ucx" && o.backend != "loopback") {
    return InvalidArgument("--backend is '" + o.backend + "'; use ucx or loopback");
  }
  if (o.backend == "loopback" && !o.ucx_tls.empty()) {
    return InvalidArgument("--ucx-tls only applies to --backend ucx");
  }
  QuietLibraryLogs();
  const int64_t row_bytes = static_cast<int64_t>(o.heads) * o.head_dim * ItemSize(dtype);
  const int64_t per_token_bytes = row_bytes * 2 * o.layers;  // K and V of every layer

  json doc;
  doc["tool"] = "kvt-bench transfer";
  doc["date_utc"] = NowUtc();
  doc["command"] = CommandLine();
  doc["machine"] = DescribeMachine(false);
  doc["loadavg_start"] = LoadAverage();
  const char* env_tls = std::getenv("UCX_TLS");
  doc["config"] = json{{"backend", o.backend},
                       {"ucx_tls", o.ucx_tls.empty() ? "(UCX default)" : o.ucx_tls},
                       {"env_UCX_TLS", env_tls ? env_tls : ""},
                       {"ucx_spin_us", o.ucx_spin_us},
                       {"layers", o.layers},
                       {"heads", o.heads},
                       {"head_dim", o.head_dim},
                       {"dtype", std::string(DTypeName(dtype))},
                       {"bytes_per_token_per_buffer", row_bytes},
                       {"bytes_per_token", per_token_bytes},
                       {"tokens", o.tokens},
                       {"iters", o.iters},
                       {"warmup", o.warmup},
                       {"latency_requests", o.latency_requests},
                       {"pool_per_side", o.pool_bytes},
                       {"seed", o.seed}};
  doc["notes"] =
      "Latency: decode side, Receive called -> engine saw TransferDone (RequestInfo::finished); "
      "caller_* adds the WaitRequest wake-up. kvt GB/s = request bytes / p50 latency; aggregate "
      "= all timed requests' bytes / wall time of the sequential loop. Contiguous put: raw "
      "Backend, one run of the same bytes child -> parent, post -> flush complete, timed in the "
      "child, median. raw_backend_same_runs: the raw Backend posting the runs of one request of "
      "this size as one write (no engine, no control plane). memcpy: one thread, contiguous, "
      "median. GB/s = 1e9 bytes/s.";
  fmt::print(
      "kvt-bench transfer ({}), backend {}{}, {} buffers x {} B per token ({} KiB per token), "
      "{} tokens = {:.0f} MiB per request, {} iters\n",
      doc["date_utc"].get<std::string>(), o.backend,
      o.backend == "ucx" ? " tls " + (o.ucx_tls.empty() ? std::string("(UCX default)") : o.ucx_tls)
                         : "",
      2 * o.layers, row_bytes, per_token_bytes / 1024, o.tokens,
      static_cast<double>(o.tokens * per_token_bytes) / (1 << 20), o.iters);

  json results = json::array();
  std::vector<std::string> bw_rows, lat_rows;
  Status first_error;
  for (int pt : page_tokens) {
    json r;
    std::string bw, lat;
    Status s = RunPageSize(o, pt, per_token_bytes, r, bw, lat);
    if (!s.ok()) {
      fmt::print("page_tokens {}: {}\n", pt, s.ToString());
      r["page_tokens"] = pt;
      r["error"] = s.ToString();
      if (first_error.ok()) first_error = s;
    } else {
      bw_rows.push_back(bw);
      lat_rows.push_back(lat);
    }
    results.push_back(r);
  }
  doc["results"] = results;
  doc["loadavg_end"] = LoadAverage();

  fmt::print("\n{:>6} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7}\n", "tokens",
             "runs/req", "kvt GB/s", "aggr", "p50 ms", "p99 ms", "memcpy", "ctg put", "raw runs",
             "kvt/put", "post ms");
  for (const std::string& row : bw_rows) fmt::print("{}\n", row);
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
      "run).\n");
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
      "TransferEngine host path between two processes (decode here, prefill in a child) vs "
      "memcpy and a contiguous put in the same run; one-page request latency");
  cmd->add_option("--json", opts->json_path, "write all figures to this JSON file");
  cmd->add_option("--backend", opts->backend, "ucx (two processes) or loopback (one process)")
      ->capture_default_str();
  cmd->add_option("--ucx-tls", opts->ucx_tls,
                  "UCX transports, UCX_TLS syntax (e.g. shm,self or tcp); default: UCX's choice");
  cmd->add_option("--ucx-spin-us", opts->ucx_spin_us,
                  "UCX progress thread spin before it sleeps (BackendOptions::ucx_spin_us)")
      ->capture_default_str();
  cmd->add_option("--page-tokens", opts->page_tokens, "tokens per page, comma-separated")
      ->capture_default_str();
  cmd->add_option("--tokens", opts->tokens, "tokens per request")->capture_default_str();
  cmd->add_option("--iters", opts->iters, "timed requests per page size")->capture_default_str();
  cmd->add_option("--warmup", opts->warmup, "untimed requests first")->capture_default_str();
  cmd->add_option("--latency-requests", opts->latency_requests,
                  "one-page requests timed per page size")
      ->capture_default_str();
  cmd->add_option("--layers", opts->layers, "layers (2 x layers buffers)")->capture_default_str();
  cmd->add_option("--heads", opts->heads, "KV heads")->capture_default_str();
  cmd->add_option("--head-dim", opts->head_dim, "head dimension")->capture_default_str();
  cmd->add_option("--dtype", opts->dtype, "element type (bf16, fp16, fp32, fp8_e4m3, ...)")
      ->capture_default_str();
  cmd->add_option("--pool", opts->pool_bytes, "pool bytes per side (at least two requests)")
      ->capture_default_str();
  cmd->add_option("--timeout", opts->timeout_s, "seconds per request and per peer reply")
      ->capture_default_str();
  cmd->add_option("--seed", opts->seed, "random page choice")->capture_default_str();
  cmd->add_flag("--verify", opts->verify,
                "after timing, check the pattern of one full and one one-page request");
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

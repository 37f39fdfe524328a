#include "agent.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <thread>
#include <utility>

#include "kvt/common/log.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/kernels/kernels.h"
#include "kvt/pool/page_allocator.h"
#include "page_list_arena.h"
#include "pattern_id.h"
#include "simulated_compute.h"

namespace kvt::tools {
namespace {

using Clock = std::chrono::steady_clock;
using transfer::IsFinal;
using transfer::RequestState;

// Makes `device` current on the calling thread (CUDA's current device is per thread).
Status UseDevice(int device) { return cuda::ToStatus(cudaSetDevice(device), "cudaSetDevice"); }

}  // namespace

class Agent::Impl {
 public:
  explicit Impl(const AgentOptions& options) : options_(options) {}

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    // Simulated compute still queued on the GPU returns at once.
    if (cuda_ != nullptr) *cuda_->cancel.as<volatile uint32_t>() = 1;
    cv_.notify_all();
    if (forward_.joinable()) forward_.join();
    if (monitor_.joinable()) monitor_.join();
    if (cuda_ != nullptr) {
      // The forward's kernels write into the pool, and the engine's copies wait on its events:
      // both must be done before the engine and the pool go.
      Status synced = UseDevice(cuda_->device);
      if (synced.ok()) synced = cuda_->stream.Synchronize();
      if (!synced.ok()) KVT_LOG_ERROR("tool", "stopping the agent's stream: {}", synced.ToString());
    }
    engine_.reset();  // before the pool it points into (and the events it may still hold)
    requests_.clear();
    cuda_.reset();
  }

  Status Init() {
    const bool cuda_pool = options_.pool.memory == pool::MemoryKind::kCuda;
    const bool loopback =
        std::holds_alternative<transfer::LoopbackOptions>(options_.engine.backend);
    if (cuda_pool && loopback) {
      return FailedPrecondition(
          "the loopback backend copies host memory inside one process and cannot move a CUDA "
          "pool (device cuda:" +
          std::to_string(options_.pool.device) +
          "); use the cuda_ipc or ucx backend, or a host pool");
    }
    if (cuda_pool) KVT_RETURN_IF_ERROR(UseDevice(options_.pool.device));
    // The backend first, so that the pool's memory can come from it: UCX's shared-memory
    // transports write straight into a peer's buffers only when UCX allocated them.
    KVT_ASSIGN_OR_RETURN(std::shared_ptr<transfer::Backend> backend,
                         transfer::CreateBackend(options_.engine.backend));
    pool::PoolOptions pool_options = options_.pool;
    pool_options.pd_disaggregation_enabled = true;
    if (pool_options.memory == pool::MemoryKind::kHost) {
      pool_options.host_allocator = transfer::BackendHostAllocator(backend);
    }
    KVT_ASSIGN_OR_RETURN(pool_, pool::KvPool::Create(pool_options));
    const int64_t pages = pool_->layout().num_pages();
    KVT_ASSIGN_OR_RETURN(allocator_, pool::PageAllocator::Create(pages));
    if (options_.shuffle_pages) {
      // Freed pages are handed out last-in first-out, so freeing all of them in a random order
      // makes later allocations come out in that order.
      KVT_ASSIGN_OR_RETURN(std::vector<int32_t> all, allocator_->Allocate(pages));
      std::shuffle(all.begin(), all.end(), std::mt19937(options_.seed));
      KVT_RETURN_IF_ERROR(allocator_->Free(all));
    }
    transfer::EngineOptions engine = options_.engine;
    engine.name = options_.name;
    engine.prefill = options_.prefill;
    KVT_ASSIGN_OR_RETURN(engine_,
                         transfer::TransferEngine::Create(engine, pool_.get(), std::move(backend)));
    auto infos = pool_->GetContiguousBufInfos();
    const int64_t layers = pool_->options().layer_num;
    k_bases_.assign(infos->data_ptrs.begin(), infos->data_ptrs.begin() + layers);
    v_bases_.assign(infos->data_ptrs.begin() + layers, infos->data_ptrs.end());
    if (cuda_pool) KVT_RETURN_IF_ERROR(InitCuda());
    if (options_.prefill) forward_ = std::thread([this] { ForwardLoop(); });
    monitor_ = std::thread([this] { MonitorLoop(); });
    return OkStatus();
  }

  Status Claim(const std::string& room, int64_t tokens) {
    if (room.empty()) return InvalidArgument("room id is empty; give every request a room id");
    std::lock_guard<std::mutex> lock(mu_);
    return ClaimLocked(room, tokens);
  }

  Status Release(const std::string& room) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = claims_.find(room);
    if (it == claims_.end()) return OkStatus();
    if (it->second.submitting) {
      return FailedPrecondition("room '" + room +
                                "' is in Submit, which ends its claim itself; release only a "
                                "claim whose Submit will not come");
    }
    const Status aborted = AbortedBeforeStart(room, it->second);
    claims_.erase(it);
    return aborted;
  }

  Status ConnectPrefill(const std::string& room, const std::string& host, uint16_t port) {
    if (options_.prefill) {
      return FailedPrecondition("room '" + room +
                                "': a prefill agent connects to no peer (decode agents connect "
                                "to it); submit the room without a prefill address");
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = claims_.find(room);
      if (it == claims_.end()) {
        return FailedPrecondition("room '" + room +
                                  "' is not claimed on this agent; Claim it before connecting");
      }
      if (it->second.abort_reason) return AbortedBeforeStart(room, it->second);
    }
    StatusOr<transfer::PeerHandle> peer = engine_->ConnectPeer(host, port);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = claims_.find(room);
    if (it != claims_.end() && it->second.abort_reason) return AbortedBeforeStart(room, it->second);
    return peer.status();
  }

  Status Submit(const SubmitSpec& spec) {
    if (spec.room.empty()) return InvalidArgument("room id is empty; give every request a room id");
    if (spec.tokens <= 0) {
      return InvalidArgument("room '" + spec.room + "': tokens=" + std::to_string(spec.tokens) +
                             " must be positive");
    }
    const int64_t page_size = pool_->options().page_size;
    const int64_t num_pages = (spec.tokens + page_size - 1) / page_size;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = claims_.find(spec.room);
      if (it == claims_.end()) {
        KVT_RETURN_IF_ERROR(ClaimLocked(spec.room, spec.tokens));
        it = claims_.find(spec.room);
      } else if (it->second.submitting) {
        return AlreadyExists("room '" + spec.room +
                             "' is being submitted to this agent already; wait for that "
                             "submit's reply");
      } else if (it->second.abort_reason) {
        const Status aborted = AbortedBeforeStart(spec.room, it->second);
        claims_.erase(it);
        return aborted;
      }
      it->second.submitting = true;
      it->second.tokens = spec.tokens;
    }
    StatusOr<std::vector<int32_t>> allocated = allocator_->Allocate(num_pages);
    if (!allocated.ok()) return EndClaim(spec.room, allocated.status());
    const std::vector<int32_t> pages = *std::move(allocated);
    Range page_list;
    if (cuda_ != nullptr && options_.prefill) {
      // The forward's device copy of the page list (decode verifies one room at a time and
      // takes its run then).
      StatusOr<Range> range = cuda_->arena->Allocate(num_pages);
      if (!range.ok()) {
        FreePages(spec.room, pages, Range{});
        return EndClaim(spec.room, range.status().WithContext("room '" + spec.room + "'"));
      }
      page_list = *range;
    }
    bool aborted_meanwhile = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Claimed& claim = claims_.at(spec.room);
      aborted_meanwhile = claim.abort_reason.has_value();
      if (!aborted_meanwhile) {
        claim.pages = pages;  // from here on an abort frees them
        claim.page_list = page_list;
      }
    }
    if (aborted_meanwhile) {
      FreePages(spec.room, pages, page_list);
      return EndClaim(spec.room, OkStatus());
    }
    // Decode: connecting may take seconds (a peer that does not answer its hello); an abort
    // meanwhile frees the pages at once, and the room goes no further when the connect ends.
    StatusOr<transfer::PeerHandle> peer = transfer::PeerHandle{};
    if (!options_.prefill) peer = engine_->ConnectPeer(spec.prefill_host, spec.prefill_port);
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto it = claims_.find(spec.room);
      if (it->second.abort_reason) {
        // The abort took the pages and freed them.
        const Status aborted = AbortedBeforeStart(spec.room, it->second);
        claims_.erase(it);
        return aborted;
      }
      if (!peer.ok()) {
        claims_.erase(it);
        lock.unlock();
        FreePages(spec.room, pages, page_list);
        return peer.status();
      }
      it->second.starting = true;  // an abort from here on is applied once the engine has it
    }
    Status started = options_.prefill ? engine_->Send(spec.room, pages, spec.deadline)
                                      : engine_->Receive(spec.room, *peer, pages, spec.deadline);
    std::optional<std::string> abort_reason;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto node = claims_.extract(spec.room);
      abort_reason = node.mapped().abort_reason;
      if (!started.ok() && abort_reason) {
        started = AbortedBeforeStart(spec.room, node.mapped());
        RecordAbortedLocked(spec.room, spec.tokens, started);
      }
      if (started.ok()) {
        Request request;
        request.spec = spec;
        request.pages = pages;
        request.page_list = page_list;
        request.submitted = Clock::now();
        ++stats_.submitted;
        requests_.emplace(spec.room, std::move(request));
        pending_.push_back(spec.room);
        if (options_.prefill) forward_queue_.push_back(spec.room);
        cv_.notify_all();
      }
    }
    if (!started.ok()) {
      FreePages(spec.room, pages, page_list);
      return started;
    }
    if (abort_reason) {
      // Aborted while the engine took the room: the engine aborts it and tells the peer.
      (void)engine_->Abort(spec.room, *abort_reason);
      return Aborted("room '" + spec.room + "' was aborted while it started: " + *abort_reason);
    }
    return OkStatus();
  }

  Status Abort(const std::string& room, const std::string& reason) {
    bool before_start = false;
    std::vector<int32_t> pages;
    Range page_list;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto claim = claims_.find(room);
      if (claim != claims_.end() && !claim->second.abort_reason) {
        before_start = true;
        // Not started: it goes no further.
        Claimed& c = claim->second;
        c.abort_reason = reason;
        KVT_LOG_WARN("tool", "{} room '{}' aborted before it started: {}",
                     options_.prefill ? "prefill" : "decode", room, reason);
        if (c.starting) return OkStatus();  // Submit aborts it once the engine has it
        pages = std::exchange(c.pages, {});
        page_list = std::exchange(c.page_list, Range{});
        RecordAbortedLocked(room, c.tokens, AbortedBeforeStart(room, c));
      } else {
        auto it = requests_.find(room);
        if (it == requests_.end()) {
          if (claim != claims_.end()) return OkStatus();  // aborted already; the engine has it now
          return NotFound("room '" + room +
                          "' was not submitted to this agent (or ended before the last " +
                          std::to_string(options_.max_reports) +
                          " reports it keeps); check the room id and the agent it went to");
        }
        if (it->second.ended) {
          return AlreadyEnded(room, it->second.report.state, it->second.report.status);
        }
      }
    }
    if (before_start) {
      FreePages(room, pages, page_list);
      return OkStatus();
    }
    // Started: the engine aborts it and tells the peer.
    StatusOr<transfer::RequestInfo> info = engine_->GetRequest(room);
    if (info.ok() && IsFinal(info->state)) return AlreadyEnded(room, info->state, info->status);
    // A room that ends between that look and the abort is answered OK; its report says how.
    Status aborted = engine_->Abort(room, reason);
    if (aborted.code() != StatusCode::kNotFound) return aborted;
    // The monitor finished and forgot the room meanwhile.
    std::lock_guard<std::mutex> lock(mu_);
    auto it = requests_.find(room);
    if (it != requests_.end() && it->second.ended) {
      return AlreadyEnded(room, it->second.report.state, it->second.report.status);
    }
    return aborted;
  }

  std::vector<RequestReport> Reports(const std::vector<std::string>& rooms) const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<RequestReport> out;
    auto report_of = [&](const std::string& room) {
      auto it = requests_.find(room);
      if (it == requests_.end()) {
        RequestReport r;
        r.room = room;
        auto claim = claims_.find(room);
        if (claim != claims_.end()) {
          // Not started yet (or aborted while the engine takes it).
          r.tokens = claim->second.tokens;
          r.state =
              claim->second.abort_reason ? RequestState::kFailed : RequestState::kBootstrapping;
          r.status = AbortedBeforeStart(room, claim->second);
          return r;
        }
        r.state = RequestState::kFailed;
        r.status = NotFound("no room '" + room + "' on this agent");
        return r;
      }
      if (it->second.done) return it->second.report;
      // Still in flight: the engine's view.
      RequestReport r;
      r.room = room;
      r.tokens = it->second.spec.tokens;
      StatusOr<transfer::RequestInfo> info = engine_->GetRequest(room);
      if (info.ok()) {
        r.bytes = info->bytes;
        if (info->state == RequestState::kFailed) {
          // Failed now, whatever still holds its pages (a lost peer's fencing bound).
          r.state = RequestState::kFailed;
          r.status = info->status;
          r.pages_quarantined = !options_.prefill && !info->pages_reusable;
        } else {
          // A success is reported once verified and its pages are back.
          r.state = IsFinal(info->state) ? RequestState::kTransferring : info->state;
        }
      }
      return r;
    };
    if (rooms.empty()) {
      for (const auto& [room, req] : requests_) out.push_back(report_of(room));
      for (const auto& [room, claim] : claims_) {
        if (requests_.count(room) == 0) out.push_back(report_of(room));
      }
    } else {
      for (const std::string& room : rooms) out.push_back(report_of(room));
    }
    return out;
  }

  AgentStats Stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    AgentStats s = stats_;
    s.free_pages = allocator_->NumFree();
    s.total_pages = allocator_->num_pages();
    return s;
  }

  uint16_t engine_port() const { return engine_->port(); }
  const transfer::TransferEngine& engine() const { return *engine_; }
  const pool::KvPool& pool() const { return *pool_; }

 private:
  struct Request {
    SubmitSpec spec;
    std::vector<int32_t> pages;
    Clock::time_point submitted;
    // Prefill: the forward thread has enqueued (CUDA) or done (host) all it will for the room.
    bool forward_done = false;
    bool ended = false;  // final, and `report` says how (its pages may not be back yet)
    bool done = false;   // ended and its pages are back
    RequestReport report;
    // CUDA prefill. Written by the forward thread before forward_done, read by the monitor
    // after it. The events go back to the pool only once the room is final (the engine may
    // wait on them until then).
    Range page_list;                  // device copy of `pages` in the arena
    std::vector<cuda::Event> events;  // event l: layers [0, l] written
    cuda::Event forward_end;          // after the forward's last launch; null: nothing pending
  };

  // The resources of CUDA pools; null for host pools.
  struct CudaState {
    int device = 0;
    cuda::Stream stream;       // prefill: the forward; decode: verification
    cuda::DeviceBuffer bases;  // [2L] uint64: K base of layers 0..L-1, then V
    std::unique_ptr<PageListArena> arena;
    cuda::PinnedBuffer cancel;  // uint32, device-readable: non-zero stops simulated compute
    const volatile uint32_t* cancel_device = nullptr;
    std::mutex events_mu;  // guards free_events
    std::vector<cuda::Event> free_events;

    const uint64_t* k_bases() const { return bases.as<const uint64_t>(); }
    const uint64_t* v_bases(int64_t layers) const { return bases.as<const uint64_t>() + layers; }
  };

  Status InitCuda() {
    auto state = std::make_unique<CudaState>();
    state->device = options_.pool.device;
    KVT_ASSIGN_OR_RETURN(state->stream, cuda::Stream::Create(state->device));
    std::vector<uint64_t> bases = k_bases_;
    bases.insert(bases.end(), v_bases_.begin(), v_bases_.end());
    const size_t bases_bytes = bases.size() * sizeof(uint64_t);
    KVT_ASSIGN_OR_RETURN(state->bases, cuda::DeviceBuffer::Allocate(bases_bytes, state->device));
    KVT_RETURN_IF_ERROR(cuda::Copy(state->bases.data(), bases.data(), bases_bytes));
    // Every request holds its pages until it is final, so the lists in use never exceed the
    // pool's page count; twice that leaves room for fragmentation.
    const int64_t pages = pool_->layout().num_pages();
    KVT_ASSIGN_OR_RETURN(
        state->arena, PageListArena::Create(options_.prefill ? 2 * pages : pages, state->device));
    KVT_ASSIGN_OR_RETURN(state->cancel, cuda::PinnedBuffer::Allocate(sizeof(uint32_t)));
    *state->cancel.as<volatile uint32_t>() = 0;
    void* cancel_device = nullptr;
    KVT_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&cancel_device, state->cancel.data(), 0));
    state->cancel_device = static_cast<const volatile uint32_t*>(cancel_device);
    cuda_ = std::move(state);
    KVT_LOG_INFO("tool", "agent {}: CUDA pool on device {}; {} page-list entries preallocated",
                 options_.name, cuda_->device, cuda_->arena->capacity());
    return OkStatus();
  }

  // An event from the pool (created when the pool is empty; cudaEventCreate does not
  // synchronise the device).
  StatusOr<cuda::Event> AcquireEvent() {
    {
      std::lock_guard<std::mutex> lock(cuda_->events_mu);
      if (!cuda_->free_events.empty()) {
        cuda::Event event = std::move(cuda_->free_events.back());
        cuda_->free_events.pop_back();
        return event;
      }
    }
    return cuda::Event::Create(/*timing=*/false);
  }

  void ReleaseEvents(Request& r) {
    std::lock_guard<std::mutex> lock(cuda_->events_mu);
    for (cuda::Event& e : r.events) {
      if (e.get() != nullptr) cuda_->free_events.push_back(std::move(e));
    }
    r.events.clear();
    if (r.forward_end.get() != nullptr) cuda_->free_events.push_back(std::move(r.forward_end));
    r.forward_end = cuda::Event();
  }

  // The pattern of `layers` layers from `first_layer` of request `r` over the given tables
  // (host tables for the CPU kernels, device tables for the CUDA ones).
  kernels::PatternArgs PatternFor(const Request& r, int32_t first_layer, int32_t layers) const {
    return PatternOver(r, first_layer, layers, k_bases_.data(), v_bases_.data(), r.pages.data());
  }

  kernels::PatternArgs PatternOver(const Request& r, int32_t first_layer, int32_t layers,
                                   const uint64_t* k_bases, const uint64_t* v_bases,
                                   const int32_t* pages) const {
    kernels::PatternArgs a;
    a.request = PatternRequestId(r.spec.room, options_.engine.tp_rank);
    a.k_bases = k_bases + first_layer;
    a.v_bases = v_bases + first_layer;
    a.first_layer = first_layer;
    a.num_layers = layers;
    a.pages = pages;
    a.num_tokens = r.spec.tokens;
    a.page_size = pool_->options().page_size;
    a.row_bytes = pool_->layout().row_bytes();
    return a;
  }

  // Prefill: the simulated forward, one request at a time, layer by layer.
  void ForwardLoop() {
    if (cuda_ != nullptr) {
      Status device = UseDevice(cuda_->device);
      if (!device.ok()) KVT_LOG_ERROR("tool", "forward thread: {}", device.ToString());
    }
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      if (forward_queue_.empty()) {
        cv_.wait(lock);
        continue;
      }
      const std::string room = forward_queue_.front();
      forward_queue_.pop_front();
      Request* request = &requests_.at(room);  // stable: map nodes do not move
      lock.unlock();
      const auto forward_start = Clock::now();
      if (cuda_ != nullptr) {
        ForwardCuda(room, *request);
      } else {
        ForwardHost(room, *request);
      }
      KVT_LOG_DEBUG(
          "tool", "forward of room '{}' ({} tokens) {} in {} us", room, request->spec.tokens,
          cuda_ != nullptr ? "enqueued" : "ran",
          std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - forward_start)
              .count());
      lock.lock();
      request->forward_done = true;
    }
  }

  // Host pools: the CPU writes each layer (after a sleep standing for its compute).
  void ForwardHost(const std::string& room, const Request& request) {
    const int32_t layers = static_cast<int32_t>(pool_->options().layer_num);
    for (int32_t layer = 0; layer < layers && !stop_; ++layer) {
      if (options_.layer_time.count() > 0) std::this_thread::sleep_for(options_.layer_time);
      auto info = engine_->GetRequest(room);
      if (!info.ok() || IsFinal(info->state)) break;  // failed or aborted: stop writing
      if (!options_.skip_fill) {
        Status filled = kernels::FillPatternCpu(PatternFor(request, layer, 1));
        if (!filled.ok()) {
          KVT_LOG_ERROR("tool", "filling room '{}': {}", room, filled.ToString());
          (void)engine_->Abort(room, "the forward failed: " + filled.ToString());
          break;
        }
      }
      Status ready = engine_->LayersReady(room, layer + 1);
      if (!ready.ok()) break;  // the room is gone (failed and forgotten)
    }
  }

  // CUDA pools: enqueues the whole forward on the agent's stream and returns; the engine's
  // copies wait for each layer's event on the GPU.
  void ForwardCuda(const std::string& room, Request& request) {
    auto info = engine_->GetRequest(room);
    if (!info.ok() || IsFinal(info->state)) return;  // failed or aborted: nothing to write
    Status enqueued = EnqueueForward(room, request);
    if (!enqueued.ok()) {
      KVT_LOG_ERROR("tool", "forward of room '{}': {}", room, enqueued.ToString());
      (void)engine_->Abort(room, "the forward failed: " + enqueued.ToString());
    }
    // Whatever was enqueued must finish before the pages and the page list are reused.
    Status marked = MarkForwardEnd(request);
    if (!marked.ok()) {
      KVT_LOG_WARN("tool", "room '{}': {}; waiting for the stream instead", room,
                   marked.ToString());
      request.forward_end = cuda::Event();
      Status synced = cuda_->stream.Synchronize();
      if (!synced.ok()) {
        KVT_LOG_ERROR("tool", "the agent's CUDA stream failed: {}", synced.ToString());
      }
    }
  }

  Status EnqueueForward(const std::string& room, Request& request) {
    const int32_t layers = static_cast<int32_t>(pool_->options().layer_num);
    const cudaStream_t stream = cuda_->stream.get();
    // The page list: into the pinned mirror, then one asynchronous copy (the mirror run is
    // not touched again until the room is final and its forward has finished).
    int32_t* host_list = cuda_->arena->host(request.page_list);
    std::copy(request.pages.begin(), request.pages.end(), host_list);
    int32_t* device_list = cuda_->arena->device(request.page_list);
    KVT_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(device_list, host_list,
                                             request.pages.size() * sizeof(int32_t),
                                             cudaMemcpyHostToDevice, stream));
    const uint64_t layer_ns =
        static_cast<uint64_t>(std::chrono::nanoseconds(options_.layer_time).count());
    request.events.reserve(static_cast<size_t>(layers));
    for (int32_t layer = 0; layer < layers && !stop_; ++layer) {
      if (layer_ns > 0) {
        KVT_RETURN_IF_ERROR(cuda::ToStatus(
            LaunchSimulatedCompute(layer_ns, cuda_->cancel_device, stream), "simulated compute"));
      }
      if (!options_.skip_fill) {
        KVT_RETURN_IF_ERROR(kernels::FillPatternCuda(
            PatternOver(request, layer, 1, cuda_->k_bases(), cuda_->v_bases(layers), device_list),
            stream));
      }
      KVT_ASSIGN_OR_RETURN(cuda::Event event, AcquireEvent());
      request.events.push_back(std::move(event));  // owned by the room before it can fail
      KVT_RETURN_IF_ERROR(request.events.back().Record(stream));
      Status ready = engine_->LayersReady(room, layer + 1, request.events.back().get());
      if (!ready.ok()) break;  // the room is gone (failed and forgotten)
    }
    return OkStatus();
  }

  Status MarkForwardEnd(Request& request) {
    KVT_ASSIGN_OR_RETURN(cuda::Event event, AcquireEvent());
    request.forward_end = std::move(event);
    return request.forward_end.Record(cuda_->stream.get());
  }

  // True once the GPU finished everything the room's forward enqueued.
  bool ForwardFinishedOnDevice(const std::string& room, const Request& request) const {
    if (request.forward_end.get() == nullptr) return true;
    const cudaError_t state = cudaEventQuery(request.forward_end.get());
    if (state == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    if (state != cudaSuccess) {
      // The device failed; nothing more will run on it. Let the room finish.
      KVT_LOG_ERROR("tool", "room '{}': {}", room,
                    cuda::ToStatus(state, "cudaEventQuery").ToString());
    }
    return true;
  }

  // Both sides: notices final requests, verifies (decode), frees pages.
  void MonitorLoop() {
    if (cuda_ != nullptr) {
      Status device = UseDevice(cuda_->device);
      if (!device.ok()) KVT_LOG_ERROR("tool", "monitor thread: {}", device.ToString());
    }
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      std::vector<std::string> rooms(pending_.begin(), pending_.end());
      lock.unlock();
      std::vector<std::string> finished;
      for (const std::string& room : rooms) {
        StatusOr<transfer::RequestInfo> info = engine_->GetRequest(room);
        if (info.ok() && !IsFinal(info->state)) continue;
        if (info.ok() && !options_.prefill && !info->pages_reusable) continue;
        if (options_.prefill) {
          std::lock_guard<std::mutex> guard(mu_);
          const Request& request = requests_.at(room);
          if (!request.forward_done) continue;  // its pages are still being written
          if (!ForwardFinishedOnDevice(room, request)) continue;  // ... by the GPU
        }
        Finish(room, info);
        finished.push_back(room);
      }
      lock.lock();
      for (const std::string& room : finished) {
        pending_.erase(std::find(pending_.begin(), pending_.end(), room));
      }
      cv_.wait_for(
          lock, finished.empty() ? std::chrono::microseconds(500) : std::chrono::microseconds(0));
    }
  }

  void Finish(const std::string& room, const StatusOr<transfer::RequestInfo>& info) {
    Request* request;
    {
      std::lock_guard<std::mutex> lock(mu_);
      request = &requests_.at(room);
    }
    RequestReport report;
    report.room = room;
    report.tokens = request->spec.tokens;
    if (!info.ok()) {
      report.state = RequestState::kFailed;
      report.status = info.status();
    } else {
      report.state = info->state;
      report.status = info->status;
      report.bytes = info->bytes;
      report.latency_us =
          std::chrono::duration<double, std::micro>(info->finished - info->created).count();
    }
    if (!options_.prefill && options_.verify && report.state == RequestState::kSuccess) {
      StatusOr<kernels::PatternCheck> check =
          cuda_ != nullptr ? VerifyCuda(*request)
                           : kernels::VerifyPatternCpu(PatternFor(
                                 *request, 0, static_cast<int32_t>(pool_->options().layer_num)));
      if (!check.ok()) {
        report.status = check.status();
      } else {
        report.mismatches = check->mismatches;
        report.verified = check->mismatches == 0;
        if (check->mismatches > 0) {
          report.first_mismatch =
              "layer " + std::to_string(check->layer) + (check->kv == 0 ? " K" : " V") + " token " +
              std::to_string(check->token) + " byte " + std::to_string(check->byte);
          report.status =
              DataLoss("room '" + room + "': " + std::to_string(check->mismatches) +
                       " bytes differ from the pattern, first at " + report.first_mismatch);
        }
      }
    }
    if (report.state != RequestState::kSuccess || !report.status.ok()) {
      // Either side's operator sees which request failed and why (a lost peer included).
      KVT_LOG_WARN(
          "tool", "{} room '{}' failed after {:.0f} us: {}",
          options_.prefill ? "prefill" : "decode", room,
          std::chrono::duration<double, std::micro>(Clock::now() - request->submitted).count(),
          report.status.ToString());
    }
    {
      // From here on an abort is answered with how the room ended.
      std::lock_guard<std::mutex> lock(mu_);
      request->report = report;
      request->ended = true;
    }
    (void)engine_->Forget(room);
    if (cuda_ != nullptr) {
      // The room is final and its forward finished on the device: nothing waits on these.
      ReleaseEvents(*request);
      if (request->page_list.valid()) cuda_->arena->Free(request->page_list);
      request->page_list = Range{};
    }
    Status freed = allocator_->Free(request->pages);
    if (!freed.ok()) KVT_LOG_ERROR("tool", "freeing room '{}': {}", room, freed.ToString());
    std::lock_guard<std::mutex> lock(mu_);
    if (report.state == RequestState::kSuccess && report.status.ok()) {
      ++stats_.succeeded;
      stats_.bytes += report.bytes;
    } else {
      ++stats_.failed;
    }
    if (report.verified) ++stats_.verified;
    if (report.mismatches > 0) ++stats_.corrupted;
    request->done = true;
    request->report = std::move(report);
    finished_.push_back(room);
    TrimReportsLocked();
  }

  void TrimReportsLocked() {
    while (finished_.size() > options_.max_reports) {
      requests_.erase(finished_.front());
      finished_.pop_front();
    }
  }

  // A room between its claim and the engine's start (see Agent::Claim).
  struct Claimed {
    int64_t tokens = 0;
    bool submitting = false;     // Submit runs for it
    bool starting = false;       // Submit is handing it to the engine: an abort is applied after
    std::vector<int32_t> pages;  // allocated by Submit, not yet the engine's
    Range page_list;             // CUDA prefill: the pages' device copy
    std::optional<std::string> abort_reason;  // set once aborted
  };

  Status ClaimLocked(const std::string& room, int64_t tokens) {
    if (claims_.count(room) != 0) {
      return AlreadyExists("room '" + room +
                           "' is being submitted to this agent already; wait for that submit's "
                           "reply");
    }
    if (requests_.count(room) != 0) {
      return AlreadyExists("room '" + room +
                           "' was already submitted to this agent; QueryRequests has its report, "
                           "and a new request needs a new room id");
    }
    Claimed claim;
    claim.tokens = tokens;
    claims_.emplace(room, std::move(claim));
    return OkStatus();
  }

  // OK, or the Aborted status of a claim that was aborted.
  static Status AbortedBeforeStart(const std::string& room, const Claimed& claim) {
    if (!claim.abort_reason) return OkStatus();
    return Aborted("room '" + room + "' was aborted before it started: " + *claim.abort_reason);
  }

  // Ends the claim of a Submit that failed with `status` (or was aborted meanwhile: then the
  // abort's status).
  Status EndClaim(const std::string& room, const Status& status) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = claims_.find(room);
    if (it == claims_.end()) return status;
    const Status aborted = AbortedBeforeStart(room, it->second);
    claims_.erase(it);
    return aborted.ok() ? status : aborted;
  }

  // The final report of a room aborted before its engine had it.
  void RecordAbortedLocked(const std::string& room, int64_t tokens, const Status& why) {
    Request request;
    request.spec.room = room;
    request.spec.tokens = tokens;
    request.ended = true;
    request.done = true;
    request.report.room = room;
    request.report.state = RequestState::kFailed;
    request.report.status = why;
    request.report.tokens = tokens;
    requests_.emplace(room, std::move(request));
    finished_.push_back(room);
    TrimReportsLocked();
  }

  static Status AlreadyEnded(const std::string& room, RequestState state, const Status& status) {
    return FailedPrecondition(
        "room '" + room + "' already ended (" + transfer::RequestStateName(state) +
        (status.ok() ? std::string() : ": " + status.ToString()) +
        "); there is nothing left to abort, and QueryRequests has its report");
  }

  void FreePages(const std::string& room, const std::vector<int32_t>& pages, Range page_list) {
    if (!pages.empty()) {
      Status freed = allocator_->Free(pages);
      if (!freed.ok()) KVT_LOG_ERROR("tool", "freeing room '{}': {}", room, freed.ToString());
    }
    if (page_list.valid()) cuda_->arena->Free(page_list);
  }

  // Decode, CUDA pools: checks the received pages on the device (the pattern kernel reads a
  // device copy of the page list; VerifyPatternCuda synchronises the stream).
  StatusOr<kernels::PatternCheck> VerifyCuda(const Request& request) {
    const int32_t layers = static_cast<int32_t>(pool_->options().layer_num);
    KVT_ASSIGN_OR_RETURN(Range range,
                         cuda_->arena->Allocate(static_cast<int64_t>(request.pages.size())));
    int32_t* host_list = cuda_->arena->host(range);
    int32_t* device_list = cuda_->arena->device(range);
    std::copy(request.pages.begin(), request.pages.end(), host_list);
    Status copied = cuda::ToStatus(
        cudaMemcpyAsync(device_list, host_list, request.pages.size() * sizeof(int32_t),
                        cudaMemcpyHostToDevice, cuda_->stream.get()),
        "cudaMemcpyAsync (page list)");
    StatusOr<kernels::PatternCheck> check =
        copied.ok() ? kernels::VerifyPatternCuda(PatternOver(request, 0, layers, cuda_->k_bases(),
                                                             cuda_->v_bases(layers), device_list),
                                                 cuda_->stream.get())
                    : StatusOr<kernels::PatternCheck>(copied);
    if (!check.ok()) (void)cuda_->stream.Synchronize();  // the run may be read still
    cuda_->arena->Free(range);
    return check;
  }

  const AgentOptions options_;
  std::unique_ptr<pool::KvPool> pool_;
  std::unique_ptr<pool::PageAllocator> allocator_;
  std::unique_ptr<transfer::TransferEngine> engine_;
  std::vector<uint64_t> k_bases_, v_bases_;
  std::unique_ptr<CudaState> cuda_;  // CUDA pools only; set in Init, before the threads start
  std::thread forward_;
  std::thread monitor_;

  mutable std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  bool stop_ = false;
  std::map<std::string, Request> requests_;
  std::map<std::string, Claimed> claims_;  // claimed, not yet the engine's (or aborted meanwhile)
  std::deque<std::string> pending_;        // submitted, not yet final
  std::deque<std::string> forward_queue_;  // prefill: rooms whose forward has not run
  std::deque<std::string> finished_;       // final rooms, oldest first (bounded report memory)
  AgentStats stats_;
};

Agent::Agent(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Agent::~Agent() = default;

StatusOr<std::unique_ptr<Agent>> Agent::Create(const AgentOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  KVT_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<Agent>(new Agent(std::move(impl)));
}

Status Agent::Claim(const std::string& room, int64_t tokens) { return impl_->Claim(room, tokens); }
Status Agent::Release(const std::string& room) { return impl_->Release(room); }
Status Agent::ConnectPrefill(const std::string& room, const std::string& host, uint16_t port) {
  return impl_->ConnectPrefill(room, host, port);
}
Status Agent::Submit(const SubmitSpec& spec) { return impl_->Submit(spec); }
Status Agent::Abort(const std::string& room, const std::string& reason) {
  return impl_->Abort(room, reason);
}
std::vector<RequestReport> Agent::Reports(const std::vector<std::string>& rooms) const {
  return impl_->Reports(rooms);
}
AgentStats Agent::Stats() const { return impl_->Stats(); }
uint16_t Agent::engine_port() const { return impl_->engine_port(); }
const transfer::TransferEngine& Agent::engine() const { return impl_->engine(); }
const pool::KvPool& Agent::pool() const { return impl_->pool(); }

}  // namespace kvt::tools

#include "agent.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>

#include "kvt/common/log.h"
#include "kvt/kernels/kernels.h"
#include "kvt/pool/page_allocator.h"
#include "pattern_id.h"

namespace kvt::tools {
namespace {

using Clock = std::chrono::steady_clock;
using transfer::IsFinal;
using transfer::RequestState;

}  // namespace

class Agent::Impl {
 public:
  explicit Impl(const AgentOptions& options) : options_(options) {}

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (forward_.joinable()) forward_.join();
    if (monitor_.joinable()) monitor_.join();
    engine_.reset();  // before the pool it points into
  }

  Status Init() {
    if (options_.pool.memory != pool::MemoryKind::kHost) {
      return Unimplemented(
          "kvt-agent runs host pools in this build; CUDA pools come with the "
          "cuda_ipc backend");
    }
    // The backend first, so that the pool's memory can come from it: UCX's shared-memory
    // transports write straight into a peer's buffers only when UCX allocated them.
    KVT_ASSIGN_OR_RETURN(
        std::shared_ptr<transfer::Backend> backend,
        transfer::CreateBackend(options_.engine.backend, options_.engine.backend_options));
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
    if (options_.prefill) forward_ = std::thread([this] { ForwardLoop(); });
    monitor_ = std::thread([this] { MonitorLoop(); });
    return OkStatus();
  }

  Status Submit(const SubmitSpec& spec) {
    if (spec.room.empty()) return InvalidArgument("room id is empty");
    if (spec.tokens <= 0) {
      return InvalidArgument("room '" + spec.room + "': tokens=" + std::to_string(spec.tokens) +
                             " must be positive");
    }
    const int64_t page_size = pool_->options().page_size;
    const int64_t num_pages = (spec.tokens + page_size - 1) / page_size;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (requests_.count(spec.room) != 0) {
        return AlreadyExists("room '" + spec.room + "' was already submitted to this agent");
      }
    }
    KVT_ASSIGN_OR_RETURN(std::vector<int32_t> pages, allocator_->Allocate(num_pages));
    Request request;
    request.spec = spec;
    request.pages = pages;
    request.submitted = Clock::now();
    Status started;
    if (options_.prefill) {
      started = engine_->Send(spec.room, pages);
    } else {
      StatusOr<transfer::PeerHandle> peer =
          engine_->ConnectPeer(spec.prefill_host, spec.prefill_port);
      started =
          peer.ok() ? engine_->Receive(spec.room, *peer, pages, spec.deadline) : peer.status();
    }
    if (!started.ok()) {
      (void)allocator_->Free(pages);
      return started;
    }
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.submitted;
    requests_.emplace(spec.room, std::move(request));
    pending_.push_back(spec.room);
    if (options_.prefill) forward_queue_.push_back(spec.room);
    cv_.notify_all();
    return OkStatus();
  }

  Status Abort(const std::string& room, const std::string& reason) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (requests_.count(room) == 0) {
        return NotFound("room '" + room + "' was not submitted to this agent");
      }
    }
    Status st = engine_->Abort(room, reason);
    // The monitor may already have finished and forgotten the room: nothing left to abort.
    return st.code() == StatusCode::kNotFound ? OkStatus() : st;
  }

  std::vector<RequestReport> Reports(const std::vector<std::string>& rooms) const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<RequestReport> out;
    auto report_of = [&](const std::string& room) {
      auto it = requests_.find(room);
      if (it == requests_.end()) {
        RequestReport r;
        r.room = room;
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
        // Final in the engine but not yet finished here (verification, page release).
        r.state = IsFinal(info->state) ? RequestState::kTransferring : info->state;
        r.bytes = info->bytes;
      }
      return r;
    };
    if (rooms.empty()) {
      for (const auto& [room, req] : requests_) out.push_back(report_of(room));
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
    bool forward_done = false;  // prefill: the forward no longer touches the pages
    bool done = false;
    RequestReport report;
  };

  kernels::PatternArgs PatternFor(const Request& r, int32_t first_layer, int32_t layers) const {
    kernels::PatternArgs a;
    a.request = PatternRequestId(r.spec.room);
    a.k_bases = k_bases_.data() + first_layer;
    a.v_bases = v_bases_.data() + first_layer;
    a.first_layer = first_layer;
    a.num_layers = layers;
    a.pages = r.pages.data();
    a.num_tokens = r.spec.tokens;
    a.page_size = pool_->options().page_size;
    a.row_bytes = pool_->layout().row_bytes();
    return a;
  }

  // Prefill: the simulated forward, one request at a time, layer by layer.
  void ForwardLoop() {
    const int32_t layers = static_cast<int32_t>(pool_->options().layer_num);
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      if (forward_queue_.empty()) {
        cv_.wait(lock);
        continue;
      }
      const std::string room = forward_queue_.front();
      forward_queue_.pop_front();
      const Request* request = &requests_.at(room);  // stable: map nodes do not move
      lock.unlock();
      const auto forward_start = Clock::now();
      for (int32_t layer = 0; layer < layers && !stop_; ++layer) {
        if (options_.layer_time.count() > 0) std::this_thread::sleep_for(options_.layer_time);
        auto info = engine_->GetRequest(room);
        if (!info.ok() || IsFinal(info->state)) break;  // failed or aborted: stop writing
        if (!options_.skip_fill) {
          Status filled = kernels::FillPatternCpu(PatternFor(*request, layer, 1));
          if (!filled.ok()) {
            KVT_LOG_ERROR("tool", "filling room '{}': {}", room, filled.ToString());
            (void)engine_->Abort(room, "the forward failed: " + filled.ToString());
            break;
          }
        }
        Status ready = engine_->LayersReady(room, layer + 1);
        if (!ready.ok()) break;  // the room is gone (failed and forgotten)
      }
      KVT_LOG_DEBUG(
          "tool", "forward of room '{}' ({} tokens) took {} us", room, request->spec.tokens,
          std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - forward_start)
              .count());
      lock.lock();
      requests_.at(room).forward_done = true;
    }
  }

  // Both sides: notices final requests, verifies (decode), frees pages.
  void MonitorLoop() {
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
          if (!requests_.at(room).forward_done) continue;  // its pages are still being written
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
      StatusOr<kernels::PatternCheck> check = kernels::VerifyPatternCpu(
          PatternFor(*request, 0, static_cast<int32_t>(pool_->options().layer_num)));
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
    (void)engine_->Forget(room);
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
    while (finished_.size() > options_.max_reports) {
      requests_.erase(finished_.front());
      finished_.pop_front();
    }
  }

  const AgentOptions options_;
  std::unique_ptr<pool::KvPool> pool_;
  std::unique_ptr<pool::PageAllocator> allocator_;
  std::unique_ptr<transfer::TransferEngine> engine_;
  std::vector<uint64_t> k_bases_, v_bases_;
  std::thread forward_;
  std::thread monitor_;

  mutable std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  bool stop_ = false;
  std::map<std::string, Request> requests_;
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

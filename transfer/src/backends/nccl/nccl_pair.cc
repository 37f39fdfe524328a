#include "backends/nccl/nccl_pair.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <span>
#include <utility>

#include "kvt/common/log.h"
#include "kvt/kernels/kernels.h"

namespace kvt::transfer::nccl {
namespace {

using Clock = std::chrono::steady_clock;

std::string Ms(std::chrono::milliseconds ms) { return std::to_string(ms.count()) + " ms"; }

int64_t MsSince(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

// Streams are drained after the communicator went away; past this the memory they may still
// touch is leaked rather than freed under a running kernel.
constexpr std::chrono::seconds kDrainStreamsTimeout{10};
// A graceful ncclCommFinalize gets this long before the communicator is aborted instead.
constexpr std::chrono::seconds kFinalizeTimeout{10};

}  // namespace

// ---- ScopedDevice ---------------------------------------------------------------------------

ScopedDevice::ScopedDevice(int device) {
  if (cudaGetDevice(&previous_) != cudaSuccess) {
    (void)cudaGetLastError();
    previous_ = -1;
  }
  if (previous_ != device) status_ = kvt::cuda::ToStatus(cudaSetDevice(device), "cudaSetDevice");
}

ScopedDevice::~ScopedDevice() {
  int now = -1;
  if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_) {
    (void)cudaSetDevice(previous_);
  }
  (void)cudaGetLastError();
}

SenderJob::~SenderJob() {
  if (gate != nullptr) (void)cudaEventDestroy(gate);  // deferred by CUDA while still awaited
}

// ---- Resources ------------------------------------------------------------------------------

struct Pair::Resources {
  uint64_t slot_bytes = 0;
  kvt::cuda::Stream comm_stream;       // NCCL groups and their header/ack copies
  kvt::cuda::Stream work_stream;       // pack (sender) or unpack (receiver) kernels
  kvt::cuda::Stream gate_stream;       // sender: records each write's gate after its ready event
  kvt::cuda::DeviceBuffer slots;       // kRing x slot_bytes: header + payload of a step
  kvt::cuda::DeviceBuffer acks;        // kRing x kAckBytes
  kvt::cuda::DeviceBuffer src_tables;  // sender: kRing x kMaxChunkPages source pages
  kvt::cuda::PinnedBuffer headers;     // kRing x kHeaderBytes, host side of the headers
  kvt::cuda::PinnedBuffer host_acks;   // kRing x kAckBytes
  kvt::cuda::PinnedBuffer host_src;    // sender: kRing x kMaxChunkPages
  std::array<kvt::cuda::Event, kRing> step_done;  // comm stream passed step n
  std::array<kvt::cuda::Event, kRing> work_done;  // work stream passed step n's (un)pack

  uint8_t* slot(uint64_t step) const { return slots.as<uint8_t>() + (step % kRing) * slot_bytes; }
  uint8_t* ack(uint64_t step) const { return acks.as<uint8_t>() + (step % kRing) * kAckBytes; }
  std::span<uint8_t> header(uint64_t step) const {
    return {headers.as<uint8_t>() + (step % kRing) * kHeaderBytes, kHeaderBytes};
  }
  std::span<uint8_t> host_ack(uint64_t step) const {
    return {host_acks.as<uint8_t>() + (step % kRing) * kAckBytes, kAckBytes};
  }
  int32_t* src_table(uint64_t step) const {
    return src_tables.as<int32_t>() + (step % kRing) * kMaxChunkPages;
  }
  int32_t* host_src_table(uint64_t step) const {
    return host_src.as<int32_t>() + (step % kRing) * kMaxChunkPages;
  }
  cudaEvent_t step_event(uint64_t step) const { return step_done[step % kRing].get(); }
  cudaEvent_t work_event(uint64_t step) const { return work_done[step % kRing].get(); }
};

// ---- Construction and the public side -------------------------------------------------------

Pair::Pair(const NcclApi& api, Config config)
    : api_(api),
      config_(std::move(config)),
      payload_capacity_(config_.token.slot_bytes - kHeaderBytes),
      started_(Clock::now()),
      registration_(config_.registration) {}

StatusOr<std::shared_ptr<Pair>> Pair::Start(const NcclApi& api, Config config) {
  if (config.token.slot_bytes < kMinSlotBytes || config.token.slot_bytes > kMaxSlotBytes) {
    return InvalidArgument("nccl staging slots of " + std::to_string(config.token.slot_bytes) +
                           " bytes; they must be in [" + std::to_string(kMinSlotBytes) + ", " +
                           std::to_string(kMaxSlotBytes) + "]");
  }
  ScopedDevice scoped(config.device);
  KVT_RETURN_IF_ERROR(scoped.status());
  std::shared_ptr<Pair> pair(new Pair(api, std::move(config)));
  auto res = std::make_unique<Resources>();
  const bool sender = pair->config_.role == Role::kSender;
  const int device = pair->config_.device;
  res->slot_bytes = pair->config_.token.slot_bytes;
  KVT_ASSIGN_OR_RETURN(res->comm_stream, kvt::cuda::Stream::Create(device));
  KVT_ASSIGN_OR_RETURN(res->work_stream, kvt::cuda::Stream::Create(device));
  if (sender) {
    KVT_ASSIGN_OR_RETURN(res->gate_stream, kvt::cuda::Stream::Create(device));
  }
  KVT_ASSIGN_OR_RETURN(res->slots,
                       kvt::cuda::DeviceBuffer::Allocate(kRing * res->slot_bytes, device));
  KVT_ASSIGN_OR_RETURN(res->acks, kvt::cuda::DeviceBuffer::Allocate(kRing * kAckBytes, device));
  KVT_ASSIGN_OR_RETURN(res->headers, kvt::cuda::PinnedBuffer::Allocate(kRing * kHeaderBytes));
  KVT_ASSIGN_OR_RETURN(res->host_acks, kvt::cuda::PinnedBuffer::Allocate(kRing * kAckBytes));
  if (sender) {
    const size_t table_bytes = kRing * size_t{kMaxChunkPages} * sizeof(int32_t);
    KVT_ASSIGN_OR_RETURN(res->src_tables, kvt::cuda::DeviceBuffer::Allocate(table_bytes, device));
    KVT_ASSIGN_OR_RETURN(res->host_src, kvt::cuda::PinnedBuffer::Allocate(table_bytes));
  }
  for (uint64_t i = 0; i < kRing; ++i) {
    KVT_ASSIGN_OR_RETURN(res->step_done[i], kvt::cuda::Event::Create(/*timing=*/false));
    KVT_ASSIGN_OR_RETURN(res->work_done[i], kvt::cuda::Event::Create(/*timing=*/false));
  }
  pair->res_ = std::move(res);
  pair->thread_ = std::thread([raw = pair.get()] { raw->Run(); });
  KVT_LOG_DEBUG("nccl", "{}: started ({} slots of {} bytes)", pair->Describe(), kRing,
                pair->config_.token.slot_bytes);
  return pair;
}

Pair::~Pair() {
  Status stopped = Stop(Backend::DisconnectMode::kPeerDead);
  (void)stopped;
}

std::string Pair::Describe() const {
  std::string text = "nccl pair ";
  char nonce[17];
  std::snprintf(nonce, sizeof(nonce), "%016llx",
                static_cast<unsigned long long>(config_.token.nonce));
  text += nonce;
  text += config_.role == Role::kSender ? " (rank 0, sending to " : " (rank 1, receiving from ";
  text += config_.peer + ")";
  return text;
}

Status Pair::Post(std::shared_ptr<SenderJob> job, cudaEvent_t ready) {
  if (config_.role != Role::kSender) {
    return FailedPrecondition("peer " + std::to_string(config_.id) +
                              " joined this side with Accept: the receiving side of an nccl pair "
                              "posts no writes");
  }
  ScopedDevice scoped(config_.device);
  KVT_RETURN_IF_ERROR(scoped.status());
  if (ready != nullptr && !job->chunks.empty()) {
    KVT_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&job->gate, cudaEventDisableTiming));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (phase_ == Phase::kFailed) return failure_;
  if (stop_requested_ || stopped_) {
    return FailedPrecondition("nccl peer " + std::to_string(config_.id) +
                              " is disconnecting; it takes no new writes");
  }
  if (job->gate != nullptr) {
    // Captured now: the caller may record `ready` again right after this returns.
    KVT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(res_->gate_stream.get(), ready, 0));
    KVT_CUDA_RETURN_IF_ERROR(cudaEventRecord(job->gate, res_->gate_stream.get()));
  }
  const WriteId id = job->id;
  WriteRecord& record = writes_[id];
  record.job = std::move(job);
  if (record.job->chunks.empty()) {
    record.status = OkStatus();
  } else {
    pending_.push_back(id);
    wake_ = true;
    cv_.notify_all();
  }
  return OkStatus();
}

Status Pair::Check(WriteId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = writes_.find(id);
  if (it == writes_.end()) return NotFound("no nccl write " + std::to_string(id));
  return it->second.status;
}

void Pair::Release(WriteId id) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = writes_.find(id);
  if (it == writes_.end()) return;
  WriteRecord& record = it->second;
  record.released = true;
  pending_.erase(std::remove(pending_.begin(), pending_.end(), id), pending_.end());
  // Announced chunks will be unpacked by the receiver whatever this side does; wait for them
  // so that no byte of the write lands after Release. A stalled pair fails within the stall
  // timeout, which ends the wait as well.
  const auto deadline = Clock::now() + config_.tuning.stall_timeout + config_.tuning.drain_timeout;
  const bool settled = cv_.wait_until(lock, deadline, [&] {
    return record.resolved >= record.next_chunk || phase_ == Phase::kFailed || stopped_;
  });
  if (!settled) {
    KVT_LOG_WARN("nccl", "{}: released write {} with {} chunks still unacknowledged", Describe(),
                 id, record.next_chunk - record.resolved);
  }
  writes_.erase(id);
}

void Pair::SetRegistration(std::shared_ptr<const Registration> registration) {
  std::lock_guard<std::mutex> lock(mutex_);
  registration_ = std::move(registration);
}

Status Pair::Stop(Backend::DisconnectMode mode) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!stop_requested_) {
      stop_requested_ = true;
      stop_mode_ = mode;
    } else if (mode == Backend::DisconnectMode::kPeerDead) {
      stop_mode_ = mode;  // a second, harder stop shortens a graceful one
    }
    wake_ = true;
    cv_.notify_all();
  }
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
  std::lock_guard<std::mutex> lock(mutex_);
  if (!stopped_) {
    stopped_ = true;
    for (auto& [id, record] : writes_) {
      if (record.status.code() == StatusCode::kInProgress) {
        record.status =
            Aborted("nccl peer " + std::to_string(config_.id) + " (" + config_.peer +
                    ") was disconnected before write " + std::to_string(id) + " completed");
      }
    }
    pending_.clear();
    if (phase_ != Phase::kFailed) phase_ = Phase::kStopped;
  }
  cv_.notify_all();
  return OkStatus();
}

// ---- Progress thread: common ----------------------------------------------------------------

void Pair::Run() {
  Status status = kvt::cuda::ToStatus(cudaSetDevice(config_.device), "cudaSetDevice");
  if (status.ok()) status = InitCommunicator();
  if (status.ok()) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (phase_ == Phase::kConnecting) phase_ = Phase::kReady;
    }
    KVT_LOG_INFO("nccl", "{}: communicator up after {} ms (NCCL {})", Describe(), MsSince(started_),
                 api_.VersionString());
    status = config_.role == Role::kSender ? RunSender() : RunReceiver();
  }
  if (!status.ok()) Fail(status);
  if (comm_ != nullptr) AbortCommunicator();
  ReleaseResources();
}

Status Pair::InitCommunicator() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // init and groups return at once; progress is polled
  config.commName = "kvt";
  ncclUniqueId id;
  static_assert(sizeof(ncclUniqueId) == kUniqueIdBytes, "kUniqueIdBytes must match nccl.h");
  std::memcpy(&id, config_.token.unique_id.data(), sizeof(id));
  const int rank = config_.role == Role::kSender ? 0 : 1;
  const ncclResult_t started = api_.CommInitRankConfig(&comm_, 2, id, rank, &config);
  if (started != ncclSuccess && started != ncclInProgress) {
    return api_.ToStatus(started, comm_,
                         "ncclCommInitRankConfig (rank " + std::to_string(rank) + " of the pair)");
  }
  const auto deadline = started_ + config_.tuning.connect_timeout;
  while (true) {
    ncclResult_t state = ncclInProgress;
    const ncclResult_t queried = api_.CommGetAsyncError(comm_, &state);
    if (queried != ncclSuccess) return api_.ToStatus(queried, comm_, "ncclCommGetAsyncError");
    if (state == ncclSuccess) return OkStatus();
    if (state != ncclInProgress) {
      return api_.ToStatus(state, comm_, "creating the nccl communicator with " + config_.peer);
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stop_requested_) {
        return Aborted("disconnected while the nccl communicator with " + config_.peer +
                       " was being set up");
      }
    }
    if (Clock::now() > deadline) {
      return DeadlineExceeded(
          "the nccl communicator with " + config_.peer + " was not up within " +
          Ms(config_.tuning.connect_timeout) + " of " +
          (rank == 0 ? "Connect: the peer must Accept this side's token (sent in the hello-ack)"
                     : "Accept: the sender's host must be reachable (NCCL bootstrap)") +
          " and run NCCL >= 2.19");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

Status Pair::WaitGroupIssued(const char* what) {
  // Issuing a group can need the peer: the first one sets up the pair's connections, which both
  // ranks do together. The sender's peer always has its next steps posted, so the sender bounds
  // the wait by the stall timeout; the receiver's peer issues a step only when it has something
  // to send (or ticks), so the receiver waits as long as its silence rule allows.
  const auto start = Clock::now();
  const bool sender = config_.role == Role::kSender;
  const bool bounded = sender || config_.token.idle_tick_ms > 0;
  const std::chrono::milliseconds limit =
      sender ? config_.tuning.stall_timeout : config_.tuning.receiver_silence_timeout;
  auto pause = std::chrono::microseconds(0);
  while (true) {
    ncclResult_t state = ncclInProgress;
    const ncclResult_t queried = api_.CommGetAsyncError(comm_, &state);
    if (queried != ncclSuccess) return api_.ToStatus(queried, comm_, "ncclCommGetAsyncError");
    if (state == ncclSuccess) return OkStatus();
    if (state != ncclInProgress) return api_.ToStatus(state, comm_, what);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stop_requested_ && (!sender || stop_mode_ == Backend::DisconnectMode::kPeerDead)) {
        return Aborted(std::string("disconnected while ") + what + " waited for the peer");
      }
    }
    if (bounded && Clock::now() - start > limit) {
      return Unavailable(std::string(what) + " was not issued within " + Ms(limit) +
                         ": the peer does not take part");
    }
    // Yield at first (issuing is quick once connected), then sleep a little.
    if (Clock::now() - start > std::chrono::milliseconds(1)) {
      pause = std::min(pause + std::chrono::microseconds(50), std::chrono::microseconds(1000));
      std::this_thread::sleep_for(pause);
    } else {
      std::this_thread::yield();
    }
  }
}

Status Pair::Group(void* send_buffer, size_t send_bytes, void* recv_buffer, size_t recv_bytes,
                   const char* what) {
  const int peer = config_.role == Role::kSender ? 1 : 0;
  cudaStream_t stream = res_->comm_stream.get();
  ncclResult_t result = api_.GroupStart();
  if (result != ncclSuccess) return api_.ToStatus(result, comm_, "ncclGroupStart");
  // The group is always closed, even when an operation was refused, so that this thread's
  // group depth stays balanced.
  ncclResult_t first = api_.Send(send_buffer, send_bytes, ncclUint8, peer, comm_, stream);
  const ncclResult_t recv = api_.Recv(recv_buffer, recv_bytes, ncclUint8, peer, comm_, stream);
  if (first == ncclSuccess || first == ncclInProgress) first = recv;
  result = api_.GroupEnd();
  if (first != ncclSuccess && first != ncclInProgress) return api_.ToStatus(first, comm_, what);
  if (result != ncclSuccess && result != ncclInProgress) return api_.ToStatus(result, comm_, what);
  // Non-blocking communicator: the group is issued to the stream only once the state says so.
  return WaitGroupIssued(what);
}

void Pair::Backoff(Clock::time_point last_progress) {
  const auto idle = Clock::now() - last_progress;
  if (idle < std::chrono::microseconds(100)) {
    std::this_thread::yield();
  } else if (idle < std::chrono::milliseconds(20)) {
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

void Pair::Fail(const Status& status) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (phase_ == Phase::kFailed) return;
  const bool stopping = stop_requested_;
  phase_ = Phase::kFailed;
  failure_ = status.code() == StatusCode::kInProgress ? Internal(status.message()) : status;
  failure_ =
      failure_.WithContext("nccl peer " + std::to_string(config_.id) + " (" + config_.peer + ")");
  for (auto& [id, record] : writes_) {
    if (record.status.code() == StatusCode::kInProgress) record.status = failure_;
  }
  pending_.clear();
  cv_.notify_all();
  if (stopping && status.code() == StatusCode::kAborted) {
    KVT_LOG_DEBUG("nccl", "{}: {}", Describe(), status.message());
  } else {
    KVT_LOG_ERROR("nccl", "{}: failed: {}", Describe(), status.message());
  }
}

void Pair::AbortCommunicator() {
  if (comm_ == nullptr) return;
  const ncclResult_t result = api_.CommAbort(comm_);
  if (result != ncclSuccess) {
    KVT_LOG_WARN("nccl", "{}: ncclCommAbort: {}", Describe(), api_.GetErrorString(result));
  } else {
    KVT_LOG_INFO("nccl", "{}: communicator aborted", Describe());
  }
  comm_ = nullptr;
}

Status Pair::DestroyCommunicator() {
  const ncclResult_t finalize = api_.CommFinalize(comm_);
  if (finalize != ncclSuccess && finalize != ncclInProgress) {
    Status status = api_.ToStatus(finalize, comm_, "ncclCommFinalize");
    AbortCommunicator();
    return status;
  }
  const auto deadline = Clock::now() + kFinalizeTimeout;
  while (true) {
    ncclResult_t state = ncclInProgress;
    (void)api_.CommGetAsyncError(comm_, &state);
    if (state == ncclSuccess) break;
    if (state != ncclInProgress || Clock::now() > deadline) {
      Status status = state != ncclInProgress
                          ? api_.ToStatus(state, comm_, "ncclCommFinalize")
                          : DeadlineExceeded("ncclCommFinalize did not finish within 10 s");
      AbortCommunicator();
      return status;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  const ncclResult_t destroyed = api_.CommDestroy(comm_);
  comm_ = nullptr;
  if (destroyed != ncclSuccess) return api_.ToStatus(destroyed, nullptr, "ncclCommDestroy");
  KVT_LOG_INFO("nccl", "{}: communicator destroyed", Describe());
  return OkStatus();
}

void Pair::ReleaseResources() {
  // Nothing of ours may run on the GPU when the memory goes: wait (bounded) for the streams,
  // which hold only our copies and kernels once the communicator is gone.
  const auto deadline = Clock::now() + kDrainStreamsTimeout;
  bool drained = true;
  for (const kvt::cuda::Stream* stream :
       {&res_->comm_stream, &res_->work_stream, &res_->gate_stream}) {
    if (stream->get() == nullptr) continue;
    while (true) {
      const cudaError_t e = cudaStreamQuery(stream->get());
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) {
        (void)cudaGetLastError();
        break;  // a broken stream runs nothing more
      }
      if (Clock::now() > deadline) {
        drained = false;
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  if (!drained) {
    // Kernels may still read the staging, the page tables and the pools' base tables (held by
    // the jobs and registrations): keep all of it alive for good.
    KVT_LOG_ERROR("nccl",
                  "{}: streams still busy {} s after the communicator went away; "
                  "leaking its staging memory rather than freeing it under the GPU",
                  Describe(), kDrainStreamsTimeout.count());
    (void)res_.release();
    (void)new std::map<uint64_t, Outgoing>(std::move(outgoing_));
    (void)new std::map<uint64_t, Incoming>(std::move(incoming_));
    (void)new std::array<std::shared_ptr<const Registration>, kRing>(std::move(in_use_));
  }
  outgoing_.clear();
  incoming_.clear();
  in_use_ = {};
}

// ---- Progress thread: sending side ----------------------------------------------------------

bool Pair::NextChunk(std::shared_ptr<SenderJob>& job, uint32_t& chunk) {
  std::lock_guard<std::mutex> lock(mutex_);
  while (!pending_.empty()) {
    auto it = writes_.find(pending_.front());
    if (it == writes_.end() || it->second.released ||
        it->second.status.code() != StatusCode::kInProgress ||
        it->second.next_chunk >= it->second.job->chunks.size()) {
      pending_.pop_front();
      continue;
    }
    WriteRecord& record = it->second;
    job = record.job;
    chunk = static_cast<uint32_t>(record.next_chunk++);
    if (record.next_chunk == record.job->chunks.size()) pending_.pop_front();
    return true;
  }
  return false;
}

bool Pair::AllResolved() {
  std::lock_guard<std::mutex> lock(mutex_);
  return pending_.empty() && outgoing_.empty();
}

void Pair::ResolveChunk(WriteId id, const Status& verdict) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = writes_.find(id);
  if (it == writes_.end()) return;  // released meanwhile
  WriteRecord& record = it->second;
  ++record.resolved;
  if (record.status.code() == StatusCode::kInProgress) {
    if (!verdict.ok()) {
      record.status = verdict;
    } else if (record.resolved == record.job->chunks.size()) {
      record.status = OkStatus();
    }
  }
  cv_.notify_all();
}

bool Pair::SenderWantsStep(Clock::time_point now) {
  if (close_step_) return next_post_ < *close_step_ + kLookahead;  // the close handshake
  if (next_post_ == 0) return true;  // sets up the pair's connections before the first write
  if (!outgoing_.empty()) {
    // Steps up to the last payload step plus kAckLag carry payloads or their acknowledgements.
    if (outgoing_.rbegin()->first + kAckLag >= next_post_) return true;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!pending_.empty()) return true;
  }
  const auto tick = config_.tuning.idle_tick;
  return tick.count() > 0 && now - last_post_time_ >= tick;
}

Status Pair::RunSender() {
  auto last_progress = Clock::now();
  auto last_completion = last_progress;
  last_post_time_ = last_progress;
  std::optional<Clock::time_point> drain_deadline;
  while (true) {
    bool progress = false;
    while (next_done_ < next_post_) {
      const cudaError_t e = cudaEventQuery(res_->step_event(next_done_));
      if (e == cudaErrorNotReady) break;
      KVT_RETURN_IF_ERROR(kvt::cuda::ToStatus(e, "waiting for an nccl step"));
      KVT_RETURN_IF_ERROR(CompleteSenderStep(next_done_));
      ++next_done_;
      progress = true;
      last_completion = Clock::now();
    }
    ncclResult_t async = ncclSuccess;
    (void)api_.CommGetAsyncError(comm_, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      return api_.ToStatus(async, comm_, "the nccl communicator failed");
    }

    bool stop = false;
    Backend::DisconnectMode mode = Backend::DisconnectMode::kGraceful;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop = stop_requested_;
      mode = stop_mode_;
    }
    const auto now = Clock::now();
    if (stop) {
      if (mode == Backend::DisconnectMode::kPeerDead) {
        return Aborted("disconnected: the peer was declared dead");
      }
      if (!drain_deadline) drain_deadline = now + config_.tuning.drain_timeout;
      if (!close_step_ && AllResolved()) {
        close_step_ = next_post_;
        KVT_LOG_DEBUG("nccl", "{}: closing at step {}", Describe(), *close_step_);
      }
      if (close_step_ && next_done_ >= *close_step_ + kLookahead && next_done_ == next_post_) {
        return DestroyCommunicator();
      }
      if (now > *drain_deadline) {
        return Aborted("graceful disconnect gave up after " + Ms(config_.tuning.drain_timeout) +
                       " with writes still in flight");
      }
    }

    // The stall clock starts when the pipeline goes from empty to busy.
    if (next_done_ == next_post_) last_completion = now;
    while (next_post_ < next_done_ + kSenderWindow && SenderWantsStep(now)) {
      KVT_RETURN_IF_ERROR(PostSenderStep());
      progress = true;
    }
    // A step whose payload still waits for its write's ready event (the producer) is not
    // stalled on the receiver: its clock starts once the pack ran.
    if (next_done_ < next_post_ && outgoing_.contains(next_done_) &&
        cudaEventQuery(res_->work_event(next_done_)) == cudaErrorNotReady) {
      last_completion = Clock::now();
    }
    if (next_done_ < next_post_ && Clock::now() - last_completion > config_.tuning.stall_timeout) {
      return Unavailable("step " + std::to_string(next_done_) + " has not completed for " +
                         Ms(config_.tuning.stall_timeout) +
                         ": the receiving side is gone or wedged");
    }
    if (progress) {
      last_progress = Clock::now();
      continue;
    }
    if (next_done_ == next_post_ && !stop) {
      // Idle: sleep until a write, a stop or the next idle tick.
      std::unique_lock<std::mutex> lock(mutex_);
      const auto tick = config_.tuning.idle_tick;
      const auto until =
          tick.count() > 0 ? last_post_time_ + tick : Clock::now() + std::chrono::hours(1);
      cv_.wait_until(lock, until, [&] { return wake_; });
      wake_ = false;
      continue;
    }
    Backoff(last_progress);
  }
}

Status Pair::PostSenderStep() {
  const uint64_t n = next_post_;
  ChunkHeader header;
  header.step = n;
  std::shared_ptr<SenderJob> job;
  uint32_t chunk = 0;
  if (close_step_ && n >= *close_step_) {
    header.kind = HeaderKind::kClose;
  } else if (NextChunk(job, chunk)) {
    // Announce the chunk for step n + kLookahead and pack it into that step's slot, whose last
    // user (step n + kLookahead - kRing = n - kSenderWindow) has completed: the window says so.
    const ChunkSpec& spec = job->chunks[chunk];
    const uint64_t payload_step = n + kLookahead;
    header.kind = HeaderKind::kChunk;
    header.write_id = job->id;
    header.chunk_index = chunk;
    header.chunk_count = static_cast<uint32_t>(job->chunks.size());
    header.num_layers = job->num_layers;
    header.layer_begin = spec.layer_begin;
    header.layer_end = spec.layer_end;
    header.num_buffers = static_cast<uint32_t>(
        job->registration->layout.layers.Buffers(spec.layer_begin, spec.layer_end).size());
    header.whole_pages = job->units.empty();
    for (const PageUnit& unit : job->units) header.units.push_back({unit.dst_offset, unit.bytes});
    header.dst_pages.assign(job->dst_pages.begin() + spec.page_begin,
                            job->dst_pages.begin() + spec.page_end);
    header.payload_bytes = spec.payload_bytes;
    Outgoing& outgoing = outgoing_[payload_step];
    outgoing = Outgoing{job, chunk, spec.payload_bytes};
    Status packed = EnqueuePack(payload_step, outgoing);
    if (!packed.ok()) {
      // A pack the kernel refuses fails this write, not the pair: the announced payload still
      // goes out (the receiver expects it) and lands as undefined bytes of a failed write.
      ResolveChunk(job->id, packed.WithContext("packing chunk " + std::to_string(chunk)));
      outgoing.settled = true;
    }
  }
  EncodeChunkHeader(header, res_->header(n));

  cudaStream_t stream = res_->comm_stream.get();
  uint8_t* slot = res_->slot(n);
  KVT_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(slot, res_->header(n).data(), kHeaderBytes, cudaMemcpyHostToDevice, stream));
  uint64_t payload = 0;
  if (auto it = outgoing_.find(n); it != outgoing_.end()) {
    payload = it->second.payload_bytes;
    KVT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, res_->work_event(n), 0));
  }
  KVT_RETURN_IF_ERROR(
      Group(slot, kHeaderBytes + payload, res_->ack(n), kAckBytes, "sending an nccl step"));
  KVT_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(res_->host_ack(n).data(), res_->ack(n), kAckBytes,
                                           cudaMemcpyDeviceToHost, stream));
  KVT_CUDA_RETURN_IF_ERROR(cudaEventRecord(res_->step_event(n), stream));
  ++next_post_;
  last_post_time_ = Clock::now();
  return OkStatus();
}

Status Pair::EnqueuePack(uint64_t payload_step, const Outgoing& outgoing) {
  const SenderJob& job = *outgoing.job;
  const ChunkSpec& spec = job.chunks[outgoing.chunk];
  const Registration& reg = *job.registration;
  const int64_t pages = spec.page_end - spec.page_begin;
  cudaStream_t stream = res_->work_stream.get();
  int32_t* host_table = res_->host_src_table(payload_step);
  std::memcpy(host_table, job.src_pages.data() + spec.page_begin,
              static_cast<size_t>(pages) * sizeof(int32_t));
  int32_t* table = res_->src_table(payload_step);
  KVT_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(table, host_table,
                                           static_cast<size_t>(pages) * sizeof(int32_t),
                                           cudaMemcpyHostToDevice, stream));
  if (job.gate != nullptr) KVT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, job.gate, 0));
  std::vector<UnitSpan> units;
  for (const PageUnit& unit : job.units) units.push_back({unit.src_offset, unit.bytes});
  const size_t first = reg.First(spec.layer_begin);
  const std::span<const uint64_t> page_bytes =
      std::span<const uint64_t>(reg.ordered_item_len)
          .subspan(first, reg.First(spec.layer_end) - first);
  Status status;
  for (const kernels::PackArgs& args :
       ChunkStagingArgs(reg.ordered_bases.as<uint64_t>() + first, page_bytes, table, pages, units,
                        res_->slot(payload_step) + kHeaderBytes)) {
    status = kernels::PackCuda(args, stream);
    if (!status.ok()) break;
  }
  // Recorded even after a failure, so the step's wait on it stays well defined.
  KVT_CUDA_RETURN_IF_ERROR(cudaEventRecord(res_->work_event(payload_step), stream));
  return status;
}

Status Pair::CompleteSenderStep(uint64_t step) {
  KVT_ASSIGN_OR_RETURN(Ack ack, DecodeAck(res_->host_ack(step), step));
  if (ack.code != StatusCode::kOk) {
    auto it = outgoing_.find(step);
    if (it == outgoing_.end() || it->second.job->id != ack.write_id ||
        it->second.chunk != ack.chunk_index) {
      return DataLoss("the ack of step " + std::to_string(step) + " refuses chunk " +
                      std::to_string(ack.chunk_index) + " of write " +
                      std::to_string(ack.write_id) + ", which that step did not carry");
    }
    if (!it->second.settled) {
      ResolveChunk(
          ack.write_id,
          Status(ack.code, "the receiver refused chunk " + std::to_string(ack.chunk_index) +
                               " of write " + std::to_string(ack.write_id) + ": " + ack.message));
    }
    outgoing_.erase(it);
  }
  // This step's completion means the receiver's stream ran it, and the receiver made it wait
  // for the unpack of step - kAckLag: that payload is in the receiver's pool.
  if (step >= kAckLag) {
    auto it = outgoing_.find(step - kAckLag);
    if (it != outgoing_.end()) {
      if (!it->second.settled) ResolveChunk(it->second.job->id, OkStatus());
      outgoing_.erase(it);
    }
  }
  return OkStatus();
}

// ---- Progress thread: receiving side --------------------------------------------------------

Status Pair::RunReceiver() {
  for (uint64_t s = 0; s < kLookahead; ++s) KVT_RETURN_IF_ERROR(PostReceiverStep(s));
  auto last_progress = Clock::now();
  auto last_completion = last_progress;
  std::optional<Clock::time_point> drain_deadline;
  while (true) {
    bool progress = false;
    while (next_done_ < next_post_) {
      const cudaError_t e = cudaEventQuery(res_->step_event(next_done_));
      if (e == cudaErrorNotReady) break;
      KVT_RETURN_IF_ERROR(kvt::cuda::ToStatus(e, "waiting for an nccl step"));
      KVT_RETURN_IF_ERROR(CompleteReceiverStep(next_done_));
      ++next_done_;
      progress = true;
      last_completion = Clock::now();
      if (!closed_) KVT_RETURN_IF_ERROR(PostReceiverStep(next_post_));
    }
    ncclResult_t async = ncclSuccess;
    (void)api_.CommGetAsyncError(comm_, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      return api_.ToStatus(async, comm_, "the nccl communicator failed");
    }
    bool stop = false;
    Backend::DisconnectMode mode = Backend::DisconnectMode::kGraceful;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop = stop_requested_;
      mode = stop_mode_;
    }
    const auto now = Clock::now();
    const bool settled = closed_ && next_done_ == next_post_;  // every posted step matched
    if (stop) {
      if (mode == Backend::DisconnectMode::kPeerDead) {
        return Aborted("disconnected: the peer was declared dead");
      }
      if (settled) return DestroyCommunicator();
      if (!drain_deadline) drain_deadline = now + config_.tuning.drain_timeout;
      if (now > *drain_deadline) {
        // The sender never closed: the receives posted ahead can only be aborted.
        return Aborted("graceful disconnect: the sender did not close within " +
                       Ms(config_.tuning.drain_timeout));
      }
    }
    if (settled && !stop) {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return wake_; });
      wake_ = false;
      continue;
    }
    // Only a sender that ticks when idle can be missed (its tick travels in the token).
    if (!closed_ && config_.token.idle_tick_ms > 0 &&
        now - last_completion > config_.tuning.receiver_silence_timeout) {
      return Unavailable("the sender ran no step for " +
                         Ms(config_.tuning.receiver_silence_timeout) + " (it ticks every " +
                         std::to_string(config_.token.idle_tick_ms) + " ms when idle): it is gone");
    }
    if (progress) {
      last_progress = Clock::now();
      continue;
    }
    Backoff(last_progress);
  }
}

Status Pair::PostReceiverStep(uint64_t m) {
  cudaStream_t stream = res_->comm_stream.get();
  auto it = incoming_.find(m);
  const Incoming* incoming = it != incoming_.end() ? &it->second : nullptr;
  const uint64_t payload = incoming != nullptr ? incoming->header.payload_bytes : 0;
  // The ack this step sends is the sender's proof that step m - kAckLag was unpacked.
  if (m >= kAckLag) {
    KVT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, res_->work_event(m - kAckLag), 0));
  }
  Ack ack;
  ack.step = m;
  if (incoming != nullptr && !incoming->fit.ok()) {
    ack.code = incoming->fit.code();
    ack.write_id = incoming->header.write_id;
    ack.chunk_index = incoming->header.chunk_index;
    ack.message = incoming->fit.message();
  }
  EncodeAck(ack, res_->host_ack(m));
  KVT_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(res_->ack(m), res_->host_ack(m).data(), kAckBytes,
                                           cudaMemcpyHostToDevice, stream));
  uint8_t* slot = res_->slot(m);
  KVT_RETURN_IF_ERROR(
      Group(res_->ack(m), kAckBytes, slot, kHeaderBytes + payload, "receiving an nccl step"));
  KVT_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(res_->header(m).data(), slot, kHeaderBytes, cudaMemcpyDeviceToHost, stream));
  KVT_CUDA_RETURN_IF_ERROR(cudaEventRecord(res_->step_event(m), stream));

  cudaStream_t work = res_->work_stream.get();
  KVT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(work, res_->step_event(m), 0));
  Status unpacked;
  if (incoming != nullptr && incoming->fit.ok()) unpacked = EnqueueUnpack(m, *incoming);
  KVT_CUDA_RETURN_IF_ERROR(cudaEventRecord(res_->work_event(m), work));
  // The registration must outlive the unpack; step m + kRing is posted only after step m + kAckLag
  // completed, which waited for this unpack.
  in_use_[m % kRing] = incoming != nullptr ? incoming->registration : nullptr;
  if (it != incoming_.end()) incoming_.erase(it);
  ++next_post_;
  // The sender already counts this chunk as sent; an unpack that cannot even be launched is a
  // broken invariant of this side, so the pair stops rather than acknowledge lost bytes.
  return unpacked;
}

Status Pair::EnqueueUnpack(uint64_t step, const Incoming& incoming) {
  const ChunkHeader& h = incoming.header;
  const Registration& reg = *incoming.registration;
  // The destination pages are read on the GPU from the header that announced this chunk: it is
  // still in its slot, which step + kAckLag (waiting for this unpack) overwrites next.
  const auto* table =
      reinterpret_cast<const int32_t*>(res_->slot(step - kLookahead) + kPagesOffset);
  // CheckChunkFits checked the chunk against this side's buffers of its layers (count, units,
  // whole-page bytes, pages), which the unpack addresses in LayerTable order.
  const size_t first = reg.First(h.layer_begin);
  const std::span<const uint64_t> page_bytes = std::span<const uint64_t>(reg.ordered_item_len)
                                                   .subspan(first, reg.First(h.layer_end) - first);
  for (const kernels::PackArgs& args : ChunkStagingArgs(
           reg.ordered_bases.as<uint64_t>() + first, page_bytes, table,
           static_cast<int64_t>(h.dst_pages.size()), h.units, res_->slot(step) + kHeaderBytes)) {
    KVT_RETURN_IF_ERROR(kernels::UnpackCuda(args, res_->work_stream.get()));
  }
  return OkStatus();
}

Status Pair::CompleteReceiverStep(uint64_t step) {
  KVT_ASSIGN_OR_RETURN(ChunkHeader header,
                       DecodeChunkHeader(res_->header(step), step, payload_capacity_));
  switch (header.kind) {
    case HeaderKind::kIdle:
      return OkStatus();
    case HeaderKind::kClose:
      if (!closed_) KVT_LOG_DEBUG("nccl", "{}: the sender closes at step {}", Describe(), step);
      closed_ = true;
      return OkStatus();
    case HeaderKind::kChunk:
      break;
  }
  if (closed_) {
    return DataLoss("step " + std::to_string(step) + " announces a chunk after the sender closed");
  }
  Incoming incoming;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    incoming.registration = registration_;
  }
  incoming.fit = incoming.registration != nullptr
                     ? CheckChunkFits(header, incoming.registration->layout)
                     : FailedPrecondition("this side has no registered pool");
  if (!incoming.fit.ok()) {
    KVT_LOG_WARN("nccl", "{}: dropping chunk {} of write {}: {}", Describe(), header.chunk_index,
                 header.write_id, incoming.fit.message());
  }
  incoming.header = std::move(header);
  incoming_[step + kLookahead] = std::move(incoming);
  return OkStatus();
}

}  // namespace kvt::transfer::nccl

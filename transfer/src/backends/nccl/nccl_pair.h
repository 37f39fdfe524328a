// One (prefill, decode) pair of the nccl backend: a two-rank NCCL communicator (rank 0 sends,
// rank 1 receives), the staging slots on this side's GPU, and the progress thread that runs the
// step protocol of nccl_protocol.h.
//
// The communicator is created on the progress thread with a non-blocking config, so neither
// Connect nor Accept waits for the other side; writes posted meanwhile are queued and fail when
// the communicator is not up within NcclTuning::connect_timeout.
//
// Sending side, per step n (comm stream; the pack stream runs ahead):
//   pack stream: [H2D source page table] [wait the write's gate]
//                [pack kernel per (unit, run of buffers of equal page bytes)] -> packed
//   comm stream: [H2D header n] [wait packed(n) if n carries a payload]
//                group{ send slot n (header + payload), recv ack n } [D2H ack n] -> step_done(n)
// Receiving side, per step m, posted once the header of step m - kLookahead was read:
//   comm stream:   [wait unpacked(m - kAckLag)] [H2D ack m]
//                  group{ recv slot m, send ack m } [D2H header m] -> step_done(m)
//   unpack stream: [wait step_done(m)] [unpack kernel per (unit, run of equal page bytes), page
//                  table read from the header of step m - kLookahead still in its slot on the
//                  GPU] -> unpacked(m)
//
// Thread contract: the progress thread alone makes NCCL calls and owns the communicator, the
// streams' contents and the step bookkeeping; the public methods may be called from any thread
// and meet it through `mutex_` (writes, the queue, the phase, stop requests).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "backends/nccl/nccl_api.h"
#include "backends/nccl/nccl_protocol.h"
#include "kvt/common/status.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/transfer/backend.h"

namespace kvt::transfer::nccl {

// Makes `device` current for the scope and restores the previous device after.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  const Status& status() const { return status_; }

 private:
  int previous_ = -1;
  Status status_;
};

// This side's registered pool as the pairs use it. Immutable once built.
struct Registration {
  int device = 0;
  std::vector<LocalRegion> regions;  // by buffer index, as registered
  ReceiverLayout layout;             // the layer table, page bytes and lengths by buffer index
  std::vector<uint64_t> ordered_item_len;  // page bytes in LayerTable order
  // uint64 buffer addresses on the device in LayerTable order, so that the buffers of layers
  // [a, b) are the slice [First(a), First(b)) of this table and of ordered_item_len.
  kvt::cuda::DeviceBuffer ordered_bases;

  size_t First(int32_t layer) const { return layout.layers.Buffers(0, layer).size(); }
};

// One write of the sending side, fixed when posted.
struct SenderJob {
  SenderJob() = default;
  ~SenderJob();
  SenderJob(const SenderJob&) = delete;
  SenderJob& operator=(const SenderJob&) = delete;

  WriteId id = 0;
  std::vector<int32_t> src_pages;
  std::vector<int32_t> dst_pages;
  int32_t num_layers = 0;
  std::vector<PageUnit> units;  // empty: whole pages (each buffer's own page bytes)
  std::vector<uint64_t> unit_bytes;
  std::vector<ChunkSpec> chunks;
  std::shared_ptr<const Registration> registration;
  cudaEvent_t gate = nullptr;  // owned; recorded after the write's ready event (null: ready now)
};

class Pair {
 public:
  enum class Role { kSender, kReceiver };

  struct Config {
    Role role = Role::kSender;
    PeerId id = 0;
    int device = 0;
    PairToken token;
    NcclTuning tuning;
    std::string peer;                                  // the peer's address, for messages
    std::shared_ptr<const Registration> registration;  // receiving side: where chunks land
  };

  // Allocates the staging memory and streams on `config.device` and starts the progress thread,
  // which joins the communicator (rank 0 for the sender, 1 for the receiver). Returns at once.
  static StatusOr<std::shared_ptr<Pair>> Start(const NcclApi& api, Config config);

  // Stops like Stop(kPeerDead) if Stop was not called.
  ~Pair();
  Pair(const Pair&) = delete;
  Pair& operator=(const Pair&) = delete;

  Role role() const { return config_.role; }
  const PairToken& token() const { return config_.token; }

  // Sending side: queues `job` (its chunks go out in order once the communicator is up) after
  // making its gate wait for `ready` (on the GPU; null: no wait). A job without chunks completes
  // at once. The pair's failure once it failed; FailedPrecondition once it is stopping.
  Status Post(std::shared_ptr<SenderJob> job, cudaEvent_t ready);

  // A posted write's state: InProgress, OK once every chunk is in the receiver's pool, or why it
  // failed. NotFound for ids this pair does not hold.
  Status Check(WriteId id);

  // Forgets a write: chunks not yet announced are never sent; announced ones (which the
  // receiver will unpack whatever happens) are waited for, bounded by the stall timeout.
  void Release(WriteId id);

  // Receiving side: chunks parsed from now on land in this registration.
  void SetRegistration(std::shared_ptr<const Registration> registration);

  // Ends the pair and joins the progress thread. kGraceful: the sender finishes its writes in
  // flight (bounded by drain_timeout), tells the receiver it closes, and destroys the
  // communicator (ncclCommFinalize + ncclCommDestroy); the receiver waits for that close
  // (bounded) and destroys likewise. Anything else, and kPeerDead, aborts the communicator
  // (ncclCommAbort). Writes not complete then report Aborted. Idempotent.
  Status Stop(Backend::DisconnectMode mode);

 private:
  using Clock = std::chrono::steady_clock;
  enum class Phase { kConnecting, kReady, kFailed, kStopped };

  struct WriteRecord {
    std::shared_ptr<SenderJob> job;
    Status status = InProgress();
    size_t next_chunk = 0;  // chunks handed to the protocol (announced)
    size_t resolved = 0;    // announced chunks that landed or were refused
    bool released = false;
  };

  // A chunk the sender announced for a later step, until it is acknowledged.
  struct Outgoing {
    std::shared_ptr<SenderJob> job;
    uint32_t chunk = 0;
    uint64_t payload_bytes = 0;
    bool settled = false;  // its write already heard the verdict (a local pack failure)
  };

  // A chunk the receiver learnt of from a header, until its step is posted.
  struct Incoming {
    ChunkHeader header;
    Status fit;  // CheckChunkFits: not OK -> received, dropped and refused in the ack
    std::shared_ptr<const Registration> registration;
  };

  struct Resources;  // streams, events, staging memory (nccl_pair.cc)

  Pair(const NcclApi& api, Config config);

  // ---- progress thread --------------------------------------------------------------------
  void Run();
  Status InitCommunicator();
  Status WaitGroupIssued(const char* what);
  Status RunSender();
  Status RunReceiver();
  bool SenderWantsStep(Clock::time_point now);
  Status PostSenderStep();
  Status CompleteSenderStep(uint64_t step);
  Status EnqueuePack(uint64_t payload_step, const Outgoing& outgoing);
  Status PostReceiverStep(uint64_t step);
  Status CompleteReceiverStep(uint64_t step);
  Status EnqueueUnpack(uint64_t step, const Incoming& incoming);
  Status Group(void* send_buffer, size_t send_bytes, void* recv_buffer, size_t recv_bytes,
               const char* what);
  void ResolveChunk(WriteId id, const Status& verdict);
  bool NextChunk(std::shared_ptr<SenderJob>& job, uint32_t& chunk);
  bool AllResolved();
  void Fail(const Status& status);
  void AbortCommunicator();
  Status DestroyCommunicator();
  void ReleaseResources();
  void Backoff(Clock::time_point last_progress);
  std::string Describe() const;

  const NcclApi& api_;
  const Config config_;
  const uint64_t payload_capacity_;
  const Clock::time_point started_;

  // Owned by the progress thread while it runs (Start fills it before the thread starts).
  std::unique_ptr<Resources> res_;
  ncclComm_t comm_ = nullptr;
  uint64_t next_post_ = 0;  // the next step to post
  uint64_t next_done_ = 0;  // the oldest posted step not yet complete
  Clock::time_point last_post_time_;
  std::map<uint64_t, Outgoing> outgoing_;  // sender: payload step -> chunk
  std::optional<uint64_t> close_step_;     // sender: the first step carrying kClose
  std::map<uint64_t, Incoming> incoming_;  // receiver: payload step -> chunk
  std::array<std::shared_ptr<const Registration>, kRing> in_use_;  // receiver: unpacks in flight
  bool closed_ = false;                                            // receiver: kClose seen

  std::thread thread_;

  std::mutex mutex_;  // guards everything below
  std::condition_variable cv_;
  Phase phase_ = Phase::kConnecting;
  Status failure_;
  bool wake_ = false;
  bool stop_requested_ = false;
  bool stopped_ = false;
  Backend::DisconnectMode stop_mode_ = Backend::DisconnectMode::kGraceful;
  std::unordered_map<WriteId, WriteRecord> writes_;
  std::deque<WriteId> pending_;  // writes with chunks left to announce, in post order
  std::shared_ptr<const Registration> registration_;
};

}  // namespace kvt::transfer::nccl

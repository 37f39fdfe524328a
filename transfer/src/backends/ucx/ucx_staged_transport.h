// The ucx backend's staged path for CUDA pools on a UCX build that cannot touch CUDA memory.
//
// Receiver-active, bounded, pipelined:
//  - Each side that registered a staged pool owns `slots` send slots and `slots` receive slots of
//    `slot_bytes` host memory (ucp_mem_map ALLOCATE, so UCX's shared-memory transports reach it,
//    page-locked with cudaHostRegister for fast DMA).
//  - A sender cuts a page write into chunks (ucx_staged_protocol.h), packs each into a free send
//  slot
//    with the gather kernel (straight into the mapped slot, after the write's `ready` event),
//    and when the pack is done sends it as one rendezvous active message whose header names the
//    chunk. It never has more chunks outstanding at a receiver than the receiver has slots
//    (credits), and reuses its own slot as soon as the send completes.
//  - A receiver queues arriving chunks (only their UCX descriptors; the bytes stay in the
//    sender's slot), lands each into a free receive slot (ucp_am_recv_data_nbx), checks the
//    self-describing payload against its pool, copies it to the device and scatters it with the
//    unpack kernel on the slot's stream, and acknowledges the chunk once that has completed, with
//    the error if anything failed.
//  - A write is complete when every chunk is acknowledged: its bytes are then in the peer's pool.
// Packing chunk k+1, sending chunk k and unpacking chunk k-1 use different slots and streams,
// so they overlap.
//
// The transport runs on a UCP context and worker of its own (active messages only), so that the
// host path's RMA context is exactly what it was (enabling UCP_FEATURE_AM there crashes UCX
// 1.13's tcp transport). The owning backend's progress thread progresses both workers.
//
// A connection starts with a hello (sender -> receiver, carrying the sender's worker address so
// the receiver can open an endpoint for acks) and its ack (with the receiver's slot count); no
// chunk goes out before the ack.
//
// Thread contract: not synchronised. Every method, and the UCX callbacks it registers (which run
// inside ucp_worker_progress), must be called with the owning backend's mutex held.
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "backends/ucx/ucx_staged_copier.h"
#include "backends/ucx/ucx_staged_protocol.h"
#include "kvt/common/status.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/transfer/backend.h"

namespace kvt::transfer {
namespace ucx_staging {

struct StagingOptions {
  uint32_t slots = 8;
  uint64_t slot_bytes = uint64_t{4} << 20;
  // Host pools staged by the CPU (tests); otherwise CUDA pools staged by the kernels.
  bool host_copier = false;
  std::chrono::microseconds host_copy_delay{0};
};

class StagedTransport {
 public:
  // A UCP context and worker over `transports` (UCX_TLS syntax; empty: UCX's choice), with the
  // protocol's active-message handlers installed. `instance` names this backend to its peers.
  static StatusOr<std::unique_ptr<StagedTransport>> Create(const std::string& transports,
                                                           uint64_t instance);
  // Destroys the worker and context; Shutdown must have run (it frees what needs them).
  ~StagedTransport();
  StagedTransport(const StagedTransport&) = delete;
  StagedTransport& operator=(const StagedTransport&) = delete;

  // The worker's address (what peers connect to) and its progress/wake-up hooks.
  const std::string& worker_address() const { return worker_address_; }
  unsigned Progress() { return ucp_worker_progress(worker_); }
  // Arms the event fd before sleeping on it; false when events are pending (progress instead).
  bool Arm() { return ucp_worker_arm(worker_) != UCS_ERR_BUSY; }
  int event_fd() const { return event_fd_; }
  void Signal() { ucp_worker_signal(worker_); }
  // Readable after a copier operation completed (CUDA copier: written by a callback the copier
  // enqueues after each gather and scatter); -1 when there is none. DrainCompletions clears it:
  // call it when it was readable, before Pump looks at the slots.
  int completion_fd() const { return notified_ ? completion_fd_ : -1; }
  void DrainCompletions();

  // ---- the local pool -------------------------------------------------------------------------
  // Allocates the slots and the copier for these buffers (a valid LayerTable; page bytes may
  // differ between buffers), replacing an idle earlier pool.
  Status Attach(std::span<const LocalRegion> regions, const StagingOptions& options);
  // Frees them; FailedPrecondition while chunks are in flight either way.
  Status Detach();
  bool attached() const { return copier_ != nullptr; }
  uint32_t slots() const { return static_cast<uint32_t>(send_.size()); }
  uint64_t slot_bytes() const { return slot_bytes_; }
  // Writes in progress or chunks being received.
  bool Active() const;

  // ---- sending ------------------------------------------------------------------------------
  // A connection to the staging receiver at `worker_address` (its descriptor's address without
  // the trailer). Sends the hello; chunks wait for its ack.
  Status AddPeer(PeerId link, std::string_view worker_address, const AddressTrailer& remote,
                 std::vector<RemoteRegion> regions);
  // Forgets the connection and closes its endpoint. Graceful: unsent chunks are cancelled, chunks
  // in flight are waited for (bounded), the receiver is told (bye). Peer dead: nothing is waited
  // for or sent, the endpoint is closed by force. Writes that did not complete are Aborted.
  void RemovePeer(PeerId link, bool peer_dead);
  bool HasPeer(PeerId link) const { return peers_.count(link) != 0; }

  Status PostPages(WriteId id, PeerId link, const PageWrite& write);
  bool HasWrite(WriteId id) const { return writes_.count(id) != 0; }
  Status Check(WriteId id);
  // Stops the write's unsent chunks and waits (bounded) for those in flight to be acknowledged,
  // so that none of its bytes lands later.
  void Release(WriteId id);
  // Called (on the progress thread) each time a write completes or fails, so that the owner can
  // tell its caller at once instead of being polled. Must not block or call back in.
  void SetOnWriteDone(std::function<void()> done) { on_write_done_ = std::move(done); }

  // ---- receiving ----------------------------------------------------------------------------
  // Stops accepting chunks from a sending backend: queued ones are dropped (acknowledged as
  // Aborted unless the sender is dead), ones being scattered are waited for (bounded).
  void DropSender(uint64_t instance, bool peer_dead);
  // Accepts it again (a new connection to it was made).
  void AdmitSender(uint64_t instance) { dropped_.erase(instance); }

  // ---- progress -----------------------------------------------------------------------------
  // Moves every slot and control message forward; call after each ucp_worker_progress.
  void Pump();
  // True while a copier operation must be polled (neither the worker's event fd nor
  // completion_fd will announce it: the host copier's).
  bool NeedsPolling() const;
  // Waits (bounded) for slot work to finish; then closes receiver endpoints and frees the pool.
  // The caller closes its peers' endpoints between Quiesce and Shutdown.
  void Quiesce();
  void Shutdown();

 private:
  struct Peer {
    ucp_ep_h ep = nullptr;
    AddressTrailer remote;
    std::vector<RemoteRegion> regions;
    bool ready = false;  // hello acknowledged
    Status error;        // the receiver refused us
    CreditWindow credits;
  };
  struct Write {
    PeerId link = 0;
    std::vector<int32_t> src_pages;
    std::vector<int32_t> dst_pages;
    std::vector<PageUnit> units;
    int32_t num_layers = 0;
    ChunkPlan plan;
    uint32_t next_chunk = 0;  // the next chunk to gather
    uint32_t acked = 0;
    cuda::Event gate;
    Status status;
  };
  struct SendSlot {
    enum class State { kFree, kGathering, kSending } state = State::kFree;
    WriteId write = 0;
    uint32_t chunk = 0;
    PeerId link = 0;
    std::vector<uint8_t> notice;  // the AM header, alive until the send completes
    uint64_t payload_bytes = 0;
    void* request = nullptr;
  };
  struct Arrival {
    ChunkNotice notice;
    void* data = nullptr;  // UCX descriptor (rendezvous) or persistent data
    size_t length = 0;
    bool rndv = false;
    std::vector<uint8_t> copy;  // data UCX would not keep
  };
  struct RecvSlot {
    enum class State { kFree, kLanding, kScattering } state = State::kFree;
    ChunkNotice notice;
    size_t length = 0;
    void* request = nullptr;
    DecodedChunk chunk;
  };
  struct Sender {  // a backend that sends to us, and our endpoint back to it for acks
    ucp_ep_h ep = nullptr;
    std::set<uint64_t> links;
  };
  struct PendingHello {
    Hello hello;
    std::string address;
  };
  struct ControlSend {
    std::vector<uint8_t> header;
    std::string data;
    void* request = nullptr;
    std::chrono::steady_clock::time_point deadline;
  };
  struct Closing {
    void* request = nullptr;
    std::chrono::steady_clock::time_point deadline;
  };

  explicit StagedTransport(uint64_t instance) : instance_(instance) {}
  Status Init(const std::string& transports);
  Status RegisterHandlers();

  static ucs_status_t OnChunk(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnHello(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnHelloAck(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnChunkAck(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnBye(void* arg, const void* header, size_t header_length, void* data,
                            size_t length, const ucp_am_recv_param_t* param);

  // Sending.
  void PumpSendSlots();
  void ScheduleChunks();
  void StartChunk(uint32_t slot, WriteId id, Write& write, Peer& peer);
  void SendGathered(uint32_t slot);
  void FailChunk(SendSlot& slot, const Status& status);
  void FailWrite(WriteId id, Write& write, const Status& status);
  void HandleAck(const ChunkAck& ack, std::string_view message);
  // Progresses until `done` or the bound; false on timeout.
  template <typename Done>
  bool WaitUntil(Done&& done, std::chrono::milliseconds bound);

  // Receiving.
  void PumpRecvSlots();
  void HandleHellos();
  void HandleByes();
  void Land(uint32_t slot, Arrival arrival);
  void Landed(uint32_t slot);
  void FinishReceive(uint32_t slot, const Status& status);
  void SendAck(const ChunkNotice& notice, const Status& status);

  Status SendControl(ucp_ep_h ep, unsigned am_id, std::vector<uint8_t> header, std::string data);
  void PumpControl();
  // Starts closing (progressed by Pump, abandoned after a bound).
  void CloseEndpoint(ucp_ep_h ep, bool force);
  // Closes and waits (bounded) for the close to finish.
  void CloseEndpointNow(ucp_ep_h ep, bool force);
  void FreeSlotMemory();
  uint8_t* SendPayload(uint32_t slot) const { return send_base_ + size_t{slot} * slot_bytes_; }
  uint8_t* RecvPayload(uint32_t slot) const { return recv_base_ + size_t{slot} * slot_bytes_; }

  const uint64_t instance_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int event_fd_ = -1;
  std::string worker_address_;

  // The local pool.
  std::vector<LocalRegion> local_;
  ChunkLimits limits_;
  std::unique_ptr<StagingCopier> copier_;
  // An eventfd the copier's completion callbacks write (OnCopierDone); notified_ when the
  // current copier calls it.
  int completion_fd_ = -1;
  std::function<void()> on_write_done_;  // SetOnWriteDone
  bool notified_ = false;
  static void OnCopierDone(void* self);
  uint64_t slot_bytes_ = 0;
  uint8_t* send_base_ = nullptr;
  uint8_t* recv_base_ = nullptr;
  ucp_mem_h send_memh_ = nullptr;  // ucp_mem_map ALLOCATE of the slots, or
  ucp_mem_h recv_memh_ = nullptr;
  cuda::PinnedBuffer send_pinned_;  // cudaHostAlloc memory when registration was refused
  cuda::PinnedBuffer recv_pinned_;
  bool leak_slot_memory_ = false;  // UCX may still touch it (a transfer did not finish)

  // Sending.
  std::unordered_map<PeerId, Peer> peers_;
  std::map<WriteId, Write> writes_;  // ordered by id: post order
  std::set<WriteId> pending_;        // writes with chunks not yet gathered
  std::vector<SendSlot> send_;

  // Receiving.
  std::vector<RecvSlot> recv_;
  std::deque<Arrival> arrivals_;
  std::unordered_map<uint64_t, Sender> senders_;
  std::unordered_set<uint64_t> dropped_;
  std::deque<uint64_t> dropped_order_;  // insertion order, to bound dropped_
  std::vector<PendingHello> hellos_;
  std::vector<Bye> byes_;

  std::list<ControlSend> control_;
  std::vector<Closing> closing_;
};

}  // namespace ucx_staging
}  // namespace kvt::transfer

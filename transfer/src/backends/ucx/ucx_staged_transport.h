// The ucx backend's staged path for CUDA pools on a UCX build that cannot touch CUDA memory.
//
// Receiver-active, bounded, pipelined:
//  - Each side that registered a staged pool owns `slots` send slots and `slots` receive slots of
//    `slot_bytes` host memory (ucp_mem_map ALLOCATE, so UCX's shared-memory transports reach it,
//    page-locked with cudaHostRegister for fast DMA).
//  - A sender cuts a page write into chunks (ucx_staged_protocol.h), packs each into a free send
//    slot (the gather kernel into the slot's device twin after the write's `ready` event, then a
//    copy engine into the slot: ucx_staged_copier.h),
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
// Reading in place (one host): a sender offers its send slots in its hello (their address and a
// packed remote key). A receiver that can map them (ucp_rkey_ptr: UCX's shared-memory
// transports reach them) and page-lock the mapping for DMA answers in_place; the sender then
// sends a SlotNotice (which slot, how many bytes) with the payload's prefix (header, page ids,
// units) as its data instead of the payload, and keeps the slot until the chunk's ack. The
// receiver checks and uses its copy of the prefix, and copies the data to the device straight
// from the sender's slot (DMA only: its CPU never reads the sender's memory): no host-to-host
// copy, which otherwise bounds this path to what one core copies (UCX's shared-memory
// rendezvous). Across hosts, or where mapping or page-locking fails, chunks go as payloads as
// above.
//
// The transport runs on a UCP context and worker of its own (active messages only), so that the
// host path's RMA context is exactly what it was (enabling UCP_FEATURE_AM there crashes UCX
// 1.13's tcp transport). The owning backend's progress thread progresses both workers.
//
// Copy runs (host memory, where UCX emulates puts over its messages, as tcp does): the same
// worker carries a write's runs as active messages (ucx_staged_protocol.h, "copy runs as active
// messages"). A sender cuts the runs into messages of at most RunOptions::message_bytes, each
// sent from the source memory as an IOV (no gather copy) with a header naming the destination
// of every piece, at most RunOptions::window messages unacknowledged per peer. The receiver
// checks the pieces against its buffers, copies eager data into place inside the AM callback
// (rendezvous data it receives into a buffer of its own and copies into place once all of it
// came and the link is still open: RunLanding) and acknowledges each message when its bytes are
// in place. A write completes when every message is acknowledged. It holds no more of a link's
// rendezvous messages than the window its hello ack granted, nor more of a link's queued chunks
// than its slots; messages past them are refused (ResourceExhausted).
//
// Every message names its link's token (ucx_staged_protocol.h, "link tokens"): a receiver takes
// messages, and a sender acks, only with it.
//
// A connection starts with a hello (sender -> receiver, carrying the sender's worker address so
// the receiver can open an endpoint for acks) and its ack (with the receiver's slot count); no
// chunk goes out before the ack.
//
// A receiver answers every chunk, slot notice and run message of a sender it has an endpoint to
// with an ack, also the ones it refuses (the ack then carries the error, and the sender fails
// that write at once). A fenced sender (FenceSender) keeps that endpoint: it may be alive behind
// a partition, and its writes must fail, not wait out their deadlines.
//
// Thread contract: not synchronised. Every method, and the UCX callbacks it registers (which run
// inside ucp_worker_progress), must be called with the owning backend's mutex held. The methods
// that wait (Release, RemovePeer, DropSender, FenceSender, Quiesce) call the yield hook
// (SetYield) between their rounds of progress, so that the owner can let other callers take the
// mutex meanwhile: the transport's state may change across those calls.
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
#include <utility>
#include <vector>

#include "backends/ucx/ucx_staged_copier.h"
#include "backends/ucx/ucx_staged_protocol.h"
#include "kvt/common/log.h"
#include "kvt/common/status.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/transfer/backend.h"

namespace kvt::transfer {
namespace ucx_staging {

// Copy runs as active messages.
struct RunOptions {
  // Bytes of data per message (a run longer than this is cut).
  uint64_t message_bytes = uint64_t{1} << 20;
  // Eager messages (the receiver copies each once from UCX's buffer) or rendezvous (a handshake
  // per message; UCX moves the bytes into a buffer of the receiver's, which copies them into
  // place: RunLanding).
  bool rendezvous = false;
  // Messages a sender has unacknowledged at one receiver.
  uint32_t window = 32;
  // Data bytes one Pump sends at most, so that the backend's lock is never held for long by a
  // large write (the next call of the model's thread waits for it).
  uint64_t pump_bytes = uint64_t{1} << 20;
  // Tests: the run message sent this many-th (from 1) fails as if ucp_am_send_nbx refused it
  // (UCS_ERR_NO_RESOURCE); 0: none.
  uint64_t fail_send_at = 0;
  // Tests: this side, receiving, sends each ack (of a run message or a chunk, landed or refused)
  // only this long after it was due, so that tests can hold a sender's writes unacknowledged.
  std::chrono::microseconds ack_delay{0};
  // Tests: this side, receiving, starts taking each rendezvous run message and each staged chunk
  // (queued until then) only this long after it arrived, so that tests can hold a sender's
  // messages queued here (a hostile sender's past its window).
  std::chrono::microseconds receive_delay{0};
  // How long Release waits for the acks of a write's chunks or messages in flight.
  std::chrono::milliseconds release_bound{10000};
};

struct StagingOptions {
  uint32_t slots = 8;
  uint64_t slot_bytes = uint64_t{16} << 20;
  // Host pools staged by the CPU (tests); otherwise CUDA pools staged by the kernels.
  bool host_copier = false;
  std::chrono::microseconds host_copy_delay{0};
  // Offer this side's send slots to receivers for reading in place, and read senders' offered
  // slots in place where they map here.
  bool in_place = true;
};

class StagedTransport {
 public:
  // A UCP context and worker over `transports` (UCX_TLS syntax; empty: UCX's choice), with the
  // protocol's active-message handlers installed. `instance` names this backend to its peers.
  static StatusOr<std::unique_ptr<StagedTransport>> Create(const std::string& transports,
                                                           uint64_t instance,
                                                           const RunOptions& runs = {});
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
  // Writes in progress, or chunks or run messages being received.
  bool Active() const;

  // ---- copy runs: the local buffers ---------------------------------------------------------
  // The host buffers (by index, as registered) that peers' run messages may write, replacing
  // earlier ones; FailedPrecondition while run messages are being received.
  Status AttachRuns(std::span<const LocalRegion> regions);
  void DetachRuns() {
    CutLandings(0, Aborted("the receiver let go of the buffers that took copy runs while the "
                           "message was received; nothing of it landed"));
    run_local_.clear();
  }
  bool runs_attached() const { return !run_local_.empty(); }

  // ---- sending ------------------------------------------------------------------------------
  // A connection to the staging receiver at `worker_address` (its descriptor's address without
  // the trailer). Sends the hello; chunks wait for its ack.
  // kRuns: the receiver's runs address (SplitAddress::runs_address); its chunks are copy runs.
  Status AddPeer(PeerId link, std::string_view worker_address, const AddressTrailer& remote,
                 std::vector<RemoteRegion> regions, LinkMode mode = LinkMode::kStaged);
  // Forgets the connection and closes its endpoint. Graceful: unsent chunks are cancelled, chunks
  // in flight are waited for (bounded), the receiver is told (bye). Peer dead: nothing is waited
  // for or sent, the endpoint is closed by force. Writes that did not complete are Aborted.
  void RemovePeer(PeerId link, bool peer_dead);
  bool HasPeer(PeerId link) const { return peers_.count(link) != 0; }
  // Senders whose bounce slots are mapped here for reading in place (retired ones included).
  size_t mapped_sender_slots() const { return sender_slots_.size(); }
  // Whether the receiver of `link` reads our slots in place (its chunks go as SlotNotices): it
  // acknowledged the slots the link's hello offered, and they are still this side's slots (the
  // pool was not registered again since); false until the hello is acknowledged.
  bool ReadsInPlace(PeerId link) const {
    auto it = peers_.find(link);
    return it != peers_.end() && it->second.in_place && it->second.offer != 0 &&
           it->second.offer == offer_generation_;
  }

  Status PostPages(WriteId id, PeerId link, const PageWrite& write);
  // A write of copy runs to a kRuns peer; `local` are this side's buffers (the runs' sources),
  // and the runs were checked against both sides' buffers (CheckRuns). The runs are copied.
  // send_now: its first messages go out on this thread; otherwise all go from Pump (the
  // progress thread), so that the caller does not spend its time in sends.
  Status PostRuns(WriteId id, PeerId link, std::span<const CopyRun> runs,
                  std::span<const LocalRegion> local, bool send_now);
  bool HasWrite(WriteId id) const { return writes_.count(id) != 0 || run_writes_.count(id) != 0; }
  Status Check(WriteId id);
  // Stops the write's unsent chunks and waits (bounded) for those in flight to be acknowledged,
  // so that none of its bytes lands later.
  void Release(WriteId id);
  // Called (on the progress thread) each time a write completes or fails, so that the owner can
  // tell its caller at once instead of being polled. Must not block or call back in.
  void SetOnWriteDone(std::function<void()> done) { on_write_done_ = std::move(done); }
  // Called with the owner's mutex held between the rounds of progress of every bounded wait;
  // it may release the mutex for a moment (other callers then run) and must return with it held
  // again. Unset: the waits hold the mutex throughout.
  void SetYield(std::function<void()> yield) { yield_ = std::move(yield); }

  // ---- receiving ----------------------------------------------------------------------------
  // Stops accepting chunks from a sending backend: queued ones are dropped (acknowledged as
  // Aborted unless the sender is dead), ones being scattered are waited for (bounded).
  void DropSender(uint64_t instance, bool peer_dead);
  // Closes every link the sending backend opened to us: their chunks and run messages are
  // refused from now on, even ones a network that was down delivers later (receivers take
  // messages only on links opened by a hello and not closed since). Each refusal is answered
  // with an ack (Aborted, naming the fence) through our endpoint back to the sender, which stays
  // open for that: a sender declared dead may be alive behind a partition, and its writes then
  // fail at once instead of waiting out their deadlines. The endpoint closes at the sender's bye
  // for every fenced link, or when more than 256 senders are kept for their fenced links alone
  // (the oldest goes; its later messages go unanswered). Messages being received into the pool
  // are waited for (bounded). New links are accepted.
  void FenceSender(uint64_t instance);
  // Accepts it again (a new connection to it was made).
  void AdmitSender(uint64_t instance) {
    if (dropped_.erase(instance) != 0) std::erase(dropped_order_, instance);
  }

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
    LinkMode mode = LinkMode::kStaged;
    AddressTrailer remote;
    std::vector<RemoteRegion> regions;
    bool ready = false;     // hello acknowledged
    bool in_place = false;  // the receiver accepted the offered slots (ReadsInPlace)
    uint64_t offer = 0;     // offer_generation_ of the slots the hello offered; 0: none
    Status error;           // the receiver refused us
    CreditWindow credits;
    uint64_t token = 0;  // the link's (ucx_staged_protocol.h, "link tokens")
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
    // kLent: the receiver reads the chunk from this slot; free again at the chunk's ack.
    enum class State { kFree, kGathering, kSending, kLent } state = State::kFree;
    bool lent = false;  // sent as a SlotNotice: the slot waits for the ack
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
    bool in_place = false;      // a SlotNotice: the payload is in the sender's slot `slot`
    uint32_t slot = 0;
    // Not taken before (RunOptions::receive_delay); min: at once.
    std::chrono::steady_clock::time_point due = std::chrono::steady_clock::time_point::min();
  };
  struct RecvSlot {
    enum class State { kFree, kLanding, kScattering } state = State::kFree;
    ChunkNotice notice;
    size_t length = 0;
    void* request = nullptr;
    DecodedChunk chunk;
    const uint8_t* source = nullptr;  // read in place: the sender's slot mapped here
    uint64_t prefix = 0;              // read in place: prefix bytes copied into our slot
  };
  // A sender's offered send slots, mapped here and page-locked (reading in place).
  struct SenderSlots {
    ucp_rkey_h rkey = nullptr;
    uint8_t* local = nullptr;  // where slot 0 is mapped here
    uint64_t remote_base = 0;
    uint64_t slot_bytes = 0;
    uint32_t count = 0;
    std::string key;       // the packed key they were offered with
    bool pinned = false;   // by the current copier
    bool retired = false;  // to unmap once no chunk read from it is in flight
  };
  // A write of copy runs: what is left to send (a cursor into the runs) and what came back.
  struct RunWrite {
    PeerId link = 0;
    std::vector<CopyRun> runs;
    std::vector<const uint8_t*> src;  // base of each local buffer
    size_t next_run = 0;              // the first run (and offset in it) not yet sent
    uint64_t next_offset = 0;
    uint32_t messages = 0;  // sent so far
    uint64_t sent_bytes = 0;
    uint32_t acked = 0;
    Status status;
    bool all_sent() const { return next_run >= runs.size(); }
  };
  // A run message being sent: UCX reads the header and the IOV until the send completes.
  struct RunSend {
    WriteId write = 0;
    uint32_t message = 0;
    PeerId link = 0;
    std::vector<uint8_t> header;
    std::vector<ucp_dt_iov_t> iov;
    void* request = nullptr;
  };
  // A rendezvous run message waiting to be received, or being received. UCX receives its data
  // into `bounce`, never straight into the pool: UCX offers no dependable way to end a receive
  // under way (in UCX 1.13 a forced close of the endpoint its data comes on does not), so a
  // sender that stops part-way and comes back later, after a fence, would otherwise land its
  // bytes in pages handed out again. Pump copies the data to `iov` once it is all here, and only
  // while the message's link is still open and the buffers are the ones `iov` names.
  struct RunLanding {
    ChunkNotice notice;             // chunk = the message index
    void* data = nullptr;           // UCX's descriptor, until the receive is posted
    size_t length = 0;              // bytes of data
    std::vector<ucp_dt_iov_t> iov;  // the destinations in the pool, piece by piece
    std::unique_ptr<uint8_t[]> bounce;
    void* request = nullptr;
    // Not OK: none of its data is copied (the buffers were registered again or let go since
    // `iov` was made, or its sender was disconnected here); the ack carries this instead.
    Status cut;
    // Not received before (RunOptions::receive_delay); min: at once.
    std::chrono::steady_clock::time_point due = std::chrono::steady_clock::time_point::min();
  };
  struct Sender {  // a backend that sends to us, and our endpoint back to it for acks
    ucp_ep_h ep = nullptr;
    std::map<uint64_t, uint64_t> links;         // link -> the token its hello carried
    std::map<uint64_t, uint64_t> fenced_links;  // closed by FenceSender; their messages are refused
    std::string address;  // the worker address its first hello gave (the endpoint's)
  };
  struct PendingHello {
    Hello hello;
    std::string address;
    std::string key;  // of the offered slots; empty: none offered
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

  StagedTransport(uint64_t instance, const RunOptions& runs)
      : instance_(instance), run_options_(runs) {}
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
  static ucs_status_t OnRuns(void* arg, const void* header, size_t header_length, void* data,
                             size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnSlotChunk(void* arg, const void* header, size_t header_length, void* data,
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
  // Frees the send slot lent for the chunk (matching link, write and chunk), if any.
  void ReturnSlot(PeerId link, WriteId write, uint32_t chunk);
  // Progresses until `done` or the bound; false on timeout.
  template <typename Done>
  bool WaitUntil(Done&& done, std::chrono::milliseconds bound);

  // Copy runs.
  // Sends messages of pending writes while their peers have credits, at most `budget` data
  // bytes (at least one message).
  void ScheduleRuns(uint64_t budget);
  // Whether a pending run write could send now (its peer has a credit).
  bool RunsSendable() const;
  // Sends the next message of the write; false when it could not (the write failed).
  bool SendRunMessage(WriteId id, RunWrite& write, Peer& peer);
  void PumpRunSends();
  void FailRunWrite(WriteId id, RunWrite& write, const Status& status);
  void HandleRunAck(const ChunkAck& ack, std::string_view message);
  void PumpRunLandings();
  // Marks the run landings of `sender` (0: of every sender) as cut with `why`, unless they are
  // already.
  void CutLandings(uint64_t sender, const Status& why);
  // Copies a landing's received data into the pool if its link is still open and its buffers
  // current, and acks it either way.
  void DeliverLanding(RunLanding& landing);
  bool RunsBusy() const;

  // Receiving.
  void PumpRecvSlots();
  void HandleHellos();
  // Waits (bounded) until no chunk of `instance` is being scattered into the pool; `which`
  // ("a disconnected", "a fenced") names the sender in the error when it does not settle. Run
  // messages need no wait: their bytes enter the pool only in Pump, after a check of the link
  // (RunLanding).
  void WaitForLandings(uint64_t instance, const char* which);
  // Whether the notice's link of its sender was opened by a hello with the notice's token and not
  // closed or fenced since.
  bool LinkOpen(const ChunkNotice& notice) const;
  // Why a message whose link is not open (LinkOpen) is refused: not its sender's, when it names
  // an open or fenced link but not that link's token (FailedPrecondition); the fence that closed
  // the link (Aborted, naming the sender and the link); or else `otherwise` (also for a sender
  // disconnected here since: the disconnect, not the fence, is what the caller names).
  Status ClosedLink(const ChunkNotice& notice, Status otherwise) const;
  // Closes and forgets the oldest senders kept only for their fenced links, beyond 256.
  void TrimFencedSenders();
  void HandleByes();
  // Maps and page-locks the slots `hello` offers (its packed key is `key`), replacing an idle
  // earlier mapping of the same sender; an error when they do not map here (another host) or
  // the mapping fails a check.
  Status MapSenderSlots(ucp_ep_h ep, const Hello& hello, std::string_view key);
  // Unmaps the sender's slots once no chunk read from them is in flight (retires them until
  // then); force: now, or never (leaked) if a chunk is still read from them.
  void UnmapSenderSlots(uint64_t instance, bool force = false);
  bool SenderSlotsBusy(uint64_t instance) const;
  void UnmapRetiredSlots();
  // When a message arriving now may be taken (RunOptions::receive_delay); min: at once. Due:
  // whether a message with that time may be taken now (reads the clock only under a delay).
  std::chrono::steady_clock::time_point ReceiveDue() const {
    return run_options_.receive_delay.count() > 0
               ? std::chrono::steady_clock::now() + run_options_.receive_delay
               : std::chrono::steady_clock::time_point::min();
  }
  static bool Due(std::chrono::steady_clock::time_point due) {
    return due == std::chrono::steady_clock::time_point::min() ||
           due <= std::chrono::steady_clock::now();
  }
  // ResourceExhausted when the notice's link already has as many chunks queued (arrivals_) as
  // the credits its hello ack granted (slots()): a queued chunk holds UCX's descriptor or a copy
  // of its data, which a sender past its credits must not pile up.
  Status ArrivalRoom(const ChunkNotice& notice) const;
  void Land(uint32_t slot, Arrival arrival);
  void Landed(uint32_t slot);
  void FinishReceive(uint32_t slot, const Status& status);
  // Acks `notice` with `status` (RunOptions::ack_delay holds it back first).
  void SendAck(const ChunkNotice& notice, const Status& status);
  void SendAckNow(const ChunkNotice& notice, const Status& status);
  void SendDelayedAcks();

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
  const RunOptions run_options_;
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
  std::function<void()> yield_;          // SetYield
  bool notified_ = false;
  static void OnCopierDone(void* self);
  uint64_t slot_bytes_ = 0;
  bool in_place_ = true;           // StagingOptions::in_place
  std::string send_key_;           // packed remote key of the send slots (offered); empty: none
  uint64_t offer_generation_ = 0;  // counts the slot memories (Attach)
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
  // Fenced senders in the order they were fenced, to bound those kept for fenced links alone.
  std::deque<uint64_t> fenced_order_;
  std::unordered_set<uint64_t> dropped_;
  std::unordered_map<uint64_t, SenderSlots> sender_slots_;  // by sender instance
  bool retired_slots_ = false;                              // some are retired
  std::deque<uint64_t> dropped_order_;                      // insertion order, to bound dropped_
  // Warnings a peer causes once per message go through a limiter of their kind (at most 10 a
  // second each, the rest counted; LogLimiter), so that a flood of one kind neither fills the
  // log nor hides a line of another: refused chunks, slot notices and run messages; hellos
  // ignored or not answered; acks and control messages that could not be delivered
  // (WarnLimited).
  LogLimiter refusal_warnings_{10, std::chrono::seconds(1)};
  LogLimiter hello_warnings_{10, std::chrono::seconds(1)};
  LogLimiter delivery_warnings_{10, std::chrono::seconds(1)};
  std::vector<PendingHello> hellos_;
  std::vector<Bye> byes_;

  // Copy runs.
  std::vector<LocalRegion> run_local_;      // buffers peers' run messages write
  std::vector<uint64_t> run_local_len_;     // their lengths, by index
  size_t max_am_header_ = 0;                // the worker's limit on an AM header
  std::map<WriteId, RunWrite> run_writes_;  // ordered by id: post order
  std::set<WriteId> run_pending_;           // run writes with messages not yet sent
  uint64_t run_messages_posted_ = 0;        // for RunOptions::fail_send_at
  std::list<RunSend> run_sends_;
  std::list<RunLanding> run_landings_;
  // Acks to send from Pump (run messages, and chunks refused inside a callback).
  std::vector<std::pair<ChunkNotice, Status>> pending_acks_;
  // Acks held back by RunOptions::ack_delay, with when each is due.
  struct DelayedAck {
    std::chrono::steady_clock::time_point due;
    ChunkNotice notice;
    Status status;
  };
  std::deque<DelayedAck> delayed_acks_;

  std::list<ControlSend> control_;
  std::vector<Closing> closing_;
};

}  // namespace ucx_staging
}  // namespace kvt::transfer

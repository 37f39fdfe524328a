// TransferEngine: moves one request's KV pages from a prefill pool into a decode pool and tells
// the decode side the moment the data is really there.
//
// One engine per agent (per pool). A prefill engine listens on a control port; a decode engine
// connects to prefill engines (ConnectPeer), exchanging layouts and memory descriptors in the
// hello and refusing incompatible layouts with both sides' values. Per request (room):
//   decode:  Receive(room, peer, dst_pages)  -> TransferRequest to the prefill engine
//   prefill: Send(room, src_pages), then LayersReady(room, n) as layers are written (or
//            LayersReady(room, L) at once); layers go out as soon as both halves are known.
// After the last layer the prefill engine waits until the backend reports every write visible
// at the decode pool, and only then sends TransferDone; the decode request becomes Success.
//
// States move forward only: Bootstrapping -> WaitingForInput -> Transferring -> Success|Failed.
//   Bootstrapping    only one half is known (prefill: no TransferRequest yet; decode: sending)
//   WaitingForInput  both halves known; waiting for layers (prefill) / for data (decode)
//   Transferring     writes posted (prefill) / progress reported (decode)
// Abort works from either side and is acknowledged; every request has a deadline; losing a
// control connection fails exactly the requests that used it. A decode request that failed
// reports pages_reusable = false while a write into its pages may still land (the prefill side
// has not confirmed it quiesced its writes and is not known dead).
//
// A prefill engine that shuts down first fails its rooms and quiesces their writes, then tells
// the decode side (which may then reuse the pages), and only then closes its connections. A
// decode side that loses a prefill peer without being told keeps the failed rooms' pages
// quarantined until the peer's process is known to be gone. A decode engine that shuts down
// fails its rooms in flight with Aborted (waiters return at once), asks their prefill engines to
// stop, and waits a bounded while for them to confirm before it closes its connections; a room
// whose pages are still not known safe then says so in its status (pages_reusable stays false).
//
// Thread safety: every public method may be called from any thread and never blocks on another
// peer's trouble. Internally one mutex guards the request table and is never held across
// blocking work (backend teardown, waiting for writes, CUDA synchronisation); a poller thread
// drives completions and deadlines; control-plane threads deliver messages; one liveness worker
// looks after lost peers.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvt/common/status.h"
#include "kvt/pool/kv_pool.h"
#include "kvt/transfer/backends.h"
#include "kvt/transfer/control_options.h"
#include "kvt/transfer/layout.h"

namespace kvt::transfer {

enum class RequestState : uint8_t {
  kBootstrapping = 0,
  kWaitingForInput = 1,
  kTransferring = 2,
  kSuccess = 3,
  kFailed = 4,
};
const char* RequestStateName(RequestState state);
inline bool IsFinal(RequestState s) {
  return s == RequestState::kSuccess || s == RequestState::kFailed;
}

struct RequestInfo {
  std::string room;
  RequestState state = RequestState::kBootstrapping;
  Status status;       // why it failed (OK otherwise)
  uint64_t bytes = 0;  // bytes written (prefill) / reported delivered (decode)
  // prefill: layers whose writes were posted for every page declared so far (a new chunk of a
  // chunked room starts it again from the room's first layer)
  int32_t layers_posted = 0;
  // decode: true once no write into the request's pages can land any more (success, or the
  // prefill side confirmed it quiesced, or it is known dead). Pages may be reused only then.
  bool pages_reusable = false;
  std::chrono::steady_clock::time_point created;
  std::chrono::steady_clock::time_point finished;  // valid in final states
  // Where a request's time went (steady_clock, one clock for every process of a host; a
  // default-constructed point = not reached). Decode: `request_sent` = the TransferRequest is
  // handed to the control connection (stamped just before); `finished` = TransferDone
  // processed. Prefill:
  // `request_seen` = the TransferRequest arrived; `source_ready` = the request, Send and
  // LayersReady up to the layer range's end were all in (the earliest moment the last write
  // could be posted); `first_post` / `last_post` = the backend accepted the
  // first / last layer batch's write; `finished` = every write visible at the peer.
  std::chrono::steady_clock::time_point request_sent;
  std::chrono::steady_clock::time_point request_seen;
  std::chrono::steady_clock::time_point source_ready;
  std::chrono::steady_clock::time_point first_post;
  std::chrono::steady_clock::time_point last_post;
};

struct EngineStats {
  uint64_t requests_succeeded = 0;
  uint64_t requests_failed = 0;
  uint64_t bytes = 0;  // bytes of successful requests
  uint64_t writes_posted = 0;
  uint64_t runs_posted = 0;  // coalesced copy runs
  // Control connections whose messages go through a shared-memory lane now (control_lanes).
  uint64_t control_lanes = 0;
  // Times a busy-polling prefill engine's poller stayed hot (spun instead of sleeping) after it
  // watched a device write (control_busy_poll).
  uint64_t poller_hot_spins = 0;
};

// A peer as seen by a decode engine.
using PeerHandle = uint64_t;

// The longest EngineOptions::control_busy_poll taken: a longer window is a core spent for nothing
// between requests.
inline constexpr std::chrono::microseconds kMaxControlBusyPoll{1000000};

struct EngineOptions {
  std::string name = "kvt";  // agent name (in hellos and authentication)
  bool prefill = true;       // prefill (listens, writes) or decode (connects, receives)
  // The backend Create makes when it is given none: the alternative picks it (UcxOptions,
  // CudaIpcOptions, NcclOptions, LoopbackOptions; backends.h).
  BackendConfig backend = UcxOptions{};
  // Control server (prefill engines). bind_address, port, cluster_token, limits.
  control::ControlServerOptions server;
  // Shared secret for connections this engine makes (decode); empty: none.
  std::string cluster_token;
  // Used when a request gives none; also bounds how long a prefill-side Send waits for the
  // decode side's request.
  std::chrono::milliseconds default_deadline{30000};
  // How long ConnectPeer waits for the prefill engine's answer to its hello.
  std::chrono::milliseconds hello_timeout{10000};
  // Final requests are forgotten this long after they ended (Forget removes them at once).
  std::chrono::milliseconds retention{120000};
  // Control connections send a heartbeat this often and are declared lost after peer_timeout
  // without any frame from the peer (a hung or partitioned peer; a killed one is noticed at once
  // through the closed socket).
  std::chrono::milliseconds heartbeat_interval{1000};
  std::chrono::milliseconds peer_timeout{10000};
  // Prefill engines with device backends (cuda_ipc): while a write's copy runs (its producer's
  // event has completed), the poller watches it for up to this long between passes instead of
  // sleeping until the backend's notification (which costs a thread wake-up): a CPU core while
  // the GPU copies, for completion seen within microseconds. A write still waiting for its
  // producer is never watched this way. 0: always sleep.
  std::chrono::microseconds device_spin{200};
  // The control plane's io threads (the prefill engine's server, one per decode connection):
  // 0 = they sleep in epoll between frames; > 0 = while requests are in flight (on a prefill
  // engine: any of its requests; on a decode engine: that connection's peer's requests), and for
  // this long after the last frame or request, they poll their sockets without sleeping
  // (control::BusyPollOptions): a CPU core per polling io thread, for control messages handled
  // within microseconds instead of after a thread wake-up. Needs server.num_threads = 1.
  // WaitRequest then polls as well, for up to this long, before it sleeps, and a prefill
  // engine's poller that watched a device copy stays hot (spins) this long after it, so the next
  // copy is watched from the moment it is posted (EngineStats::poller_hot_spins). At most
  // kMaxControlBusyPoll.
  std::chrono::microseconds control_busy_poll{0};
  // With control_busy_poll: a control connection to a peer on this host (the same shared-memory
  // namespace and user) that polls too carries its messages through a shared-memory lane instead
  // of the socket (control::BusyPollOptions::lanes; docs/protocol.md, "Lanes"). false: never.
  bool control_lanes = true;
  uint32_t tp_rank = 0;
  uint32_t tp_size = 1;
  // Prefill: called (on a control thread, without engine locks held) when a TransferRequest
  // arrives for a room this engine has no Send for yet; an agent can start its forward there.
  std::function<void(const std::string& room, size_t num_pages)> on_transfer_request;
};

// Options of one Send call (a chunk of a room's source pages).
struct SendOptions {
  // 0: the engine's default deadline. The room's deadline is set by its first Send or request
  // (the default or the one given, counted from that call); a later call's deadline, counted
  // from that call, can only bring it forward (the earlier of the two holds).
  std::chrono::milliseconds deadline{0};
  // false: more chunks follow (chunked prefill). Each chunk's pages follow the previous chunks'
  // in token order and go to the next positions of the decode side's page list; each chunk has
  // its own LayersReady count (LayersReady applies to the latest chunk), and the next chunk may
  // be sent only once the previous one is ready up to its last layer.
  bool last = true;
  // The room's aux slot in this engine's layout (TransferLayout::aux); -1: none. Given with any
  // chunk. Its bytes are read once the last chunk is ready in every layer of this engine
  // (LayersReady with the layer count, even when the decode side asked for fewer layers), that
  // call's event has completed and the pages are written: write them before that call (on a
  // CUDA pool, on the stream before its event).
  int64_t aux_slot = -1;
};

// Options of one Receive call.
struct ReceiveOptions {
  std::chrono::milliseconds deadline{0};  // 0: the engine's default deadline
  int32_t layer_begin = 0;                // transfer layers [layer_begin, layer_end)
  int32_t layer_end = -1;                 // -1: every layer
  // The aux slot of this engine's layout that receives the prefill slot's bytes; -1: none.
  // Its bytes are written before the request becomes Success.
  int64_t aux_slot = -1;
};

class TransferEngine {
 public:
  // Registers the memory the layout describes (memory the caller owns and keeps alive and
  // registered-size for the engine's life; never zeroed or written by registration) with the
  // backend and, for prefill, starts listening. The layout is validated first (Validate()).
  // options.tp_rank / tp_size are ignored: the layout's hold.
  static StatusOr<std::unique_ptr<TransferEngine>> Create(
      const EngineOptions& options, const TransferLayout& layout,
      std::shared_ptr<Backend> backend = nullptr);

  // Registers the pool's buffers with the backend (the pool's guards refuse what they refuse:
  // slab-aliased or state-layer pools cannot be registered) and, for prefill, starts listening.
  // The pool must outlive the engine. `backend`: one made beforehand (e.g. to allocate the
  // pool's memory through BackendHostAllocator); null: the engine creates options.backend.
  static StatusOr<std::unique_ptr<TransferEngine>> Create(
      const EngineOptions& options, pool::KvPool* pool, std::shared_ptr<Backend> backend = nullptr);
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  // For an owner about to destroy the engine while other threads may be inside its calls (the
  // destructor must not run under a call): calls that wait return now instead of at their
  // timeouts: a ConnectPeer waiting for its hello's answer, and a WaitRequest on a room that is
  // not final, fail with Aborted, and so do later calls of either; the rooms themselves are left
  // as they are. Any thread; never blocks.
  void Interrupt();

  // Prefill: the control port actually bound.
  uint16_t port() const;
  std::string_view backend_name() const;

  // ---- decode side ----------------------------------------------------------------------------
  // Connects to a prefill engine: hello with our layout and memory descriptors, then a
  // compatibility check (layers, page size, dtype, heads, head_dim). A mismatch is
  // FailedPrecondition naming both sides' values. Connecting twice to one address returns the
  // same handle while the connection lives.
  StatusOr<PeerHandle> ConnectPeer(const std::string& host, uint16_t port);

  // Asks `peer` to send the room's KV into `dst_pages` (token order, each >= 1), layers
  // [layer_begin, layer_end) (layer_end = -1: every layer). deadline 0 = default.
  Status Receive(const std::string& room, PeerHandle peer, std::vector<int32_t> dst_pages,
                 std::chrono::milliseconds deadline = std::chrono::milliseconds(0),
                 int32_t layer_begin = 0, int32_t layer_end = -1);
  Status Receive(const std::string& room, PeerHandle peer, std::vector<int32_t> dst_pages,
                 const ReceiveOptions& options);

  // ---- prefill side ---------------------------------------------------------------------------
  // Declares the room's source pages (token order). The transfer starts when the decode
  // side's request for the room is known too. The room fails with DeadlineExceeded (and the
  // caller may free its pages) when it is not done within `deadline` (0: the default deadline),
  // or within the decode side's deadline when that one ends earlier; a room whose decode request
  // never comes thus ends too.
  Status Send(const std::string& room, std::vector<int32_t> src_pages,
              std::chrono::milliseconds deadline = std::chrono::milliseconds(0));
  // The same with options: a chunk of a chunked prefill (options.last = false), an aux slot.
  // A chunk that would take the room past the decode side's page count is refused (OutOfRange
  // naming both counts) and changes nothing. An empty last chunk (no pages, options.last) closes
  // a chunked room whose chunks already hold every page; LayersReady goes on applying to its
  // latest chunk.
  Status Send(const std::string& room, std::vector<int32_t> src_pages, const SendOptions& options);
  // Layers [0, layers_done) of the room are written in the pool; their pages may go out.
  // Monotone; values beyond the layer count are clamped.
  // CUDA pools: `ready` is an event the producer recorded on its compute stream after writing
  // those layers; the copy waits for it on the GPU (no CPU polling), so LayersReady may be
  // called as soon as the layer's work is enqueued. The engine keeps the latest event of the
  // room and waits on it when it posts, so events of one room must come from one stream and
  // an event must not be re-recorded until layers_posted covers its layers (or the room is
  // final). Backends that copy on the CPU synchronise on it before reading.
  Status LayersReady(const std::string& room, int32_t layers_done, cudaEvent_t ready = nullptr);

  // ---- both sides -----------------------------------------------------------------------------
  StatusOr<RequestInfo> GetRequest(const std::string& room) const;
  // Waits until the room is final (or `timeout`); returns its info (DeadlineExceeded on timeout).
  // With control_busy_poll > 0 it polls (yielding its core between looks) for up to that window
  // before it sleeps: a sleeping waiter's wake-up costs a one-page request tens of microseconds.
  StatusOr<RequestInfo> WaitRequest(const std::string& room,
                                    std::chrono::milliseconds timeout) const;
  // Fails the room with Aborted and tells the peer (which acknowledges). NotFound when unknown;
  // OK without effect when it is already final.
  Status Abort(const std::string& room, const std::string& reason = "aborted by the caller");
  // Drops a final room's record. FailedPrecondition while it is not final, and on a decode
  // engine while a failed room's pages may still be written (RequestInfo::pages_reusable).
  Status Forget(const std::string& room);

  EngineStats stats() const;

  // The layout this engine registered.
  const TransferLayout& layout() const;

 private:
  class Impl;
  explicit TransferEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvt::transfer

// The prefill side of a transfer engine: it listens on the control port, accepts decode peers
// (hello, compatibility check, backend connect), pairs each room's Send with the decode side's
// TransferRequest, posts layer batches as they become ready, and sends TransferDone once the
// backend reports every write visible at the peer.
//
// Thread contract: public methods may be called from any thread; control-plane callbacks come
// on the server's io threads, PollPass on the poller. Everything shared is guarded by the
// context's mutex; backend calls that can block run outside it (AfterUnlock).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "control/control_server.h"
#include "engine/request_table.h"
#include "kvt/transfer/plan.h"

namespace kvt::transfer::engine {

// A write posted for a room, with the producer event its copy waits for (null: none).
struct PostedWrite {
  WriteId id = 0;
  cudaEvent_t ready = nullptr;
};

// One Send call's pages: the whole source of a room, or one chunk of a chunked prefill. Each
// chunk has its own readiness (LayersReady counts layers of the latest chunk) and posts its
// layer batches on its own; it goes to the decode pages at the same positions.
struct SourceChunk {
  size_t offset = 0;  // position of its first page in the room's page lists
  size_t count = 0;
  int32_t layers_ready = 0;
  cudaEvent_t ready = nullptr;  // the producer's event covering layers [0, layers_ready)
  bool planned = false;         // its spec was validated (and, for run backends, planned)
  std::optional<Plan> plan;
  int32_t posted_end = 0;  // layers [layer_begin, posted_end) posted
};

struct PrefillRoom : RoomCore {
  std::vector<int32_t> src_pages;  // every chunk's pages, in token order
  std::vector<SourceChunk> chunks;
  bool last_chunk = false;  // the last chunk was sent: src_pages is complete
  int64_t aux_slot = -1;    // this side's aux slot (SendOptions::aux_slot); -1: none
  bool have_request = false;
  bool abort_acked = false;  // an AbortAck went out exempt from the queue's limits
  control::ConnectionId conn = 0;
  std::vector<int32_t> dst_pages;
  std::vector<PageUnit> units;
  std::optional<uint32_t> dst_aux_slot;  // the decode side asked for aux data
  std::vector<std::string> aux;          // the aux slot's bytes, read once the KV is complete
  std::vector<PostedWrite> writes;
  // When the last of its writes completed: a producer that is still making progress (a layerwise
  // forward) is worth watching without sleeping.
  Clock::time_point last_progress;

  bool have_src() const { return !chunks.empty(); }
};

class PrefillSide final : public SideWithTable<PrefillRoom>, public control::ControlHandler {
 public:
  explicit PrefillSide(EngineContext& ctx) : SideWithTable(ctx) {}
  ~PrefillSide() override;

  // Starts the control server.
  Status Start();
  uint16_t port() const { return server_ ? server_->port() : 0; }

  Status Send(const std::string& room, std::vector<int32_t> src_pages, const SendOptions& options)
      KVT_EXCLUDES(ctx_.mu);
  Status LayersReady(const std::string& room, int32_t layers_done, cudaEvent_t ready)
      KVT_EXCLUDES(ctx_.mu);

  Status Abort(const std::string& room, const std::string& reason) override KVT_EXCLUDES(ctx_.mu);
  PollResult PollPass(Clock::time_point now) override KVT_EXCLUDES(ctx_.mu);
  void Shutdown() override KVT_EXCLUDES(ctx_.mu);
  uint64_t ControlLanes() const override KVT_EXCLUDES(ctx_.mu);

  // control::ControlHandler (the server's io threads).
  void OnConnect(control::ConnectionId id, const control::ConnectionInfo& info) override;
  void OnMessage(control::ConnectionId id, const v1::Envelope& envelope) override
      KVT_EXCLUDES(ctx_.mu);
  void OnDisconnect(control::ConnectionId id, const Status& why) override KVT_EXCLUDES(ctx_.mu);
  void OnHeartbeat(control::ConnectionId id) override KVT_EXCLUDES(ctx_.mu);

 private:
  struct Session {
    PeerId backend_peer = 0;
    v1::PeerInfo info;
    bool closing = false;  // the engine is shutting down: post nothing more
    // The last frame (a heartbeat included) received from the peer. Nothing is posted to a peer
    // not heard from for peer_timeout: it is fenced (FenceLocked), which is what lets the peer
    // reuse the pages of its failed requests after PeerInfo.fence_ms.
    Clock::time_point last_heard = Clock::now();
    // Both sides' buffers, by index: what a plan of this session's requests needs.
    std::vector<PlanBuffer> buffers;
  };

  void OnHello(control::ConnectionId conn, const v1::Hello& hello) KVT_EXCLUDES(ctx_.mu);
  void OnTransferRequest(control::ConnectionId conn, const v1::Envelope& envelope)
      KVT_EXCLUDES(ctx_.mu);
  void OnAbort(control::ConnectionId conn, const v1::Abort& abort) KVT_EXCLUDES(ctx_.mu);

  // Whether the session has gone unheard for peer_timeout (then nothing may be posted to it).
  bool SilentLocked(const Session& session, Clock::time_point now) const KVT_REQUIRES(ctx_.mu) {
    return now - session.last_heard > ctx_.options.peer_timeout;
  }
  Status SilenceStatus(const Session& session, Clock::time_point now) const
      KVT_REQUIRES(ctx_.mu);
  // Ends a session whose peer is lost or silent: its endpoint is closed forcibly first, then its
  // rooms' writes released, its rooms failed and the connection closed. Erases the session.
  void EndSessionLocked(control::ConnectionId conn, const Status& why, AfterUnlock& after)
      KVT_REQUIRES(ctx_.mu);
  // Posts what can be posted and finishes the room when every write is visible.
  void AdvanceLocked(PrefillRoom& room, AfterUnlock& after) KVT_REQUIRES(ctx_.mu);
  // Validates (and for run backends plans) a chunk once both halves are known; an error fails
  // the room.
  Status PlanChunkLocked(PrefillRoom& room, SourceChunk& chunk, const Session& session)
      KVT_REQUIRES(ctx_.mu);
  StatusOr<WriteId> PostLayersLocked(PrefillRoom& room, SourceChunk& chunk, const Session& session,
                                     int32_t ready_end, uint64_t* bytes, size_t* num_runs)
      KVT_REQUIRES(ctx_.mu);
  // Whether every page of the room is declared and every layer of it posted.
  bool AllPostedLocked(const PrefillRoom& room) const KVT_REQUIRES(ctx_.mu);
  // When the poller must look at the room next: now while writes are in flight or layers wait
  // for their producer's event, by its deadline while it waits for the other side or the
  // application, never once it is final (Wakeup::KickBefore).
  Clock::time_point PollByLocked(const PrefillRoom& room) const KVT_REQUIRES(ctx_.mu);
  // Whether layers of the room were declared ready with a producer's event but not posted yet.
  bool WaitsForEventLocked(const PrefillRoom& room) const KVT_REQUIRES(ctx_.mu);
  // Whether the room's aux bytes may be read (true when it has none): the last chunk is ready
  // in every layer and its producer's event has completed; an error when the decode side asked
  // for aux data the prefill side did not name.
  StatusOr<bool> AuxReadyLocked(const PrefillRoom& room) const KVT_REQUIRES(ctx_.mu);
  // Whether every layer of the room is written and only its aux bytes wait, for the producer's
  // event of its final LayersReady call (the poller looks again soon).
  bool WaitsForAuxLocked(const PrefillRoom& room) const KVT_REQUIRES(ctx_.mu);
  // Reads the room's aux slot for its TransferDone (AuxReadyLocked said it may).
  Status ReadAuxLocked(PrefillRoom& room) KVT_REQUIRES(ctx_.mu);
  void CheckWritesLocked(PrefillRoom& room, AfterUnlock& after) KVT_REQUIRES(ctx_.mu);
  // Fails the room: its writes are released after the lock (cancelled and waited for), and only
  // then is the decode side told (TransferDone with the reason), so that the message proves
  // that no byte of the room lands any more.
  void FailAndReportLocked(PrefillRoom& room, Status why, AfterUnlock& after) KVT_REQUIRES(ctx_.mu);
  void TakeWritesLocked(PrefillRoom& room, AfterUnlock& after) KVT_REQUIRES(ctx_.mu);
  void QueueDoneLocked(const PrefillRoom& room, AfterUnlock& after) KVT_REQUIRES(ctx_.mu);
  void FinishLocked(PrefillRoom& room) KVT_REQUIRES(ctx_.mu);
  // Does `after` now, or on the engine's worker when it may block.
  void Run(AfterUnlock& after) KVT_EXCLUDES(ctx_.mu) { Dispatch(ctx_, after); }
  // Sends on the connection (failures logged: a closed connection ends its rooms anyway).
  // LayerProgress and replies to bad frames are held to the queue's limits; a room's final
  // messages are exempt (control::QueueLimit).
  void SendTo(control::ConnectionId conn, const v1::Envelope& envelope,
              control::QueueLimit limit = control::QueueLimit::kEnforced);
  // Non-final rooms, read without the lock by the control server's io threads (an atomic).
  size_t ActiveRooms() const KVT_NO_THREAD_SAFETY_ANALYSIS {
    return table_.active_counter().load(std::memory_order_relaxed);
  }

  std::vector<CopyRun> TakeSpareRunsLocked() KVT_REQUIRES(ctx_.mu);
  void RecycleRunsLocked(std::vector<CopyRun> runs) KVT_REQUIRES(ctx_.mu);

  std::unique_ptr<control::ControlServer> server_;
  std::unordered_map<control::ConnectionId, Session> sessions_ KVT_GUARDED_BY(ctx_.mu);
  // Run storage of finished plans, reused by the next ones (planning then allocates nothing in
  // steady state).
  std::vector<std::vector<CopyRun>> spare_runs_ KVT_GUARDED_BY(ctx_.mu);
  Clock::time_point last_sweep_ KVT_GUARDED_BY(ctx_.mu) = Clock::now();
  // TransferDones decided under the lock but not yet handed to their connection (they are sent
  // after it is released): Shutdown waits for them, so that its Goodbye never overtakes the
  // TransferDone of a room that ended on another thread.
  int pending_dones_ KVT_GUARDED_BY(ctx_.mu) = 0;
  CondVar dones_cv_;
};

}  // namespace kvt::transfer::engine

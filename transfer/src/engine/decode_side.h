// The decode side of a transfer engine: it connects to prefill engines (hello, compatibility
// check; one connection per address however many callers connect at once), sends each room's
// TransferRequest, follows the prefill side's messages to the room's end, and decides when a
// failed room's pages may be reused: when the prefill side said its writes are quiesced, when the
// prefill process is known dead, or when the prefill side's fencing bound (PeerInfo.fence_ms) has
// passed since the connection was lost.
//
// Lost peers are handled by one liveness worker thread (never a thread per peer): it proves the
// peer's process gone (same host: no process with the peer's pid and start time; another host:
// its control port refuses, which a prefill engine only lets happen after it quiesced its
// writes) or waits out its fencing bound (not counting time a same-host peer spends stopped),
// releases the quarantined pages then, and frees the peer's connection.
//
// Thread contract: public methods may be called from any thread; peer messages arrive on each
// connection's io thread; PollPass runs on the poller. Shared state is guarded by the context's
// mutex; connecting, closing connections and backend teardown run outside it.
#pragma once

#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "control/control_client.h"
#include "engine/request_table.h"

namespace kvt::transfer::engine {

struct DecodeRoom : RoomCore {
  PeerHandle peer = 0;
  int64_t aux_slot = -1;  // the slot the prefill side's aux bytes go to; -1: none
};

class DecodeSide final : public SideWithTable<DecodeRoom> {
 public:
  explicit DecodeSide(EngineContext& ctx) : SideWithTable(ctx) {}
  ~DecodeSide() override;

  // Also refuses a failed room whose pages may still be written (not pages_reusable): a new
  // room of the same id would take the late answers of this one for its own.
  Status Forget(const std::string& room) override KVT_EXCLUDES(ctx_.mu);

  // Starts the liveness worker.
  Status Start();

  StatusOr<PeerHandle> ConnectPeer(const std::string& host, uint16_t port) KVT_EXCLUDES(ctx_.mu);
  Status Receive(const std::string& room, PeerHandle peer, std::vector<int32_t> dst_pages,
                 std::chrono::milliseconds deadline, int32_t layer_begin, int32_t layer_end,
                 int64_t aux_slot) KVT_EXCLUDES(ctx_.mu);

  Status Abort(const std::string& room, const std::string& reason) override KVT_EXCLUDES(ctx_.mu);
  PollResult PollPass(Clock::time_point now) override KVT_EXCLUDES(ctx_.mu);
  // Fails every room that is not final with Aborted (its waiters return at once) and asks its
  // prefill engine to stop; waits up to 2.5 s (kFenceTeardown and a margin) for the answers that
  // make the pages reusable, then closes the connections and lets go of the backend ends: a
  // two-sided end that disconnects makes its rooms' pages reusable too. A room it ended whose pages
  // stay quarantined says why in its status. Rooms already final keep their status.
  void Shutdown() override KVT_EXCLUDES(ctx_.mu);
  // TransferEngine::Interrupt: connects waiting for their hello's answer fail now.
  void Interrupt() KVT_EXCLUDES(ctx_.mu);
  uint64_t ControlLanes() const override KVT_EXCLUDES(ctx_.mu);

  // Peers whose connection is gone but whose clean-up (the liveness worker's) is not finished.
  size_t lost_peers() const KVT_EXCLUDES(ctx_.mu);

 private:
  class PeerClientHandler : public control::ControlClient::Handler {
   public:
    PeerClientHandler(DecodeSide* side, PeerHandle id) : side_(side), id_(id) {}
    void OnMessage(const v1::Envelope& envelope) override { side_->OnPeerMessage(id_, envelope); }
    void OnDisconnect(const Status& why) override { side_->OnPeerDisconnect(id_, why); }

   private:
    DecodeSide* side_;
    PeerHandle id_;
  };

  struct DecodePeer {
    // Non-final rooms of this peer: its connection's io thread busy-polls while > 0. Declared
    // before the client, whose io thread reads it, so that it outlives that thread.
    std::atomic<int64_t> in_flight{0};
    PeerHandle id = 0;
    std::string address;
    std::string host;
    uint16_t port = 0;
    std::unique_ptr<PeerClientHandler> handler;  // outlives client (declared first)
    std::unique_ptr<control::ControlClient> client;
    std::promise<StatusOr<v1::HelloAck>> hello_reply;
    bool hello_answered = false;
    v1::PeerInfo info;
    std::optional<PeerId> backend_peer;  // two-sided backends: this side's end of the pair
    bool alive = false;
    bool said_goodbye = false;  // the peer ended the session with its writes quiesced
    // The connection closed while Connect was still setting the peer up (after its hello-ack):
    // why. Connect then fails instead of handing out a dead peer.
    std::optional<Status> closed_while_connecting;
  };

  // A lost peer the liveness worker looks after.
  struct LostPeer {
    PeerHandle id = 0;
    std::string host;
    uint16_t port = 0;
    std::string host_id;
    uint32_t pid = 0;
    uint64_t process_start = 0;
    std::vector<std::string> quarantined;  // failed rooms whose pages wait for a proof
    // When the peer's fencing bound (PeerInfo.fence_ms after the connection closed) has passed:
    // none of its writes can land any more. max(): the peer made no such promise.
    Clock::time_point fence_at = Clock::time_point::max();
    Clock::time_point give_up;  // without a fencing bound: when to stop looking
    std::optional<PeerId> backend_peer;  // two-sided backends: released at the first look
    // One-sided backends: what the peer published, fenced at the first look (Backend::
    // FenceSender), so that nothing it sent lands once its pages are reused.
    std::optional<PeerDescriptor> fence_sender;
  };

  void OnPeerMessage(PeerHandle peer, const v1::Envelope& envelope) KVT_EXCLUDES(ctx_.mu);
  void OnPeerDisconnect(PeerHandle peer, const Status& why) KVT_EXCLUDES(ctx_.mu);
  StatusOr<PeerHandle> Connect(const std::string& host, uint16_t port, const std::string& address)
      KVT_EXCLUDES(ctx_.mu);
  void DropPeer(PeerHandle id) KVT_EXCLUDES(ctx_.mu);
  void LivenessLoop() KVT_EXCLUDES(ctx_.mu);
  // What the liveness worker can tell of a lost peer's process.
  enum class PeerFate {
    kGone,     // certainly gone: it can post no write any more
    kStopped,  // on this host and stopped: its fencing bound does not run while it cannot act
    kUnknown,  // alive, unreachable, or on another host
  };
  PeerFate CheckPeer(const LostPeer& lost) const;

  DecodeRoom* RoomOfLocked(PeerHandle peer, const std::string& room) KVT_REQUIRES(ctx_.mu);
  bool FailLocked(DecodeRoom& room, Status why) KVT_REQUIRES(ctx_.mu);
  void SucceedLocked(DecodeRoom& room) KVT_REQUIRES(ctx_.mu);
  // Writes the aux bytes of a successful TransferDone into the room's slot; an error when they
  // do not match the layout's aux buffers (then nothing is written).
  Status StoreAuxLocked(const DecodeRoom& room, const v1::TransferDone& done)
      KVT_REQUIRES(ctx_.mu);
  void OnFinalLocked(DecodeRoom& room) KVT_REQUIRES(ctx_.mu);
  void MarkReusableLocked(DecodeRoom& room) KVT_REQUIRES(ctx_.mu);
  // Fails the room and asks the prefill side to stop (it acknowledges once its writes are
  // quiesced; the pages stay quarantined until then). The prefill side is told `peer_reason`,
  // or why's message when it is empty.
  void AbortLocked(DecodeRoom& room, v1::StatusCode code, Status why,
                   const std::string& peer_reason = {}) KVT_REQUIRES(ctx_.mu);
  // Shutdown: fails a room that is not final with Aborted, naming its state, and asks the
  // prefill side to stop writing into its pages (they stay quarantined until it answers).
  void EndAtShutdownLocked(DecodeRoom& room) KVT_REQUIRES(ctx_.mu);
  // Whether a failed room whose pages are quarantined may still hear from its peer (the peer's
  // connection is up): Shutdown waits for those answers, bounded.
  bool AwaitsAnswerLocked() KVT_REQUIRES(ctx_.mu);
  Status SendToPeerLocked(PeerHandle peer, const v1::Envelope& envelope,
                          control::QueueLimit limit = control::QueueLimit::kEnforced)
      KVT_REQUIRES(ctx_.mu);

  std::map<PeerHandle, std::unique_ptr<DecodePeer>> peers_ KVT_GUARDED_BY(ctx_.mu);
  // Connections being made, by address: a second ConnectPeer to the same address waits for the
  // first one's result instead of opening another connection.
  std::map<std::string, std::shared_future<StatusOr<PeerHandle>>> connecting_
      KVT_GUARDED_BY(ctx_.mu);
  PeerHandle next_peer_ KVT_GUARDED_BY(ctx_.mu) = 1;
  std::vector<LostPeer> lost_ KVT_GUARDED_BY(ctx_.mu);
  mutable CondVar lost_cv_;  // wakes the liveness worker
  std::thread liveness_;
  Clock::time_point last_sweep_ KVT_GUARDED_BY(ctx_.mu) = Clock::now();
};

}  // namespace kvt::transfer::engine

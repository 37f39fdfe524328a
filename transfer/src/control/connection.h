// Connection (private to the control plane): one framed, authenticated, validated TCP
// connection, server or client side. ControlServer and ControlClient own these.
//
// Thread contract: every member except Send(), Close() and Fail() runs on the connection's
// strand (the executor of the socket it was given). Those three are thread-safe: they post onto
// the strand. Callbacks run on the strand; on_close runs exactly once, last, and the callbacks
// are released after it. Keep a Connection in a shared_ptr (handlers hold references).
#pragma once

#include <atomic>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "control/control_server.h"
#include "control/framing.h"
#include "control/io_loop.h"
#include "control/lane.h"
#include "control/validate.h"
#include "kvt/common/status.h"
#include "kvt/transfer/control_options.h"
#include "kvt/v1/control.pb.h"

namespace kvt::control::internal {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

enum class Side { kServer, kClient };

struct ConnectionConfig {
  Side side = Side::kServer;
  ConnectionId id = 0;
  std::string local_id;              // our server_id or client_id
  v1::Role role = v1::ROLE_TOOL;     // client side: our role (bound into the MAC)
  std::string cluster_token;         // empty: no authentication
  bool require_server_proof = true;  // client side, with a token: mutual authentication
  ConnectionLimits limits;
  ValidationLimits validation;
  // Lanes (lane.h): the io thread's set, or null for none. Client: offers the server a lane once
  // the HelloAck arrived; server: accepts an offered lane it can open.
  LanePollSet* lanes = nullptr;
  uint32_t lane_ring_bytes = kDefaultLaneRingBytes;
};

struct ConnectionCallbacks {
  // The handshake is done.
  std::function<void(const ConnectionInfo&)> on_open;
  // A validated message. A non-OK result closes the connection (Error frame first).
  std::function<Status(const v1::Envelope&)> on_message;
  // The connection is closed; was_open tells whether on_open ran.
  std::function<void(const Status& why, bool was_open)> on_close;
  // A heartbeat or heartbeat ack arrived after the handshake (optional; never throws).
  std::function<void()> on_heartbeat;
};

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  // `socket` is connected; its executor must be a strand.
  Connection(tcp::socket socket, ConnectionConfig config, ConnectionCallbacks callbacks);
  ~Connection();

  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Begins the handshake (server: sends AuthChallenge) and reading. Call once.
  void Start();

  // Thread-safe: encodes on the caller's thread and queues the frame (see ControlServer::Send).
  Status Send(const v1::Envelope& envelope, QueueLimit limit = QueueLimit::kEnforced);

  // Thread-safe: closes after queued frames are sent (bounded by close_linger).
  void Close(Status why);

  // Thread-safe: sends Error{code, why.message()}, then closes with `why`.
  void Fail(v1::StatusCode code, Status why);

  // Thread-safe. True while a server with a cluster token waits for this connection's
  // auth_response; ControlServer evicts such connections first when it is full.
  bool awaiting_authentication() const { return awaiting_authentication_.load(); }
  // Thread-safe. Claims an unauthenticated connection for eviction: true once (for the caller
  // that should then call Evict()), false when it authenticated or was claimed already.
  bool ClaimForEviction() { return awaiting_authentication_.exchange(false); }
  // Thread-safe: like Fail(RESOURCE_EXHAUSTED, why), unless the connection has authenticated
  // meanwhile.
  void Evict(Status why);

  // Thread-safe. True once the connection is closing (saying goodbye, bounded by close_linger)
  // or closed.
  bool closing() const { return closing_.load(); }

  ConnectionId id() const { return config_.id; }
  // Thread-safe: frames go through the lane both ways.
  bool lane_active() const { return lane_active_.load(std::memory_order_relaxed); }
  const std::string& remote_address() const { return remote_address_; }

 private:
  enum class State {
    kNew,
    kAwaitAuthResponse,  // server: challenge sent, waiting for the client's MAC
    kAwaitChallenge,     // client: waiting for the server's first frame
    kAwaitAuthResult,    // client: MAC sent, waiting for the server's verdict
    kOpen,
    kDraining,  // closing: sending what is queued, reading nothing
    kClosed,
  };

  void DoStart();
  void ReadSome();
  void OnRead(const boost::system::error_code& ec, size_t bytes);
  // Decodes `data` with `decoder` and handles each complete frame; false once closing.
  bool Consume(FrameDecoder& decoder, std::string_view data, bool from_lane);
  void HandleFrame(const v1::Envelope& envelope, bool from_lane);
  // Lanes. Connection-level frames: none reaches on_message.
  void HandleLaneFrame(const v1::Envelope& envelope, bool from_lane);
  void OfferLane();
  // Strand: queues `envelope` on the socket and, in the same critical section, sends every later
  // frame through the lane.
  Status SendThenSwitchToLane(const v1::Envelope& envelope);
  void ActivateLane();  // reads through the lane's poller from here on
  // Strand: reads and handles what waits in the lane, at most one ring's bytes (the poll loop
  // comes back for more); whether there was anything.
  bool DrainLane();
  // write_mu_ held, lane_out_ set: writes `frame` into the lane (what does not fit waits in
  // lane_pending_), ringing the doorbell when the reader sleeps.
  void WriteLaneLocked(std::string frame);
  // write_mu_ held, lane_out_ set: moves what lane_pending_ holds into the ring as far as it fits
  // (ringing the doorbell); whether it moved anything. A corrupt segment drops the rest and
  // fails the connection.
  bool MoveIntoLaneLocked();
  void RingDoorbellLocked();
  // write_mu_ held: forgets the frames waiting for the lane (uncounting them).
  void DropLanePendingLocked();
  // Strand: moves lane_pending_ into the ring as space frees; whether it moved anything.
  bool FlushLane();
  void OnAuthResponse(const v1::Envelope& envelope);
  void OnChallenge(const v1::Envelope& envelope);
  void OnAuthResult(const v1::Envelope& envelope);
  void Open();

  // Strand-only counterparts of the public calls.
  // `linger`: how long the goodbye may take (negative: limits.close_linger).
  void FailNow(v1::StatusCode code, Status why,
               std::chrono::milliseconds linger = std::chrono::milliseconds(-1));
  void BeginClose(Status why, bool flush,
                  std::chrono::milliseconds linger = std::chrono::milliseconds(-1));
  void FinishClose();
  // Queues a frame built on the strand; `bypass_limits` for the final Error frame.
  Status SendNow(const v1::Envelope& envelope, bool bypass_limits);
  // Strand: queues a counted frame (into the lane once switched); `dispatched` for a frame
  // Send() handed over (counted in dispatched_). Dropped once closing, and once the lane broke
  // unless `error` (an Error frame, the one frame the peer takes on the socket after its switch).
  void EnqueueFrame(std::string frame, bool dispatched = false, bool error = false);
  // write_mu_ held: queues a counted frame behind the socket's queue and starts writing if idle.
  void QueueFrameLocked(std::string frame);
  // write_mu_ held, direct_ok_: a counted frame to the socket now, on this thread, when nothing is
  // queued or being written (what the socket does not take continues on the strand); else behind
  // the write in progress.
  void WriteSocketLocked(std::string frame);
  // write_mu_ held: writes the queue's next frame, or marks writing done.
  void WriteNextLocked();
  // write_mu_ held, writing_ set: starts the asynchronous write of the queue's front frame.
  void StartWriteLocked();
  // Strand: continues a frame that Send() started writing on its own thread.
  void ResumeWrite();
  // write_mu_ held: forgets every queued frame (the connection is closed).
  void DropQueuedLocked();
  void OnWrite(const boost::system::error_code& ec);

  void ArmIdleTimer(std::chrono::steady_clock::duration after);
  void OnHandshakeTimeout();
  // After a read from the socket or the lane: starts that path's frame_timeout clock when a frame
  // is left incomplete.
  void WatchPartialFrame(bool from_lane);
  void ArmFrameTimer(std::chrono::steady_clock::duration after);
  // Before authentication a frame may be at most max_handshake_frame_bytes; after it,
  // max_frame_bytes.
  void LimitFramesForHandshake();
  void ArmHeartbeatTimer();
  bool closing_or_closed() const { return state_ == State::kDraining || state_ == State::kClosed; }

  const ConnectionConfig config_;
  ConnectionCallbacks callbacks_;
  tcp::socket socket_;
  asio::any_io_executor strand_;  // == socket_.get_executor()
  std::string remote_address_;

  // Confined to the strand.
  State state_ = State::kNew;
  bool was_open_ = false;
  Status close_reason_;
  FrameDecoder decoder_;
  std::vector<char> read_buffer_;
  bool reading_ = false;
  std::string nonce_;         // server: the challenge nonce; client: the server's nonce
  std::string client_nonce_;  // client: ours, when asking for the server's proof
  std::string peer_id_;
  v1::Role peer_role_ = v1::ROLE_UNSPECIFIED;
  bool authenticated_ = false;
  PeerContext peer_;  // from the peer's Hello / HelloAck
  std::chrono::steady_clock::time_point last_receive_;
  uint64_t heartbeat_sequence_ = 0;
  bool first_frame_received_ = false;
  // The lane (strand; lane_out_ below is the writers' view of it).
  std::unique_ptr<Lane> lane_;
  // A lane_offer went out (client) or came in (server). One per connection: a server answers
  // a decline past the send queue's limits (a dropped one would leave the client's segment
  // offered until the connection ends), so a client must not be able to ask for more of them.
  bool lane_offered_ = false;
  bool lane_in_ = false;       // frames arrive through the lane
  uint64_t lane_poll_id_ = 0;  // in config_.lanes
  FrameDecoder lane_decoder_;
  std::vector<char> lane_buffer_;
  bool lane_flush_armed_ = false;
  // The retry's delay: kLaneFlushRetry, doubling while retries move nothing (a reader that stopped
  // reading costs a wake-up per kLaneFlushRetryMax, not a busy core).
  std::chrono::microseconds lane_flush_delay_{0};
  bool lane_draining_ = false;  // in DrainLane (a doorbell handled inside it does not recurse)
  asio::steady_timer lane_flush_timer_;
  // Per path (0: the socket, 1: the lane): bytes of an incomplete frame are buffered, since when.
  bool frame_in_progress_[2] = {false, false};
  std::chrono::steady_clock::time_point frame_started_[2];
  bool frame_timer_armed_ = false;
  asio::steady_timer handshake_timer_;
  asio::steady_timer frame_timer_;
  asio::steady_timer idle_timer_;
  asio::steady_timer heartbeat_timer_;
  asio::steady_timer linger_timer_;

  // The write side, shared with Send() callers on other threads: a Send() that finds nothing
  // queued and nothing being written writes its frame straight to the socket on its own thread
  // (no hop to the connection's thread: a control message's latency is mostly wake-ups).
  std::mutex write_mu_;
  std::deque<std::string> write_queue_;  // guarded by write_mu_
  bool writing_ = false;                 // guarded by write_mu_; a frame is being written
  bool direct_ok_ = false;               // guarded by write_mu_; open, and the socket is not closed
  // Guarded by write_mu_: frames Send() handed to the strand that it has not queued yet. While
  // any is, later frames follow them through the strand (no frame overtakes an earlier one).
  size_t dispatched_ = 0;
  // Guarded by write_mu_: once set, every frame goes into the lane (in order: after what waits in
  // lane_pending_), and the socket carries only doorbells. Lives in lane_.
  Lane* lane_out_ = nullptr;
  // Guarded by write_mu_: a write into the lane failed (the peer corrupted it) and the connection
  // is failing: no frame but the Error goes out any more.
  bool lane_broken_ = false;
  std::deque<std::string> lane_pending_;  // guarded by write_mu_; the front may be partly written
  size_t lane_front_sent_ = 0;            // guarded by write_mu_; bytes of the front written
  // Shared with Send() callers on other threads.
  std::atomic<bool> closing_{false};
  std::atomic<bool> awaiting_authentication_{false};
  std::atomic<bool> lane_active_{false};
  std::atomic<bool> lane_has_pending_{false};  // lane_pending_ is not empty
  std::atomic<size_t> queued_frames_{0};
  std::atomic<size_t> queued_bytes_{0};
};

// InvalidArgument naming the field and its value when `limits` cannot work.
Status CheckConnectionLimits(const ConnectionLimits& limits);

// "ip:port" of an endpoint.
std::string EndpointString(const tcp::endpoint& endpoint);

}  // namespace kvt::control::internal

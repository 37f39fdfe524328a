#include "connection.h"

#include <fmt/format.h>
#include <sys/socket.h>

#include <algorithm>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/write.hpp>
#include <cerrno>
#include <exception>
#include <utility>

#include "control/auth.h"
#include "control/protocol.h"
#include "kvt/common/log.h"

namespace kvt::control::internal {
namespace {

// Requests a driver sends to an agent's RPC port; each is answered on its own.
bool IsDriverRequest(v1::Envelope::BodyCase body) {
  return body == v1::Envelope::kSubmitRequest || body == v1::Envelope::kQueryRequests ||
         body == v1::Envelope::kQueryStats || body == v1::Envelope::kAbortRoom;
}

constexpr size_t kReadChunkBytes = 64u << 10;
// How soon a connection retries moving frames into a full lane whose reader does not poll, and
// how far the delay grows while the reader takes nothing.
constexpr auto kLaneFlushRetry = std::chrono::microseconds(50);
constexpr auto kLaneFlushRetryMax = std::chrono::microseconds(10000);
// How long a connection closed for silence waits for its Error frame to reach the socket.
constexpr auto kSilentPeerLinger = std::chrono::milliseconds(20);

long long Ms(std::chrono::milliseconds d) { return static_cast<long long>(d.count()); }

void CancelTimer(asio::steady_timer& timer) {
  try {
    timer.cancel();
  } catch (const std::exception&) {
    // cancel() only throws when the OS refuses; the timer then simply fires and finds the
    // connection closed.
  }
}

bool IsAuthMessage(v1::Envelope::BodyCase body) {
  return body == v1::Envelope::kAuthChallenge || body == v1::Envelope::kAuthResponse ||
         body == v1::Envelope::kAuthResult;
}

}  // namespace

std::string EndpointString(const tcp::endpoint& endpoint) {
  const auto address = endpoint.address();
  if (address.is_v6()) return fmt::format("[{}]:{}", address.to_string(), endpoint.port());
  return fmt::format("{}:{}", address.to_string(), endpoint.port());
}

Status CheckConnectionLimits(const ConnectionLimits& limits) {
  if (limits.max_handshake_frame_bytes < kMinHandshakeFrameBytes) {
    return InvalidArgument(fmt::format(
        "limits.max_handshake_frame_bytes = {}: too small for an auth_response with the longest "
        "client id; use at least {} (the default is {})",
        limits.max_handshake_frame_bytes, kMinHandshakeFrameBytes, kDefaultMaxHandshakeFrameBytes));
  }
  if (limits.handshake_timeout.count() <= 0) {
    return InvalidArgument(fmt::format(
        "limits.handshake_timeout = {} ms: must be > 0 (it bounds how long an unauthenticated "
        "connection may stay open; the default is 5000 ms)",
        Ms(limits.handshake_timeout)));
  }
  if (limits.frame_timeout.count() <= 0) {
    return InvalidArgument(fmt::format(
        "limits.frame_timeout = {} ms: must be > 0 (it bounds how long one frame may take to "
        "arrive; the default is 30000 ms)",
        Ms(limits.frame_timeout)));
  }
  return OkStatus();
}

Connection::Connection(tcp::socket socket, ConnectionConfig config, ConnectionCallbacks callbacks)
    : config_(std::move(config)),
      callbacks_(std::move(callbacks)),
      socket_(std::move(socket)),
      strand_(socket_.get_executor()),
      decoder_(config_.limits.max_frame_bytes),
      read_buffer_(kReadChunkBytes),
      lane_decoder_(config_.limits.max_frame_bytes),
      lane_flush_timer_(strand_),
      handshake_timer_(strand_),
      frame_timer_(strand_),
      idle_timer_(strand_),
      heartbeat_timer_(strand_),
      linger_timer_(strand_) {
  boost::system::error_code ec;
  const tcp::endpoint remote = socket_.remote_endpoint(ec);
  remote_address_ = ec ? std::string("<unknown>") : EndpointString(remote);
  // Control messages are small and latency-bound; do not let Nagle hold them back.
  socket_.set_option(tcp::no_delay(true), ec);
}

Connection::~Connection() = default;

void Connection::Start() {
  asio::post(strand_, [self = shared_from_this()] { self->DoStart(); });
}

Status Connection::Send(const v1::Envelope& envelope, QueueLimit limit) {
  if (closing_.load()) {
    return Unavailable(fmt::format("connection {} to {} is closed", config_.id, remote_address_));
  }
  std::string frame;
  KVT_RETURN_IF_ERROR(AppendFrame(envelope, config_.limits.max_frame_bytes, &frame));
  // Reserve queue space here, on the caller's thread, so a full queue is reported to the caller.
  const size_t frames = queued_frames_.fetch_add(1) + 1;
  const size_t bytes = queued_bytes_.fetch_add(frame.size()) + frame.size();
  if (limit == QueueLimit::kEnforced &&
      (frames > config_.limits.max_queued_frames || bytes > config_.limits.max_queued_bytes)) {
    queued_frames_.fetch_sub(1);
    queued_bytes_.fetch_sub(frame.size());
    return ResourceExhausted(fmt::format(
        "send queue of connection {} to {} is full ({} frames / {} bytes queued; limits {} / "
        "{}): the peer reads too slowly; retry later",
        config_.id, remote_address_, frames - 1, bytes - frame.size(),
        config_.limits.max_queued_frames, config_.limits.max_queued_bytes));
  }
  {
    // Open: the frame goes out here, in order under this lock, whichever thread sends it: into
    // the lane, or to the socket now when nothing waits (else behind the queue, which the
    // write in progress goes on to). Only frames sent before the connection opened (or while it
    // closes) go through the strand, and while any of them waits, later ones follow it there.
    std::unique_lock<std::mutex> lock(write_mu_);
    if (direct_ok_ && dispatched_ == 0) {
      if (lane_out_ != nullptr) {
        WriteLaneLocked(std::move(frame));
      } else {
        WriteSocketLocked(std::move(frame));
      }
      return OkStatus();
    }
    ++dispatched_;
  }
  // dispatch, not post: a handler that replies from the strand queues its reply at once, ahead of
  // anything the rest of the current read produces (e.g. an Error frame).
  asio::dispatch(strand_, [self = shared_from_this(), frame = std::move(frame),
                           error = envelope.has_error()]() mutable {
    self->EnqueueFrame(std::move(frame), /*dispatched=*/true, error);
  });
  return OkStatus();
}

void Connection::Close(Status why) {
  asio::post(strand_, [self = shared_from_this(), why = std::move(why)] {
    self->BeginClose(why, /*flush=*/true);
  });
}

void Connection::Fail(v1::StatusCode code, Status why) {
  asio::post(strand_,
             [self = shared_from_this(), code, why = std::move(why)] { self->FailNow(code, why); });
}

void Connection::Evict(Status why) {
  asio::post(strand_, [self = shared_from_this(), why = std::move(why)] {
    if (self->state_ == State::kAwaitAuthResponse) {
      self->FailNow(v1::STATUS_CODE_RESOURCE_EXHAUSTED, why);
    }
  });
}

void Connection::DoStart() {
  if (state_ != State::kNew) return;
  last_receive_ = std::chrono::steady_clock::now();
  const auto& limits = config_.limits;
  // Counted from the connect and never extended: bytes that do not finish the handshake (or,
  // without a token, the first frame) do not keep the connection open.
  handshake_timer_.expires_after(limits.handshake_timeout);
  handshake_timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (!ec) self->OnHandshakeTimeout();
  });
  if (limits.idle_timeout.count() > 0) ArmIdleTimer(limits.idle_timeout);

  if (config_.side == Side::kServer) {
    v1::Envelope challenge;
    v1::AuthChallenge* c = challenge.mutable_auth_challenge();
    c->set_server_id(config_.local_id);
    c->set_protocol_version(kProtocolVersion);
    if (!config_.cluster_token.empty()) {
      StatusOr<std::string> nonce = MakeNonce();
      if (!nonce.ok()) {
        FailNow(v1::STATUS_CODE_INTERNAL, nonce.status());
        return;
      }
      nonce_ = *nonce;
      c->set_nonce(nonce_);
      c->set_auth_required(true);
      state_ = State::kAwaitAuthResponse;
      awaiting_authentication_.store(true);
      LimitFramesForHandshake();
    }
    if (Status s = SendNow(challenge, false); !s.ok()) {
      FailNow(v1::STATUS_CODE_INTERNAL, s);
      return;
    }
    if (config_.cluster_token.empty()) Open();
  } else {
    state_ = State::kAwaitChallenge;
    LimitFramesForHandshake();
  }
  // Open() runs the connect handler, which may have closed the connection (and started the
  // lingering read) already.
  if (!closing_or_closed()) ReadSome();
}

void Connection::OnHandshakeTimeout() {
  const State state = state_;
  const long long ms = Ms(config_.limits.handshake_timeout);
  if (state == State::kAwaitAuthResponse) {
    FailNow(
        v1::STATUS_CODE_UNAUTHENTICATED,
        DeadlineExceeded(fmt::format(
            "authentication timed out: no auth_response within {} ms (handshake_timeout)", ms)));
  } else if (state == State::kAwaitChallenge || state == State::kAwaitAuthResult) {
    FailNow(v1::STATUS_CODE_DEADLINE_EXCEEDED,
            DeadlineExceeded(fmt::format(
                "handshake timed out: no {} from the server within {} ms",
                state == State::kAwaitChallenge ? "auth_challenge" : "auth_result", ms)));
  } else if (state == State::kOpen && config_.side == Side::kServer && !first_frame_received_) {
    // A server without a token: the peer had handshake_timeout to send one whole frame.
    FailNow(v1::STATUS_CODE_DEADLINE_EXCEEDED,
            DeadlineExceeded(fmt::format(
                "handshake timed out: no complete frame within {} ms of connecting "
                "(handshake_timeout); send the first frame (a hello, a request or a heartbeat) "
                "right after connecting",
                ms)));
  }
}

void Connection::LimitFramesForHandshake() {
  const uint32_t limit =
      std::min(config_.limits.max_handshake_frame_bytes, config_.limits.max_frame_bytes);
  decoder_.set_max_frame_bytes(limit, "max_handshake_frame_bytes");
}

void Connection::WatchPartialFrame(bool from_lane) {
  const FrameDecoder& decoder = from_lane ? lane_decoder_ : decoder_;
  const int path = from_lane ? 1 : 0;
  if (decoder.buffered_bytes() == 0) {
    frame_in_progress_[path] = false;
    return;
  }
  if (frame_in_progress_[path]) return;
  frame_in_progress_[path] = true;
  frame_started_[path] = std::chrono::steady_clock::now();
  if (!frame_timer_armed_) ArmFrameTimer(config_.limits.frame_timeout);
}

void Connection::ArmFrameTimer(std::chrono::steady_clock::duration after) {
  frame_timer_armed_ = true;
  frame_timer_.expires_after(after);
  frame_timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    self->frame_timer_armed_ = false;
    if (ec || self->closing_or_closed()) return;
    // The older of the two paths' incomplete frames decides.
    int path = -1;
    for (int p = 0; p < 2; ++p) {
      if (self->frame_in_progress_[p] &&
          (path < 0 || self->frame_started_[p] < self->frame_started_[path])) {
        path = p;
      }
    }
    if (path < 0) return;
    const auto limit = self->config_.limits.frame_timeout;
    const auto taken = std::chrono::steady_clock::now() - self->frame_started_[path];
    if (taken >= limit) {
      self->FailNow(
          v1::STATUS_CODE_DEADLINE_EXCEEDED,
          DeadlineExceeded(fmt::format(
              "frame incomplete after {} ms (frame_timeout): {} bytes of it arrived{}; a frame "
              "must arrive whole within frame_timeout once it has begun",
              Ms(limit),
              path == 1 ? self->lane_decoder_.buffered_bytes() : self->decoder_.buffered_bytes(),
              path == 1 ? " through the shared-memory lane" : "")));
      return;
    }
    self->ArmFrameTimer(limit - taken);  // a younger frame than the one this timer was set for
  });
}

void Connection::ReadSome() {
  reading_ = true;
  socket_.async_read_some(asio::buffer(read_buffer_),
                          [self = shared_from_this()](const boost::system::error_code& ec,
                                                      size_t bytes) { self->OnRead(ec, bytes); });
}

void Connection::OnRead(const boost::system::error_code& ec, size_t bytes) {
  reading_ = false;
  if (state_ == State::kClosed) return;
  if (state_ == State::kDraining) {
    // Lingering close: discard what the peer still sends until it closes too (or close_linger
    // ends). Closing with unread bytes would make the kernel send RST, which can destroy the
    // Error frame we just sent before the peer reads it.
    if (ec) {
      FinishClose();
    } else {
      ReadSome();
    }
    return;
  }
  if (ec) {
    // What the peer put in the lane before its socket ended came first: handle it.
    DrainLane();
    if (closing_or_closed()) return;
    const bool eof = ec == asio::error::eof || ec == asio::error::connection_reset;
    Status why = Unavailable(
        eof ? fmt::format("connection {} closed by the peer {}", config_.id, remote_address_)
            : fmt::format("connection {} to {}: read failed: {}", config_.id, remote_address_,
                          ec.message()));
    if (state_ != State::kOpen) {
      KVT_LOG_WARN("ctl", "connection {} ({}): peer left during the handshake: {}", config_.id,
                   remote_address_, why.message());
    }
    BeginClose(std::move(why), /*flush=*/false);
    return;
  }
  last_receive_ = std::chrono::steady_clock::now();
  if (!Consume(decoder_, std::string_view(read_buffer_.data(), bytes), /*from_lane=*/false)) {
    return;
  }
  WatchPartialFrame(/*from_lane=*/false);
  ReadSome();
}

bool Connection::Consume(FrameDecoder& decoder, std::string_view data, bool from_lane) {
  while (true) {
    if (decoder.frame_ready()) {
      v1::Envelope envelope;
      if (Status s = decoder.Take(&envelope); !s.ok()) {
        FailNow(v1::STATUS_CODE_MALFORMED_FRAME,
                from_lane ? s.WithContext("a frame from the shared-memory lane") : s);
        return false;
      }
      frame_in_progress_[from_lane ? 1 : 0] = false;
      if (!first_frame_received_) {
        first_frame_received_ = true;
        // A server without a token: the first frame completes the handshake.
        if (state_ == State::kOpen) CancelTimer(handshake_timer_);
      }
      HandleFrame(envelope, from_lane);
      if (closing_or_closed()) return false;
      continue;
    }
    if (data.empty()) return true;
    StatusOr<size_t> used = decoder.Feed(data);
    if (!used.ok()) {
      Status why = used.status();
      if (state_ == State::kAwaitAuthResponse) {
        why = InvalidArgument(fmt::format(
            "{}; before authentication only an auth_response (a few hundred bytes) may be sent",
            why.message()));
      }
      if (from_lane) why = why.WithContext("the shared-memory lane");
      FailNow(v1::STATUS_CODE_MALFORMED_FRAME, why);
      return false;
    }
    data.remove_prefix(*used);
  }
}

void Connection::HandleFrame(const v1::Envelope& envelope, bool from_lane) {
  const auto body = envelope.body_case();
  // The version comes first: a newer peer's Hello may fail validation for reasons the version
  // explains.
  if (body == v1::Envelope::kHello || body == v1::Envelope::kHelloAck) {
    const uint32_t version = body == v1::Envelope::kHello ? envelope.hello().protocol_version()
                                                          : envelope.hello_ack().protocol_version();
    if (Status s = CheckProtocolVersion(version); !s.ok()) {
      FailNow(v1::STATUS_CODE_PROTOCOL_VERSION_MISMATCH, s);
      return;
    }
  }
  if (Status s = Validate(envelope, peer_, config_.validation); !s.ok()) {
    // A driver's request (a decoded frame with a known body) that breaks a rule costs that
    // request only: it is answered with an Error tied to it and the connection keeps serving.
    if (state_ == State::kOpen && IsDriverRequest(body)) {
      KVT_LOG_WARN("ctl", "connection {} ({}): refusing {} #{}: {}", config_.id, remote_address_,
                   BodyName(envelope), envelope.id(), s.ToString());
      v1::Envelope error = MakeErrorEnvelope(v1::STATUS_CODE_INVALID_ARGUMENT, s.message());
      error.set_reply_to(envelope.id());
      (void)SendNow(error, /*bypass_limits=*/false);
      return;
    }
    FailNow(body == v1::Envelope::BODY_NOT_SET ? v1::STATUS_CODE_MALFORMED_FRAME
                                               : v1::STATUS_CODE_INVALID_ARGUMENT,
            s);
    return;
  }
  switch (state_) {
    case State::kAwaitAuthResponse:
      return OnAuthResponse(envelope);
    case State::kAwaitChallenge:
      return OnChallenge(envelope);
    case State::kAwaitAuthResult:
      return OnAuthResult(envelope);
    case State::kOpen:
      break;
    default:
      return;
  }
  if (IsAuthMessage(body)) {
    FailNow(
        v1::STATUS_CODE_FAILED_PRECONDITION,
        FailedPrecondition(fmt::format("unexpected {} after the handshake", BodyName(envelope))));
    return;
  }
  // Once the peer has moved its frames to the lane, the socket carries only its doorbells and
  // the Error of a peer whose lane broke. Any other frame there would be handled out of its
  // order against the lane's frames, so it is refused rather than guessed at.
  if (!from_lane && lane_in_ && body != v1::Envelope::kLaneDoorbell &&
      body != v1::Envelope::kError) {
    FailNow(v1::STATUS_CODE_FAILED_PRECONDITION,
            FailedPrecondition(fmt::format(
                "{} #{} arrived on the socket after the peer moved its frames to the "
                "shared-memory lane; only lane_doorbell and error may follow there (the peer "
                "breaks the lane protocol: run a kvt peer of this protocol version)",
                BodyName(envelope), envelope.id())));
    return;
  }
  if ((body == v1::Envelope::kHeartbeat || body == v1::Envelope::kHeartbeatAck) &&
      callbacks_.on_heartbeat) {
    callbacks_.on_heartbeat();
  }
  if (body == v1::Envelope::kHeartbeat) {
    v1::Envelope ack;
    ack.set_reply_to(envelope.id());
    ack.mutable_heartbeat_ack()->set_sequence(envelope.heartbeat().sequence());
    // A full queue drops the ack: the peer's heartbeats are then the thing that floods us.
    (void)SendNow(ack, false);
    return;
  }
  if (body == v1::Envelope::kHeartbeatAck) return;
  if (body == v1::Envelope::kLaneOffer || body == v1::Envelope::kLaneReply ||
      body == v1::Envelope::kLaneSwitch || body == v1::Envelope::kLaneDoorbell) {
    HandleLaneFrame(envelope, from_lane);
    return;
  }
  if (body == v1::Envelope::kHello) peer_ = PeerContextFrom(envelope.hello().peer());
  if (body == v1::Envelope::kHelloAck) peer_ = PeerContextFrom(envelope.hello_ack().peer());

  Status result;
  try {
    result = callbacks_.on_message ? callbacks_.on_message(envelope) : OkStatus();
  } catch (const std::exception& e) {
    result = Internal(fmt::format("message handler threw: {}", e.what()));
  } catch (...) {
    result = Internal("message handler threw a non-standard exception");
  }
  if (!result.ok()) {
    FailNow(ToProtoCode(result.code()), result);
    return;
  }
  // The peer speaks this protocol version (its HelloAck passed): it knows lanes.
  if (body == v1::Envelope::kHelloAck && !closing_or_closed()) OfferLane();
}

void Connection::OfferLane() {
  // Once per connection: a server refuses a second offer, even after declining the first.
  if (config_.lanes == nullptr || config_.side != Side::kClient || lane_offered_) return;
  StatusOr<std::unique_ptr<Lane>> lane = Lane::Create(config_.lane_ring_bytes);
  if (!lane.ok()) {
    KVT_LOG_INFO("ctl", "connection {} ({}): no shared-memory lane, frames stay on the socket: {}",
                 config_.id, remote_address_, lane.status().ToString());
    return;
  }
  v1::Envelope offer;
  v1::LaneOffer* o = offer.mutable_lane_offer();
  o->set_name((*lane)->name());
  o->set_nonce((*lane)->nonce());
  o->set_ring_bytes((*lane)->ring_bytes());
  if (!SendNow(offer, /*bypass_limits=*/false).ok()) return;  // a full queue: no lane, no harm
  lane_offered_ = true;
  lane_ = std::move(lane).value();  // offered: the reply decides
}

void Connection::HandleLaneFrame(const v1::Envelope& envelope, bool from_lane) {
  const auto body = envelope.body_case();
  if (body == v1::Envelope::kLaneDoorbell) {
    if (!from_lane) DrainLane();  // through the lane it says nothing
    return;
  }
  auto refuse = [&](std::string_view why) {
    FailNow(v1::STATUS_CODE_FAILED_PRECONDITION,
            FailedPrecondition(fmt::format("unexpected {}: {}", BodyName(envelope), why)));
  };
  if (from_lane) return refuse("lane setup frames travel on the socket, not the lane");
  switch (body) {
    case v1::Envelope::kLaneOffer: {
      if (config_.side != Side::kServer) return refuse("only a client offers a lane");
      // Every offer is answered past the queue's limits (below): one per connection bounds that.
      if (lane_offered_) {
        return refuse(fmt::format(
            "a lane was already offered on this connection (and {}); a client offers at most one "
            "lane per connection: to offer another, open a new connection",
            lane_ != nullptr ? "accepted" : "declined"));
      }
      lane_offered_ = true;
      const v1::LaneOffer& o = envelope.lane_offer();
      v1::Envelope reply;
      reply.set_reply_to(envelope.id());
      v1::LaneReply* r = reply.mutable_lane_reply();
      std::unique_ptr<Lane> lane;
      if (config_.lanes == nullptr) {
        r->set_reason(
            "this endpoint's io thread does not busy-poll with lanes (busy_poll.window = 0 or "
            "lanes = false), so frames stay on the socket");
      } else if (StatusOr<std::unique_ptr<Lane>> opened =
                     Lane::Open(o.name(), o.nonce(), o.ring_bytes());
                 opened.ok()) {
        lane = std::move(opened).value();
        r->set_accepted(true);
      } else {
        r->set_reason(opened.status().message());
      }
      if (lane == nullptr) {
        KVT_LOG_DEBUG("ctl", "connection {} ({}): lane declined: {}", config_.id, remote_address_,
                      r->reason());
        // Past the queue's limits, as an acceptance goes: a decline dropped for a full queue
        // would leave the client's segment offered (and its name in /dev/shm) until the
        // connection ends. Only a connection that is closing does not send it.
        if (Status s = SendNow(reply, /*bypass_limits=*/true); !s.ok()) {
          KVT_LOG_DEBUG("ctl", "connection {} ({}): the lane's decline was not sent: {}",
                        config_.id, remote_address_, s.ToString());
        }
        return;
      }
      // On the socket, ahead of every frame that goes through the lane (the client reads the
      // lane only once it has this reply).
      lane_ = std::move(lane);
      if (Status s = SendThenSwitchToLane(reply); !s.ok()) return FailNow(ToProtoCode(s.code()), s);
      ActivateLane();  // its frames arrive after the client's lane_switch
      return;
    }
    case v1::Envelope::kLaneReply: {
      // A client's lane_ is an offer until the reply accepts it (lane_in_).
      if (config_.side != Side::kClient || lane_ == nullptr || lane_in_) {
        return refuse("no lane was offered");
      }
      const v1::LaneReply& r = envelope.lane_reply();
      if (!r.accepted()) {
        KVT_LOG_INFO("ctl", "connection {} ({}): the peer keeps frames on the socket: {}",
                     config_.id, remote_address_, r.reason());
        lane_.reset();  // removes the segment
        return;
      }
      lane_->Unlink();
      lane_in_ = true;  // the server's frames after this reply are in the lane
      v1::Envelope lane_switch;
      lane_switch.mutable_lane_switch();
      if (Status s = SendThenSwitchToLane(lane_switch); !s.ok()) {
        return FailNow(ToProtoCode(s.code()), s);
      }
      ActivateLane();
      lane_active_.store(true);
      KVT_LOG_DEBUG("ctl", "connection {} ({}): frames go through lane {}", config_.id,
                    remote_address_, lane_->name());
      DrainLane();
      return;
    }
    case v1::Envelope::kLaneSwitch: {
      if (config_.side != Side::kServer || lane_ == nullptr || lane_in_) {
        return refuse("no accepted lane is waiting for it");
      }
      lane_in_ = true;
      lane_active_.store(true);
      KVT_LOG_DEBUG("ctl", "connection {} ({}): frames go through lane {}", config_.id,
                    remote_address_, lane_->name());
      DrainLane();
      return;
    }
    default:
      return;
  }
}

Status Connection::SendThenSwitchToLane(const v1::Envelope& envelope) {
  std::string frame;
  KVT_RETURN_IF_ERROR(AppendFrame(envelope, config_.limits.max_frame_bytes, &frame));
  queued_frames_.fetch_add(1);
  queued_bytes_.fetch_add(frame.size());
  // One critical section: a frame another thread sends goes either before this one on the
  // socket or after it through the lane, never between the two on the socket.
  std::lock_guard<std::mutex> lock(write_mu_);
  QueueFrameLocked(std::move(frame));
  lane_out_ = lane_.get();
  return OkStatus();
}

void Connection::ActivateLane() {
  if (config_.lanes == nullptr || lane_poll_id_ != 0) return;
  lane_buffer_.resize(kReadChunkBytes);
  std::weak_ptr<Connection> weak = weak_from_this();
  LanePollSet::Entry entry;
  entry.poll = [weak] {
    std::shared_ptr<Connection> self = weak.lock();
    if (self == nullptr) return false;
    const bool flushed = self->FlushLane();
    return self->DrainLane() || flushed;
  };
  entry.sleep = [weak] {
    std::shared_ptr<Connection> self = weak.lock();
    return self != nullptr && self->lane_in_ && self->state_ == State::kOpen &&
           self->lane_->Sleep();
  };
  entry.wake = [weak] {
    std::shared_ptr<Connection> self = weak.lock();
    if (self != nullptr && self->lane_ != nullptr) self->lane_->Wake();
  };
  lane_poll_id_ = config_.lanes->Add(std::move(entry));
}

bool Connection::DrainLane() {
  if (!lane_in_ || state_ != State::kOpen || lane_draining_) return false;
  lane_draining_ = true;
  bool any = false;
  // At most one ring's bytes per call (all that can have been in it when the call began): a peer
  // that writes as fast as this reads cannot keep the io thread here, away from its other
  // connections and timers; the poll loop comes back for the rest.
  size_t budget = lane_->ring_bytes();
  while (state_ == State::kOpen && budget > 0) {
    StatusOr<size_t> n =
        lane_->Read(lane_buffer_.data(), std::min<size_t>(lane_buffer_.size(), budget));
    if (!n.ok()) {
      FailNow(v1::STATUS_CODE_MALFORMED_FRAME, n.status());
      any = true;
      break;
    }
    if (*n == 0) break;
    any = true;
    budget -= *n;
    last_receive_ = std::chrono::steady_clock::now();
    if (!Consume(lane_decoder_, std::string_view(lane_buffer_.data(), *n), /*from_lane=*/true)) {
      break;
    }
  }
  lane_draining_ = false;
  if (any && state_ == State::kOpen) WatchPartialFrame(/*from_lane=*/true);
  return any;
}

void Connection::WriteLaneLocked(std::string frame) {
  lane_pending_.push_back(std::move(frame));
  MoveIntoLaneLocked();
  if (!lane_pending_.empty()) {
    // Room frees as the reader reads: the strand retries (FlushLane).
    asio::post(strand_, [self = shared_from_this()] { self->FlushLane(); });
  }
}

bool Connection::MoveIntoLaneLocked() {
  bool moved = false;
  while (!lane_pending_.empty()) {
    const std::string& front = lane_pending_.front();
    // A frame larger than the free room goes in pieces; what went is skipped, not erased (a
    // frame of megabytes through a small ring would otherwise be moved again for every piece).
    StatusOr<size_t> n = lane_out_->Write(std::string_view(front).substr(lane_front_sent_));
    if (!n.ok()) {
      // The peer corrupted the segment: nothing more can go through it, and the connection
      // fails; its Error frame goes out on the socket. Frames sent until then are dropped, not
      // written to the socket: the peer reads only doorbells and Errors there after its switch.
      DropLanePendingLocked();
      lane_out_ = nullptr;
      lane_broken_ = true;
      direct_ok_ = false;
      asio::post(strand_, [self = shared_from_this(), why = n.status()] {
        self->FailNow(v1::STATUS_CODE_INTERNAL, why);
      });
      return moved;
    }
    if (*n == 0) break;
    moved = true;
    queued_bytes_.fetch_sub(*n);
    lane_front_sent_ += *n;
    if (lane_front_sent_ < front.size()) break;
    lane_front_sent_ = 0;
    queued_frames_.fetch_sub(1);
    lane_pending_.pop_front();
  }
  if (moved) RingDoorbellLocked();
  lane_has_pending_.store(!lane_pending_.empty(), std::memory_order_release);
  return moved;
}

void Connection::DropLanePendingLocked() {
  size_t bytes = 0;
  for (const std::string& frame : lane_pending_) bytes += frame.size();
  queued_frames_.fetch_sub(lane_pending_.size());
  queued_bytes_.fetch_sub(bytes - lane_front_sent_);  // the front's sent bytes left the count
  lane_pending_.clear();
  lane_front_sent_ = 0;
  lane_has_pending_.store(false, std::memory_order_release);
}

void Connection::RingDoorbellLocked() {
  if (!lane_out_->TakeDoorbell()) return;
  // Open, a frame still waiting for the socket (a doorbell, or the switch itself) reaches the
  // reader and makes it read the lane: one more would add nothing. So a peer that keeps its sleep
  // flag set gets at most one doorbell in the queue, not one per frame against the queue's limits.
  // Not the frame being written (the queue's front while writing_): its bytes may have reached
  // the reader already, which then read the lane, found nothing and went to sleep, while the
  // write's completion still waits for this io thread.
  const size_t not_started = write_queue_.size() - (writing_ && !write_queue_.empty() ? 1 : 0);
  if (direct_ok_ && not_started > 0) return;
  static const std::string kDoorbell = [] {
    v1::Envelope doorbell;
    doorbell.mutable_lane_doorbell();
    std::string frame;
    (void)AppendFrame(doorbell, kDefaultMaxFrameBytes, &frame);
    return frame;
  }();
  queued_frames_.fetch_add(1);
  queued_bytes_.fetch_add(kDoorbell.size());
  if (direct_ok_) {
    WriteSocketLocked(kDoorbell);
    return;
  }
  // Closing (then this runs on the strand: Send() writes the lane only while direct_ok_): the
  // goodbye's frames still stream through the lane, so their doorbells go through the queue; the
  // socket's shutdown waits for both.
  QueueFrameLocked(kDoorbell);
}

bool Connection::FlushLane() {
  // The poller asks on every pass; the lock is taken only when something waits.
  if (!lane_has_pending_.load(std::memory_order_acquire)) return false;
  std::lock_guard<std::mutex> lock(write_mu_);
  if (lane_out_ == nullptr || lane_pending_.empty()) return false;
  const bool moved = MoveIntoLaneLocked();
  if (!lane_pending_.empty()) {
    lane_flush_delay_ =
        moved ? kLaneFlushRetry
              : std::clamp(2 * lane_flush_delay_, kLaneFlushRetry, kLaneFlushRetryMax);
    if (!lane_flush_armed_) {
      lane_flush_armed_ = true;
      lane_flush_timer_.expires_after(lane_flush_delay_);
      lane_flush_timer_.async_wait([self = shared_from_this()](const boost::system::error_code&) {
        self->lane_flush_armed_ = false;
        self->FlushLane();
      });
    }
  } else if (state_ == State::kDraining && !writing_ && write_queue_.empty()) {
    boost::system::error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_send, ignored);
  }
  return moved;
}

void Connection::OnAuthResponse(const v1::Envelope& envelope) {
  if (!envelope.has_auth_response()) {
    FailNow(v1::STATUS_CODE_UNAUTHENTICATED,
            FailedPrecondition(fmt::format(
                "authentication required: the first frame must be auth_response, got {}",
                BodyName(envelope))));
    return;
  }
  const v1::AuthResponse& response = envelope.auth_response();
  StatusOr<std::string> expected =
      ClientAuthMac(config_.cluster_token, nonce_, response.client_id(), response.role());
  if (!expected.ok()) {
    FailNow(v1::STATUS_CODE_INTERNAL, expected.status());
    return;
  }
  if (!MacEquals(response.mac(), *expected)) {
    KVT_LOG_WARN("ctl", "connection {} ({}): client \"{}\" presented a wrong MAC", config_.id,
                 remote_address_, response.client_id());
    // The reason stays vague on the wire on purpose; the log above has the detail.
    FailNow(v1::STATUS_CODE_UNAUTHENTICATED, FailedPrecondition("authentication failed"));
    return;
  }
  v1::Envelope result;
  result.set_reply_to(envelope.id());
  v1::AuthResult* r = result.mutable_auth_result();
  if (!response.client_nonce().empty()) {
    StatusOr<std::string> proof =
        ServerAuthMac(config_.cluster_token, response.client_nonce(), nonce_, config_.local_id);
    if (!proof.ok()) {
      FailNow(v1::STATUS_CODE_INTERNAL, proof.status());
      return;
    }
    r->set_server_mac(*proof);
  }
  if (Status s = SendNow(result, false); !s.ok()) {
    FailNow(v1::STATUS_CODE_INTERNAL, s);
    return;
  }
  authenticated_ = true;
  peer_id_ = response.client_id();
  peer_role_ = response.role();
  Open();
}

void Connection::OnChallenge(const v1::Envelope& envelope) {
  if (envelope.has_error()) {
    BeginClose(StatusFromError(envelope.error()), /*flush=*/false);
    return;
  }
  if (!envelope.has_auth_challenge()) {
    FailNow(v1::STATUS_CODE_MALFORMED_FRAME,
            FailedPrecondition(fmt::format(
                "the server's first frame must be auth_challenge, got {}", BodyName(envelope))));
    return;
  }
  const v1::AuthChallenge& challenge = envelope.auth_challenge();
  peer_id_ = challenge.server_id();
  const bool have_token = !config_.cluster_token.empty();
  if (!challenge.auth_required()) {
    if (have_token && config_.require_server_proof) {
      BeginClose(FailedPrecondition(fmt::format(
                     "server \"{}\" at {} does not authenticate (it has no cluster token) but "
                     "this client has one and requires the server's proof; give the server the "
                     "token, or set require_server_proof = false",
                     peer_id_, remote_address_)),
                 /*flush=*/false);
      return;
    }
    Open();
    return;
  }
  if (!have_token) {
    BeginClose(FailedPrecondition(
                   fmt::format("server \"{}\" at {} requires authentication: set the cluster token "
                               "(KVT_CLUSTER_TOKEN or cluster_token in the options)",
                               peer_id_, remote_address_)),
               /*flush=*/false);
    return;
  }
  nonce_ = challenge.nonce();
  StatusOr<std::string> mac =
      ClientAuthMac(config_.cluster_token, nonce_, config_.local_id, config_.role);
  if (!mac.ok()) {
    FailNow(v1::STATUS_CODE_INTERNAL, mac.status());
    return;
  }
  v1::Envelope response;
  response.set_reply_to(envelope.id());
  v1::AuthResponse* r = response.mutable_auth_response();
  r->set_client_id(config_.local_id);
  r->set_role(config_.role);
  r->set_mac(*mac);
  if (config_.require_server_proof) {
    StatusOr<std::string> client_nonce = MakeNonce();
    if (!client_nonce.ok()) {
      FailNow(v1::STATUS_CODE_INTERNAL, client_nonce.status());
      return;
    }
    client_nonce_ = *client_nonce;
    r->set_client_nonce(client_nonce_);
  }
  if (Status s = SendNow(response, false); !s.ok()) {
    FailNow(v1::STATUS_CODE_INTERNAL, s);
    return;
  }
  state_ = State::kAwaitAuthResult;
}

void Connection::OnAuthResult(const v1::Envelope& envelope) {
  if (envelope.has_error()) {
    BeginClose(StatusFromError(envelope.error()), /*flush=*/false);
    return;
  }
  if (!envelope.has_auth_result()) {
    FailNow(v1::STATUS_CODE_MALFORMED_FRAME,
            FailedPrecondition(
                fmt::format("expected auth_result from the server, got {}", BodyName(envelope))));
    return;
  }
  if (!client_nonce_.empty()) {
    StatusOr<std::string> expected =
        ServerAuthMac(config_.cluster_token, client_nonce_, nonce_, peer_id_);
    if (!expected.ok()) {
      FailNow(v1::STATUS_CODE_INTERNAL, expected.status());
      return;
    }
    if (!MacEquals(envelope.auth_result().server_mac(), *expected)) {
      KVT_LOG_WARN("ctl", "connection {} ({}): server \"{}\" failed to prove the cluster token",
                   config_.id, remote_address_, peer_id_);
      FailNow(v1::STATUS_CODE_UNAUTHENTICATED,
              FailedPrecondition(
                  fmt::format("server \"{}\" at {} failed to prove the cluster token (mutual "
                              "authentication): it has a different token",
                              peer_id_, remote_address_)));
      return;
    }
  }
  authenticated_ = true;
  Open();
}

void Connection::Open() {
  state_ = State::kOpen;
  was_open_ = true;
  awaiting_authentication_.store(false);
  decoder_.set_max_frame_bytes(config_.limits.max_frame_bytes);
  {
    std::lock_guard<std::mutex> lock(write_mu_);
    direct_ok_ = true;
  }
  // A server without a token keeps the handshake deadline until the first complete frame.
  if (config_.side == Side::kClient || authenticated_ || first_frame_received_) {
    CancelTimer(handshake_timer_);
  }
  if (config_.limits.heartbeat_interval.count() > 0) ArmHeartbeatTimer();
  ConnectionInfo info;
  info.id = config_.id;
  info.remote_address = remote_address_;
  info.authenticated = authenticated_;
  info.peer_id = peer_id_;
  info.role = peer_role_;
  KVT_LOG_DEBUG("ctl", "connection {} ({}) open{}", config_.id, remote_address_,
                authenticated_ ? ", authenticated as \"" + peer_id_ + "\"" : "");
  if (!callbacks_.on_open) return;
  try {
    callbacks_.on_open(info);
  } catch (const std::exception& e) {
    FailNow(v1::STATUS_CODE_INTERNAL, Internal(fmt::format("connect handler threw: {}", e.what())));
  }
}

void Connection::ArmIdleTimer(std::chrono::steady_clock::duration after) {
  idle_timer_.expires_after(after);
  idle_timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (ec || self->closing_or_closed()) return;
    const auto idle = self->config_.limits.idle_timeout;
    const auto quiet = std::chrono::steady_clock::now() - self->last_receive_;
    if (quiet >= idle) {
      // A peer silent this long reads nothing either: the Error frame goes to the socket, but
      // waiting close_linger for the peer's FIN would only delay everything that waits on this
      // connection's end (failing its requests, fencing its writes).
      self->FailNow(v1::STATUS_CODE_DEADLINE_EXCEEDED,
                    DeadlineExceeded(fmt::format(
                        "idle timeout: nothing received for {} ms (the peer should send "
                        "heartbeats)",
                        Ms(idle))),
                    kSilentPeerLinger);
      return;
    }
    self->ArmIdleTimer(idle - quiet);
  });
}

void Connection::ArmHeartbeatTimer() {
  heartbeat_timer_.expires_after(config_.limits.heartbeat_interval);
  heartbeat_timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (ec || self->state_ != State::kOpen) return;
    v1::Envelope heartbeat;
    heartbeat.mutable_heartbeat()->set_sequence(++self->heartbeat_sequence_);
    (void)self->SendNow(heartbeat, false);  // a full queue already keeps the peer busy
    self->ArmHeartbeatTimer();
  });
}

void Connection::FailNow(v1::StatusCode code, Status why, std::chrono::milliseconds linger) {
  if (closing_or_closed()) return;
  KVT_LOG_WARN("ctl", "connection {} ({}): {}; closing it", config_.id, remote_address_,
               why.ToString());
  // Best effort: the peer may be gone or not reading; close_linger bounds the attempt.
  (void)SendNow(MakeErrorEnvelope(code, why.message()), /*bypass_limits=*/true);
  BeginClose(std::move(why), /*flush=*/true, linger);
}

void Connection::BeginClose(Status why, bool flush, std::chrono::milliseconds linger) {
  if (closing_or_closed()) return;
  close_reason_ = std::move(why);
  closing_.store(true);
  {
    std::lock_guard<std::mutex> lock(write_mu_);
    direct_ok_ = false;  // from here on frames go through the queue (draining sends them)
  }
  CancelTimer(handshake_timer_);
  CancelTimer(frame_timer_);
  CancelTimer(idle_timer_);
  CancelTimer(heartbeat_timer_);
  awaiting_authentication_.store(false);
  if (!flush || state_ == State::kNew) {
    FinishClose();
    return;
  }
  // Send what is queued (the Error frame), then FIN, then wait for the peer's FIN; close_linger
  // bounds the whole goodbye.
  state_ = State::kDraining;
  linger_timer_.expires_after(linger.count() >= 0 ? std::min(linger, config_.limits.close_linger)
                                                  : config_.limits.close_linger);
  linger_timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (!ec && self->state_ == State::kDraining) self->FinishClose();
  });
  {
    std::lock_guard<std::mutex> lock(write_mu_);
    if (!writing_ && write_queue_.empty() && lane_pending_.empty()) {
      boost::system::error_code ignored;
      socket_.shutdown(tcp::socket::shutdown_send, ignored);
    }
  }
  if (!reading_) ReadSome();
}

void Connection::FinishClose() {
  if (state_ == State::kClosed) return;
  auto self = shared_from_this();  // the on_close callback may drop the owner's reference
  if (close_reason_.ok()) close_reason_ = Unavailable("connection closed");
  state_ = State::kClosed;
  closing_.store(true);
  CancelTimer(handshake_timer_);
  CancelTimer(frame_timer_);
  CancelTimer(idle_timer_);
  CancelTimer(heartbeat_timer_);
  CancelTimer(linger_timer_);
  CancelTimer(lane_flush_timer_);
  if (lane_poll_id_ != 0) {
    config_.lanes->Remove(lane_poll_id_);
    lane_poll_id_ = 0;
  }
  {
    // Under the write lock: no Send() is writing to the descriptor while it closes.
    std::lock_guard<std::mutex> lock(write_mu_);
    direct_ok_ = false;
    lane_out_ = nullptr;  // the segment lives until the connection goes
    lane_active_.store(false);
    DropLanePendingLocked();
    boost::system::error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
    if (!writing_) DropQueuedLocked();  // else OnWrite drops it once the write is cancelled
  }
  KVT_LOG_DEBUG("ctl", "connection {} ({}) closed: {}", config_.id, remote_address_,
                close_reason_.ToString());
  ConnectionCallbacks callbacks = std::move(callbacks_);
  callbacks_ = {};
  if (callbacks.on_close) {
    try {
      callbacks.on_close(close_reason_, was_open_);
    } catch (const std::exception& e) {
      KVT_LOG_ERROR("ctl", "connection {}: disconnect handler threw: {}", config_.id, e.what());
    }
  }
}

Status Connection::SendNow(const v1::Envelope& envelope, bool bypass_limits) {
  if (state_ == State::kClosed || (state_ == State::kDraining && !bypass_limits)) {
    return Unavailable("connection is closing");
  }
  std::string frame;
  KVT_RETURN_IF_ERROR(AppendFrame(envelope, config_.limits.max_frame_bytes, &frame));
  const size_t frames = queued_frames_.fetch_add(1) + 1;
  const size_t bytes = queued_bytes_.fetch_add(frame.size()) + frame.size();
  if (!bypass_limits &&
      (frames > config_.limits.max_queued_frames || bytes > config_.limits.max_queued_bytes)) {
    queued_frames_.fetch_sub(1);
    queued_bytes_.fetch_sub(frame.size());
    return ResourceExhausted("send queue full");
  }
  EnqueueFrame(std::move(frame), /*dispatched=*/false, envelope.has_error());
  return OkStatus();
}

void Connection::EnqueueFrame(std::string frame, bool dispatched, bool error) {
  std::lock_guard<std::mutex> lock(write_mu_);
  if (dispatched) --dispatched_;
  // Nothing follows the goodbye: once closing, only the Error frame queued before it goes out.
  if (closing_or_closed() || (lane_broken_ && !error)) {
    queued_frames_.fetch_sub(1);
    queued_bytes_.fetch_sub(frame.size());
    return;
  }
  if (lane_out_ != nullptr) {
    WriteLaneLocked(std::move(frame));
    return;
  }
  QueueFrameLocked(std::move(frame));
}

void Connection::QueueFrameLocked(std::string frame) {
  write_queue_.push_back(std::move(frame));
  if (!writing_) WriteNextLocked();
}

void Connection::WriteSocketLocked(std::string frame) {
  if (writing_ || !write_queue_.empty()) {
    write_queue_.push_back(std::move(frame));  // the write in progress goes on to it
    return;
  }
  const ssize_t n =
      ::send(socket_.native_handle(), frame.data(), frame.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  if (n == static_cast<ssize_t>(frame.size())) {
    queued_frames_.fetch_sub(1);
    queued_bytes_.fetch_sub(frame.size());
    return;
  }
  if (n > 0) {
    queued_bytes_.fetch_sub(static_cast<size_t>(n));
    frame.erase(0, static_cast<size_t>(n));
  }
  // n < 0 (EAGAIN, or an error the strand's write will meet and report): the strand retries.
  writing_ = true;
  write_queue_.push_back(std::move(frame));
  asio::post(strand_, [self = shared_from_this()] { self->ResumeWrite(); });
}

void Connection::WriteNextLocked() {
  if (write_queue_.empty()) {
    writing_ = false;
    if (state_ == State::kDraining && lane_pending_.empty()) {
      boost::system::error_code ignored;
      socket_.shutdown(tcp::socket::shutdown_send, ignored);
    }
    return;
  }
  writing_ = true;
  StartWriteLocked();
}

void Connection::StartWriteLocked() {
  asio::async_write(socket_, asio::buffer(write_queue_.front()),
                    [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                      self->OnWrite(ec);
                    });
}

void Connection::DropQueuedLocked() {
  for (const std::string& frame : write_queue_) {
    queued_frames_.fetch_sub(1);
    queued_bytes_.fetch_sub(frame.size());
  }
  write_queue_.clear();
}

void Connection::ResumeWrite() {
  std::lock_guard<std::mutex> lock(write_mu_);
  if (state_ == State::kClosed) {  // closed meanwhile: the frame will never go out
    writing_ = false;
    DropQueuedLocked();
    return;
  }
  StartWriteLocked();
}

void Connection::OnWrite(const boost::system::error_code& ec) {
  std::unique_lock<std::mutex> lock(write_mu_);
  queued_frames_.fetch_sub(1);
  queued_bytes_.fetch_sub(write_queue_.front().size());
  write_queue_.pop_front();
  if (state_ == State::kClosed) {
    writing_ = false;
    DropQueuedLocked();
    return;
  }
  if (ec) {
    writing_ = false;
    lock.unlock();
    if (state_ != State::kDraining) {
      close_reason_ = Unavailable(fmt::format("connection {} to {}: write failed: {}", config_.id,
                                              remote_address_, ec.message()));
      closing_.store(true);
    }
    FinishClose();
    return;
  }
  WriteNextLocked();
}

}  // namespace kvt::control::internal

// The staging worker's copy runs: host writes sent as active messages where UCX has no native
// RMA to the peer (ucx_staged_transport.h, ucx_staged_protocol.h "copy runs as active
// messages"). Same thread contract as the rest of StagedTransport: the owning backend's mutex
// is held in every method and callback.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "backends/ucx/ucx_peer_check.h"
#include "backends/ucx/ucx_staged_transport.h"
#include "backends/ucx/ucx_util.h"
#include "kvt/common/hex.h"
#include "kvt/common/log.h"
#include "tsan_annotations.h"

// What a sender did before it sent a message happens before the receiver's copy, and the copy
// before the sender sees the acknowledgement, through UCX's own synchronisation, which
// ThreadSanitizer cannot see (UCX is not instrumented). When both sides run in one process
// (tests), these annotations tell it: released before each send and after each copy into the
// pool, acquired before each copy and before an acknowledgement counts.

namespace kvt::transfer {
namespace ucx_staging {
namespace {

char runs_tag;
void RunsRelease() { internal::TsanRelease(&runs_tag); }
void RunsAcquire() { internal::TsanAcquire(&runs_tag); }

std::string MessageName(uint64_t write, uint32_t message) {
  return "run message " + std::to_string(message) + " of write " + std::to_string(write);
}

}  // namespace

Status StagedTransport::AttachRuns(std::span<const LocalRegion> regions) {
  for (size_t i = 0; i < regions.size(); ++i) {
    if (regions[i].kind != MemoryKind::kHost) {
      return InvalidArgument("copy runs as active messages write host memory, but buffer " +
                             std::to_string(i) + " is CUDA memory");
    }
  }
  // The backend refuses to register again while a landing on an open link is under way
  // (RunsBusy); those left are of links closed since, and name the old buffers: none of their
  // bytes is copied.
  CutLandings(0, Aborted("the receiver registered its buffers again while the message was "
                         "received; nothing of it landed; write it again"));
  run_local_.assign(regions.begin(), regions.end());
  run_local_len_.clear();
  for (const LocalRegion& r : regions) run_local_len_.push_back(r.length);
  return OkStatus();
}

bool StagedTransport::RunsBusy() const {
  for (const auto& [id, write] : run_writes_) {
    if (write.status.code() == StatusCode::kInProgress) return true;
  }
  if (!run_sends_.empty()) return true;
  // Landings of closed links (a fence, a disconnect) will copy nothing: they do not hold the
  // buffers, however long their data takes to come.
  for (const RunLanding& l : run_landings_) {
    if (l.cut.ok() && dropped_.count(l.notice.sender) == 0 && LinkOpen(l.notice)) return true;
  }
  return false;
}

// ---- sending ------------------------------------------------------------------------------------

Status StagedTransport::PostRuns(WriteId id, PeerId link, std::span<const CopyRun> runs,
                                 std::span<const LocalRegion> local, bool send_now) {
  auto pit = peers_.find(link);
  if (pit == peers_.end() || pit->second.mode != LinkMode::kRuns) {
    return NotFound("no UCX peer " + std::to_string(link) + " taking copy runs as messages");
  }
  if (!pit->second.error.ok()) return pit->second.error;
  RunWrite write;
  write.link = link;
  write.runs.reserve(runs.size());
  for (const CopyRun& run : runs) {
    if (run.bytes > 0) write.runs.push_back(run);
  }
  write.src.reserve(local.size());
  for (const LocalRegion& r : local) write.src.push_back(reinterpret_cast<const uint8_t*>(r.base));
  write.status = write.runs.empty() ? OkStatus() : InProgress();
  const bool queue = !write.runs.empty();
  run_writes_.emplace(id, std::move(write));
  if (queue) {
    run_pending_.insert(id);
    if (send_now) ScheduleRuns(run_options_.pump_bytes);
  }
  return OkStatus();
}

bool StagedTransport::RunsSendable() const {
  for (WriteId id : run_pending_) {
    auto w = run_writes_.find(id);
    if (w == run_writes_.end()) return true;  // ScheduleRuns forgets it
    auto p = peers_.find(w->second.link);
    if (p == peers_.end() || (p->second.ready && p->second.credits.available() > 0)) return true;
  }
  return false;
}

void StagedTransport::ScheduleRuns(uint64_t budget) {
  // Oldest write first; each sends while its peer has credits (a later write to another peer
  // is not held up by a peer that has none), until the budget is spent.
  uint64_t sent = 0;
  for (auto it = run_pending_.begin(); it != run_pending_.end() && sent < budget;) {
    const WriteId id = *it;
    auto w = run_writes_.find(id);
    if (w == run_writes_.end() || w->second.status.code() != StatusCode::kInProgress ||
        w->second.all_sent()) {
      it = run_pending_.erase(it);
      continue;
    }
    RunWrite& write = w->second;
    auto p = peers_.find(write.link);
    if (p == peers_.end()) {
      it = run_pending_.erase(it);
      FailRunWrite(id, write, Aborted("peer disconnected during the write"));
      continue;
    }
    if (!p->second.error.ok()) {
      it = run_pending_.erase(it);
      FailRunWrite(id, write, p->second.error);
      continue;
    }
    // SendRunMessage returns false only when it failed the write (FailRunWrite), which takes the
    // write out of run_pending_: `it` is then gone, and the loop goes on from the write after it.
    const auto after = std::next(it);
    bool failed = false;
    while (p->second.ready && p->second.credits.available() > 0 && !write.all_sent() &&
           sent < budget) {
      const uint64_t before = write.sent_bytes;
      if (!SendRunMessage(id, write, p->second)) {
        failed = true;
        break;
      }
      sent += write.sent_bytes - before;
    }
    if (failed) {
      it = after;
    } else if (write.all_sent() || write.status.code() != StatusCode::kInProgress) {
      it = run_pending_.erase(it);
    } else {
      ++it;
    }
  }
}

bool StagedTransport::SendRunMessage(WriteId id, RunWrite& write, Peer& peer) {
  // Pieces up to message_bytes of data, within the segment cap and the worker's AM header limit.
  const size_t header_cap = max_am_header_ > kRunsHeaderBytes
                                ? (max_am_header_ - kRunsHeaderBytes) / kRunSegmentBytes
                                : 1;
  const size_t max_segments = std::max<size_t>(1, std::min<size_t>(kMaxRunSegments, header_cap));
  std::vector<RunSegment> segments;
  RunSend send;
  send.write = id;
  send.message = write.messages;
  send.link = write.link;
  uint64_t bytes = 0;
  while (!write.all_sent() && bytes < run_options_.message_bytes &&
         segments.size() < max_segments) {
    const CopyRun& run = write.runs[write.next_run];
    const uint64_t take =
        std::min(run.bytes - write.next_offset, run_options_.message_bytes - bytes);
    segments.push_back(RunSegment{run.DstBuffer(), run.dst_offset + write.next_offset, take});
    send.iov.push_back(ucp_dt_iov_t{
        const_cast<uint8_t*>(write.src[run.buffer] + run.src_offset + write.next_offset), take});
    bytes += take;
    write.sent_bytes += take;
    write.next_offset += take;
    if (write.next_offset == run.bytes) {
      ++write.next_run;
      write.next_offset = 0;
    }
  }
  StatusOr<std::vector<uint8_t>> header =
      EncodeRuns(RunsHeader{instance_, write.link, id, send.message,
                            static_cast<uint32_t>(segments.size()), peer.token},
                 segments);
  if (!header.ok()) {
    FailRunWrite(id, write, header.status().WithContext(MessageName(id, send.message)));
    return false;
  }
  send.header = std::move(header).value();
  if (!peer.credits.Acquire(id, send.message)) {
    FailRunWrite(id, write, Internal("no credit for " + MessageName(id, send.message)));
    return false;
  }
  ++write.messages;
  ucp_request_param_t param = {};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  param.datatype = ucp_dt_make_iov();
  param.memory_type = UCS_MEMORY_TYPE_HOST;
  // Eager: the fastest call over tcp at these sizes (docs/performance.md); rendezvous: the
  // receiver pulls the bytes when it has taken the message.
  param.flags = run_options_.rendezvous ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER;
  run_sends_.push_back(std::move(send));
  RunSend& s = run_sends_.back();
  RunsRelease();
  ucs_status_ptr_t req = ++run_messages_posted_ == run_options_.fail_send_at
                             ? UCS_STATUS_PTR(UCS_ERR_NO_RESOURCE)
                             : ucp_am_send_nbx(peer.ep, kAmRuns, s.header.data(), s.header.size(),
                                               s.iov.data(), s.iov.size(), &param);
  if (UCS_PTR_IS_ERR(req)) {
    peer.credits.Release(id, s.message);
    const Status failed = UcsStatus(UCS_PTR_STATUS(req), "ucp_am_send_nbx of a run message");
    run_sends_.pop_back();
    FailRunWrite(id, write, failed.WithContext(MessageName(id, write.messages - 1)));
    return false;
  }
  if (req == nullptr) {
    run_sends_.pop_back();  // sent already; the ack follows
  } else {
    s.request = req;
  }
  return true;
}

void StagedTransport::PumpRunSends() {
  for (auto it = run_sends_.begin(); it != run_sends_.end();) {
    const ucs_status_t st = ucp_request_check_status(it->request);
    if (st == UCS_INPROGRESS) {
      ++it;
      continue;
    }
    ucp_request_free(it->request);
    if (st != UCS_OK) {
      // No ack will come for it: its credit goes back here.
      if (auto p = peers_.find(it->link); p != peers_.end()) {
        p->second.credits.Release(it->write, it->message);
      }
      if (auto w = run_writes_.find(it->write); w != run_writes_.end()) {
        FailRunWrite(it->write, w->second,
                     UcsStatus(st, "UCX send of " + MessageName(it->write, it->message)));
      }
    }
    it = run_sends_.erase(it);
  }
}

void StagedTransport::FailRunWrite(WriteId id, RunWrite& write, const Status& status) {
  run_pending_.erase(id);
  if (write.status.code() != StatusCode::kInProgress) return;
  write.status = status;
  KVT_LOG_DEBUG("ucx", "run write {} failed: {}", id, status.ToString());
  if (on_write_done_) on_write_done_();
}

void StagedTransport::HandleRunAck(const ChunkAck& ack, std::string_view message) {
  auto w = run_writes_.find(ack.write);
  if (w == run_writes_.end() || w->second.link != ack.link) return;
  auto p = peers_.find(ack.link);
  // A duplicated ack holds no credit and counts for nothing (HandleAck ignored forged ones).
  if (p == peers_.end() || !p->second.credits.Release(ack.write, ack.chunk)) return;
  RunWrite& write = w->second;
  RunsAcquire();
  if (ack.code != StatusCode::kOk) {
    FailRunWrite(ack.write, write,
                 Status(ack.code, "the receiver failed " + MessageName(ack.write, ack.chunk) +
                                      ": " + std::string(message)));
    return;
  }
  ++write.acked;
  if (write.all_sent() && write.acked == write.messages &&
      write.status.code() == StatusCode::kInProgress) {
    write.status = OkStatus();
    if (on_write_done_) on_write_done_();
  }
  // A credit came back: Pump (after this callback) sends the next messages.
}

// ---- receiving ----------------------------------------------------------------------------------

ucs_status_t StagedTransport::OnRuns(void* arg, const void* header, size_t header_length,
                                     void* data, size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<StagedTransport*>(arg);
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  StatusOr<DecodedRuns> runs = DecodeRuns({static_cast<const uint8_t*>(header), header_length},
                                          self->run_local_len_, length);
  // Who to tell: a sender we have an endpoint to (also one disconnected or fenced here, which
  // may be alive and must fail the write at once) gets an ack carrying the error; a message
  // that does not name such a sender can only be dropped (its sender then learns nothing until
  // its own deadline), and a rendezvous one fails the sender's send.
  const ChunkNotice notice =
      RunsNotice({static_cast<const uint8_t*>(header), header_length}).value_or(ChunkNotice{});
  // As for staged chunks (OnChunk): a rendezvous message refused with an ack completes as
  // taken, so that the ack's reason is the one its sender reports.
  auto refuse = [&](ucs_status_t why, const Status& status) {
    WarnLimited(self->refusal_warnings_, "ucx", "refusing a run message: {}", status.ToString());
    if (self->senders_.count(notice.sender) != 0) {
      self->pending_acks_.emplace_back(notice, status);
      return UCS_OK;
    }
    return rndv ? why : UCS_OK;
  };
  if (!self->runs_attached()) {
    return refuse(UCS_ERR_UNSUPPORTED,
                  FailedPrecondition("this side registered no buffers that take copy runs"));
  }
  if (!runs.ok()) return refuse(UCS_ERR_INVALID_PARAM, runs.status());
  if (self->dropped_.count(notice.sender) != 0) {
    return refuse(UCS_ERR_REJECTED, Aborted("its sender was disconnected here"));
  }
  if (!self->LinkOpen(notice)) {
    return refuse(
        UCS_ERR_REJECTED,
        self->ClosedLink(notice, FailedPrecondition("its link " + std::to_string(notice.link) +
                                                    " is not open here (closed, fenced, or no "
                                                    "hello)")));
  }
  if (rndv && length > kMaxRunMessageBytes) {
    return refuse(UCS_ERR_MESSAGE_TRUNCATED,
                  OutOfRange("a rendezvous run message of " + std::to_string(length) +
                             " data bytes; at most " + std::to_string(kMaxRunMessageBytes) +
                             " (the largest am_message_bytes) are taken"));
  }
  if (rndv) {
    // A landing holds UCX's descriptor and an IOV of up to kMaxRunSegments pieces until Pump
    // receives it: no more per link than the window its hello ack granted, which the sender's
    // credits never exceed.
    const auto landing = std::count_if(
        self->run_landings_.begin(), self->run_landings_.end(), [&](const RunLanding& l) {
          return l.notice.sender == notice.sender && l.notice.link == notice.link;
        });
    if (static_cast<uint64_t>(landing) >= self->run_options_.window) {
      return refuse(UCS_ERR_NO_RESOURCE,
                    ResourceExhausted("link " + std::to_string(notice.link) + " of sender " +
                                      Hex(notice.sender) + " has " + std::to_string(landing) +
                                      " run messages landing here, its window (the hello ack "
                                      "granted " +
                                      std::to_string(self->run_options_.window) +
                                      "); a sender sends no more than its window unacknowledged"));
    }
  }
  std::vector<ucp_dt_iov_t> iov;
  iov.reserve(runs->segments.size());
  for (const RunSegment& seg : runs->segments) {
    iov.push_back(ucp_dt_iov_t{
        reinterpret_cast<uint8_t*>(self->run_local_[seg.buffer].base) + seg.offset, seg.bytes});
  }
  if (rndv) {
    // Received from Pump (no UCX call inside its callback), and copied into place there.
    RunLanding& landing = self->run_landings_.emplace_back();
    landing.notice = notice;
    landing.data = data;
    landing.length = length;
    landing.iov = std::move(iov);
    landing.due = self->ReceiveDue();
    return UCS_INPROGRESS;
  }
  RunsAcquire();
  const auto* src = static_cast<const uint8_t*>(data);
  for (const ucp_dt_iov_t& piece : iov) {
    std::memcpy(piece.buffer, src, piece.length);
    src += piece.length;
  }
  RunsRelease();
  self->pending_acks_.emplace_back(notice, OkStatus());
  return UCS_OK;
}

void StagedTransport::PumpRunLandings() {
  for (auto it = run_landings_.begin(); it != run_landings_.end();) {
    RunLanding& l = *it;
    if (l.request == nullptr && !Due(l.due)) {
      ++it;  // RunOptions::receive_delay
      continue;
    }
    if (l.request == nullptr) {
      if (!l.cut.ok() || dropped_.count(l.notice.sender) != 0 || !LinkOpen(l.notice)) {
        ucp_am_data_release(worker_, l.data);
        DeliverLanding(l);  // refused, naming why
        it = run_landings_.erase(it);
        continue;
      }
      // Uninitialised: UCX writes all of it before a byte is read. At most kMaxRunMessageBytes
      // (OnRuns), a window of them per link; refused, not thrown, when memory runs out.
      l.bounce.reset(new (std::nothrow) uint8_t[l.length]);
      if (l.bounce == nullptr) {
        ucp_am_data_release(worker_, l.data);
        pending_acks_.emplace_back(
            l.notice, ResourceExhausted("no memory for a buffer of " + std::to_string(l.length) +
                                        " bytes to receive the run message into"));
        it = run_landings_.erase(it);
        continue;
      }
      ucp_request_param_t param = {};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
      param.datatype = ucp_dt_make_contig(1);
      param.memory_type = UCS_MEMORY_TYPE_HOST;
      ucs_status_ptr_t req =
          ucp_am_recv_data_nbx(worker_, l.data, l.bounce.get(), l.length, &param);
      l.data = nullptr;  // UCX's from here on
      if (UCS_PTR_IS_ERR(req)) {
        pending_acks_.emplace_back(
            l.notice, UcsStatus(UCS_PTR_STATUS(req), "ucp_am_recv_data_nbx of a run message"));
        it = run_landings_.erase(it);
        continue;
      }
      if (req == nullptr) {
        DeliverLanding(l);
        it = run_landings_.erase(it);
        continue;
      }
      l.request = req;
    }
    const ucs_status_t st = ucp_request_check_status(l.request);
    if (st == UCS_INPROGRESS) {
      ++it;
      continue;
    }
    ucp_request_free(l.request);
    l.request = nullptr;
    if (st == UCS_OK) {
      DeliverLanding(l);
    } else {
      pending_acks_.emplace_back(l.notice, UcsStatus(st, "receiving a run message"));
    }
    it = run_landings_.erase(it);
  }
}

void StagedTransport::CutLandings(uint64_t sender, const Status& why) {
  for (RunLanding& l : run_landings_) {
    if ((sender == 0 || l.notice.sender == sender) && l.cut.ok()) l.cut = why;
  }
}

void StagedTransport::DeliverLanding(RunLanding& l) {
  if (dropped_.count(l.notice.sender) != 0 || !LinkOpen(l.notice)) {
    pending_acks_.emplace_back(l.notice,
                               ClosedLink(l.notice, Aborted("its sender was disconnected here; "
                                                            "nothing of the message landed")));
    return;
  }
  if (!l.cut.ok()) {
    pending_acks_.emplace_back(l.notice, l.cut);
    return;
  }
  RunsAcquire();
  const uint8_t* src = l.bounce.get();
  for (const ucp_dt_iov_t& piece : l.iov) {
    std::memcpy(piece.buffer, src, piece.length);
    src += piece.length;
  }
  RunsRelease();
  pending_acks_.emplace_back(l.notice, OkStatus());
}

}  // namespace ucx_staging
}  // namespace kvt::transfer

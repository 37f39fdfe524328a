#include "backends/ucx/ucx_staged_transport.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "backends/common/layer_table.h"
#include "backends/ucx/ucx_peer_check.h"
#include "backends/ucx/ucx_util.h"
#include "kvt/common/hex.h"
#include "kvt/common/log.h"
#include "kvt/common/random.h"
#include "kvt/transfer/plan.h"

namespace kvt::transfer {
namespace ucx_staging {
namespace {

using Clock = std::chrono::steady_clock;

// How long a release, disconnect or shutdown waits for chunks in flight before giving up.
constexpr std::chrono::milliseconds kWaitBound{10000};
// How long an endpoint close or a control message may take before it is abandoned.
constexpr std::chrono::milliseconds kCloseBound{2000};
constexpr std::chrono::milliseconds kControlBound{10000};
// How long the worker must have been idle before it is destroyed (DrainWorker).
constexpr std::chrono::milliseconds kDrainQuiet{20};
constexpr size_t kMaxAckMessage = 1024;
// Disconnected senders remembered (to refuse their late chunks); the oldest are forgotten.
constexpr size_t kMaxDropped = 4096;
// Fenced senders whose endpoints stay open for the acks of refusals though no link of theirs is
// open (each holds a connection; most of them are dead); the oldest are closed.
constexpr size_t kMaxFencedSenders = 256;

std::span<const uint8_t> Bytes(const void* p, size_t n) {
  return {static_cast<const uint8_t*>(p), n};
}

std::string ChunkName(uint64_t write, uint32_t chunk) {
  return "chunk " + std::to_string(chunk) + " of write " + std::to_string(write);
}

void OnReverseEndpointError(void*, ucp_ep_h, ucs_status_t status) {
  KVT_LOG_WARN("ucx", "endpoint to a staging sender failed: {}", ucs_status_string(status));
}

}  // namespace

StatusOr<std::unique_ptr<StagedTransport>> StagedTransport::Create(const std::string& transports,
                                                                   uint64_t instance,
                                                                   const RunOptions& runs) {
  std::unique_ptr<StagedTransport> transport(new StagedTransport(instance, runs));
  KVT_RETURN_IF_ERROR(transport->Init(transports));
  return transport;
}

Status StagedTransport::Init(const std::string& transports) {
  KVT_ASSIGN_OR_RETURN(ucp_config_t * config, ReadUcpConfig(transports));
  ucp_params_t params = {};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;
  const ucs_status_t st = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  KVT_RETURN_IF_ERROR(UcsStatus(st, "ucp_init of the staging context"));
  ucp_worker_params_t wparams = {};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // serialised by the backend's mutex
  KVT_RETURN_IF_ERROR(UcsStatus(ucp_worker_create(context_, &wparams, &worker_),
                                "ucp_worker_create of the staging worker"));
  KVT_RETURN_IF_ERROR(UcsStatus(ucp_worker_get_efd(worker_, &event_fd_), "ucp_worker_get_efd"));
  ucp_address_t* address = nullptr;
  size_t address_len = 0;
  KVT_RETURN_IF_ERROR(
      UcsStatus(ucp_worker_get_address(worker_, &address, &address_len), "ucp_worker_get_address"));
  worker_address_.assign(reinterpret_cast<const char*>(address), address_len);
  ucp_worker_release_address(worker_, address);
  ucp_worker_attr_t attr = {};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
  KVT_RETURN_IF_ERROR(UcsStatus(ucp_worker_query(worker_, &attr), "ucp_worker_query"));
  max_am_header_ = attr.max_am_header;
  return RegisterHandlers();
}

StagedTransport::~StagedTransport() {
  copier_.reset();  // waits for its pending completion callbacks
  if (completion_fd_ >= 0) close(completion_fd_);
  if (worker_ != nullptr) {
    DrainWorker(worker_, kDrainQuiet, kCloseBound);
    ucp_worker_destroy(worker_);
  }
  if (context_ != nullptr) ucp_cleanup(context_);
}

Status StagedTransport::RegisterHandlers() {
  struct Handler {
    unsigned id;
    ucp_am_recv_callback_t cb;
    uint32_t flags;
  };
  const Handler handlers[] = {
      // Chunks: keep eager data too, so that every arrival can wait for a free slot.
      {kAmChunk, &StagedTransport::OnChunk, UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA},
      {kAmHello, &StagedTransport::OnHello, UCP_AM_FLAG_WHOLE_MSG},
      {kAmHelloAck, &StagedTransport::OnHelloAck, UCP_AM_FLAG_WHOLE_MSG},
      {kAmChunkAck, &StagedTransport::OnChunkAck, UCP_AM_FLAG_WHOLE_MSG},
      {kAmBye, &StagedTransport::OnBye, UCP_AM_FLAG_WHOLE_MSG},
      {kAmSlotChunk, &StagedTransport::OnSlotChunk, UCP_AM_FLAG_WHOLE_MSG},
      // Run messages: eager data is copied into place inside the callback.
      {kAmRuns, &StagedTransport::OnRuns, UCP_AM_FLAG_WHOLE_MSG},
  };
  for (const Handler& h : handlers) {
    ucp_am_handler_param_t param = {};
    param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                       UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    param.id = h.id;
    param.cb = h.cb;
    param.arg = this;
    param.flags = h.flags;
    KVT_RETURN_IF_ERROR(UcsStatus(ucp_worker_set_am_recv_handler(worker_, &param),
                                  "ucp_worker_set_am_recv_handler(" + std::to_string(h.id) + ")"));
  }
  return OkStatus();
}

// ---- the local pool -----------------------------------------------------------------------------

bool StagedTransport::Active() const {
  for (const auto& [id, write] : writes_) {
    if (write.status.code() == StatusCode::kInProgress) return true;
  }
  for (const SendSlot& s : send_) {
    if (s.state != SendSlot::State::kFree) return true;
  }
  for (const RecvSlot& r : recv_) {
    if (r.state != RecvSlot::State::kFree) return true;
  }
  return !arrivals_.empty() || RunsBusy();
}

Status StagedTransport::Attach(std::span<const LocalRegion> regions,
                               const StagingOptions& options) {
  if (attached()) KVT_RETURN_IF_ERROR(Detach());
  if (options.slots < 1 || options.slots > 4096) {
    return InvalidArgument("ucx staging_slots is " + std::to_string(options.slots) +
                           "; give 1 to 4096 bounce slots");
  }
  if (options.slot_bytes < kMinSlotBytes || options.slot_bytes > (uint64_t{1} << 32)) {
    return InvalidArgument("ucx staging_slot_bytes is " + std::to_string(options.slot_bytes) +
                           "; give " + std::to_string(kMinSlotBytes) + " bytes to 4 GiB");
  }
  if (regions.empty()) {
    return InvalidArgument("a staged pool registers the layout's buffers; got none");
  }
  ChunkLimits limits;
  for (size_t i = 0; i < regions.size(); ++i) {
    if (regions[i].item_len == 0) {
      return InvalidArgument("staged buffer " + std::to_string(i) +
                             " has pages of 0 bytes; give every buffer its page bytes");
    }
    if (regions[i].kind != regions[0].kind || regions[i].device != regions[0].device) {
      return InvalidArgument("staging needs every buffer in one memory (host, or one CUDA " +
                             std::string("device); buffer ") + std::to_string(i) + " differs");
    }
    limits.item_len.push_back(regions[i].item_len);
    limits.buffer_len.push_back(regions[i].length);
  }
  // Chunks carry the buffers of their layers in LayerTable order, each with its own page bytes.
  KVT_ASSIGN_OR_RETURN(limits.layers, LayerTable::Create(regions));
  // Slots stay 4 KiB multiples so that every payload (and its 256-byte segments) is aligned.
  const uint64_t slot_bytes = (options.slot_bytes + 4095) / 4096 * 4096;
  for (int32_t l = 0; l < limits.layers.num_layers(); ++l) {
    const std::vector<uint64_t> page_bytes =
        ChunkPageBytes(limits.layers, limits.item_len, l, l + 1);
    const uint64_t one_page = PayloadBytes(1, {}, page_bytes);
    if (one_page > slot_bytes) {
      return InvalidArgument("ucx staging_slot_bytes " + std::to_string(slot_bytes) +
                             " cannot hold one page of transfer layer " + std::to_string(l) + " (" +
                             std::to_string(one_page) + " bytes of its " +
                             std::to_string(page_bytes.size()) +
                             " buffers with the chunk header); raise it");
    }
  }
  const size_t area = static_cast<size_t>(options.slots) * slot_bytes;

  // Slot memory from UCX's allocator, so that its shared-memory transports can map it.
  auto allocate = [&](ucp_mem_h& memh, uint8_t*& base, const char* what) -> Status {
    ucp_mem_map_params_t mp = {};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS |
                    UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE | UCP_MEM_MAP_PARAM_FIELD_ADDRESS;
    mp.address = nullptr;
    mp.length = area;
    mp.flags = UCP_MEM_MAP_ALLOCATE;
    mp.memory_type = UCS_MEMORY_TYPE_HOST;
    KVT_RETURN_IF_ERROR(UcsStatus(ucp_mem_map(context_, &mp, &memh),
                                  std::string("ucp_mem_map(ALLOCATE) of the ") + what + " (" +
                                      std::to_string(area) + " bytes)"));
    ucp_mem_attr_t attr = {};
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    KVT_RETURN_IF_ERROR(UcsStatus(ucp_mem_query(memh, &attr), "ucp_mem_query"));
    if (attr.length < area || reinterpret_cast<uintptr_t>(attr.address) % 4096 != 0) {
      return Internal("UCX allocated " + std::to_string(attr.length) + " bytes for the " + what +
                      " (asked " + std::to_string(area) + "), or not page-aligned");
    }
    base = static_cast<uint8_t*>(attr.address);
    return OkStatus();
  };
  leak_slot_memory_ = false;
  Status allocated = allocate(send_memh_, send_base_, "send slots");
  if (allocated.ok()) allocated = allocate(recv_memh_, recv_base_, "receive slots");
  if (!allocated.ok()) {
    FreeSlotMemory();
    return allocated;
  }
  slot_bytes_ = slot_bytes;

  SlotMemory memory{send_base_, recv_base_, options.slots, slot_bytes, false};
  if (options.host_copier) {
    auto copier = CreateHostCopier(regions, memory, options.host_copy_delay);
    if (!copier.ok()) {
      FreeSlotMemory();
      return copier.status();
    }
    copier_ = std::move(copier).value();
  } else {
    bool registration_failed = false;
    auto copier = CreateCudaCopier(regions[0].device, regions, memory, &registration_failed);
    if (!copier.ok() && registration_failed) {
      // Some kernels refuse to page-lock UCX's shared-memory mappings; CUDA's own pinned memory
      // still works (UCX then reaches it through copies instead of mapping it).
      KVT_LOG_WARN("ucx",
                   "{}; staging through cudaHostAlloc memory instead (UCX cannot map it for "
                   "shared-memory peers, so transfers take a copy more)",
                   copier.status().ToString());
      FreeSlotMemory();
      auto send = cuda::PinnedBuffer::Allocate(area);
      auto recv = send.ok() ? cuda::PinnedBuffer::Allocate(area)
                            : StatusOr<cuda::PinnedBuffer>(send.status());
      if (!recv.ok()) return recv.status().WithContext("allocating pinned staging slots");
      send_pinned_ = std::move(send).value();
      recv_pinned_ = std::move(recv).value();
      send_base_ = send_pinned_.as<uint8_t>();
      recv_base_ = recv_pinned_.as<uint8_t>();
      slot_bytes_ = slot_bytes;
      memory = SlotMemory{send_base_, recv_base_, options.slots, slot_bytes, true};
      copier = CreateCudaCopier(regions[0].device, regions, memory, &registration_failed);
    }
    if (!copier.ok()) {
      FreeSlotMemory();
      return copier.status();
    }
    copier_ = std::move(copier).value();
  }
  // Completions announced on an eventfd, so the progress thread sleeps while gathers wait for
  // the producer (a whole forward pass) instead of polling their events.
  if (completion_fd_ < 0) completion_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  notified_ = completion_fd_ >= 0 && copier_->NotifyCompletions(&OnCopierDone, this);
  if (completion_fd_ < 0) {
    KVT_LOG_WARN("ucx", "eventfd for staging completions failed ({}); polling them instead",
                 std::strerror(errno));
  }
  local_.assign(regions.begin(), regions.end());
  limits_ = std::move(limits);
  send_.assign(options.slots, SendSlot{});
  recv_.assign(options.slots, RecvSlot{});
  in_place_ = options.in_place;
  // New slot memory: offers made for the old one no longer hold (ReadsInPlace).
  ++offer_generation_;
  if (in_place_ && send_memh_ != nullptr) {
    void* packed = nullptr;
    size_t packed_len = 0;
    Status key = UcsStatus(ucp_rkey_pack(context_, send_memh_, &packed, &packed_len),
                           "ucp_rkey_pack of the send slots");
    if (key.ok()) {
      send_key_.assign(static_cast<const char*>(packed), packed_len);
      ucp_rkey_buffer_release(packed);
    } else {
      KVT_LOG_DEBUG("ucx", "send slots not offered for reading in place: {}", key.ToString());
    }
  }
  // Senders' slots mapped for the previous copier: page-locked again for this one.
  for (auto it = sender_slots_.begin(); it != sender_slots_.end();) {
    SenderSlots& m = it->second;
    Status pinned = in_place_ ? copier_->PinPeerSlots(m.local, m.slot_bytes * m.count)
                              : FailedPrecondition("reading in place is off");
    if (pinned.ok()) {
      m.pinned = true;
      ++it;
      continue;
    }
    KVT_LOG_WARN("ucx", "the slots of sender {:x} are no longer read in place: {}", it->first,
                 pinned.ToString());
    ucp_rkey_destroy(m.rkey);
    it = sender_slots_.erase(it);
  }
  KVT_LOG_DEBUG("ucx", "staging attached: {} copier, {} slots of {} bytes each way",
                copier_->Name(), options.slots, slot_bytes_);
  return OkStatus();
}

Status StagedTransport::Detach() {
  if (!attached()) return OkStatus();
  if (Active()) {
    return FailedPrecondition(
        "cannot re-register the staged pool while chunks are in flight; release the writes "
        "first");
  }
  // The copier unpins the senders' slots it page-locked; the mappings stay for the next one.
  for (auto& [instance, m] : sender_slots_) m.pinned = false;
  copier_.reset();
  notified_ = false;
  FreeSlotMemory();
  send_.clear();
  recv_.clear();
  local_.clear();
  limits_ = ChunkLimits{};
  return OkStatus();
}

void StagedTransport::FreeSlotMemory() {
  send_key_.clear();
  if (leak_slot_memory_) {
    KVT_LOG_ERROR("ucx",
                  "leaving the staging slots allocated: a transfer into or out of them did "
                  "not finish and UCX may still touch them");
    send_memh_ = recv_memh_ = nullptr;
    // Deliberately never freed.
    if (send_pinned_.data() != nullptr) new cuda::PinnedBuffer(std::move(send_pinned_));
    if (recv_pinned_.data() != nullptr) new cuda::PinnedBuffer(std::move(recv_pinned_));
    send_base_ = recv_base_ = nullptr;
    leak_slot_memory_ = false;
    return;
  }
  if (send_memh_ != nullptr) ucp_mem_unmap(context_, send_memh_);
  if (recv_memh_ != nullptr) ucp_mem_unmap(context_, recv_memh_);
  send_memh_ = recv_memh_ = nullptr;
  send_pinned_ = cuda::PinnedBuffer();
  recv_pinned_ = cuda::PinnedBuffer();
  send_base_ = recv_base_ = nullptr;
}

// ---- sending ------------------------------------------------------------------------------------

Status StagedTransport::AddPeer(PeerId link, std::string_view worker_address,
                                const AddressTrailer& remote, std::vector<RemoteRegion> regions,
                                LinkMode mode) {
  if (mode == LinkMode::kStaged && (!remote.staged || remote.slots == 0)) {
    return FailedPrecondition("the peer does not stage CUDA pools (no bounce slots announced)");
  }
  if (mode == LinkMode::kRuns && remote.runs_address_bytes == 0) {
    return FailedPrecondition("the peer takes no copy runs as active messages");
  }
  Peer peer;
  peer.mode = mode;
  peer.remote = remote;
  peer.regions = std::move(regions);
  peer.credits.SetLimit(0);  // until the hello is acknowledged
  peer.token = RandomNonZeroU64();
  ucp_ep_params_t ep = {};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.address = reinterpret_cast<const ucp_address_t*>(worker_address.data());
  // As in ucx_backend: PEER mode would rule out UCX 1.13's shared-memory transports; peer death
  // is the control plane's to detect, which then disconnects the peer (kPeerDead).
  ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
  ep.err_handler.cb = &OnReverseEndpointError;
  ep.err_handler.arg = nullptr;
  KVT_RETURN_IF_ERROR(UcsStatus(ucp_ep_create(worker_, &ep, &peer.ep), "ucp_ep_create"));
  Hello h{instance_, link, mode};
  h.token = peer.token;
  std::string data = worker_address_;
  if (mode == LinkMode::kStaged && !send_key_.empty()) {
    peer.offer = offer_generation_;
    h.slots_base = reinterpret_cast<uint64_t>(send_base_);
    h.slot_bytes = slot_bytes_;
    h.slots = static_cast<uint32_t>(send_.size());
    h.key_bytes = static_cast<uint32_t>(send_key_.size());
    data += send_key_;
  }
  Status hello = SendControl(peer.ep, kAmHello, Encode(h), std::move(data));
  if (!hello.ok()) {
    CloseEndpointNow(peer.ep, /*force=*/true);
    return hello.WithContext("sending the staging hello");
  }
  peers_.emplace(link, std::move(peer));
  return OkStatus();
}

void StagedTransport::RemovePeer(PeerId link, bool peer_dead) {
  auto it = peers_.find(link);
  if (it == peers_.end()) return;
  // Cancel what has not been gathered yet: those writes cannot complete any more.
  for (auto& [id, write] : writes_) {
    if (write.link != link) continue;
    if (write.status.code() == StatusCode::kInProgress && write.next_chunk < write.plan.count()) {
      FailWrite(id, write, Aborted("peer disconnected during the write"));
    }
  }
  for (auto& [id, write] : run_writes_) {
    if (write.link == link && !write.all_sent()) {
      FailRunWrite(id, write, Aborted("peer disconnected during the write"));
    }
  }
  if (!peer_dead) {
    // Let the connection finish its handshake first: closing a tcp endpoint while the peer is
    // still connecting back to us crashes UCX 1.13 (uct_tcp_iface_progress).
    WaitUntil(
        [&] {
          auto p = peers_.find(link);
          return p == peers_.end() || p->second.ready || !p->second.error.ok();
        },
        kCloseBound);
    const bool drained = WaitUntil(
        [&] {
          auto p = peers_.find(link);
          return p == peers_.end() || p->second.credits.outstanding() == 0;
        },
        kWaitBound);
    if (!drained) {
      KVT_LOG_WARN("ucx",
                   "chunks or run messages to a disconnecting peer were not acknowledged "
                   "in {} ms",
                   kWaitBound.count());
    }
    it = peers_.find(link);
    if (it != peers_.end()) {
      Status bye =
          SendControl(it->second.ep, kAmBye, Encode(Bye{instance_, link, it->second.token}), {});
      if (!bye.ok()) KVT_LOG_DEBUG("ucx", "staging bye not sent: {}", bye.ToString());
    }
  }
  for (auto& [id, write] : writes_) {
    if (write.link == link && write.status.code() == StatusCode::kInProgress) {
      FailWrite(id, write, Aborted("peer disconnected during the write"));
    }
  }
  for (auto& [id, write] : run_writes_) {
    if (write.link == link) FailRunWrite(id, write, Aborted("peer disconnected during the write"));
  }
  it = peers_.find(link);
  if (it == peers_.end()) return;  // removed by another call while this one waited
  const ucp_ep_h ep = it->second.ep;
  peers_.erase(it);
  // Slots the receiver read from: it acknowledged them (graceful), or it is gone.
  for (SendSlot& slot : send_) {
    if (slot.lent && slot.link == link) ReturnSlot(link, slot.write, slot.chunk);
  }
  // Sends still in flight on it complete (cancelled, when forced) and free their slots.
  CloseEndpointNow(ep, peer_dead);
}

Status StagedTransport::PostPages(WriteId id, PeerId link, const PageWrite& w) {
  if (!attached()) {
    return FailedPrecondition("no staged pool is registered; register CUDA buffers first");
  }
  auto pit = peers_.find(link);
  if (pit == peers_.end()) return NotFound("no staged UCX peer " + std::to_string(link));
  Peer& peer = pit->second;
  if (!peer.error.ok()) return peer.error;
  if (peer.regions.size() != local_.size()) {
    return InvalidArgument("the peer registered " + std::to_string(peer.regions.size()) +
                           " staged buffers and this side " + std::to_string(local_.size()) +
                           "; both sides must register the same layout");
  }
  KVT_RETURN_IF_ERROR(limits_.layers.CheckRange(w.num_layers, w.layer_begin, w.layer_end));
  // Pages and units against every buffer of the range, each with its own page bytes and length
  // on both sides.
  std::vector<PlanBuffer> buffers(local_.size());
  for (size_t b = 0; b < local_.size(); ++b) {
    buffers[b] = PlanBuffer{local_[b].layer, local_[b].item_len, peer.regions[b].item_len,
                            local_[b].length, peer.regions[b].length};
  }
  PlanSpec spec;
  spec.src_pages = w.src_pages;
  spec.dst_pages = w.dst_pages;
  spec.num_layers = w.num_layers;
  spec.layer_begin = w.layer_begin;
  spec.layer_end = w.layer_end;
  spec.units = w.units;
  spec.buffers = buffers;
  KVT_RETURN_IF_ERROR(ValidatePlanSpec(spec));

  Write write;
  write.link = link;
  write.src_pages.assign(w.src_pages.begin(), w.src_pages.end());
  write.dst_pages.assign(w.dst_pages.begin(), w.dst_pages.end());
  write.units.assign(w.units.begin(), w.units.end());  // empty: whole pages
  write.num_layers = w.num_layers;
  const uint64_t slot = std::min(slot_bytes_, peer.remote.slot_bytes);
  KVT_ASSIGN_OR_RETURN(write.plan, PlanChunks(w.layer_begin, w.layer_end,
                                              static_cast<int64_t>(write.src_pages.size()),
                                              write.units, limits_.layers, limits_.item_len, slot));
  KVT_RETURN_IF_ERROR(copier_->Gate(w.ready, write.gate).WithContext("waiting for `ready`"));
  write.status = write.plan.count() == 0 ? OkStatus() : InProgress();
  const bool queue = write.plan.count() > 0;
  writes_.emplace(id, std::move(write));
  if (queue) {
    pending_.insert(id);
    ScheduleChunks();
  }
  return OkStatus();
}

Status StagedTransport::Check(WriteId id) {
  if (auto r = run_writes_.find(id); r != run_writes_.end()) {
    if (r->second.status.code() == StatusCode::kInProgress) {
      ucp_worker_progress(worker_);
      Pump();
      r = run_writes_.find(id);
    }
    return r->second.status;
  }
  auto it = writes_.find(id);
  if (it == writes_.end()) return NotFound("no UCX write " + std::to_string(id));
  if (it->second.status.code() == StatusCode::kInProgress) {
    ucp_worker_progress(worker_);
    Pump();
    it = writes_.find(id);
  }
  return it->second.status;
}

void StagedTransport::Release(WriteId id) {
  PeerId link = 0;
  if (auto r = run_writes_.find(id); r != run_writes_.end()) {
    // Unsent messages are never sent; those in flight are waited for below.
    run_pending_.erase(id);
    link = r->second.link;
    if (r->second.status.code() == StatusCode::kInProgress) {
      r->second.status = Aborted("write released before it completed");
    }
  } else if (auto it = writes_.find(id); it != writes_.end()) {
    pending_.erase(id);
    link = it->second.link;
    if (it->second.status.code() == StatusCode::kInProgress) {
      // Gathered chunks of a write that is no longer in progress are not sent.
      it->second.status = Aborted("write released before it completed");
    }
  } else {
    return;
  }
  auto held = [&] {
    auto p = peers_.find(link);
    return p == peers_.end() ? 0u : p->second.credits.HeldBy(id);
  };
  if (held() > 0 && !WaitUntil([&] { return held() == 0; }, run_options_.release_bound)) {
    KVT_LOG_ERROR("ucx",
                  "released write {} still has {} chunks unacknowledged after {} ms; its bytes "
                  "may land later",
                  id, held(), run_options_.release_bound.count());
    // Slots the receiver may still read stay lent, and the credits stay taken: the receiver
    // still holds those chunks or messages (a sender that took the credits back could send
    // past what it holds); a late ack, or the peer's removal, frees both.
  }
  writes_.erase(id);
  run_writes_.erase(id);
}

template <typename Done>
bool StagedTransport::WaitUntil(Done&& done, std::chrono::milliseconds bound) {
  const auto give_up = Clock::now() + bound;
  while (!done()) {
    if (Clock::now() > give_up) return false;
    ucp_worker_progress(worker_);
    Pump();
    if (yield_) yield_();
  }
  return true;
}

void StagedTransport::FailWrite(WriteId id, Write& write, const Status& status) {
  pending_.erase(id);
  if (write.status.code() != StatusCode::kInProgress) return;
  write.status = status;
  KVT_LOG_DEBUG("ucx", "staged write {} failed: {}", id, status.ToString());
  if (on_write_done_) on_write_done_();
}

void StagedTransport::FailChunk(SendSlot& slot, const Status& status) {
  if (auto p = peers_.find(slot.link); p != peers_.end()) {
    p->second.credits.Release(slot.write, slot.chunk);
  }
  if (auto w = writes_.find(slot.write); w != writes_.end()) {
    FailWrite(slot.write, w->second, status.WithContext(ChunkName(slot.write, slot.chunk)));
  }
}

void StagedTransport::PumpSendSlots() {
  for (uint32_t i = 0; i < send_.size(); ++i) {
    SendSlot& s = send_[i];
    if (s.state == SendSlot::State::kGathering) {
      StatusOr<bool> done = copier_->GatherDone(i);
      if (!done.ok()) {
        FailChunk(s, done.status());
        s.state = SendSlot::State::kFree;
        continue;
      }
      if (!*done) continue;
      SendGathered(i);
    }
    if (s.state == SendSlot::State::kSending) {
      const ucs_status_t st = ucp_request_check_status(s.request);
      if (st == UCS_INPROGRESS) continue;
      ucp_request_free(s.request);
      s.request = nullptr;
      if (st != UCS_OK) s.lent = false;
      s.state = s.lent ? SendSlot::State::kLent : SendSlot::State::kFree;
      if (st != UCS_OK) FailChunk(s, UcsStatus(st, "UCX send of the chunk"));
    }
  }
}

void StagedTransport::SendGathered(uint32_t i) {
  SendSlot& s = send_[i];
  auto w = writes_.find(s.write);
  auto p = peers_.find(s.link);
  if (w == writes_.end() || w->second.status.code() != StatusCode::kInProgress ||
      p == peers_.end()) {
    // Released, failed or disconnected meanwhile: the chunk stays here.
    if (p != peers_.end()) p->second.credits.Release(s.write, s.chunk);
    s.state = SendSlot::State::kFree;
    return;
  }
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  param.memory_type = UCS_MEMORY_TYPE_HOST;
  ucs_status_ptr_t req = nullptr;
  s.lent = ReadsInPlace(s.link);
  if (s.lent) {
    // The receiver reads the payload's data from this slot, which is ours again only after the
    // ack; its prefix (header, page ids, units) travels with the notice, so that the receiver
    // never reads our memory with its CPU.
    s.notice = Encode(SlotNotice{ChunkNotice{instance_, s.link, s.write, s.chunk, p->second.token},
                                 i, s.payload_bytes});
    const uint64_t prefix = std::min<uint64_t>(
        s.payload_bytes, ChunkPrefixBytes(std::span<const uint8_t>(SendPayload(i), slot_bytes_)));
    param.flags = UCP_AM_SEND_FLAG_EAGER;
    req = ucp_am_send_nbx(p->second.ep, kAmSlotChunk, s.notice.data(), s.notice.size(),
                          SendPayload(i), prefix, &param);
  } else {
    // Rendezvous: the receiver pulls the payload when it has a slot for it, straight from ours.
    param.flags = UCP_AM_SEND_FLAG_RNDV;
    req = ucp_am_send_nbx(p->second.ep, kAmChunk, s.notice.data(), s.notice.size(), SendPayload(i),
                          s.payload_bytes, &param);
  }
  if (UCS_PTR_IS_ERR(req)) {
    s.state = SendSlot::State::kFree;
    s.lent = false;
    FailChunk(s, UcsStatus(UCS_PTR_STATUS(req), "ucp_am_send_nbx of the chunk"));
    return;
  }
  if (req == nullptr) {
    // Sent already; the ack follows (and frees a lent slot).
    s.state = s.lent ? SendSlot::State::kLent : SendSlot::State::kFree;
    return;
  }
  s.request = req;
  s.state = SendSlot::State::kSending;
}

void StagedTransport::ScheduleChunks() {
  if (pending_.empty()) return;
  for (uint32_t i = 0; i < send_.size() && !pending_.empty(); ++i) {
    if (send_[i].state != SendSlot::State::kFree) continue;
    // The oldest write whose receiver has a credit left; others wait their turn.
    bool started = false;
    for (auto it = pending_.begin(); it != pending_.end();) {
      const WriteId id = *it;
      auto w = writes_.find(id);
      if (w == writes_.end() || w->second.status.code() != StatusCode::kInProgress ||
          w->second.next_chunk >= w->second.plan.count()) {
        it = pending_.erase(it);
        continue;
      }
      auto p = peers_.find(w->second.link);
      if (p == peers_.end()) {
        ++it;
        FailWrite(id, w->second, Aborted("peer disconnected during the write"));
        continue;
      }
      if (!p->second.error.ok()) {
        ++it;
        FailWrite(id, w->second, p->second.error);
        continue;
      }
      if (!p->second.ready || p->second.credits.available() == 0) {
        ++it;
        continue;
      }
      StartChunk(i, id, w->second, p->second);
      started = true;
      break;
    }
    if (!started) break;
  }
}

void StagedTransport::StartChunk(uint32_t i, WriteId id, Write& write, Peer& peer) {
  const uint32_t index = write.next_chunk++;
  if (write.next_chunk >= write.plan.count()) pending_.erase(id);
  const Chunk chunk = write.plan.Get(index);
  const int64_t pages = chunk.page_end - chunk.page_begin;
  const std::vector<uint64_t> page_bytes =
      ChunkPageBytes(limits_.layers, limits_.item_len, chunk.layer_begin, chunk.layer_end);
  const PayloadLayout layout = LayoutPayload(pages, write.units, page_bytes);
  ChunkHeader header;
  header.sender = instance_;
  header.link = write.link;
  header.write = id;
  header.chunk = index;
  header.chunk_count = write.plan.count();
  header.num_layers = write.num_layers;
  header.layer_begin = chunk.layer_begin;
  header.layer_end = chunk.layer_end;
  header.num_pages = static_cast<uint32_t>(pages);
  header.num_units = static_cast<uint32_t>(write.units.size());
  header.num_buffers = static_cast<uint32_t>(page_bytes.size());
  header.payload_bytes = layout.payload_bytes;
  const auto dst = std::span<const int32_t>(write.dst_pages).subspan(chunk.page_begin, pages);
  const auto src = std::span<const int32_t>(write.src_pages).subspan(chunk.page_begin, pages);
  Status encoded = EncodeChunkPrefix(header, dst, write.units, page_bytes,
                                     std::span<uint8_t>(SendPayload(i), slot_bytes_));
  if (!encoded.ok()) {
    FailWrite(id, write, encoded.WithContext(ChunkName(id, index)));
    return;
  }
  if (!peer.credits.Acquire(id, index)) {
    FailWrite(id, write, Internal("no credit for " + ChunkName(id, index)));
    return;
  }
  CopierChunk cc;
  cc.layer_begin = chunk.layer_begin;
  cc.layer_end = chunk.layer_end;
  cc.pages = src;
  cc.units = layout.units;
  cc.pages_offset = kChunkHeaderBytes;
  cc.payload_bytes = layout.payload_bytes;
  Status started = copier_->StartGather(i, cc, write.gate.get());
  if (!started.ok()) {
    peer.credits.Release(id, index);
    FailWrite(id, write, started.WithContext("gathering " + ChunkName(id, index)));
    return;
  }
  SendSlot& s = send_[i];
  s.state = SendSlot::State::kGathering;
  s.write = id;
  s.chunk = index;
  s.link = write.link;
  s.notice = Encode(ChunkNotice{instance_, write.link, id, index, peer.token});
  s.payload_bytes = layout.payload_bytes;
  s.request = nullptr;
}

void StagedTransport::HandleAck(const ChunkAck& ack, std::string_view message) {
  // Only the receiver of the link knows its token: an ack without it is not that receiver's, and
  // counts for nothing (it must not complete, fail or free another sender's chunks).
  auto peer = peers_.find(ack.link);
  if (peer == peers_.end() || peer->second.token != ack.token) {
    KVT_LOG_DEBUG("ucx", "ignoring an ack of {} on link {}: {}", ChunkName(ack.write, ack.chunk),
                  ack.link, peer == peers_.end() ? "no such link" : "not the link's token");
    return;
  }
  if (run_writes_.count(ack.write) != 0) {
    HandleRunAck(ack, message);
    return;
  }
  // Whatever the write's state: the receiver no longer reads the slot.
  ReturnSlot(ack.link, ack.write, ack.chunk);
  // A duplicated ack holds no credit and counts for nothing.
  if (!peer->second.credits.Release(ack.write, ack.chunk)) return;
  // A write released before its acks came (Release gave up waiting), of either kind, kept its
  // credits until now: the receiver held its chunks or messages all along.
  auto w = writes_.find(ack.write);
  if (w == writes_.end() || w->second.link != ack.link) return;
  Write& write = w->second;
  if (ack.code == StatusCode::kOk) {
    ++write.acked;
    if (write.acked == write.plan.count() && write.status.code() == StatusCode::kInProgress) {
      write.status = OkStatus();
      if (on_write_done_) on_write_done_();
    }
    return;
  }
  FailWrite(ack.write, write,
            Status(ack.code, "the receiver failed " + ChunkName(ack.write, ack.chunk) + ": " +
                                 std::string(message)));
}

void StagedTransport::ReturnSlot(PeerId link, WriteId write, uint32_t chunk) {
  for (SendSlot& s : send_) {
    if (!s.lent || s.link != link || s.write != write || s.chunk != chunk) continue;
    s.lent = false;
    if (s.state == SendSlot::State::kLent) s.state = SendSlot::State::kFree;
    // kSending: freed when the notice's send completes.
  }
}

// ---- receiving ----------------------------------------------------------------------------------

void StagedTransport::DropSender(uint64_t instance, bool peer_dead) {
  if (instance == 0) return;
  if (dropped_.insert(instance).second) {
    // Bounded: a long-lived prefill side disconnects every decode peer it ever had.
    dropped_order_.push_back(instance);
    if (dropped_order_.size() > kMaxDropped) {
      dropped_.erase(dropped_order_.front());
      dropped_order_.pop_front();
    }
  }
  auto sender = senders_.find(instance);
  if (peer_dead && sender != senders_.end()) {
    // No ack goes back to a dead peer; close our endpoint to it without a flush.
    CloseEndpoint(sender->second.ep, /*force=*/true);
    senders_.erase(sender);
  }
  // Before the wait, which may let a new link of the sender in: its slots go now, or (retired)
  // once no chunk read from them is in flight, never a mapping made for the new link. Its run
  // messages still being received land nothing: its links stay open for a reconnect (AdmitSender),
  // which must not find the old session's bytes landing.
  if (peer_dead) UnmapSenderSlots(instance);
  CutLandings(instance, Aborted("the receiver disconnected this sender while the message was "
                                "received; nothing of it landed"));
  // Bytes being scattered cannot be stopped; wait for them so none lands after we return.
  // Queued and landing chunks are dropped as they come up (Landed sees the drop).
  WaitForLandings(instance, "a disconnected");
}

void StagedTransport::WaitForLandings(uint64_t instance, const char* which) {
  const bool settled = WaitUntil(
      [&] {
        for (const RecvSlot& r : recv_) {
          if (r.state == RecvSlot::State::kScattering && r.notice.sender == instance) return false;
        }
        return true;
      },
      kWaitBound);
  if (!settled) {
    KVT_LOG_ERROR("ucx", "bytes of {} sender were still landing in the pool after {} ms", which,
                  kWaitBound.count());
  }
}

void StagedTransport::FenceSender(uint64_t instance) {
  auto sender = senders_.find(instance);
  if (sender != senders_.end()) {
    // Its links close; a link is opened only by a hello, so nothing sent on these lands again.
    // The endpoint stays, so that what still arrives on them is refused with an ack: a sender
    // declared dead may be alive behind a partition, and must fail those writes at once.
    Sender& s = sender->second;
    s.fenced_links.insert(s.links.begin(), s.links.end());
    s.links.clear();
    if (s.fenced_links.empty()) {
      CloseEndpoint(s.ep, /*force=*/true);
      senders_.erase(sender);
    } else {
      // Fenced again (after a new link): it is the newest now.
      auto earlier = std::find(fenced_order_.begin(), fenced_order_.end(), instance);
      if (earlier != fenced_order_.end()) fenced_order_.erase(earlier);
      fenced_order_.push_back(instance);
      TrimFencedSenders();
    }
  }
  // Before the wait, which may let a new link of the sender in: its slots go now, or (retired)
  // once no chunk read from them is in flight, never a mapping made for the new link.
  UnmapSenderSlots(instance);
  WaitForLandings(instance, "a fenced");
}

void StagedTransport::TrimFencedSenders() {
  while (fenced_order_.size() > kMaxFencedSenders) {
    const uint64_t oldest = fenced_order_.front();
    fenced_order_.pop_front();
    auto it = senders_.find(oldest);
    // Gone already, or connected again (a new link is open): nothing to close.
    if (it == senders_.end() || !it->second.links.empty()) continue;
    KVT_LOG_DEBUG("ucx", "closing the endpoint to fenced sender {}: more than {} are kept",
                  Hex(oldest), kMaxFencedSenders);
    CloseEndpoint(it->second.ep, /*force=*/true);
    senders_.erase(it);
    UnmapSenderSlots(oldest);
  }
}

bool StagedTransport::LinkOpen(const ChunkNotice& notice) const {
  auto it = senders_.find(notice.sender);
  if (it == senders_.end()) return false;
  auto link = it->second.links.find(notice.link);
  return link != it->second.links.end() && link->second == notice.token;
}

Status StagedTransport::ClosedLink(const ChunkNotice& notice, Status otherwise) const {
  auto it = senders_.find(notice.sender);
  if (dropped_.count(notice.sender) != 0 || it == senders_.end()) return otherwise;
  const Sender& sender = it->second;
  const auto open = sender.links.find(notice.link);
  const auto fenced = sender.fenced_links.find(notice.link);
  if ((open != sender.links.end() && open->second != notice.token) ||
      (fenced != sender.fenced_links.end() && fenced->second != notice.token)) {
    return FailedPrecondition(
        "the message names link " + std::to_string(notice.link) + " of sender " +
        Hex(notice.sender) +
        " but not the token that link was opened with: it is not that sender's (a forged or "
        "misrouted message); dropped. A sender of ours that gets this reconnects (a new link)");
  }
  if (fenced == sender.fenced_links.end()) return otherwise;
  return Aborted("sender " + Hex(notice.sender) +
                 " was fenced here (the receiver's control plane lost it and declared it dead): "
                 "nothing it sent on link " +
                 std::to_string(notice.link) +
                 " lands any more; reconnect (a new session) to write again");
}

void StagedTransport::HandleHellos() {
  std::vector<PendingHello> hellos = std::move(hellos_);
  hellos_.clear();
  for (PendingHello& h : hellos) {
    auto it = senders_.find(h.hello.sender);
    if (it == senders_.end()) {
      // The address came in the hello's payload: UCX's parser trusts every length in it.
      Status valid = ucx_check::CheckWorkerAddress(
          {reinterpret_cast<const uint8_t*>(h.address.data()), h.address.size()});
      if (!valid.ok()) {
        WarnLimited(hello_warnings_, "ucx", "cannot answer a staging hello: {}", valid.ToString());
        continue;
      }
      ucp_ep_params_t ep = {};
      ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.address = reinterpret_cast<const ucp_address_t*>(h.address.data());
      // As for our own peers: peer failure is the control plane's to detect (see ucx_backend).
      ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
      ep.err_handler.cb = &OnReverseEndpointError;
      ep.err_handler.arg = nullptr;
      ucp_ep_h handle = nullptr;
      Status created = UcsStatus(ucp_ep_create(worker_, &ep, &handle), "ucp_ep_create");
      if (!created.ok()) {
        WarnLimited(hello_warnings_, "ucx", "cannot answer a staging hello: {}",
                    created.ToString());
        continue;
      }
      it = senders_.emplace(h.hello.sender, Sender{handle, {}, {}, h.address}).first;
    } else if (it->second.address != h.address) {
      // A backend's staging worker keeps its address for its lifetime: a hello naming this
      // sender from another worker is not that sender's, and must not open a link on its
      // endpoint (whose acks would carry the new link's token to it).
      WarnLimited(hello_warnings_, "ucx",
                  "ignoring a staging hello for link {} of sender {} from another worker address "
                  "than the sender's",
                  h.hello.link, Hex(h.hello.sender));
      continue;
    }
    if (it->second.links.count(h.hello.link) != 0 ||
        it->second.fenced_links.count(h.hello.link) != 0) {
      // A sender opens each link once (its links are numbered afresh by each connect): a second
      // hello for it is not that sender's, and must not replace the link's token.
      WarnLimited(hello_warnings_, "ucx",
                  "ignoring a staging hello for link {} of sender {}, which is open or fenced "
                  "here already",
                  h.hello.link, Hex(h.hello.sender));
      continue;
    }
    HelloAck ack;
    ack.receiver = instance_;
    ack.link = h.hello.link;
    ack.token = h.hello.token;
    std::string message;
    if (dropped_.count(h.hello.sender) != 0) {
      ack.code = StatusCode::kFailedPrecondition;
      message = "the receiver disconnected this sender; reconnect from both sides";
    } else if (h.hello.mode == LinkMode::kRuns) {
      if (!runs_attached()) {
        ack.code = StatusCode::kFailedPrecondition;
        message =
            "the receiving ucx backend takes no copy runs as active messages (it registered a "
            "staged or CUDA pool, nothing, or its host_path is 'put')";
      } else {
        ack.slots = run_options_.window;
        it->second.links.emplace(h.hello.link, h.hello.token);
      }
    } else if (!attached()) {
      ack.code = StatusCode::kFailedPrecondition;
      message =
          "the receiving ucx backend has no staged pool (it registered host memory, CUDA memory "
          "UCX writes directly, or nothing)";
    } else {
      ack.slots = slots();
      ack.slot_bytes = slot_bytes_;
      it->second.links.emplace(h.hello.link, h.hello.token);
      if (in_place_ && h.hello.slots != 0) {
        Status mapped = MapSenderSlots(it->second.ep, h.hello, h.key);
        ack.in_place = mapped.ok();
        if (!mapped.ok()) {
          KVT_LOG_DEBUG("ucx", "staged chunks of sender {:x} arrive as payloads: {}",
                        h.hello.sender, mapped.ToString());
        }
      }
    }
    Status sent = SendControl(it->second.ep, kAmHelloAck, Encode(ack), message);
    if (!sent.ok()) {
      WarnLimited(delivery_warnings_, "ucx", "staging hello ack not sent: {}", sent.ToString());
    }
  }
}

void StagedTransport::HandleByes() {
  std::vector<Bye> byes = std::move(byes_);
  byes_.clear();
  for (const Bye& bye : byes) {
    auto it = senders_.find(bye.sender);
    if (it == senders_.end()) continue;
    // Only the link's own sender knows its token; a bye without it closes nothing.
    auto open = it->second.links.find(bye.link);
    auto fenced = it->second.fenced_links.find(bye.link);
    if (open != it->second.links.end() && open->second == bye.token) {
      it->second.links.erase(open);
    } else if (fenced != it->second.fenced_links.end() && fenced->second == bye.token) {
      it->second.fenced_links.erase(fenced);
    } else {
      WarnLimited(hello_warnings_, "ucx",
                  "ignoring a staging bye for link {} of sender {}: no such link here, or not "
                  "its token",
                  bye.link, Hex(bye.sender));
      continue;
    }
    if (!it->second.links.empty()) continue;
    if (!it->second.fenced_links.empty()) {
      // Only fenced links left (their byes may never come: the sender dropped them as dead):
      // the slots mapped for the session that just ended go, and the endpoint, kept to refuse
      // what still arrives on the fenced links, counts against the cap again.
      UnmapSenderSlots(bye.sender);
      if (std::find(fenced_order_.begin(), fenced_order_.end(), bye.sender) ==
          fenced_order_.end()) {
        fenced_order_.push_back(bye.sender);
        TrimFencedSenders();
      }
      continue;
    }
    // Acks of its chunks went out before its bye (it waited for them); close gracefully.
    CloseEndpoint(it->second.ep, /*force=*/false);
    senders_.erase(it);
    UnmapSenderSlots(bye.sender);
  }
}

void StagedTransport::PumpRecvSlots() {
  for (uint32_t i = 0; i < recv_.size(); ++i) {
    RecvSlot& r = recv_[i];
    if (r.state == RecvSlot::State::kLanding) {
      const ucs_status_t st = ucp_request_check_status(r.request);
      if (st == UCS_INPROGRESS) continue;
      ucp_request_free(r.request);
      r.request = nullptr;
      if (st != UCS_OK) {
        FinishReceive(i, UcsStatus(st, "receiving the chunk payload"));
      } else {
        Landed(i);
      }
    } else if (r.state == RecvSlot::State::kScattering) {
      StatusOr<bool> done = copier_->ScatterDone(i);
      if (!done.ok()) {
        FinishReceive(i, done.status());
      } else if (*done) {
        FinishReceive(i, OkStatus());
      }
    }
  }
  for (uint32_t i = 0; i < recv_.size() && !arrivals_.empty(); ++i) {
    if (recv_[i].state != RecvSlot::State::kFree) continue;
    if (!Due(arrivals_.front().due)) break;  // RunOptions::receive_delay
    Arrival arrival = std::move(arrivals_.front());
    arrivals_.pop_front();
    Land(i, std::move(arrival));
  }
  if (retired_slots_) UnmapRetiredSlots();
}

void StagedTransport::Land(uint32_t i, Arrival a) {
  RecvSlot& r = recv_[i];
  r.notice = a.notice;
  r.length = a.length;
  r.request = nullptr;
  r.source = nullptr;
  r.prefix = 0;
  if (a.in_place) {
    if (!LinkOpen(a.notice)) {  // closed (a fence) while it was queued
      FinishReceive(i,
                    ClosedLink(a.notice, Aborted("the receiver disconnected or fenced this sender; "
                                                 "chunk dropped")));
      return;
    }
    auto m = sender_slots_.find(a.notice.sender);
    if (m == sender_slots_.end() || m->second.retired || !m->second.pinned) {
      FinishReceive(
          i, Aborted("this receiver no longer maps the slots of sender " + Hex(a.notice.sender) +
                     " (it registered again, or fenced the sender); reconnect"));
      return;
    }
    if (a.slot >= m->second.count || a.length > m->second.slot_bytes) {
      FinishReceive(
          i, OutOfRange("slot " + std::to_string(a.slot) + " and " + std::to_string(a.length) +
                        " bytes do not fit the " + std::to_string(m->second.count) + " slots of " +
                        std::to_string(m->second.slot_bytes) + " bytes of sender " +
                        Hex(a.notice.sender) + " mapped here"));
      return;
    }
    // The prefix came with the notice and is checked and used from our copy; only the data is
    // read from the sender's slot, by the device's copy engine (the sender could rewrite it at
    // any time: that can only hurt its own request).
    std::memcpy(RecvPayload(i), a.copy.data(), a.copy.size());
    r.source = m->second.local + size_t{a.slot} * m->second.slot_bytes;
    r.prefix = a.copy.size();
    Landed(i);
    return;
  }
  if (a.rndv) {
    ucp_request_param_t param = {};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    param.memory_type = UCS_MEMORY_TYPE_HOST;
    ucs_status_ptr_t req = ucp_am_recv_data_nbx(worker_, a.data, RecvPayload(i), a.length, &param);
    if (UCS_PTR_IS_ERR(req)) {
      FinishReceive(i, UcsStatus(UCS_PTR_STATUS(req), "ucp_am_recv_data_nbx"));
      return;
    }
    if (req != nullptr) {
      r.request = req;
      r.state = RecvSlot::State::kLanding;
      return;
    }
  } else if (a.data != nullptr) {
    std::memcpy(RecvPayload(i), a.data, a.length);
    ucp_am_data_release(worker_, a.data);
  } else {
    std::memcpy(RecvPayload(i), a.copy.data(), a.length);
  }
  Landed(i);
}

void StagedTransport::Landed(uint32_t i) {
  RecvSlot& r = recv_[i];
  if (dropped_.count(r.notice.sender) != 0 || !LinkOpen(r.notice)) {
    FinishReceive(
        i, ClosedLink(r.notice, Aborted("the receiver disconnected or fenced this sender; chunk "
                                        "dropped")));
    return;
  }
  StatusOr<DecodedChunk> decoded =
      r.source != nullptr ? DecodeChunkPrefix(Bytes(RecvPayload(i), r.prefix), r.length, limits_)
                          : DecodeChunk(Bytes(RecvPayload(i), r.length), limits_);
  if (!decoded.ok()) {
    FinishReceive(i, decoded.status().WithContext("refusing a malformed chunk"));
    return;
  }
  const ChunkHeader& h = decoded->header;
  if (h.sender != r.notice.sender || h.link != r.notice.link || h.write != r.notice.write ||
      h.chunk != r.notice.chunk) {
    FinishReceive(i, DataLoss("chunk payload names " + ChunkName(h.write, h.chunk) +
                              " but arrived as " + ChunkName(r.notice.write, r.notice.chunk)));
    return;
  }
  r.chunk = std::move(decoded).value();
  CopierChunk cc;
  cc.layer_begin = r.chunk.header.layer_begin;
  cc.layer_end = r.chunk.header.layer_end;
  cc.pages = r.chunk.dst_pages;
  cc.units = r.chunk.layout.units;
  cc.pages_offset = r.chunk.pages_offset;
  cc.payload_bytes = r.chunk.header.payload_bytes;
  cc.data_source = r.source;
  cc.data_offset = r.chunk.layout.data_offset;
  Status started = copier_->StartScatter(i, cc);
  if (!started.ok()) {
    FinishReceive(i, started.WithContext("scattering the chunk into the pool"));
    return;
  }
  r.state = RecvSlot::State::kScattering;
}

void StagedTransport::FinishReceive(uint32_t i, const Status& status) {
  RecvSlot& r = recv_[i];
  r.state = RecvSlot::State::kFree;
  r.source = nullptr;
  if (!status.ok()) {
    KVT_LOG_DEBUG("ucx", "receiving {}: {}", ChunkName(r.notice.write, r.notice.chunk),
                  status.ToString());
  }
  Status reported = status;
  if (status.ok() && dropped_.count(r.notice.sender) != 0) {
    reported = Aborted("the receiver disconnected this sender while the chunk was scattered");
  }
  SendAck(r.notice, reported);
}

void StagedTransport::SendAck(const ChunkNotice& notice, const Status& status) {
  if (run_options_.ack_delay.count() > 0) {
    delayed_acks_.push_back(DelayedAck{Clock::now() + run_options_.ack_delay, notice, status});
    return;
  }
  SendAckNow(notice, status);
}

void StagedTransport::SendDelayedAcks() {
  const auto now = Clock::now();
  while (!delayed_acks_.empty() && delayed_acks_.front().due <= now) {
    SendAckNow(delayed_acks_.front().notice, delayed_acks_.front().status);
    delayed_acks_.pop_front();
  }
}

void StagedTransport::SendAckNow(const ChunkNotice& notice, const Status& status) {
  auto it = senders_.find(notice.sender);
  if (it == senders_.end()) return;  // a dead or unknown sender: nobody to tell
  ChunkAck ack{notice.link, notice.write, notice.chunk, status.code(), notice.token};
  std::string message = status.message().substr(0, kMaxAckMessage);
  Status sent = SendControl(it->second.ep, kAmChunkAck, Encode(ack), std::move(message));
  if (!sent.ok()) WarnLimited(delivery_warnings_, "ucx", "chunk ack not sent: {}", sent.ToString());
}

Status StagedTransport::ArrivalRoom(const ChunkNotice& notice) const {
  const auto queued = std::count_if(arrivals_.begin(), arrivals_.end(), [&](const Arrival& a) {
    return a.notice.sender == notice.sender && a.notice.link == notice.link;
  });
  if (static_cast<uint64_t>(queued) < slots()) return OkStatus();
  return ResourceExhausted("link " + std::to_string(notice.link) + " of sender " +
                           Hex(notice.sender) + " has " + std::to_string(queued) +
                           " chunks queued here, the " + std::to_string(slots()) +
                           " credits its hello ack granted; a sender sends no more chunks than "
                           "its credits");
}

// ---- callbacks (inside ucp_worker_progress, mutex held) -----------------------------------------

ucs_status_t StagedTransport::OnChunk(void* arg, const void* header, size_t header_length,
                                      void* data, size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<StagedTransport*>(arg);
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  const bool persistent = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA) != 0;
  StatusOr<ChunkNotice> notice = DecodeChunkNotice(Bytes(header, header_length));
  // A sender we have an endpoint to is told why with an ack (sent from Pump), which fails its
  // write naming the reason; a rendezvous chunk then completes as taken (UCS_OK), so that the
  // ack's reason is the one the sender reports. To any other sender refusing a rendezvous chunk
  // fails its send with `why`; an eager one can only be dropped.
  auto refuse = [&](ucs_status_t why, const Status& status) {
    WarnLimited(self->refusal_warnings_, "ucx", "refusing a staged chunk: {}", status.ToString());
    if (notice.ok() && self->senders_.count(notice->sender) != 0) {
      self->pending_acks_.emplace_back(*notice, status);
      return UCS_OK;
    }
    return rndv ? why : UCS_OK;
  };
  if (!notice.ok()) return refuse(UCS_ERR_INVALID_PARAM, notice.status());
  if (!self->attached()) {
    return refuse(UCS_ERR_UNSUPPORTED, FailedPrecondition("no staged pool registered here"));
  }
  if (self->dropped_.count(notice->sender) != 0) {
    return refuse(UCS_ERR_REJECTED, Aborted("its sender was disconnected here"));
  }
  if (!self->LinkOpen(*notice)) {
    return refuse(
        UCS_ERR_REJECTED,
        self->ClosedLink(*notice, Aborted("its link " + std::to_string(notice->link) +
                                          " is not open here (closed, fenced, or no hello)")));
  }
  if (length > self->slot_bytes_) {
    return refuse(UCS_ERR_MESSAGE_TRUNCATED,
                  OutOfRange("payload of " + std::to_string(length) +
                             " bytes exceeds the slots of " + std::to_string(self->slot_bytes_)));
  }
  if (Status room = self->ArrivalRoom(*notice); !room.ok()) {
    return refuse(UCS_ERR_NO_RESOURCE, room);
  }
  Arrival arrival;
  arrival.notice = *notice;
  arrival.length = length;
  arrival.rndv = rndv;
  if (rndv || persistent) {
    arrival.data = data;
  } else {
    const auto* bytes = static_cast<const uint8_t*>(data);
    arrival.copy.assign(bytes, bytes + length);
  }
  arrival.due = self->ReceiveDue();
  self->arrivals_.push_back(std::move(arrival));
  return (rndv || persistent) ? UCS_INPROGRESS : UCS_OK;
}

ucs_status_t StagedTransport::OnSlotChunk(void* arg, const void* header, size_t header_length,
                                          void* data, size_t length,
                                          const ucp_am_recv_param_t* param) {
  auto* self = static_cast<StagedTransport*>(arg);
  StatusOr<SlotNotice> notice = DecodeSlotNotice(Bytes(header, header_length));
  if (!notice.ok()) {
    WarnLimited(self->refusal_warnings_, "ucx", "ignoring a malformed slot notice: {}",
                notice.status().ToString());
    return UCS_OK;
  }
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    // Its sender waits for the data to be taken: refusing it fails the send.
    WarnLimited(self->refusal_warnings_, "ucx",
                "refusing a slot notice sent by rendezvous ({} bytes of prefix)", length);
    return UCS_ERR_INVALID_PARAM;
  }
  // Refused with an ack (sent from Pump): the sender's slot and credit come back at once.
  auto refuse = [&](const Status& why) {
    WarnLimited(self->refusal_warnings_, "ucx", "refusing a staged chunk read in place: {}",
                why.ToString());
    self->pending_acks_.emplace_back(notice->notice, why);
    return UCS_OK;
  };
  const uint64_t sender = notice->notice.sender;
  if (!self->attached()) return refuse(FailedPrecondition("no staged pool registered here"));
  if (self->dropped_.count(sender) != 0) {
    return refuse(Aborted("its sender was disconnected here"));
  }
  if (!self->LinkOpen(notice->notice)) {
    return refuse(self->ClosedLink(notice->notice,
                                   Aborted("its link " + std::to_string(notice->notice.link) +
                                           " is not open here (closed, fenced, or no hello)")));
  }
  auto m = self->sender_slots_.find(sender);
  if (m == self->sender_slots_.end() || m->second.retired) {
    return refuse(FailedPrecondition(
        "the chunk names slot " + std::to_string(notice->slot) +
        " but this receiver reads no slots of sender " + Hex(sender) +
        " in place (its hello ack said not to, or it registered again since: reconnect)"));
  }
  if (notice->slot >= m->second.count) {
    return refuse(OutOfRange("the chunk names slot " + std::to_string(notice->slot) + " of the " +
                             std::to_string(m->second.count) + " its sender offered"));
  }
  const uint64_t limit = std::min(m->second.slot_bytes, self->slot_bytes_);
  if (notice->payload_bytes < kChunkHeaderBytes || notice->payload_bytes > limit) {
    return refuse(OutOfRange("the chunk's payload_bytes is " +
                             std::to_string(notice->payload_bytes) + "; expected " +
                             std::to_string(kChunkHeaderBytes) + ".." + std::to_string(limit) +
                             " (the slots of both sides)"));
  }
  if (length < kChunkHeaderBytes || length > notice->payload_bytes) {
    return refuse(DataLoss("the slot notice carries a prefix of " + std::to_string(length) +
                           " bytes; expected " + std::to_string(kChunkHeaderBytes) + ".." +
                           std::to_string(notice->payload_bytes) +
                           " (the chunk's header, page ids and units)"));
  }
  if (Status room = self->ArrivalRoom(notice->notice); !room.ok()) return refuse(room);
  Arrival arrival;
  arrival.notice = notice->notice;
  arrival.length = notice->payload_bytes;
  arrival.in_place = true;
  arrival.slot = notice->slot;
  const auto* prefix = static_cast<const uint8_t*>(data);
  arrival.copy.assign(prefix, prefix + length);
  arrival.due = self->ReceiveDue();
  self->arrivals_.push_back(std::move(arrival));
  return UCS_OK;
}

Status StagedTransport::MapSenderSlots(ucp_ep_h ep, const Hello& hello, std::string_view key) {
  const uint64_t bytes = hello.slot_bytes * hello.slots;  // DecodeHello bounded it
  if (auto it = sender_slots_.find(hello.sender); it != sender_slots_.end()) {
    const SenderSlots& m = it->second;
    if (!m.retired && m.remote_base == hello.slots_base && m.slot_bytes == hello.slot_bytes &&
        m.count == hello.slots && m.key == key) {
      return m.pinned ? OkStatus() : FailedPrecondition("its slots are mapped but not pinned");
    }
    if (SenderSlotsBusy(hello.sender)) {
      return FailedPrecondition("its earlier slots are still being read (it registered again)");
    }
    UnmapSenderSlots(hello.sender, /*force=*/true);
  }
  KVT_RETURN_IF_ERROR(ucx_check::CheckPackedRkey(Bytes(key.data(), key.size())));
  // What is mapped before the key is unpacked: the shared memory it attaches is what is new
  // afterwards, and the only memory the offered slots may lie in.
  KVT_ASSIGN_OR_RETURN(const std::vector<ucx_check::Mapping> before, ucx_check::ReadSelfMaps());
  std::string padded(key);
  padded.append(ucx_check::kRkeyUnpackPadding, '\0');
  ucp_rkey_h rkey = nullptr;
  KVT_RETURN_IF_ERROR(
      UcsStatus(ucp_ep_rkey_unpack(ep, padded.data(), &rkey), "ucp_ep_rkey_unpack of its slots"));
  uint8_t* first = nullptr;
  const ucs_status_t st = RkeyPtrRange(rkey, hello.slots_base, bytes, &first);
  Status usable = OkStatus();
  if (st == UCS_ERR_OUT_OF_RANGE) {
    usable = InvalidArgument("its " + std::to_string(bytes) + " bytes of slots at " +
                             Hex(hello.slots_base) + " do not map to one range here");
  } else if (st != UCS_OK) {
    usable = UcsStatus(
        st, "ucp_rkey_ptr of its slots at " + Hex(hello.slots_base) + " (not mapped on this host)");
  }
  if (usable.ok()) {
    StatusOr<std::vector<ucx_check::Mapping>> after = ucx_check::ReadSelfMaps();
    usable = after.status();
    if (usable.ok()) {
      usable = ucx_check::CheckMappedForWrite(0, hello.slots_base, bytes,
                                              reinterpret_cast<uint64_t>(first),
                                              ucx_check::NewMappings(before, *after), {})
                   .WithContext("its offered send slots (buffer 0 below)");
    }
  }
  if (usable.ok()) {
    usable = copier_->PinPeerSlots(first, bytes).WithContext("page-locking its slots");
  }
  if (!usable.ok()) {
    ucp_rkey_destroy(rkey);
    return usable;
  }
  SenderSlots m;
  m.rkey = rkey;
  m.local = first;
  m.remote_base = hello.slots_base;
  m.slot_bytes = hello.slot_bytes;
  m.count = hello.slots;
  m.key.assign(key);
  m.pinned = true;
  sender_slots_[hello.sender] = m;
  KVT_LOG_DEBUG("ucx", "reading the {} slots of sender {:x} in place", hello.slots, hello.sender);
  return OkStatus();
}

bool StagedTransport::SenderSlotsBusy(uint64_t instance) const {
  for (const RecvSlot& r : recv_) {
    if (r.state != RecvSlot::State::kFree && r.source != nullptr && r.notice.sender == instance) {
      return true;
    }
  }
  // Queued notices were checked against the current mapping.
  for (const Arrival& a : arrivals_) {
    if (a.in_place && a.notice.sender == instance) return true;
  }
  return false;
}

void StagedTransport::UnmapSenderSlots(uint64_t instance, bool force) {
  auto it = sender_slots_.find(instance);
  if (it == sender_slots_.end()) return;
  if (SenderSlotsBusy(instance)) {
    if (!force) {
      it->second.retired = true;
      retired_slots_ = true;
      return;
    }
    KVT_LOG_ERROR("ucx",
                  "leaving the slots of sender {:x} mapped: a chunk read from them did not "
                  "finish",
                  instance);
    sender_slots_.erase(it);
    return;
  }
  if (it->second.pinned && copier_ != nullptr) copier_->UnpinPeerSlots(it->second.local);
  ucp_rkey_destroy(it->second.rkey);
  sender_slots_.erase(it);
}

void StagedTransport::UnmapRetiredSlots() {
  retired_slots_ = false;
  std::vector<uint64_t> retired;
  for (const auto& [instance, m] : sender_slots_) {
    if (m.retired) retired.push_back(instance);
  }
  for (uint64_t instance : retired) UnmapSenderSlots(instance);
}

ucs_status_t StagedTransport::OnHello(void* arg, const void* header, size_t header_length,
                                      void* data, size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<StagedTransport*>(arg);
  StatusOr<Hello> hello = DecodeHello(Bytes(header, header_length));
  if (!hello.ok() || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 || length == 0) {
    WarnLimited(self->hello_warnings_, "ucx", "ignoring a malformed staging hello");
    return UCS_OK;
  }
  if (hello->key_bytes >= length) {
    WarnLimited(self->hello_warnings_, "ucx",
                "ignoring a staging hello whose key of {} bytes leaves no address in its {} bytes",
                hello->key_bytes, length);
    return UCS_OK;
  }
  // Endpoints cannot be created inside a callback; Pump answers it.
  const auto* bytes = static_cast<const char*>(data);
  const size_t address = length - hello->key_bytes;
  self->hellos_.push_back(PendingHello{*hello, std::string(bytes, address),
                                       std::string(bytes + address, hello->key_bytes)});
  return UCS_OK;
}

ucs_status_t StagedTransport::OnHelloAck(void* arg, const void* header, size_t header_length,
                                         void* data, size_t length,
                                         const ucp_am_recv_param_t* param) {
  auto* self = static_cast<StagedTransport*>(arg);
  StatusOr<HelloAck> ack = DecodeHelloAck(Bytes(header, header_length));
  if (!ack.ok() || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) return UCS_OK;
  auto it = self->peers_.find(ack->link);
  if (it == self->peers_.end() || it->second.remote.instance != ack->receiver ||
      it->second.token != ack->token) {
    return UCS_OK;
  }
  Peer& peer = it->second;
  if (ack->code != StatusCode::kOk) {
    peer.error = Status(ack->code, "the peer refused staged writes: " +
                                       std::string(static_cast<const char*>(data), length));
    return UCS_OK;
  }
  peer.ready = true;
  peer.in_place = ack->in_place;
  peer.credits.SetLimit(peer.mode == LinkMode::kRuns
                            ? std::min(self->run_options_.window, ack->slots)
                            : std::min(peer.remote.slots, ack->slots));
  peer.remote.slot_bytes = std::min(peer.remote.slot_bytes, ack->slot_bytes);
  return UCS_OK;
}

ucs_status_t StagedTransport::OnChunkAck(void* arg, const void* header, size_t header_length,
                                         void* data, size_t length,
                                         const ucp_am_recv_param_t* param) {
  auto* self = static_cast<StagedTransport*>(arg);
  StatusOr<ChunkAck> ack = DecodeChunkAck(Bytes(header, header_length));
  if (!ack.ok() || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) return UCS_OK;
  self->HandleAck(*ack, std::string_view(static_cast<const char*>(data), length));
  return UCS_OK;
}

ucs_status_t StagedTransport::OnBye(void* arg, const void* header, size_t header_length, void*,
                                    size_t, const ucp_am_recv_param_t*) {
  auto* self = static_cast<StagedTransport*>(arg);
  StatusOr<Bye> bye = DecodeBye(Bytes(header, header_length));
  if (bye.ok()) self->byes_.push_back(*bye);
  return UCS_OK;
}

// ---- control messages and progress --------------------------------------------------------------

Status StagedTransport::SendControl(ucp_ep_h ep, unsigned am_id, std::vector<uint8_t> header,
                                    std::string data) {
  if (ep == nullptr) return FailedPrecondition("no endpoint for a staging control message");
  // UCX 1.13 reads the header and data until the send completes; keep them until then.
  control_.push_back(
      ControlSend{std::move(header), std::move(data), nullptr, Clock::now() + kControlBound});
  ControlSend& c = control_.back();
  ucp_request_param_t param = {};
  ucs_status_ptr_t req =
      ucp_am_send_nbx(ep, am_id, c.header.data(), c.header.size(),
                      c.data.empty() ? nullptr : c.data.data(), c.data.size(), &param);
  if (UCS_PTR_IS_ERR(req)) {
    control_.pop_back();
    return UcsStatus(UCS_PTR_STATUS(req), "ucp_am_send_nbx");
  }
  if (req == nullptr) {
    control_.pop_back();
    return OkStatus();
  }
  c.request = req;
  return OkStatus();
}

void StagedTransport::PumpControl() {
  const auto now = Clock::now();
  for (auto it = control_.begin(); it != control_.end();) {
    const ucs_status_t st = ucp_request_check_status(it->request);
    if (st == UCS_INPROGRESS && now < it->deadline) {
      ++it;
      continue;
    }
    if (st == UCS_INPROGRESS) {
      WarnLimited(delivery_warnings_, "ucx",
                  "a staging control message was not delivered in {} ms; cancelling it",
                  kControlBound.count());
      ucp_request_cancel(worker_, it->request);
      if (ucp_request_check_status(it->request) == UCS_INPROGRESS) {
        // UCX still owns the buffers; keep them (this transport outlives the worker).
        it->deadline = Clock::time_point::max();
        ++it;
        continue;
      }
    } else if (st != UCS_OK) {
      KVT_LOG_DEBUG("ucx", "a staging control message failed: {}", ucs_status_string(st));
    }
    ucp_request_free(it->request);
    it = control_.erase(it);
  }
  for (auto it = closing_.begin(); it != closing_.end();) {
    if (ucp_request_check_status(it->request) == UCS_INPROGRESS && now < it->deadline) {
      ++it;
      continue;
    }
    ucp_request_free(it->request);
    it = closing_.erase(it);
  }
}

void StagedTransport::CloseEndpoint(ucp_ep_h ep, bool force) {
  if (ep == nullptr) return;
  ucp_request_param_t param = {};
  if (force) {
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  }
  ucs_status_ptr_t req = ucp_ep_close_nbx(ep, &param);
  if (req == nullptr || UCS_PTR_IS_ERR(req)) return;
  closing_.push_back(Closing{req, Clock::now() + kCloseBound});
}

void StagedTransport::CloseEndpointNow(ucp_ep_h ep, bool force) {
  if (ep == nullptr) return;
  ucp_request_param_t param = {};
  if (force) {
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  }
  ucs_status_ptr_t req = ucp_ep_close_nbx(ep, &param);
  if (req == nullptr || UCS_PTR_IS_ERR(req)) return;
  const auto give_up = Clock::now() + kCloseBound;
  while (ucp_request_check_status(req) == UCS_INPROGRESS && Clock::now() < give_up) {
    ucp_worker_progress(worker_);
    if (yield_) yield_();
  }
  if (ucp_request_check_status(req) == UCS_INPROGRESS) {
    KVT_LOG_WARN("ucx", "staging endpoint close did not finish in {} ms (peer gone?)",
                 kCloseBound.count());
  }
  ucp_request_free(req);
}

void StagedTransport::Pump() {
  // Byes first: a sender that re-registered and reconnected in one go has its old slots
  // unmapped before its new offer is looked at.
  if (!byes_.empty()) HandleByes();
  if (!hellos_.empty()) HandleHellos();
  if (copier_ != nullptr) {
    PumpSendSlots();
    ScheduleChunks();
    PumpRecvSlots();
  }
  if (!run_sends_.empty()) PumpRunSends();
  if (!run_pending_.empty()) ScheduleRuns(run_options_.pump_bytes);
  if (!run_landings_.empty()) PumpRunLandings();
  if (!pending_acks_.empty()) {
    std::vector<std::pair<ChunkNotice, Status>> acks = std::move(pending_acks_);
    pending_acks_.clear();
    for (const auto& [notice, status] : acks) SendAck(notice, status);
  }
  if (!delayed_acks_.empty()) SendDelayedAcks();
  if (!control_.empty() || !closing_.empty()) PumpControl();
}

void StagedTransport::OnCopierDone(void* self) {
  const uint64_t one = 1;
  // Cannot fail short of a closed fd; an overflowing counter (never) would still be readable.
  [[maybe_unused]] ssize_t n =
      write(static_cast<StagedTransport*>(self)->completion_fd_, &one, sizeof(one));
}

void StagedTransport::DrainCompletions() {
  if (completion_fd_ < 0) return;
  uint64_t count = 0;
  [[maybe_unused]] ssize_t n = read(completion_fd_, &count, sizeof(count));  // EAGAIN: none
}

bool StagedTransport::NeedsPolling() const {
  // Copier completions wake no UCX event fd: the CUDA copier's announce themselves on
  // completion_fd; the host copier's are seen by the next Pump.
  if (!hellos_.empty() || !byes_.empty() || !pending_acks_.empty() || !delayed_acks_.empty()) {
    return true;
  }
  if (!run_pending_.empty() && RunsSendable()) return true;  // sent a budget per Pump
  for (const RunLanding& l : run_landings_) {
    if (l.request == nullptr) return true;  // waiting to be received
  }
  // Chunks held back (RunOptions::receive_delay) until they are due.
  if (run_options_.receive_delay.count() > 0 && !arrivals_.empty()) return true;
  if (notified_) return false;
  for (const SendSlot& s : send_) {
    if (s.state == SendSlot::State::kGathering) return true;
  }
  for (const RecvSlot& r : recv_) {
    if (r.state == RecvSlot::State::kScattering) return true;
  }
  return false;
}

void StagedTransport::Quiesce() {
  const bool idle = WaitUntil(
      [&] {
        for (const SendSlot& s : send_) {
          if (s.state != SendSlot::State::kFree) return false;
        }
        for (const RecvSlot& r : recv_) {
          if (r.state != RecvSlot::State::kFree) return false;
        }
        return run_sends_.empty() && run_landings_.empty();
      },
      kWaitBound);
  if (!idle) {
    KVT_LOG_ERROR("ucx", "staging slots still busy after {} ms at shutdown", kWaitBound.count());
    for (const SendSlot& s : send_) {
      // kLent: a receiver reads it in place; some mappings (xpmem) do not outlive ours.
      if (s.state == SendSlot::State::kSending || s.state == SendSlot::State::kLent) {
        leak_slot_memory_ = true;
      }
    }
    for (const RecvSlot& r : recv_) {
      if (r.state == RecvSlot::State::kLanding) leak_slot_memory_ = true;
    }
  }
}

void StagedTransport::Shutdown() {
  for (auto& [link, peer] : peers_) CloseEndpointNow(peer.ep, /*force=*/false);
  peers_.clear();
  std::vector<uint64_t> mapped;
  for (const auto& [instance, m] : sender_slots_) mapped.push_back(instance);
  for (uint64_t instance : mapped) UnmapSenderSlots(instance, /*force=*/true);
  for (auto& [instance, sender] : senders_) {
    // One kept for fenced links alone was declared dead: no flush toward it.
    CloseEndpoint(sender.ep, /*force=*/sender.links.empty() && !sender.fenced_links.empty());
  }
  senders_.clear();
  fenced_order_.clear();
  const auto give_up = Clock::now() + kCloseBound;
  while ((!closing_.empty() || !control_.empty()) && Clock::now() < give_up) {
    ucp_worker_progress(worker_);
    PumpControl();
  }
  for (Closing& c : closing_) ucp_request_free(c.request);
  closing_.clear();
  for (ControlSend& c : control_) {
    if (c.request != nullptr) ucp_request_cancel(worker_, c.request);
  }
  // Control requests still held are freed with the worker; their buffers live in control_ until
  // this object goes (after the worker).
  for (auto it = control_.begin(); it != control_.end();) {
    if (ucp_request_check_status(it->request) != UCS_INPROGRESS) {
      ucp_request_free(it->request);
      it = control_.erase(it);
    } else {
      ++it;
    }
  }
  copier_.reset();
  notified_ = false;
  FreeSlotMemory();
  send_.clear();
  recv_.clear();
  // Arrivals still queued hold UCX descriptors; the worker frees them when it is destroyed.
  arrivals_.clear();
  // Run sends and landings UCX still reads or writes keep their buffers until this object goes
  // (after the worker); finished ones are freed now.
  for (auto it = run_sends_.begin(); it != run_sends_.end();) {
    if (ucp_request_check_status(it->request) != UCS_INPROGRESS) {
      ucp_request_free(it->request);
      it = run_sends_.erase(it);
    } else {
      ucp_request_cancel(worker_, it->request);
      ++it;
    }
  }
  for (auto it = run_landings_.begin(); it != run_landings_.end();) {
    if (it->request != nullptr && ucp_request_check_status(it->request) != UCS_INPROGRESS) {
      ucp_request_free(it->request);
      it = run_landings_.erase(it);
    } else {
      ++it;
    }
  }
  run_writes_.clear();
  run_pending_.clear();
  pending_acks_.clear();
  delayed_acks_.clear();
  writes_.clear();
  pending_.clear();
  peers_.clear();
}

}  // namespace ucx_staging
}  // namespace kvt::transfer

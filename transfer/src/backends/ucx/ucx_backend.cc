#include "backends/ucx/ucx_backend.h"

#include <poll.h>
#include <sys/mman.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "backends/common/host_memory.h"
#include "backends/common/run_check.h"
#include "backends/common/stream_copy.h"
#include "backends/ucx/ucx_peer_check.h"
#include "backends/ucx/ucx_staged_protocol.h"
#include "backends/ucx/ucx_staged_transport.h"
#include "backends/ucx/ucx_util.h"
#include "control/spin.h"
#include "kvt/common/log.h"
#include "kvt/common/random.h"
#include "kvt/kernels/cuda_util.h"

namespace kvt::transfer {
namespace {

using Clock = std::chrono::steady_clock;

// Direct copies: at most this many copy threads, and no thread gets a slice of a write smaller
// than kMinCopySliceBytes (below that one thread copies faster than two start).
constexpr int kMaxCopyThreads = 64;
constexpr uint64_t kMinCopySliceBytes = uint64_t{1} << 20;
// Network writes posted by the poster thread: bytes of puts posted per hold of the backend's
// mutex (over tcp, posting a put sends it, so a bound keeps a cancel or another post from
// waiting for a whole long write).
constexpr uint64_t kPostBatchBytes = uint64_t{1} << 20;

// "host, cuda" for a ucp_context_query memory-type mask.
std::string MemoryTypeNames(uint64_t mask) {
  static const char* const kNames[] = {"host", "cuda", "cuda-managed", "rocm", "rocm-managed"};
  std::string names;
  for (unsigned bit = 0; bit < 64; ++bit) {
    if ((mask & (uint64_t{1} << bit)) == 0) continue;
    if (!names.empty()) names += ", ";
    names += bit < std::size(kNames) ? std::string(kNames[bit]) : "type " + std::to_string(bit);
  }
  return names.empty() ? "none" : names;
}

// UcxOptions::copy_threads 0: half this machine's cores, at least 2, at most 8 (copies of
// scattered pages scale with threads until memory bandwidth is the limit; the other half of the
// cores stays for the model; docs/performance.md has the scaling).
int AutoCopyThreads() {
  const unsigned cores = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp<unsigned>(cores / 2, 2, 8));
}

// A random id for this backend instance, so receivers can tell senders apart across processes.
uint64_t NewInstanceId() {
  const uint64_t id = RandomU64() ^ (static_cast<uint64_t>(getpid()) << 16) ^
                      static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  return id == 0 ? 1 : id;
}

class UcxBackend final : public Backend {
  // Takes mutex_ for an API call, announcing itself first so that the progress thread (which
  // otherwise re-takes the mutex in a tight loop while it spins) steps aside.
  class ApiLock {
   public:
    explicit ApiLock(UcxBackend& b) : b_(b), lock_(b.mutex_, std::defer_lock) {
      b_.LockAsWaiter(lock_);
    }
    void unlock() { lock_.unlock(); }
    std::unique_lock<std::mutex>& unique() { return lock_; }
    // Lets other callers (and the progress thread) have the mutex for a moment.
    void Yield() {
      lock_.unlock();
      std::this_thread::yield();
      b_.LockAsWaiter(lock_);
    }

   private:
    UcxBackend& b_;
    std::unique_lock<std::mutex> lock_;
  };

 public:
  UcxBackend(const UcxOptions& options, const UcxTestHooks& hooks)
      : spin_(options.spin),
        direct_shm_(options.direct_shm),
        direct_inline_bytes_(options.direct_inline_bytes),
        copy_threads_(options.copy_threads == 0 ? AutoCopyThreads() : options.copy_threads),
        transports_(options.transports),
        cuda_mode_(options.cuda_mode),
        staging_slots_(options.staging_slots),
        staging_slot_bytes_(options.staging_slot_bytes),
        staging_in_place_(options.staging_in_place),
        host_path_(options.host_path),
        run_options_{.message_bytes = options.am_message_bytes,
                     .rendezvous = options.am_rendezvous,
                     .window = RunWindow(options.am_message_bytes),
                     .fail_send_at = hooks.fail_run_send_at,
                     .ack_delay = std::chrono::microseconds(hooks.ack_delay_us),
                     .receive_delay = std::chrono::microseconds(hooks.receive_delay_us),
                     .release_bound = hooks.release_bound_ms > 0
                                          ? std::chrono::milliseconds(hooks.release_bound_ms)
                                          : ucx_staging::RunOptions{}.release_bound},
        hooks_(hooks),
        instance_(NewInstanceId()) {}

  ~UcxBackend() override {
    stop_.store(true);
    if (worker_ != nullptr) ucp_worker_signal(worker_);
    if (progress_.joinable()) progress_.join();
    {
      ApiLock lock(*this);  // no byte of an unfinished direct copy lands after this
      CancelJobs(DirectJobsLocked(std::nullopt));
      // Network writes stop being posted (what was posted is flushed below).
      CancelPostsLocked(lock, PostJobsLocked(std::nullopt));
      post_stop_ = true;
      post_cv_.notify_all();
    }
    if (poster_.joinable()) poster_.join();
    {
      std::lock_guard<std::mutex> lock(copy_mu_);
      copy_stop_ = true;
    }
    copy_cv_.notify_all();
    for (std::thread& t : copiers_) t.join();  // they finish or cancel the queued copies first
    ApiLock lock(*this);
    for (auto& [id, write] : writes_) WaitLocked(write);
    writes_.clear();
    if (staging_) staging_->Quiesce();
    for (auto& [id, peer] : peers_) {
      if ((peer.staged || peer.runs) && staging_) staging_->RemovePeer(id, /*peer_dead=*/false);
      ClosePeerLocked(peer);
    }
    peers_.clear();
    if (staging_) staging_->Shutdown();
    UnmapLocked();
    for (auto& [address, allocation] : allocations_) ucp_mem_unmap(context_, allocation.memh);
    allocations_.clear();
    if (worker_address_ != nullptr) ucp_worker_release_address(worker_, worker_address_);
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
  }

  Status Init() {
    KVT_ASSIGN_OR_RETURN(ucp_config_t * config, ReadUcpConfig(transports_));
    ucp_params_t params = {};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    // RMA only: the staged path's active messages run on a context of their own
    // (StagedTransport), because enabling UCP_FEATURE_AM here makes UCX 1.13's tcp transport
    // crash in ucp_worker_progress (uct_tcp_iface_progress) even with no AM traffic.
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 0;
    ucs_status_t st = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (st != UCS_OK && !transports_.empty()) {
      return UcsStatus(st, "ucp_init with transports '" + transports_ + "'")
          .WithContext("check the transport list against `ucx_info -d`");
    }
    KVT_RETURN_IF_ERROR(UcsStatus(st, "ucp_init"));

    ucp_context_attr_t attr = {};
    attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    KVT_RETURN_IF_ERROR(UcsStatus(ucp_context_query(context_, &attr), "ucp_context_query"));
    memory_types_ = attr.memory_types;
    // Once per process at info (it decides how CUDA pools move), then at debug.
    static std::atomic<bool> logged{false};
    if (!logged.exchange(true)) {
      KVT_LOG_INFO("ucx", "UCX {} handles memory types: {}; CUDA pools {}", UcxVersion(),
                   MemoryTypeNames(memory_types_),
                   UcxHandlesCuda() ? "are registered directly (ucx cuda_mode auto)"
                                    : "are staged through pinned host bounce buffers");
    } else {
      KVT_LOG_DEBUG("ucx", "UCX {} handles memory types: {}", UcxVersion(),
                    MemoryTypeNames(memory_types_));
    }

    ucp_worker_params_t wparams = {};
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wparams.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // serialised by mutex_
    KVT_RETURN_IF_ERROR(
        UcsStatus(ucp_worker_create(context_, &wparams, &worker_), "ucp_worker_create"));
    KVT_RETURN_IF_ERROR(UcsStatus(ucp_worker_get_efd(worker_, &event_fd_), "ucp_worker_get_efd"));
    KVT_RETURN_IF_ERROR(
        UcsStatus(ucp_worker_get_address(worker_, &worker_address_, &worker_address_len_),
                  "ucp_worker_get_address"));
    // Peers' addresses are checked against the format this UCX's own must have too.
    KVT_RETURN_IF_ERROR(
        CheckOwnAddress({reinterpret_cast<const uint8_t*>(worker_address_), worker_address_len_}));
    progress_ = std::thread([this] { ProgressLoop(); });
    for (int i = 0; i < copy_threads_; ++i) copiers_.emplace_back([this] { CopyLoop(); });
    poster_ = std::thread([this] { PostLoop(); });
    return OkStatus();
  }

  std::string_view Name() const override { return "ucx"; }

  BackendCapabilities Capabilities() const override {
    BackendCapabilities caps;
    caps.host_memory = (memory_types_ & UCS_BIT(UCS_MEMORY_TYPE_HOST)) != 0;
    caps.cuda_memory = UcxHandlesCuda();
    caps.inter_process = true;
    caps.inter_node = true;
    caps.page_writes = staged_.load(std::memory_order_acquire);
    // Direct copies, flushes and staged writes (their last acknowledgement) call the notifier.
    caps.notifies_completion = true;
    return caps;
  }

  StatusOr<PeerDescriptor> Register(std::span<const LocalRegion> regions) override {
    ApiLock lock(*this);
    for (auto& [id, write] : writes_) {
      if (write.status.code() == StatusCode::kInProgress) {
        return FailedPrecondition("cannot re-register buffers while writes are in flight");
      }
    }
    if (connecting_ > 0) {
      return FailedPrecondition("cannot re-register buffers while " + std::to_string(connecting_) +
                                " Connect calls set up their endpoints (each waits for its peer "
                                "for at most about 7 s); retry once they have returned");
    }
    if (releasing_ > 0) {
      return FailedPrecondition("cannot re-register buffers while " + std::to_string(releasing_) +
                                " released writes still flush (their puts may read the buffers; "
                                "at most 30 s each); retry once Release has returned");
    }
    if (staging_ && staging_->Active()) {
      return FailedPrecondition(
          "cannot re-register buffers while staged writes or received chunks are in flight");
    }
    for (size_t i = 0; i < regions.size(); ++i) {
      if (regions[i].base == 0 || regions[i].length == 0) {
        return InvalidArgument("buffer " + std::to_string(i) + " has a null base or zero length");
      }
    }
    KVT_RETURN_IF_ERROR(CheckHostRegionsMapped(regions, "ucx"));
    KVT_ASSIGN_OR_RETURN(const bool stage, ChooseStagingLocked(regions));
    const bool host_pool = std::all_of(regions.begin(), regions.end(), [](const LocalRegion& r) {
      return r.kind == MemoryKind::kHost;
    });
    const bool runs = !stage && host_pool && !regions.empty() && host_path_ != UcxHostPath::kPut;
    if ((stage || runs) && !staging_) {
      // The staging context comes with the first staged pool or host pool that may take copy
      // runs as active messages (backends with host_path 'put' never pay).
      auto created = ucx_staging::StagedTransport::Create(transports_, instance_, run_options_);
      if (!created.ok() && (stage || host_path_ == UcxHostPath::kActiveMessages)) {
        return created.status().WithContext(stage ? "starting the staging worker"
                                                  : "starting the active-message worker");
      }
      if (created.ok()) {
        staging_ = std::move(created).value();
        staging_->SetOnWriteDone([this] { Notify(); });
        // Its bounded waits (acks of a peer's writes, landings of a sender's chunks) take up to
        // seconds when a peer does not answer; other peers' calls go on meanwhile.
        staging_->SetYield([this] { YieldLocked(); });
      } else {
        KVT_LOG_WARN("ucx", "no active-message worker ({}); host writes go as puts",
                     created.status().ToString());
      }
    }
    UnmapLocked();
    if (staging_) {
      KVT_RETURN_IF_ERROR(staging_->Detach());
      staging_->DetachRuns();
    }
    staged_.store(false, std::memory_order_release);
    PeerDescriptor descriptor;
    descriptor.backend = "ucx";
    const std::string_view worker_address(reinterpret_cast<const char*>(worker_address_),
                                          worker_address_len_);
    if (stage) {
      ucx_staging::StagingOptions options;
      options.slots = static_cast<uint32_t>(std::max(staging_slots_, 0));
      options.slot_bytes = staging_slot_bytes_;
      options.host_copier = regions[0].kind == MemoryKind::kHost;
      options.in_place = staging_in_place_;
      options.host_copy_delay = std::chrono::microseconds(hooks_.host_copy_delay_us);
      KVT_RETURN_IF_ERROR(staging_->Attach(regions, options).WithContext("staging the pool"));
      for (const LocalRegion& r : regions) {
        // No rkeys: UCX cannot write this memory; peers send chunks to our bounce slots.
        descriptor.regions.push_back(RemoteRegion{r.base, r.length, r.item_len, {}});
      }
      local_.assign(regions.begin(), regions.end());
      staged_.store(true, std::memory_order_release);
      // Peers reach a staged pool through the staging worker.
      descriptor.address = ucx_staging::AppendTrailer(
          staging_->worker_address(), {instance_, true, staging_->slots(), staging_->slot_bytes()});
      KVT_LOG_DEBUG("ucx", "{} buffers staged through {} bounce slots of {} bytes", regions.size(),
                    staging_->slots(), staging_->slot_bytes());
      return descriptor;
    }
    // Peers without native RMA to us send copy runs to the staging worker.
    if (runs && staging_) KVT_RETURN_IF_ERROR(staging_->AttachRuns(regions));
    descriptor.address = ucx_staging::AppendTrailer(
        worker_address, {instance_, false, 0, 0},
        staging_ && staging_->runs_attached() ? std::string_view(staging_->worker_address())
                                              : std::string_view());
    for (size_t i = 0; i < regions.size(); ++i) {
      const LocalRegion& r = regions[i];
      ucp_mem_h memh = AllocationContaining(r.base, r.length);
      if (memh == nullptr) {
        ucp_mem_map_params_t mp = {};
        mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                        UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
        mp.address = reinterpret_cast<void*>(r.base);
        mp.length = r.length;
        mp.memory_type = r.kind == MemoryKind::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
        Status mapped = UcsStatus(ucp_mem_map(context_, &mp, &memh), "ucp_mem_map");
        if (!mapped.ok()) {
          UnmapLocked();
          return mapped.WithContext("registering buffer " + std::to_string(i));
        }
        memhs_.push_back(memh);  // ours to unmap; allocation handles stay with FreeHost
      }
      void* packed = nullptr;
      size_t packed_len = 0;
      Status packed_ok =
          UcsStatus(ucp_rkey_pack(context_, memh, &packed, &packed_len), "ucp_rkey_pack");
      if (!packed_ok.ok()) {
        UnmapLocked();
        return packed_ok;
      }
      packed_ok = ucx_check::CheckPackedRkey({static_cast<const uint8_t*>(packed), packed_len});
      if (!packed_ok.ok()) {
        ucp_rkey_buffer_release(packed);
        UnmapLocked();
        return Internal(
            "this UCX (" + std::string(UcxVersion()) +
            ") packs memory keys that kvt's check of peers' keys refuses: " + packed_ok.message() +
            "; kvt cannot check peers' keys with this UCX: use UCX 1.13");
      }
      descriptor.regions.push_back(RemoteRegion{
          r.base, r.length, r.item_len, std::string(static_cast<const char*>(packed), packed_len)});
      ucp_rkey_buffer_release(packed);
    }
    local_.assign(regions.begin(), regions.end());
    return descriptor;
  }

  StatusOr<PeerId> Connect(const PeerDescriptor& descriptor) override {
    if (descriptor.backend != "ucx") {
      return InvalidArgument("peer uses backend '" + descriptor.backend + "', this side 'ucx'");
    }
    const ucx_staging::SplitAddress address = ucx_staging::SplitPeerAddress(descriptor.address);
    if (address.worker_address.empty()) return InvalidArgument("peer sent an empty UCX address");
    const bool peer_staged = address.trailer.has_value() && address.trailer->staged;
    // Nothing the peer sent reaches UCX unchecked: UCX's parsers trust every length in it.
    KVT_RETURN_IF_ERROR(ucx_check::CheckWorkerAddress(
        {reinterpret_cast<const uint8_t*>(address.worker_address.data()),
         address.worker_address.size()}));
    // The address of the worker that takes copy runs as active messages goes to UCX too.
    if (!address.runs_address.empty()) {
      Status runs = ucx_check::CheckWorkerAddress(
          {reinterpret_cast<const uint8_t*>(address.runs_address.data()),
           address.runs_address.size()});
      if (!runs.ok()) return runs.WithContext("the peer's copy-run worker address");
    }
    for (size_t i = 0; i < descriptor.regions.size(); ++i) {
      const RemoteRegion& region = descriptor.regions[i];
      if (region.length == 0 || region.base + region.length < region.base) {
        return InvalidArgument("the peer's buffer " + std::to_string(i) + " (base " +
                               std::to_string(region.base) + ", " + std::to_string(region.length) +
                               " bytes) is empty or wraps the address space; the peer is not a "
                               "kvt agent");
      }
      if (peer_staged) continue;  // no keys: the peer's pool is reached through bounce slots
      KVT_RETURN_IF_ERROR(
          ucx_check::CheckPackedRkey(
              {reinterpret_cast<const uint8_t*>(region.key.data()), region.key.size()})
              .WithContext("the key of the peer's buffer " + std::to_string(i)));
    }
    ApiLock lock(*this);
    const bool local_staged = staged_.load(std::memory_order_acquire);
    // Page writes pair buffers index by index; copy runs name the peer's buffer themselves.
    if (peer_staged || local_staged) {
      KVT_RETURN_IF_ERROR(CheckRegionCount(local_.size(), descriptor.regions.size()));
    }
    if (peer_staged != local_staged) {
      return FailedPrecondition(
          std::string(peer_staged ? "the peer stages its CUDA pool through host bounce buffers"
                                  : "the peer registered its buffers for direct UCX writes") +
          " but this side " +
          (local_staged ? "stages its CUDA pool" : "registered its buffers for direct writes") +
          "; both sides must do the same: register CUDA pools with ucx cuda_mode 'staged' on "
          "both (or 'auto' where UCX " +
          UcxVersion() + " has no CUDA support)");
    }
    const PeerId id = next_peer_++;
    Peer peer;
    peer.regions = descriptor.regions;
    peer.staged = local_staged;
    peer.remote_instance = address.trailer ? address.trailer->instance : 0;
    peer.error = std::make_shared<std::atomic<int>>(UCS_OK);
    // Setting up the endpoint waits for the peer and lets other callers in meanwhile
    // (Register refuses while a Connect is under way). The peer backend's messages to us are
    // admitted again (if a Disconnect dropped them) only once the link is connected: a Connect
    // that fails leaves them as they were.
    ConnectingScope connecting(*this);
    if (peer.staged) {
      // Staged peers live on the staging worker; this worker has no endpoint to them.
      KVT_RETURN_IF_ERROR(
          staging_->AddPeer(id, address.worker_address, *address.trailer, descriptor.regions));
      staging_->AdmitSender(peer.remote_instance);
      peers_.emplace(id, std::move(peer));
      staging_->Signal();  // the hello's ack arrives through the progress thread
      return id;
    }
    ucp_ep_params_t ep = {};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(address.worker_address.data());
    // UCX 1.13's shared-memory transports have no peer-failure handler, so asking for
    // UCP_ERR_HANDLING_MODE_PEER would rule them out (leaving only tcp). Peer death is detected
    // by the control plane (connection loss, heartbeats), which then disconnects the peer here.
    ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    ep.err_handler.cb = &UcxBackend::OnEndpointError;
    ep.err_handler.arg = peer.error.get();
    KVT_RETURN_IF_ERROR(UcsStatus(ucp_ep_create(worker_, &ep, &peer.ep), "ucp_ep_create"));
    // What is mapped before the keys are unpacked: the shared memory they attach is what is new
    // afterwards, and the only memory the peer's buffers may lie in (MapDirectLocked).
    StatusOr<std::vector<ucx_check::Mapping>> maps_before = ucx_check::ReadSelfMaps();
    if (!maps_before.ok()) {
      ClosePeerLocked(peer, /*peer_dead=*/false, /*yield=*/true);
      return maps_before.status();
    }
    for (size_t i = 0; i < descriptor.regions.size(); ++i) {
      // Zeros after the key: a transport's unpacker reads its own key size, whatever the peer's.
      std::string key = descriptor.regions[i].key;
      key.append(ucx_check::kRkeyUnpackPadding, '\0');
      ucp_rkey_h rkey = nullptr;
      ucs_status_t st = ucp_ep_rkey_unpack(peer.ep, key.data(), &rkey);
      if (st != UCS_OK) {
        ClosePeerLocked(peer, /*peer_dead=*/false, /*yield=*/true);
        return UcsStatus(st, "ucp_ep_rkey_unpack of the peer's buffer " + std::to_string(i))
            .WithContext("the peer's memory descriptor is unusable");
      }
      peer.rkeys.push_back(rkey);
    }
    // Checked with or without direct copies: UCX's shared-memory puts copy to the same place.
    Status mapped = MapDirectLocked(peer, *maps_before, direct_shm_);
    if (!mapped.ok()) {
      ClosePeerLocked(peer, /*peer_dead=*/false, /*yield=*/true);
      return mapped;
    }
    StatusOr<bool> runs = ChooseRunsLocked(peer, address);
    if (runs.ok() && *runs) {
      // Copy runs go as active messages on the staging worker; the RMA endpoint is not needed.
      // It is closed once its connection is set up: UCX 1.13's tcp transport crashes when an
      // endpoint still connecting is closed, or its worker destroyed (ucp_worker_destroy).
      Status wired =
          FlushLocked(peer.ep, "setting up the UCX endpoint to the peer", /*yield=*/true);
      Status added = wired.ok()
                         ? staging_->AddPeer(id, address.runs_address, *address.trailer,
                                             descriptor.regions, ucx_staging::LinkMode::kRuns)
                         : wired;
      if (!added.ok()) runs = added;
      peer.runs = added.ok();
      if (peer.runs) ClosePeerLocked(peer, /*peer_dead=*/false, /*yield=*/true);
    }
    if (!runs.ok()) {
      ClosePeerLocked(peer, /*peer_dead=*/false, /*yield=*/true);
      return runs.status();
    }
    if (staging_) staging_->AdmitSender(peer.remote_instance);
    peers_.emplace(id, std::move(peer));
    if (*runs) staging_->Signal();  // the hello's ack arrives through the progress thread
    return id;
  }

  Status Disconnect(PeerId id, DisconnectMode mode) override {
    ApiLock lock(*this);
    auto it = peers_.find(id);
    if (it == peers_.end()) return NotFound("no UCX peer " + std::to_string(id));
    const bool dead = mode == DisconnectMode::kPeerDead;
    // Network writes to this peer stop being posted before its endpoint closes (waiting lets
    // other calls in; the peer refuses new writes meanwhile).
    it->second.closing = true;
    CancelPostsLocked(lock, PostJobsLocked(id));
    it = peers_.find(id);
    if (it == peers_.end())
      return NotFound("UCX peer " + std::to_string(id) +
                      " was disconnected by another call while this one stopped its writes");
    // Staged: the sender side waits for (or abandons) its chunks and says bye while the endpoint
    // is still open; the receiver side stops taking chunks from that backend. Both waits let
    // other calls in (YieldLocked), a second Disconnect of this peer among them.
    if (staging_) {
      const uint64_t instance = it->second.remote_instance;
      if (it->second.staged || it->second.runs) staging_->RemovePeer(id, dead);
      it = peers_.find(id);
      if (it == peers_.end()) {
        return NotFound("UCX peer " + std::to_string(id) +
                        " was disconnected by another call while this one waited for its writes");
      }
      // Checked after the waits, which let other calls in: another link to the same peer
      // backend that is connected keeps that backend's messages to us admitted.
      if (SharesInstanceLocked(id, instance)) {
        KVT_LOG_DEBUG("ucx",
                      "peer {}: another link to its backend is open; its messages stay "
                      "admitted",
                      id);
      } else {
        staging_->DropSender(instance, dead);
        it = peers_.find(id);
        if (it == peers_.end()) {
          return NotFound("UCX peer " + std::to_string(id) +
                          " was disconnected by another call while this one waited for its "
                          "landings");
        }
      }
    }
    // Copies into the peer's mapping must stop before closing the endpoint unmaps it.
    CancelJobs(DirectJobsLocked(id));
    // Out of peers_ before the close, whose wait lets other calls in: they find no such peer.
    Peer closing = std::move(it->second);
    peers_.erase(it);
    ClosePeerLocked(closing, dead, /*yield=*/true);
    for (auto& [wid, write] : writes_) {
      if (write.peer != id) continue;
      WaitLocked(write);
      if (!write.status.ok()) {
        write.status =
            Aborted("peer disconnected during the write (" + write.status.ToString() + ")");
      }
    }
    return OkStatus();
  }

  void FenceSender(const PeerDescriptor& descriptor) override {
    if (descriptor.backend != "ucx") return;
    const ucx_staging::SplitAddress address = ucx_staging::SplitPeerAddress(descriptor.address);
    if (!address.trailer) return;
    ApiLock lock(*this);
    // Copy runs and staged chunks reach this side on the staging worker; puts are fenced by the
    // sender's own forced close (the connection is its alone).
    if (staging_) staging_->FenceSender(address.trailer->instance);
  }

  StatusOr<WriteId> PostWrite(PeerId id, std::span<const CopyRun> runs) override {
    ApiLock lock(*this);
    auto it = peers_.find(id);
    if (it == peers_.end()) return NotFound("no UCX peer " + std::to_string(id));
    Peer& peer = it->second;
    if (peer.staged || staged_.load(std::memory_order_acquire)) {
      return Unimplemented(
          "this ucx backend stages its CUDA pool through host bounce buffers (UCX " +
          std::string(UcxVersion()) + " handles " + MemoryTypeNames(memory_types_) +
          "); staged CUDA pools take page writes (PostPages), not copy runs");
    }
    if (peer.closing) {
      return FailedPrecondition("UCX peer " + std::to_string(id) +
                                " is being disconnected; connect it again before writing to it");
    }
    if (int err = peer.error->load(); err != UCS_OK) {
      return UcsStatus(static_cast<ucs_status_t>(err), "UCX endpoint to the peer failed");
    }
    KVT_RETURN_IF_ERROR(CheckRuns(runs, local_, peer.regions));
    uint64_t bytes = 0;
    for (const CopyRun& run : runs) bytes += run.bytes;
    if (peer.runs) {
      // As active messages; a large write is sent by the progress thread, not the caller.
      const WriteId wid = next_write_++;
      KVT_RETURN_IF_ERROR(
          staging_->PostRuns(wid, id, runs, local_, /*send_now=*/bytes <= direct_inline_bytes_));
      staging_->Signal();  // the progress thread may be asleep on the event fds
      return wid;
    }
    Write write;
    write.peer = id;
    if (!peer.direct.empty()) {
      // Shared memory mapped here: plain copies. Small writes at once; large ones on the copy
      // threads (the stores are published before the job reads as done).
      if (bytes <= direct_inline_bytes_) {
        for (const CopyRun& run : runs) {
          std::memcpy(peer.direct[run.DstBuffer()] + run.dst_offset,
                      reinterpret_cast<const uint8_t*>(local_[run.buffer].base) + run.src_offset,
                      run.bytes);
        }
        std::atomic_thread_fence(std::memory_order_release);
        write.status = OkStatus();
      } else {
        auto job = std::make_shared<DirectJob>();
        job->runs.assign(runs.begin(), runs.end());
        job->bounds = SplitRuns(job->runs, copy_threads_, kMinCopySliceBytes);
        job->slices_left = static_cast<int>(job->bounds.size()) - 1;
        job->dst = peer.direct;
        job->src.reserve(local_.size());
        for (const LocalRegion& r : local_)
          job->src.push_back(reinterpret_cast<const uint8_t*>(r.base));
        {
          std::lock_guard<std::mutex> copy_lock(copy_mu_);
          copy_queue_.push_back(job);
        }
        for (size_t i = 1; i < job->bounds.size(); ++i) copy_cv_.notify_one();  // one per slice
        write.job = std::move(job);
        write.status = InProgress();
      }
      return AddWriteLocked(std::move(write));
    }
    // Over the network: UCX puts, then one flush over them (PostBatchLocked, FinishPostLocked).
    auto job = std::make_shared<PostJob>();
    job->peer = id;
    job->runs.assign(runs.begin(), runs.end());
    write.post = job;
    if (bytes > direct_inline_bytes_) {
      // A large write goes to the poster thread, so that the caller (often the model's thread in
      // LayersReady, or the control plane's) does not send it.
      post_queue_.push_back(std::move(job));
      post_cv_.notify_all();
      write.status = InProgress();
      return AddWriteLocked(std::move(write));
    }
    // A small one is posted here, at once.
    job->state = PostJob::State::kRunning;
    while (!PostBatchLocked(*job)) {
    }
    if (!job->status.ok()) return job->status;  // a refused put is this call's error
    FinishPostLocked(*job);
    PollPostLocked(write);
    const WriteId wid = AddWriteLocked(std::move(write));
    lock.unlock();
    ucp_worker_signal(worker_);  // the progress thread may be asleep on the event fd
    return wid;
  }

  StatusOr<WriteId> PostPages(PeerId id, const PageWrite& write) override {
    ApiLock lock(*this);
    if (!staged_.load(std::memory_order_acquire)) {
      return Unimplemented(
          "ucx takes page writes only for CUDA pools it stages through bounce buffers "
          "(ucx cuda_mode 'staged', or 'auto' on a UCX without CUDA support); this registration "
          "takes copy runs (PostWrite)");
    }
    auto it = peers_.find(id);
    if (it == peers_.end()) return NotFound("no UCX peer " + std::to_string(id));
    if (it->second.closing) {
      return FailedPrecondition("UCX peer " + std::to_string(id) +
                                " is being disconnected; connect it again before writing to it");
    }
    if (int err = it->second.error->load(); err != UCS_OK) {
      return UcsStatus(static_cast<ucs_status_t>(err), "UCX endpoint to the peer failed");
    }
    const WriteId wid = next_write_++;
    KVT_RETURN_IF_ERROR(staging_->PostPages(wid, id, write));
    staging_->Signal();  // the progress thread may be asleep on the event fds
    return wid;
  }

  Status Check(WriteId id) override {
    ApiLock lock(*this);
    auto it = writes_.find(id);
    if (it == writes_.end()) {
      if (staging_ && staging_->HasWrite(id)) return staging_->Check(id);
      return NotFound("no UCX write " + std::to_string(id));
    }
    Write& write = it->second;
    if (write.job) PollJob(write);
    if (write.post) PollPostLocked(write);
    if (write.flush != nullptr) {
      ucp_worker_progress(worker_);
      PollLocked(write);
    }
    return write.status;
  }

  void SetCompletionNotifier(std::function<void()> notify) override {
    std::lock_guard<std::mutex> lock(notify_mu_);
    notify_ = std::move(notify);
  }

  StatusOr<void*> AllocateHost(size_t bytes) override {
    if (bytes == 0) return InvalidArgument("host allocation of 0 bytes");
    ucp_mem_map_params_t mp = {};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS |
                    UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE | UCP_MEM_MAP_PARAM_FIELD_ADDRESS;
    mp.address = nullptr;
    mp.length = bytes;
    mp.flags = UCP_MEM_MAP_ALLOCATE;
    mp.memory_type = UCS_MEMORY_TYPE_HOST;
    ApiLock lock(*this);
    ucp_mem_h memh = nullptr;
    KVT_RETURN_IF_ERROR(UcsStatus(ucp_mem_map(context_, &mp, &memh),
                                  "ucp_mem_map(ALLOCATE, " + std::to_string(bytes) + " bytes)"));
    ucp_mem_attr_t attr = {};
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    Status queried = UcsStatus(ucp_mem_query(memh, &attr), "ucp_mem_query");
    if (!queried.ok()) {
      ucp_mem_unmap(context_, memh);
      return queried;
    }
    if (reinterpret_cast<uintptr_t>(attr.address) % 4096 != 0) {
      ucp_mem_unmap(context_, memh);
      return Internal("UCX allocated host memory that is not page-aligned");
    }
    allocations_[reinterpret_cast<uint64_t>(attr.address)] = Allocation{memh, attr.length};
    return attr.address;
  }

  void FreeHost(void* block) override {
    ApiLock lock(*this);
    auto it = allocations_.find(reinterpret_cast<uint64_t>(block));
    if (it == allocations_.end()) {
      KVT_LOG_ERROR("ucx", "FreeHost of a block this backend did not allocate");
      return;
    }
    ucp_mem_unmap(context_, it->second.memh);
    allocations_.erase(it);
  }

  size_t MappedSenderSlots() {
    ApiLock lock(*this);
    return staging_ != nullptr ? staging_->mapped_sender_slots() : 0;
  }

  StatusOr<std::string> PeerPath(PeerId id) {
    ApiLock lock(*this);
    auto it = peers_.find(id);
    if (it == peers_.end()) return NotFound("no UCX peer " + std::to_string(id));
    const Peer& peer = it->second;
    if (peer.staged) {
      return std::string(staging_ != nullptr && staging_->ReadsInPlace(id) ? "staged-in-place"
                                                                           : "staged");
    }
    if (peer.runs) return std::string("am");
    return std::string(peer.direct.empty() ? "put" : "copy");
  }

  void Release(WriteId id) override {
    ApiLock lock(*this);
    auto it = writes_.find(id);
    if (it == writes_.end()) {
      if (staging_) staging_->Release(id);
      return;
    }
    if (std::shared_ptr<PostJob> job = it->second.post) {
      CancelPostLocked(lock, job);  // may let other calls in: find the write again
      it = writes_.find(id);
      if (it == writes_.end()) return;  // released by another thread meanwhile
    }
    // A flush to a peer that does not answer takes up to its bound (30 s): the write leaves the
    // table and is waited for letting other calls take the lock between rounds of progress, so
    // that other peers' writes go on. Register refuses meanwhile: the puts may still read the
    // buffers.
    Write write = std::move(it->second);
    writes_.erase(it);
    ++releasing_;
    WaitLocked(write, /*yield=*/true);
    --releasing_;
  }

 private:
  struct Peer {
    ucp_ep_h ep = nullptr;
    std::vector<ucp_rkey_h> rkeys;
    std::vector<RemoteRegion> regions;
    std::shared_ptr<std::atomic<int>> error;  // set by the endpoint's error handler
    // When every peer buffer lives in shared memory UCX has mapped into this process
    // (ucp_rkey_ptr), its local address per buffer: writes are then plain copies.
    std::vector<uint8_t*> direct;
    bool staged = false;           // writes go through the staged transport
    bool runs = false;             // copy runs go as active messages (the staged transport)
    bool closing = false;          // Disconnect is stopping its writes: no new ones
    uint64_t remote_instance = 0;  // the peer backend's id (its descriptor trailer), 0 unknown
  };

  // Finds local mappings of the peer's buffers. A buffer UCX maps here (ucp_rkey_ptr) that lies
  // anywhere but, whole, in the shared memory that unpacking the peer's keys attached (what
  // /proc/self/maps has beyond `maps_before`) is a lie: InvalidArgument. UCX does not check:
  // the shared-memory transports' ucp_rkey_ptr adds an offset to any address, and their puts
  // copy there too. When every buffer maps here and `copy_directly`, writes become plain copies
  // into the mappings, pre-faulted here, because the first store to each 4 KiB page of a fresh
  // mapping costs a page fault (a few microseconds here), which would otherwise land on every
  // first write to a page. mutex_ held.
  Status MapDirectLocked(Peer& peer, std::span<const ucx_check::Mapping> maps_before,
                         bool copy_directly) {
    std::vector<uint8_t*> direct(peer.rkeys.size(), nullptr);
    bool all_mapped = true;
    for (size_t i = 0; i < peer.rkeys.size(); ++i) {
      const RemoteRegion& region = peer.regions[i];
      const ucs_status_t st = RkeyPtrRange(peer.rkeys[i], region.base, region.length, &direct[i]);
      if (st == UCS_ERR_UNREACHABLE) {  // not mapped here: network puts
        all_mapped = false;
        continue;
      }
      if (st != UCS_OK) {
        return InvalidArgument(
            "the peer's buffer " + std::to_string(i) + " (base " + std::to_string(region.base) +
            ", " + std::to_string(region.length) +
            " bytes) lies outside the memory its key maps (ucp_rkey_ptr: " + ucs_status_string(st) +
            "); the peer is not a kvt agent, or its registration changed "
            "without a new hello");
      }
    }
    if (std::all_of(direct.begin(), direct.end(), [](uint8_t* p) { return p == nullptr; })) {
      return OkStatus();
    }
    KVT_ASSIGN_OR_RETURN(const std::vector<ucx_check::Mapping> maps_after,
                         ucx_check::ReadSelfMaps());
    const std::vector<ucx_check::Mapping> maps = ucx_check::NewMappings(maps_before, maps_after);
    std::vector<ucx_check::Range> own;
    for (const LocalRegion& r : local_) own.push_back({r.base, r.length});
    for (size_t i = 0; i < direct.size(); ++i) {
      if (direct[i] == nullptr) continue;
      KVT_RETURN_IF_ERROR(
          ucx_check::CheckMappedForWrite(i, peer.regions[i].base, peer.regions[i].length,
                                         reinterpret_cast<uint64_t>(direct[i]), maps, own));
    }
    if (!copy_directly || !all_mapped) return OkStatus();
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
    for (size_t i = 0; i < direct.size(); ++i) {
      const uintptr_t begin = reinterpret_cast<uintptr_t>(direct[i]) & ~uintptr_t{4095};
      const uintptr_t end = reinterpret_cast<uintptr_t>(direct[i]) + peer.regions[i].length;
      madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE);  // best effort
    }
    peer.direct = std::move(direct);
    KVT_LOG_DEBUG("ucx", "peer buffers mapped directly ({} buffers): writes are plain copies",
                  peer.direct.size());
    return OkStatus();
  }

  // The check of peers' addresses must pass this UCX's own: otherwise its format is not the one
  // the check knows (another UCX version, or UCX_UNIFIED_MODE, which leaves the lengths out).
  static Status CheckOwnAddress(std::span<const uint8_t> address) {
    Status own = ucx_check::CheckWorkerAddress(address);
    if (own.ok()) return own;
    return FailedPrecondition(
        "this UCX's (" + std::string(UcxVersion()) +
        ") own worker address fails kvt's check of peers' addresses (" + own.message() +
        "), so no peer could connect; run with UCX 1.13 in its default address format "
        "(UCX_ADDRESS_VERSION v1 or v2, UCX_UNIFIED_MODE unset)");
  }
  // A large write into a directly mapped peer, copied by the copy threads: one slice each
  // (SplitRuns), claimed from the front of the queue, so writes start in the order posted (the
  // slices of consecutive writes may overlap in time: writes of one request, or of different
  // requests, never target the same bytes).
  struct DirectJob {
    enum class State { kQueued, kRunning, kDone, kCancelled };
    std::vector<CopyRun> runs;
    std::vector<size_t> bounds;       // slice i: runs[bounds[i], bounds[i + 1])
    std::vector<uint8_t*> dst;        // the peer's buffers as mapped here
    std::vector<const uint8_t*> src;  // ours
    State state = State::kQueued;     // guarded by copy_mu_, as are the three below
    size_t slices_claimed = 0;
    int slices_left = 0;              // not yet finished
    bool incomplete = false;          // a slice stopped early (cancel)
    std::atomic<bool> cancel{false};  // read by the copy threads between runs
  };
  // A large network write, posted by the poster thread: batches of puts, then one flush.
  // Guarded by mutex_.
  struct PostJob {
    enum class State { kQueued, kRunning, kDone };
    PeerId peer = 0;
    std::vector<CopyRun> runs;
    size_t next = 0;      // first run not yet posted completely
    uint64_t offset = 0;  // bytes of runs[next] already posted (long runs go in pieces)
    State state = State::kQueued;
    bool cancel = false;    // stop posting (Release, Disconnect, shutdown)
    bool delayed = false;   // the test hook's delay was spent
    void* flush = nullptr;  // kDone: the flush covering the posted runs (null: none pending)
    Status status;          // kDone: OK, the posting error, or Aborted when cancelled
  };
  struct Write {
    PeerId peer = 0;
    void* flush = nullptr;           // outstanding flush request
    std::shared_ptr<DirectJob> job;  // a direct copy not yet seen finished
    std::shared_ptr<PostJob> post;   // a network write not yet seen posted
    Status post_error;               // the status once the flush completes, if it succeeds
    Status status;
  };

  // Lets the API calls waiting for mutex_ (and the progress thread) have it for a moment; the
  // caller holds it, through an ApiLock, and holds it again on return. Called between the rounds
  // of progress of the staged transport's bounded waits, so that a wait for one unresponsive
  // peer does not stall every other caller. At most about a millisecond passes before the
  // caller competes for the mutex again.
  void YieldLocked() {
    mutex_.unlock();
    const auto until = Clock::now() + std::chrono::milliseconds(1);
    do {
      std::this_thread::yield();
    } while (api_waiters_.load(std::memory_order_acquire) > 0 && Clock::now() < until);
    LockAsWaiter(mutex_);
  }

  // Takes `lock` (mutex_ or a lock of it) counted among the API waiters, which the progress
  // thread makes way for.
  template <typename Lockable>
  void LockAsWaiter(Lockable& lock) {
    api_waiters_.fetch_add(1, std::memory_order_acq_rel);
    lock.lock();
    api_waiters_.fetch_sub(1, std::memory_order_acq_rel);
  }

  size_t releasing_ = 0;  // guarded by mutex_: writes Release took out of writes_ and waits for
  // Guarded by mutex_: Connect calls under way, which may wait with mutex_ let go.
  size_t connecting_ = 0;

  // A Connect under way, from before its first wait to its return (mutex_ held at both ends).
  class ConnectingScope {
   public:
    explicit ConnectingScope(UcxBackend& b) : b_(b) { ++b_.connecting_; }
    ~ConnectingScope() { --b_.connecting_; }
    ConnectingScope(const ConnectingScope&) = delete;
    ConnectingScope& operator=(const ConnectingScope&) = delete;

   private:
    UcxBackend& b_;
  };

  WriteId AddWriteLocked(Write write) {
    const WriteId wid = next_write_++;
    writes_.emplace(wid, std::move(write));
    return wid;
  }

  void Notify() {
    std::lock_guard<std::mutex> lock(notify_mu_);
    if (notify_) notify_();
  }

  // A copy thread: takes the next slice of the write at the front of the queue, copies it,
  // and the thread finishing a write's last slice marks it done (or cancelled) and notifies.
  void CopyLoop() {
    std::unique_lock<std::mutex> lock(copy_mu_);
    while (true) {
      copy_cv_.wait(lock, [this] { return copy_stop_ || !copy_queue_.empty(); });
      if (copy_queue_.empty()) return;  // stopping, nothing left
      std::shared_ptr<DirectJob> job = copy_queue_.front();
      if (job->state == DirectJob::State::kCancelled) {  // cancelled while queued
        copy_queue_.pop_front();
        continue;
      }
      if (copy_stop_ && job->slices_claimed == 0) {
        job->state = DirectJob::State::kCancelled;
        copy_queue_.pop_front();
        continue;
      }
      const size_t slice = job->slices_claimed++;
      if (job->slices_claimed + 1 == job->bounds.size()) copy_queue_.pop_front();
      job->state = DirectJob::State::kRunning;
      lock.unlock();
      if (hooks_.direct_copy_delay_us > 0) {
        const auto until = Clock::now() + std::chrono::microseconds(hooks_.direct_copy_delay_us);
        while (Clock::now() < until && !job->cancel.load(std::memory_order_relaxed)) {
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
      }
      // Non-temporal stores with the source prefetched ahead (stream_copy.h); fenced inside,
      // and published to the thread that marks the write done through copy_mu_.
      const std::span<const CopyRun> runs = std::span<const CopyRun>(job->runs).subspan(
          job->bounds[slice], job->bounds[slice + 1] - job->bounds[slice]);
      const bool complete = StreamCopyRuns(runs, job->src, job->dst, &job->cancel) == runs.size();
      lock.lock();
      if (!complete) job->incomplete = true;
      if (--job->slices_left > 0) continue;
      job->state = job->incomplete ? DirectJob::State::kCancelled : DirectJob::State::kDone;
      copy_done_cv_.notify_all();
      lock.unlock();
      Notify();
      lock.lock();
    }
  }

  // Stops direct copies: each dequeued if it has not started, else told to stop between runs;
  // all are marked before any is waited for (so a free copy thread cannot start one of them
  // meanwhile). Afterwards no byte of them lands any more.
  void CancelJobs(const std::vector<std::shared_ptr<DirectJob>>& jobs) {
    std::unique_lock<std::mutex> lock(copy_mu_);
    for (const std::shared_ptr<DirectJob>& job : jobs) {
      if (job->state == DirectJob::State::kQueued) {
        job->state = DirectJob::State::kCancelled;
      } else {
        job->cancel.store(true, std::memory_order_relaxed);
      }
    }
    copy_done_cv_.wait(lock, [&] {
      return std::none_of(jobs.begin(), jobs.end(), [](const std::shared_ptr<DirectJob>& job) {
        return job->state == DirectJob::State::kRunning;
      });
    });
  }
  void CancelJob(const std::shared_ptr<DirectJob>& job) { CancelJobs({job}); }

  // The direct copies not yet seen finished, of one peer or of all. mutex_ held.
  std::vector<std::shared_ptr<DirectJob>> DirectJobsLocked(std::optional<PeerId> peer) const {
    std::vector<std::shared_ptr<DirectJob>> jobs;
    for (const auto& [wid, write] : writes_) {
      if (write.job && (!peer || write.peer == *peer)) jobs.push_back(write.job);
    }
    return jobs;
  }

  // The poster thread: posts the queued network writes in order, kPostBatchBytes of puts per
  // hold of mutex_, then each write's flush; notifies when a write is fully posted.
  void PostLoop() {
    ApiLock lock(*this);
    while (true) {
      post_cv_.wait(lock.unique(), [this] { return post_stop_ || !post_queue_.empty(); });
      if (post_queue_.empty()) return;  // stopping, nothing left
      const std::shared_ptr<PostJob> job = post_queue_.front();
      job->state = PostJob::State::kRunning;
      if (hooks_.post_delay_us > 0 && !job->delayed) {
        job->delayed = true;
        post_cv_.wait_for(lock.unique(), std::chrono::microseconds(hooks_.post_delay_us),
                          [&] { return job->cancel; });
      }
      if (!job->cancel && !PostBatchLocked(*job)) {
        ucp_worker_signal(worker_);  // the progress thread may be asleep on the event fd
        if (hooks_.post_batch_pause_us > 0) {
          post_cv_.wait_for(lock.unique(), std::chrono::microseconds(hooks_.post_batch_pause_us),
                            [&] { return job->cancel; });
        } else {
          lock.Yield();
        }
        continue;
      }
      FinishPostLocked(*job);
      post_queue_.pop_front();
      post_done_cv_.notify_all();
      ucp_worker_signal(worker_);
      Notify();
    }
  }

  // Posts the job's next runs, up to kPostBatchBytes. True when nothing is left to post (all
  // posted, or an error in job.status). mutex_ held.
  bool PostBatchLocked(PostJob& job) {
    auto it = peers_.find(job.peer);
    if (it == peers_.end()) {
      job.status = Aborted("the peer disconnected before the write was posted");
      return true;
    }
    Peer& peer = it->second;
    if (int err = peer.error->load(); err != UCS_OK) {
      job.status = UcsStatus(static_cast<ucs_status_t>(err), "UCX endpoint to the peer failed");
      return true;
    }
    ucp_request_param_t param = {};
    const uint64_t batch_bytes = hooks_.post_batch_bytes > 0
                                     ? static_cast<uint64_t>(hooks_.post_batch_bytes)
                                     : kPostBatchBytes;
    uint64_t batch = 0;
    while (job.next < job.runs.size() && batch < batch_bytes) {
      // A piece of the run: at most what is left of the batch (a long coalesced run must not
      // hold the mutex, nor delay a cancel, for its whole send).
      const CopyRun& run = job.runs[job.next];
      const uint64_t piece = std::min(run.bytes - job.offset, batch_bytes - batch);
      const void* src =
          reinterpret_cast<const uint8_t*>(local_[run.buffer].base) + run.src_offset + job.offset;
      const uint64_t dst = peer.regions[run.DstBuffer()].base + run.dst_offset + job.offset;
      ucs_status_ptr_t req =
          ucp_put_nbx(peer.ep, src, piece, dst, peer.rkeys[run.DstBuffer()], &param);
      if (UCS_PTR_IS_ERR(req)) {
        job.status = UcsStatus(UCS_PTR_STATUS(req), "ucp_put_nbx");
        return true;
      }
      if (req != nullptr) ucp_request_free(req);  // the job's flush covers it
      batch += piece;
      job.offset += piece;
      if (job.offset == run.bytes) {
        ++job.next;
        job.offset = 0;
      }
    }
    return job.next == job.runs.size();
  }

  // Ends a job's posting: a flush over what was posted (so waiters know when none of it is in
  // flight any more), the final status, state kDone. mutex_ held.
  void FinishPostLocked(PostJob& job) {
    if (job.cancel && job.status.ok()) {
      job.status =
          Aborted("the write was cancelled after " + std::to_string(job.next) + " of its " +
                  std::to_string(job.runs.size()) + " runs were posted (and " +
                  std::to_string(job.offset) + " bytes of the next)");
    }
    if (job.next > 0 || job.offset > 0) {
      auto it = peers_.find(job.peer);
      if (it != peers_.end()) {
        StatusOr<void*> flush = PostFlushLocked(it->second);
        if (flush.ok()) {
          job.flush = *flush;
        } else {
          // Only on a failed endpoint: its puts are not waited for (they fail with it).
          KVT_LOG_WARN("ucx", "no flush after {} posted runs: {}", job.next,
                       flush.status().ToString());
          if (job.status.ok()) job.status = flush.status();
        }
      }
    }
    job.state = PostJob::State::kDone;
  }

  // An endpoint flush whose callback (run inside ucp_worker_progress) calls the completion
  // notifier; null when nothing was outstanding. mutex_ held.
  StatusOr<void*> PostFlushLocked(Peer& peer) {
    ucp_request_param_t flush_param = {};
    flush_param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    flush_param.cb.send = [](void*, ucs_status_t, void* self) {
      static_cast<UcxBackend*>(self)->Notify();
    };
    flush_param.user_data = this;
    ucs_status_ptr_t flush = ucp_ep_flush_nbx(peer.ep, &flush_param);
    if (UCS_PTR_IS_ERR(flush)) return UcsStatus(UCS_PTR_STATUS(flush), "ucp_ep_flush_nbx");
    return static_cast<void*>(flush);
  }

  // Stops posting network writes: each dequeued if it has not started, else told to stop after
  // the batch in progress; all are marked before any is waited for (the wait lets other calls
  // take mutex_). Afterwards no further put of them is posted; what was posted is covered by
  // their flushes. mutex_ held.
  void CancelPostsLocked(ApiLock& lock, const std::vector<std::shared_ptr<PostJob>>& jobs) {
    for (const std::shared_ptr<PostJob>& job : jobs) {
      if (job->state == PostJob::State::kQueued) {
        auto it = std::find(post_queue_.begin(), post_queue_.end(), job);
        if (it != post_queue_.end()) post_queue_.erase(it);
        job->state = PostJob::State::kDone;
        job->status = Aborted("the write was cancelled before any of it was posted");
      } else {
        job->cancel = true;
      }
    }
    post_cv_.notify_all();  // a delay or pause hook waiting on a cancel
    post_done_cv_.wait(lock.unique(), [&] {
      return std::all_of(jobs.begin(), jobs.end(), [](const std::shared_ptr<PostJob>& job) {
        return job->state == PostJob::State::kDone;
      });
    });
  }
  void CancelPostLocked(ApiLock& lock, const std::shared_ptr<PostJob>& job) {
    CancelPostsLocked(lock, {job});
  }

  // The network writes not yet fully posted, of one peer or of all. mutex_ held.
  std::vector<std::shared_ptr<PostJob>> PostJobsLocked(std::optional<PeerId> peer) const {
    std::vector<std::shared_ptr<PostJob>> jobs;
    for (const auto& [wid, write] : writes_) {
      if (write.post && (!peer || write.peer == *peer)) jobs.push_back(write.post);
    }
    return jobs;
  }

  // Takes a network write's flush and status over once it is fully posted. mutex_ held.
  void PollPostLocked(Write& write) {
    if (write.post->state != PostJob::State::kDone) return;
    write.flush = write.post->flush;
    write.post->flush = nullptr;
    write.post_error = write.post->status;
    write.status = write.flush != nullptr ? InProgress() : write.post->status;
    write.post.reset();
  }

  // Moves a direct write's status on once its copy finished (or was cancelled).
  void PollJob(Write& write) {
    DirectJob::State state;
    {
      std::lock_guard<std::mutex> lock(copy_mu_);
      state = write.job->state;
    }
    if (state == DirectJob::State::kDone) {
      std::atomic_thread_fence(std::memory_order_acquire);
      write.status = OkStatus();
      write.job.reset();
    } else if (state == DirectJob::State::kCancelled) {
      write.status = Aborted("the direct copy was cancelled before it finished");
      write.job.reset();
    }
  }
  struct Allocation {
    ucp_mem_h memh = nullptr;
    size_t length = 0;
  };

  // The registration of an AllocateHost block holding [base, base + length), or null. mutex_ held.
  ucp_mem_h AllocationContaining(uint64_t base, uint64_t length) const {
    auto it = allocations_.upper_bound(base);
    if (it == allocations_.begin()) return nullptr;
    --it;
    if (base + length > it->first + it->second.length) return nullptr;
    return it->second.memh;
  }

  bool UcxHandlesCuda() const { return (memory_types_ & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0; }

  // Whether a registration of these regions stages (CUDA pools on a UCX that cannot write them,
  // or mode "staged"; host pools only under the test hook). mutex_ held.
  StatusOr<bool> ChooseStagingLocked(std::span<const LocalRegion> regions) const {
    bool any_cuda = false;
    size_t host_buffer = regions.size();
    for (size_t i = 0; i < regions.size(); ++i) {
      if (regions[i].kind == MemoryKind::kCuda) {
        any_cuda = true;
      } else if (host_buffer == regions.size()) {
        host_buffer = i;
      }
    }
    if (!any_cuda) return hooks_.stage_host_memory && !regions.empty();
    if (cuda_mode_ == UcxCudaMode::kDirect) {
      if (!UcxHandlesCuda()) {
        return FailedPrecondition(
            "ucx cuda_mode 'direct' registers CUDA memory with UCX, but UCX " +
            std::string(UcxVersion()) +
            " handles only these memory types: " + MemoryTypeNames(memory_types_) +
            "; use ucx cuda_mode 'auto' or 'staged' (pinned host bounce buffers), or a UCX "
            "built with CUDA support");
      }
      return false;
    }
    if (cuda_mode_ == UcxCudaMode::kAuto && UcxHandlesCuda()) return false;
    if (host_buffer != regions.size()) {
      return InvalidArgument("staging needs every buffer in CUDA memory, but buffer " +
                             std::to_string(host_buffer) + " is host memory");
    }
    if (!cuda::HasDevice()) {
      return Unavailable(
          "staging CUDA buffers through host bounce buffers needs a usable CUDA device, but "
          "there is none (" +
          cuda::DeviceCount().reason + ")");
    }
    return true;
  }

  // Messages unacknowledged per peer: about 8 MiB of data (what a few socket buffers hold over
  // tcp; more only queues inside UCX), at least 2 so one is sent while one is copied.
  static uint32_t RunWindow(size_t message_bytes) {
    return static_cast<uint32_t>(std::clamp<size_t>((size_t{8} << 20) / message_bytes, 2, 64));
  }

  // One round of what the progress thread does under mutex_: both workers, and the staging
  // transport's slots and messages. For a caller that waits with the lock, so that other peers'
  // writes go on even when the progress thread does not get the lock meanwhile.
  unsigned ProgressOnceLocked() {
    unsigned progressed = ucp_worker_progress(worker_);
    if (staging_) {
      progressed += staging_->Progress();
      staging_->Pump();
    }
    return progressed;
  }

  // Progresses until `done()` or `bound` passes; whether `done()` held. `yield`: every
  // kYieldEvery (however busy the workers are), other callers take mutex_ (YieldLocked), so
  // that one peer that does not answer stalls only this call; the rounds in between progress
  // everything (ProgressOnceLocked), not only the worker the awaited request is on. The one
  // wait loop of the backend's bounded waits (flushes, endpoint closes, a write's flush).
  template <typename Done>
  bool ProgressUntilLocked(Done&& done, std::chrono::milliseconds bound, bool yield) {
    constexpr auto kYieldEvery = std::chrono::microseconds(200);
    const auto start = Clock::now();
    auto last_yield = start;
    while (!done()) {
      const auto now = Clock::now();
      if (now - start >= bound) return false;
      if (!yield) {
        ucp_worker_progress(worker_);
        continue;
      }
      ProgressOnceLocked();
      if (now - last_yield >= kYieldEvery) {
        YieldLocked();
        last_yield = Clock::now();
      }
    }
    return true;
  }

  // Whether `req` (a request of worker_) is no longer in progress.
  static bool Finished(void* req) { return ucp_request_check_status(req) != UCS_INPROGRESS; }

  // Whether a connected peer other than `id` links to the backend `instance`. mutex_ held.
  bool SharesInstanceLocked(PeerId id, uint64_t instance) const {
    if (instance == 0) return false;
    return std::any_of(peers_.begin(), peers_.end(), [&](const auto& p) {
      return p.first != id && p.second.remote_instance == instance;
    });
  }

  // Flushes the endpoint and waits (bounded) for the flush: its connection is then set up.
  // Unavailable when the peer does not answer in time. mutex_ held. `yield`: as
  // ProgressUntilLocked's.
  Status FlushLocked(ucp_ep_h ep, const std::string& what, bool yield = false) {
    ucp_request_param_t param = {};
    ucs_status_ptr_t req = ucp_ep_flush_nbx(ep, &param);
    if (req == nullptr) return OkStatus();
    if (UCS_PTR_IS_ERR(req)) return UcsStatus(UCS_PTR_STATUS(req), what);
    ProgressUntilLocked([req] { return Finished(req); }, std::chrono::seconds(5), yield);
    const ucs_status_t st = ucp_request_check_status(req);
    if (st == UCS_INPROGRESS) {
      // Left to UCX: freeing a request still in flight only drops our handle.
      ucp_request_free(req);
      return Unavailable(what +
                         ": the peer's UCX worker did not answer in 5 s; is the peer "
                         "alive and reachable?");
    }
    ucp_request_free(req);
    return UcsStatus(st, what);
  }

  // Whether copy runs to this (connected, unmapped or mapped) peer go as active messages:
  // host_path, whether the peer takes them, and (auto) whether UCX reaches it by native RMA.
  // FailedPrecondition when host_path 'am' cannot be honoured. mutex_ held.
  StatusOr<bool> ChooseRunsLocked(const Peer& peer, const ucx_staging::SplitAddress& address) {
    if (host_path_ == UcxHostPath::kPut || !peer.direct.empty()) return false;
    // This side's host pool is attached for copy runs exactly when it may send them too.
    const bool possible = staging_ != nullptr && staging_->runs_attached() &&
                          !address.runs_address.empty() && address.trailer.has_value();
    if (host_path_ == UcxHostPath::kActiveMessages) {
      if (possible) return true;
      return FailedPrecondition(
          std::string("ucx host_path is 'am', but ") +
          (address.runs_address.empty()
               ? "the peer takes no copy runs as active messages (its host_path is 'put', or it "
                 "registered CUDA memory)"
               : "this side registered no host pool (or its active-message worker did not "
                 "start)") +
          "; use host_path 'auto' or 'put' on this side, or 'auto' or 'am' on the peer");
    }
    if (!possible) return false;
    const bool emulated = RmaEmulated(peer.ep);
    KVT_LOG_DEBUG("ucx", "UCX reaches the peer {}: host writes go as {}",
                  emulated ? "without native RMA" : "by native RMA",
                  emulated ? "active messages" : "puts");
    return emulated;
  }

  // True when no lane of the endpoint carries RMA (UCX then emulates puts over its active
  // messages, as over tcp). UCX 1.13 reports an endpoint's lanes only as text
  // (ucp_ep_print_info); a lane that carries RMA lists "rma" or "rma_bw" among its uses.
  static bool RmaEmulated(ucp_ep_h ep) {
    char* text = nullptr;
    size_t size = 0;
    FILE* out = open_memstream(&text, &size);
    if (out == nullptr) return false;
    ucp_ep_print_info(ep, out);
    fclose(out);
    const std::string info(text, size);
    free(text);
    std::istringstream lines(info);
    std::string line;
    while (std::getline(lines, line)) {
      if (line.find("lane[") == std::string::npos) continue;
      const size_t arrow = line.find("->");  // the lane's uses follow the remote side
      std::istringstream words(arrow == std::string::npos ? line : line.substr(arrow));
      std::string word;
      while (words >> word) {
        if (word.rfind("rma", 0) == 0) return false;
      }
    }
    return true;
  }

  static void OnEndpointError(void* arg, ucp_ep_h, ucs_status_t status) {
    static_cast<std::atomic<int>*>(arg)->store(status);
    KVT_LOG_WARN("ucx", "endpoint error: {}", ucs_status_string(status));
  }

  // Moves a write's status forward if its flush finished. mutex_ held.
  void PollLocked(Write& write) {
    if (write.flush == nullptr) return;
    ucs_status_t st = ucp_request_check_status(write.flush);
    if (st == UCS_INPROGRESS) return;
    ucp_request_free(write.flush);
    write.flush = nullptr;
    // A posting error (or the cancel) says more than the flush failing after it.
    write.status = st == UCS_OK || !write.post_error.ok()
                       ? write.post_error
                       : UcsStatus(st, "UCX write failed at flush");
  }

  // Progresses until the write's flush has finished (bounded: a dead endpoint fails its flush);
  // a direct copy still running is cancelled and waited for.
  // A network write's posting must have been cancelled (CancelPostLocked) before. With `yield`,
  // other calls may take the lock between rounds (YieldLocked): only for a write the caller took
  // out of writes_.
  void WaitLocked(Write& write, bool yield = false) {
    if (write.job) {
      CancelJob(write.job);
      PollJob(write);
    }
    if (write.post) {
      PollPostLocked(write);
      if (write.post) {  // a caller forgot CancelPostLocked: never wait here without the lock
        KVT_LOG_ERROR("ucx", "waiting for a write whose posting was not stopped");
        write.post.reset();
        write.status = Internal("the write's posting was not stopped before waiting");
      }
    }
    const bool flushed = ProgressUntilLocked(
        [&] {
          PollLocked(write);
          return write.flush == nullptr;
        },
        std::chrono::seconds(30), yield);
    if (!flushed) {
      KVT_LOG_ERROR("ucx", "a flush did not finish in 30 s; leaking its request");
      write.flush = nullptr;
      write.status = DeadlineExceeded("UCX flush did not finish in 30 s");
    }
  }

  // Closes the endpoint: flushing when the peer is alive (bounded, so a peer that died
  // unannounced cannot hang us), forced when it is known dead. UCX documents the forced close as
  // needing UCP_ERR_HANDLING_MODE_PEER because it may cause errors on the remote side; with the
  // remote gone there is no remote side left to disturb.
  // `yield`: as ProgressUntilLocked's; only for a peer no longer in peers_.
  void ClosePeerLocked(Peer& peer, bool peer_dead = false, bool yield = false) {
    for (ucp_rkey_h rkey : peer.rkeys) ucp_rkey_destroy(rkey);
    peer.rkeys.clear();
    if (peer.ep == nullptr) return;
    ucp_request_param_t param = {};
    if (peer_dead) {
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = UCP_EP_CLOSE_FLAG_FORCE;
    }
    ucs_status_ptr_t req = ucp_ep_close_nbx(peer.ep, &param);
    peer.ep = nullptr;
    // UCX 1.13's tcp transport may still fail a closed endpoint whose connection was being
    // set up (an endpoint never written to: the peer's writes went as active messages) and then
    // call its error handler: the handler's state outlives the peer.
    retired_errors_.push_back(peer.error);
    if (retired_errors_.size() > kRetiredErrors) retired_errors_.pop_front();
    if (req == nullptr || UCS_PTR_IS_ERR(req)) return;
    if (!ProgressUntilLocked([req] { return Finished(req); }, std::chrono::seconds(2), yield)) {
      KVT_LOG_WARN("ucx", "endpoint close did not finish in 2 s (peer gone?); leaving it");
    }
    ucp_request_free(req);
  }

  void UnmapLocked() {
    for (ucp_mem_h memh : memhs_) ucp_mem_unmap(context_, memh);
    memhs_.clear();
    local_.clear();
  }

  // Progresses the worker: spins while there is work or for spin_ after it, then sleeps on the
  // worker's event fd (woken by network activity or by ucp_worker_signal from PostWrite).
  void ProgressLoop() {
    auto last_work = Clock::now();
    control::internal::SpinPacer pacer;
    while (!stop_.load(std::memory_order_relaxed)) {
      if (api_waiters_.load(std::memory_order_acquire) > 0) {
        std::this_thread::yield();  // an API call wants the worker; it progresses it too
        continue;
      }
      if (hooks_.hold_progress && hooks_.hold_progress->load(std::memory_order_acquire)) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        continue;
      }
      unsigned progressed;
      bool polling = false;
      int staging_fd = -1;
      int completion_fd = -1;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        progressed = ProgressOnceLocked();
        if (staging_) {
          polling = staging_->NeedsPolling();
          staging_fd = staging_->event_fd();
          completion_fd = staging_->completion_fd();
        }
      }
      const auto now = Clock::now();
      if (progressed != 0 || polling) {
        last_work = now;
        continue;
      }
      if (now - last_work < spin_) {
        pacer.Wait();
        continue;
      }
      bool armed;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        armed = ucp_worker_arm(worker_) != UCS_ERR_BUSY;
        if (armed && staging_) armed = staging_->Arm();
      }
      if (!armed) continue;
      // The staging worker's fd, and the copier's completions (gathers waiting for a forward
      // pass finish on the GPU: the copier's callback wakes us, no polling meanwhile).
      // poll skips entries whose fd is -1 (no staging, or no completion fd).
      pollfd pfds[3] = {
          {event_fd_, POLLIN, 0}, {staging_fd, POLLIN, 0}, {completion_fd, POLLIN, 0}};
      poll(pfds, 3, 10);  // bounded so stop_ is seen even without a signal
      if ((pfds[2].revents & POLLIN) != 0) {
        std::lock_guard<std::mutex> lock(mutex_);
        // Drained before the next Pump looks at the slots: a completion after this read makes
        // the fd readable again for the next poll.
        if (staging_) staging_->DrainCompletions();
      }
      last_work = Clock::now();
    }
  }

  const std::chrono::microseconds spin_;
  const bool direct_shm_;
  const size_t direct_inline_bytes_;
  const int copy_threads_;
  const std::string transports_;
  const UcxCudaMode cuda_mode_;
  const int staging_slots_;
  const size_t staging_slot_bytes_;
  const bool staging_in_place_;
  const UcxHostPath host_path_;
  const ucx_staging::RunOptions run_options_;
  const UcxTestHooks hooks_;
  const uint64_t instance_;
  std::atomic<bool> staged_{false};  // the current registration stages a CUDA pool
  std::atomic<bool> stop_{false};
  std::atomic<int> api_waiters_{0};  // API calls waiting for mutex_
  std::thread progress_;

  // The copy threads and their queue (direct writes above direct_inline_bytes_).
  std::mutex copy_mu_;
  std::condition_variable copy_cv_;       // work queued, or stop
  std::condition_variable copy_done_cv_;  // a job left kRunning
  std::deque<std::shared_ptr<DirectJob>> copy_queue_;
  bool copy_stop_ = false;
  std::vector<std::thread> copiers_;

  // The poster thread and its queue (network writes above direct_inline_bytes_), guarded by
  // mutex_.
  std::condition_variable post_cv_;       // a job queued, a cancel, or stop
  std::condition_variable post_done_cv_;  // a job reached kDone
  std::deque<std::shared_ptr<PostJob>> post_queue_;
  bool post_stop_ = false;
  std::thread poster_;

  std::mutex notify_mu_;  // guards notify_; held while it runs
  std::function<void()> notify_;

  ucp_context_h context_ = nullptr;
  uint64_t memory_types_ = 0;
  int event_fd_ = -1;

  std::mutex mutex_;  // guards the worker and everything below
  ucp_worker_h worker_ = nullptr;
  ucp_address_t* worker_address_ = nullptr;
  size_t worker_address_len_ = 0;
  std::vector<ucp_mem_h> memhs_;                // registrations made by Register
  std::map<uint64_t, Allocation> allocations_;  // AllocateHost blocks by address
  std::vector<LocalRegion> local_;
  std::unordered_map<PeerId, Peer> peers_;
  // Error states of closed endpoints (ClosePeerLocked), the newest kRetiredErrors kept.
  static constexpr size_t kRetiredErrors = 4096;
  std::deque<std::shared_ptr<std::atomic<int>>> retired_errors_;
  std::unordered_map<WriteId, Write> writes_;
  // The staged path (CUDA pools on a UCX without CUDA support): its own UCP context and worker,
  // created by the first staged registration, guarded by mutex_ like the rest.
  std::unique_ptr<ucx_staging::StagedTransport> staging_;
  PeerId next_peer_ = 1;
  WriteId next_write_ = 1;
};

}  // namespace

const char* UcxVersion() { return ucp_get_version_string(); }

namespace {

StatusOr<UcxBackend*> AsUcx(Backend& backend) {
  auto* ucx = dynamic_cast<UcxBackend*>(&backend);
  if (ucx == nullptr) {
    return InvalidArgument("backend '" + std::string(backend.Name()) +
                           "' is not ucx; pass a backend made with backend \"ucx\"");
  }
  return ucx;
}

}  // namespace

StatusOr<size_t> UcxMappedSenderSlots(Backend& backend) {
  KVT_ASSIGN_OR_RETURN(UcxBackend * ucx, AsUcx(backend));
  return ucx->MappedSenderSlots();
}

StatusOr<std::string> UcxPeerPath(Backend& backend, PeerId peer) {
  KVT_ASSIGN_OR_RETURN(UcxBackend * ucx, AsUcx(backend));
  return ucx->PeerPath(peer);
}

std::string_view UcxCudaModeName(UcxCudaMode mode) {
  switch (mode) {
    case UcxCudaMode::kAuto:
      return "auto";
    case UcxCudaMode::kStaged:
      return "staged";
    case UcxCudaMode::kDirect:
      return "direct";
  }
  return "unknown";
}

StatusOr<UcxCudaMode> ParseUcxCudaMode(std::string_view name) {
  for (UcxCudaMode mode : {UcxCudaMode::kAuto, UcxCudaMode::kStaged, UcxCudaMode::kDirect}) {
    if (name == UcxCudaModeName(mode)) return mode;
  }
  return InvalidArgument("ucx cuda_mode is '" + std::string(name) +
                         "'; use 'auto', 'staged' or 'direct'");
}

std::string_view UcxHostPathName(UcxHostPath path) {
  switch (path) {
    case UcxHostPath::kAuto:
      return "auto";
    case UcxHostPath::kPut:
      return "put";
    case UcxHostPath::kActiveMessages:
      return "am";
  }
  return "unknown";
}

StatusOr<UcxHostPath> ParseUcxHostPath(std::string_view name) {
  for (UcxHostPath path : {UcxHostPath::kAuto, UcxHostPath::kPut, UcxHostPath::kActiveMessages}) {
    if (name == UcxHostPathName(path)) return path;
  }
  return InvalidArgument("ucx host_path is '" + std::string(name) +
                         "'; use 'auto', 'put' or 'am' (active messages)");
}

namespace {

Status ValidateUcxOptions(const UcxOptions& options) {
  if (options.spin < std::chrono::microseconds(0) || options.spin > std::chrono::seconds(1)) {
    return InvalidArgument("ucx spin is " + std::to_string(options.spin.count()) +
                           " us; use 0..1000000 us (how long the progress thread spins before "
                           "it sleeps)");
  }
  if (options.copy_threads < 0 || options.copy_threads > kMaxCopyThreads) {
    return InvalidArgument("ucx copy_threads is " + std::to_string(options.copy_threads) +
                           "; use 1.." + std::to_string(kMaxCopyThreads) +
                           " (threads copying a large write into a peer's mapped buffers), or "
                           "0 for half the cores (2..8)");
  }
  const std::string_view mode = UcxCudaModeName(options.cuda_mode);
  if (mode == "unknown") {
    return InvalidArgument("ucx cuda_mode is " +
                           std::to_string(static_cast<int>(options.cuda_mode)) +
                           "; use UcxCudaMode::kAuto, kStaged or kDirect");
  }
  if (options.staging_slots < 1 || options.staging_slots > 4096) {
    return InvalidArgument("ucx staging_slots is " + std::to_string(options.staging_slots) +
                           "; give 1 to 4096 bounce slots");
  }
  if (options.staging_slot_bytes < ucx_staging::kMinSlotBytes ||
      options.staging_slot_bytes > (uint64_t{1} << 32)) {
    return InvalidArgument("ucx staging_slot_bytes is " +
                           std::to_string(options.staging_slot_bytes) + "; give " +
                           std::to_string(ucx_staging::kMinSlotBytes) + " bytes to 4 GiB");
  }
  if (UcxHostPathName(options.host_path) == "unknown") {
    return InvalidArgument("ucx host_path is " +
                           std::to_string(static_cast<int>(options.host_path)) +
                           "; use UcxHostPath::kAuto, kPut or kActiveMessages");
  }
  if (options.am_message_bytes < 4096 ||
      options.am_message_bytes > ucx_staging::kMaxRunMessageBytes) {
    return InvalidArgument("ucx am_message_bytes is " + std::to_string(options.am_message_bytes) +
                           "; give 4096 bytes to 64 MiB of data per active message");
  }
  return OkStatus();
}

}  // namespace

StatusOr<std::unique_ptr<Backend>> CreateUcxBackend(const UcxOptions& options) {
  return CreateUcxBackendForTest(options, UcxTestHooks{});
}

StatusOr<std::unique_ptr<Backend>> CreateUcxBackendForTest(const UcxOptions& options,
                                                           const UcxTestHooks& hooks) {
  KVT_RETURN_IF_ERROR(ValidateUcxOptions(options));
  auto backend = std::make_unique<UcxBackend>(options, hooks);
  KVT_RETURN_IF_ERROR(backend->Init().WithContext("starting the UCX backend"));
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace kvt::transfer

// TransferEngine: the public facade. It builds the context both sides share (layout, backend,
// registration), then hands every call to the side of its role (prefill_side.cc,
// decode_side.cc); the poller (poller.cc) drives deadlines and completions.
#include "kvt/transfer/engine.h"

#include <unistd.h>

#include "backends/common/host_identity.h"
#include "backends/common/page_bounds.h"
#include "engine/decode_side.h"
#include "engine/layout_codec.h"
#include "engine/poller.h"
#include "engine/prefill_side.h"
#include "engine/process_identity.h"
#include "kvt/common/log.h"

namespace kvt::transfer {

const char* RequestStateName(RequestState state) {
  switch (state) {
    case RequestState::kBootstrapping:
      return "Bootstrapping";
    case RequestState::kWaitingForInput:
      return "WaitingForInput";
    case RequestState::kTransferring:
      return "Transferring";
    case RequestState::kSuccess:
      return "Success";
    case RequestState::kFailed:
      return "Failed";
  }
  return "Unknown";
}

class TransferEngine::Impl {
 public:
  Impl(const EngineOptions& options, TransferLayout layout, std::shared_ptr<Backend> backend)
      : ctx_(options) {
    ctx_.layout = std::move(layout);
    ctx_.backend = std::move(backend);
  }

  ~Impl() { Shutdown(); }

  Status Init() {
    const EngineOptions& options = ctx_.options;
    // (Bounded also so that a window's end always fits the clock's nanoseconds.)
    if (options.control_busy_poll.count() < 0 || options.control_busy_poll > kMaxControlBusyPoll) {
      return InvalidArgument("EngineOptions::control_busy_poll = " +
                             std::to_string(options.control_busy_poll.count()) +
                             " us: must be in 0 .. " + std::to_string(kMaxControlBusyPoll.count()) +
                             " us (e.g. 1000 for 1 ms; 0: the control threads sleep between "
                             "frames)");
    }
    if (options.hello_timeout.count() <= 0) {
      return InvalidArgument(
          "EngineOptions::hello_timeout = " + std::to_string(options.hello_timeout.count()) +
          " ms: must be > 0 (how long ConnectPeer waits for the hello's answer)");
    }
    constexpr auto kMaxPeerTimeout = std::chrono::hours(23);
    if (options.peer_timeout.count() <= 0 || options.peer_timeout > kMaxPeerTimeout) {
      return InvalidArgument(
          "EngineOptions::peer_timeout = " + std::to_string(options.peer_timeout.count()) +
          " ms: must be in 1 ms .. 23 h (how long a silent peer is waited for before it is lost)");
    }
    if (options.heartbeat_interval.count() <= 0 ||
        options.heartbeat_interval >= options.peer_timeout) {
      return InvalidArgument(
          "EngineOptions::heartbeat_interval = " +
          std::to_string(options.heartbeat_interval.count()) + " ms: must be > 0 and below " +
          "peer_timeout = " + std::to_string(options.peer_timeout.count()) +
          " ms, or idle peers are declared lost (a third of peer_timeout or less is usual)");
    }
    KVT_ASSIGN_OR_RETURN(ctx_.local_layout, LayoutToProto(ctx_.layout));
    ctx_.buffers = ctx_.layout.Flatten();
    if (!ctx_.backend) {
      KVT_ASSIGN_OR_RETURN(ctx_.backend, CreateBackend(options.backend));
    }
    const std::vector<LocalRegion> regions = LocalRegionsOf(ctx_.layout, ctx_.buffers);
    KVT_ASSIGN_OR_RETURN(PeerDescriptor descriptor, ctx_.backend->Register(regions));
    const BackendCapabilities caps = ctx_.backend->Capabilities();
    // Device backends take page lists (one gather/scatter launch per layer batch) and wait for
    // the producer's event on the GPU; the others copy on the CPU once it has completed.
    ctx_.page_writes = caps.page_writes;
    ctx_.waits_on_events = caps.page_writes && ctx_.layout.device >= 0;
    ctx_.notified = caps.notifies_completion;
    ctx_.hinted = caps.completion_hints;
    if (ctx_.notified) {
      // Never blocks (a CUDA host function may call it).
      ctx_.backend->SetCompletionNotifier([this] { ctx_.wakeup.Kick(); });
      // The poller watches a write that can run and asks for a notice only before it sleeps
      // (Poller::Loop), so a post does not pay for a notice nobody waits for.
      ctx_.backend->SetNoticesOnDemand(true);
    }
    ctx_.local_info =
        MakePeerInfo(options.name, options.prefill, ctx_.local_layout, descriptor, regions);
    // Who we are, so that a peer on this host can tell later whether this process is gone.
    ctx_.local_info.set_host_id(ReadBootId("xfer"));
    ctx_.local_info.set_pid(static_cast<uint32_t>(getpid()));
    ctx_.local_info.set_process_start(engine::OwnProcessStart());
    if (options.prefill) {
      ctx_.local_info.set_fence_ms(
          static_cast<uint32_t>((options.peer_timeout + engine::kFenceTeardown).count()));
    }
    ctx_.worker = std::make_unique<engine::Worker>(*ctx_.backend);
    if (options.prefill) {
      auto prefill = std::make_unique<engine::PrefillSide>(ctx_);
      prefill_ = prefill.get();
      side_ = std::move(prefill);
      KVT_RETURN_IF_ERROR(prefill_->Start());
    } else {
      auto decode = std::make_unique<engine::DecodeSide>(ctx_);
      decode_ = decode.get();
      side_ = std::move(decode);
      KVT_RETURN_IF_ERROR(decode_->Start());
    }
    poller_ = std::make_unique<engine::Poller>(ctx_, *side_);
    poller_->Start();
    KVT_LOG_INFO("xfer", "{} engine '{}' up: backend {}, {} buffers ({}){}",
                 options.prefill ? "prefill" : "decode", options.name, ctx_.backend->Name(),
                 regions.size(), ctx_.layout.Describe(),
                 prefill_ ? ", control port " + std::to_string(prefill_->port()) : "");
    return OkStatus();
  }

  void Shutdown() {
    if (shut_down_.exchange(true)) return;
    if (poller_) poller_->Stop();
    {
      MutexLock lock(ctx_.mu);
      ctx_.stop = true;
    }
    if (side_) side_->Shutdown();
    if (ctx_.worker) ctx_.worker->Stop();
    if (ctx_.notified && ctx_.backend) ctx_.backend->SetCompletionNotifier(nullptr);
  }

  void Interrupt() {
    {
      MutexLock lock(ctx_.mu);
      ctx_.interrupted = true;
    }
    ctx_.NotifyFinal();
    if (decode_ != nullptr) decode_->Interrupt();
  }

  uint16_t port() const { return prefill_ ? prefill_->port() : 0; }
  std::string_view backend_name() const { return ctx_.backend->Name(); }

  StatusOr<PeerHandle> ConnectPeer(const std::string& host, uint16_t port) {
    if (decode_ == nullptr) {
      return FailedPrecondition("ConnectPeer is for decode engines; this engine is prefill");
    }
    return decode_->ConnectPeer(host, port);
  }

  Status Receive(const std::string& room, PeerHandle peer, std::vector<int32_t> dst_pages,
                 const ReceiveOptions& options) {
    const std::chrono::milliseconds deadline = options.deadline;
    int32_t layer_begin = options.layer_begin;
    int32_t layer_end = options.layer_end;
    if (decode_ == nullptr) {
      return FailedPrecondition("Receive is for decode engines; this engine is prefill");
    }
    if (room.empty()) return InvalidArgument("room id is empty");
    if (dst_pages.empty()) return InvalidArgument("room '" + room + "' names no pages");
    const int32_t num_layers = ctx_.num_layers();
    if (layer_end < 0) layer_end = num_layers;
    if (layer_begin < 0 || layer_begin >= layer_end || layer_end > num_layers) {
      return InvalidArgument("layer range [" + std::to_string(layer_begin) + ", " +
                             std::to_string(layer_end) + ") is not inside [0, " +
                             std::to_string(num_layers) + ")");
    }
    KVT_RETURN_IF_ERROR(CheckOwnPages(dst_pages, "destination"));
    KVT_RETURN_IF_ERROR(CheckAuxSlot(options.aux_slot, room));
    return decode_->Receive(room, peer, std::move(dst_pages), deadline, layer_begin, layer_end,
                            options.aux_slot);
  }

  Status Send(const std::string& room, std::vector<int32_t> src_pages, const SendOptions& options) {
    const std::chrono::milliseconds deadline = options.deadline;
    if (prefill_ == nullptr) {
      return FailedPrecondition("Send is for prefill engines; this engine is decode");
    }
    if (room.empty()) return InvalidArgument("room id is empty");
    // An empty list only closes a chunked room whose chunks already hold every page.
    if (src_pages.empty() && !options.last) {
      return InvalidArgument("room '" + room +
                             "' names no pages; an empty Send may only be the last chunk of a "
                             "chunked room (SendOptions::last = true)");
    }
    if (deadline.count() < 0) {
      return InvalidArgument("deadline " + std::to_string(deadline.count()) + " ms of room '" +
                             room + "' is negative; pass 0 for the engine's default deadline");
    }
    KVT_RETURN_IF_ERROR(CheckOwnPages(src_pages, "source"));
    KVT_RETURN_IF_ERROR(CheckAuxSlot(options.aux_slot, room));
    return prefill_->Send(room, std::move(src_pages), options);
  }

  const TransferLayout& layout() const { return ctx_.layout; }

  Status LayersReady(const std::string& room, int32_t layers_done, cudaEvent_t ready) {
    if (prefill_ == nullptr) {
      return FailedPrecondition(
          "LayersReady is for prefill engines; call it on the engine that Send()s the room");
    }
    return prefill_->LayersReady(room, layers_done, ready);
  }

  engine::EngineSide& side() const { return *side_; }

  EngineStats stats() const {
    EngineStats stats;
    {
      MutexLock lock(ctx_.mu);
      stats = ctx_.stats;
    }
    stats.control_lanes = side().ControlLanes();
    stats.poller_hot_spins = ctx_.poller_hot_spins.load(std::memory_order_relaxed);
    return stats;
  }

 private:
  Status CheckAuxSlot(int64_t slot, const std::string& room) const {
    if (slot == -1) return OkStatus();
    const uint64_t slots = ctx_.layout.num_aux_slots();
    if (slots == 0) {
      return InvalidArgument("room '" + room + "' names aux slot " + std::to_string(slot) +
                             " but this engine's layout has no aux buffers; pass -1, or "
                             "register aux buffers in the layout");
    }
    if (slot < 0 || static_cast<uint64_t>(slot) >= slots) {
      return OutOfRange("room '" + room + "': aux slot " + std::to_string(slot) +
                        " is outside [0, " + std::to_string(slots) + ") (-1: no aux data)");
    }
    return OkStatus();
  }

  Status CheckOwnPages(const std::vector<int32_t>& pages, const char* side) const {
    const uint64_t num_pages = ctx_.local_layout.num_pages();
    if (PagesInside(pages, 1, num_pages)) return OkStatus();
    for (size_t i = 0; i < pages.size(); ++i) {
      if (pages[i] < 1 || static_cast<uint64_t>(pages[i]) >= num_pages) {
        return OutOfRange(std::string(side) + " page " + std::to_string(pages[i]) +
                          " at position " + std::to_string(i) + " is outside [1, " +
                          std::to_string(num_pages) + "); page 0 is the dummy page");
      }
    }
    return OkStatus();
  }

  // Destroyed last (declared first): the sides and the poller use it.
  engine::EngineContext ctx_;
  std::unique_ptr<engine::EngineSide> side_;
  engine::PrefillSide* prefill_ = nullptr;
  engine::DecodeSide* decode_ = nullptr;
  std::unique_ptr<engine::Poller> poller_;
  std::atomic<bool> shut_down_{false};
};

// --------------------------------------------------------------------------- public wrapper --
TransferEngine::TransferEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TransferEngine::~TransferEngine() = default;

StatusOr<std::unique_ptr<TransferEngine>> TransferEngine::Create(const EngineOptions& options,
                                                                 pool::KvPool* pool,
                                                                 std::shared_ptr<Backend> backend) {
  if (pool == nullptr) return InvalidArgument("the engine needs a pool (got null)");
  KVT_ASSIGN_OR_RETURN(TransferLayout layout,
                       TransferLayout::FromPool(*pool, options.tp_rank, options.tp_size));
  auto impl = std::make_unique<Impl>(options, std::move(layout), std::move(backend));
  KVT_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<TransferEngine>(new TransferEngine(std::move(impl)));
}

StatusOr<std::unique_ptr<TransferEngine>> TransferEngine::Create(const EngineOptions& options,
                                                                 const TransferLayout& layout,
                                                                 std::shared_ptr<Backend> backend) {
  KVT_RETURN_IF_ERROR(layout.Validate());
  auto impl = std::make_unique<Impl>(options, layout, std::move(backend));
  KVT_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<TransferEngine>(new TransferEngine(std::move(impl)));
}

uint16_t TransferEngine::port() const { return impl_->port(); }
std::string_view TransferEngine::backend_name() const { return impl_->backend_name(); }
void TransferEngine::Interrupt() { impl_->Interrupt(); }

StatusOr<PeerHandle> TransferEngine::ConnectPeer(const std::string& host, uint16_t port) {
  return impl_->ConnectPeer(host, port);
}
Status TransferEngine::Receive(const std::string& room, PeerHandle peer,
                               std::vector<int32_t> dst_pages, std::chrono::milliseconds deadline,
                               int32_t layer_begin, int32_t layer_end) {
  ReceiveOptions options;
  options.deadline = deadline;
  options.layer_begin = layer_begin;
  options.layer_end = layer_end;
  return impl_->Receive(room, peer, std::move(dst_pages), options);
}
Status TransferEngine::Receive(const std::string& room, PeerHandle peer,
                               std::vector<int32_t> dst_pages, const ReceiveOptions& options) {
  return impl_->Receive(room, peer, std::move(dst_pages), options);
}
Status TransferEngine::Send(const std::string& room, std::vector<int32_t> src_pages,
                            std::chrono::milliseconds deadline) {
  SendOptions options;
  options.deadline = deadline;
  return impl_->Send(room, std::move(src_pages), options);
}
Status TransferEngine::Send(const std::string& room, std::vector<int32_t> src_pages,
                            const SendOptions& options) {
  return impl_->Send(room, std::move(src_pages), options);
}
const TransferLayout& TransferEngine::layout() const { return impl_->layout(); }
Status TransferEngine::LayersReady(const std::string& room, int32_t layers_done,
                                   cudaEvent_t ready) {
  return impl_->LayersReady(room, layers_done, ready);
}
StatusOr<RequestInfo> TransferEngine::GetRequest(const std::string& room) const {
  return impl_->side().GetRequest(room);
}
StatusOr<RequestInfo> TransferEngine::WaitRequest(const std::string& room,
                                                  std::chrono::milliseconds timeout) const {
  return impl_->side().WaitRequest(room, timeout);
}
Status TransferEngine::Abort(const std::string& room, const std::string& reason) {
  return impl_->side().Abort(room, reason);
}
Status TransferEngine::Forget(const std::string& room) { return impl_->side().Forget(room); }
EngineStats TransferEngine::stats() const { return impl_->stats(); }

}  // namespace kvt::transfer

// A transfer backend moves bytes from registered local memory into a peer's registered memory.
//
// Every backend (ucx, loopback, later cuda_ipc and nccl) is one class behind this interface,
// with the same cycle: capability queries first, then register (once per pool) -> connect a peer
// (from the descriptors the peer published in its hello) -> post a batch of copy runs -> check
// it until it completes -> release it. A write that Check() reports complete is visible in the
// peer's memory (the backend flushed it), so "done" may be sent right after.
//
// Thread safety: every method may be called from any thread; implementations serialise access
// to their own state. Completion is polled (Check), never called back, so the caller decides on
// which thread request state moves.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvt/common/status.h"
#include "kvt/transfer/plan.h"

namespace kvt::transfer {

enum class MemoryKind : uint8_t { kHost = 0, kCuda = 1 };

// One local buffer to register: a layout's KV buffer (base, length, item_len) and the transfer
// layer it belongs to. Buffers are registered in the layout's buffer order (TransferLayout:
// group by group, K of every layer then V, or one buffer per layer for latent groups), and a
// peer's buffers correspond to ours index by index (the engines checked their layouts match).
struct LocalRegion {
  uint64_t base = 0;
  uint64_t length = 0;
  uint64_t item_len = 0;
  MemoryKind kind = MemoryKind::kHost;
  int32_t device = -1;  // CUDA device ordinal for kCuda
  int32_t layer = 0;    // transfer layer: a page write of layers [a, b) moves the buffers in it
};

// What a peer needs to write into one of our buffers; travels in the hello.
struct RemoteRegion {
  uint64_t base = 0;
  uint64_t length = 0;
  uint64_t item_len = 0;
  std::string key;  // backend-specific: UCX packed rkey, CUDA IPC handle, ...
};

// What a peer published: its backend address and one descriptor per buffer, in buffer order.
struct PeerDescriptor {
  std::string backend;  // must equal Backend::Name() of the connecting side
  std::string address;  // backend-specific endpoint address (UCX worker address, ...)
  std::vector<RemoteRegion> regions;
};

struct BackendCapabilities {
  bool host_memory = false;    // can register and write host memory
  bool cuda_memory = false;    // can register CUDA memory directly
  bool inter_process = false;  // peers may live in other processes
  bool inter_node = false;     // peers may live on other machines
  // Writes are posted as page lists (PostPages: one gather/scatter per layer batch, device
  // memory) rather than as copy runs; PostWrite may then be Unimplemented. May change with
  // Register (the ucx backend stages CUDA pools through bounce buffers page by page).
  bool page_writes = false;
  // The receiving side takes part in every transfer (nccl: matching receives on a two-rank
  // communicator). The engine then calls ConnectToken after Connect on the sending side, carries
  // the token in the hello-ack, and the receiving side joins with Accept.
  bool two_sided = false;
  // Calls the completion notifier (SetCompletionNotifier) when writes complete, so the caller
  // needs no tight polling loop.
  bool notifies_completion = false;
  // CompletedHint tells, without a lock or a driver call, that a write has completed (cuda_ipc:
  // a word its stream sets after each write), so a thread that watches a running write can
  // spin on it instead of on Check.
  bool completion_hints = false;
};

// A page-indexed write: for every registered buffer whose layer lies in [layer_begin,
// layer_end) (LocalRegion::layer; buffers of one layer in registration order, layers ascending),
// page src_pages[i] of ours goes to page dst_pages[i] of the peer's; whole pages when `units` is
// empty, else each unit's bytes of every page. Buffers may differ in item_len (a draft model's
// pages hold other heads). The engine validated the pages against both sides' buffers
// (ValidatePlanSpec) before posting.
struct PageWrite {
  std::span<const int32_t> src_pages;
  std::span<const int32_t> dst_pages;
  int32_t num_layers = 0;  // transfer layers of the layout (the highest region layer + 1)
  int32_t layer_begin = 0;
  int32_t layer_end = 0;
  std::span<const PageUnit> units;
  uint64_t bytes = 0;  // total bytes (PlanBytes), for accounting
  // Device backends: the copy waits (on the GPU, cudaStreamWaitEvent at post time) for this
  // event, recorded by the producer after it wrote the layers. Null: the source is ready now.
  cudaEvent_t ready = nullptr;
};

using PeerId = uint64_t;
using WriteId = uint64_t;

class Backend {
 public:
  virtual ~Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  virtual std::string_view Name() const = 0;
  virtual BackendCapabilities Capabilities() const = 0;

  // Registers the local buffers once (replacing any earlier registration, which must have no
  // writes in flight) and returns this side's descriptor for the hello.
  virtual StatusOr<PeerDescriptor> Register(std::span<const LocalRegion> regions) = 0;

  // Connects to a peer from its descriptor. The peer's regions must correspond one to one to
  // ours (same buffer count); lengths may differ (the plan checks offsets against them).
  virtual StatusOr<PeerId> Connect(const PeerDescriptor& peer) = 0;

  // Two-sided backends, sending side: what the peer needs to join the connection made by
  // Connect (sent back in the hello-ack). Empty for one-sided backends.
  virtual StatusOr<std::string> ConnectToken(PeerId peer) { return std::string(); }

  // Two-sided backends, receiving side: joins the connection the peer (described by its
  // hello-ack) made to us, with the peer's token. The returned id is Disconnected like one from
  // Connect when the control connection ends. May complete the join in the background; the
  // peer's writes wait for it.
  virtual StatusOr<PeerId> Accept(const PeerDescriptor& peer, const std::string& token) {
    return Unimplemented(std::string(Name()) + " is one-sided: the receiver does not join");
  }

  // Forgets a peer: its writes in flight are waited for (bounded) or cancelled, after which
  // Check reports them Aborted, and its resources are released. kPeerDead skips every exchange
  // with the peer (use it once the control plane has declared the peer dead). Unknown ids are
  // NotFound.
  enum class DisconnectMode { kGraceful, kPeerDead };
  virtual Status Disconnect(PeerId peer, DisconnectMode mode = DisconnectMode::kGraceful) = 0;

  // Receiving side of one-sided backends, when the control plane has lost the peer that
  // published `peer` (its hello-ack): every connection it made to us is closed here and nothing
  // more it sent on them lands, even bytes a network that was down delivers later. A sender that
  // is still alive (a partition, not a death) has each such write refused where the backend can
  // answer it, so that the write fails at once, naming the fence, instead of at its deadline.
  // Connections it makes afterwards (a new session) are accepted as usual. A backend whose writes
  // cannot outlive the sender's own fence (its close ends them) has nothing to do.
  virtual void FenceSender(const PeerDescriptor& peer) {}

  // Starts writing `runs` (source offsets in our buffers, destination offsets in the peer's)
  // and returns a handle. The runs are copied; the memory they name must stay registered.
  virtual StatusOr<WriteId> PostWrite(PeerId peer, std::span<const CopyRun> runs) = 0;

  // Starts a page-indexed write (backends with Capabilities().page_writes); the spans are copied
  // before returning, and `ready` is waited for on the GPU, never on this thread.
  virtual StatusOr<WriteId> PostPages(PeerId peer, const PageWrite& write) {
    return Unimplemented(std::string(Name()) + " posts copy runs, not page lists");
  }

  // OK once every byte of the write is visible at the peer; InProgress while it runs; another
  // error when it failed (the write's bytes at the peer are then undefined).
  virtual Status Check(WriteId write) = 0;

  // True when the write's turn has certainly passed (Capabilities().completion_hints): a load,
  // no lock and no driver call, for a thread that spins while a write it posted runs. False
  // while it runs and for writes the hint does not cover; for an id it does not know (released,
  // or never posted) the answer means nothing. It never says whether the write succeeded: Check
  // tells that (and reports a failed write). Thread-safe.
  virtual bool CompletedHint(WriteId write) const { return false; }

  // Installs `notify` (null: none): the backend calls it, from any thread (a CUDA host callback
  // or its progress thread), when a write may have completed, so that the caller Checks at once
  // instead of at its next poll. `notify` must return quickly and never block or call back into
  // the backend. Once this returns, the previous notifier is no longer running or called.
  virtual void SetCompletionNotifier(std::function<void()> notify) {}

  // Notices on demand, for a caller that watches its writes itself while they run and wants a
  // notice only when it stops watching (the engine's poller: it spins on a device write that can
  // run, and sleeps otherwise). After SetNoticesOnDemand(true) a backend whose notices cost
  // something per write (cuda_ipc: a CUDA host function, about 4 µs of the posting thread) sends
  // none by itself; ArmCompletionNotice then asks for one notice when the oldest write in flight
  // completes (at once if it has). Backends whose notices cost nothing per write ignore both and
  // keep notifying. Thread-safe; never blocks on the GPU.
  virtual void SetNoticesOnDemand(bool on_demand) {}
  virtual void ArmCompletionNotice() {}

  // Frees a write's handle. A write still in flight is cancelled first and waited for, so after
  // Release no byte of it lands later.
  virtual void Release(WriteId write) = 0;

  // Host memory this backend reaches best (UCX: memory from its shared-memory transports, which
  // peers on the same host write into directly). Page-aligned, contents undefined. Unimplemented
  // when the backend has nothing better than ordinary memory. Registering a region inside such
  // a block reuses the block's registration.
  virtual StatusOr<void*> AllocateHost(size_t bytes) {
    return Unimplemented(std::string(Name()) + " has no host allocator");
  }
  // Frees a block from AllocateHost; it must no longer be registered by a live write.
  virtual void FreeHost(void* block) {}

 protected:
  Backend() = default;
};

}  // namespace kvt::transfer

// The loopback backend: peers are other loopback backends in this process, found by address in
// a process-wide directory; writes are memcpy. It exists for unit tests of the engine and for
// the backend conformance suite, and optionally delays completion to exercise in-flight paths.
#include "backends/loopback/loopback_backend.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>

#include "backends/common/host_memory.h"
#include "backends/common/layer_table.h"
#include "backends/common/run_check.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/kernels/kernels.h"

namespace kvt::transfer {
namespace {

using Clock = std::chrono::steady_clock;

// What a loopback backend exposes to its peers.
struct Target {
  std::mutex mutex;  // guards regions and alive
  std::vector<LocalRegion> regions;
  bool alive = true;
};

class Directory {
 public:
  static Directory& Get() {
    static Directory* directory = new Directory();  // never destroyed: used from destructors
    return *directory;
  }
  std::string Add(std::shared_ptr<Target> target) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::string address = "loopback:" + std::to_string(next_++);
    targets_[address] = std::move(target);
    return address;
  }
  std::shared_ptr<Target> Find(const std::string& address) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = targets_.find(address);
    if (it == targets_.end()) return nullptr;
    return it->second.lock();
  }
  void Remove(const std::string& address) {
    std::lock_guard<std::mutex> lock(mutex_);
    targets_.erase(address);
  }

 private:
  std::mutex mutex_;  // guards targets_ and next_
  std::map<std::string, std::weak_ptr<Target>> targets_;
  uint64_t next_ = 1;
};

class LoopbackBackend final : public Backend {
 public:
  explicit LoopbackBackend(const LoopbackOptions& options)
      : delay_(options.delay),
        page_writes_(options.page_writes),
        release_completes_(options.release_completes_in_flight),
        before_disconnect_(options.before_disconnect),
        self_(std::make_shared<Target>()) {
    address_ = Directory::Get().Add(self_);
  }

  ~LoopbackBackend() override {
    {
      std::lock_guard<std::mutex> lock(self_->mutex);
      self_->alive = false;
    }
    Directory::Get().Remove(address_);
  }

  std::string_view Name() const override { return "loopback"; }

  BackendCapabilities Capabilities() const override {
    BackendCapabilities caps;
    caps.host_memory = true;
    caps.page_writes = page_writes_;
    return caps;
  }

  StatusOr<PeerDescriptor> Register(std::span<const LocalRegion> regions) override {
    for (size_t i = 0; i < regions.size(); ++i) {
      if (regions[i].kind != MemoryKind::kHost) {
        return Unimplemented("loopback backend registers host memory only, but buffer " +
                             std::to_string(i) + " is CUDA memory; use cuda_ipc or ucx");
      }
      if (regions[i].base == 0 || regions[i].length == 0) {
        return InvalidArgument("buffer " + std::to_string(i) + " has a null base or zero length");
      }
    }
    KVT_RETURN_IF_ERROR(CheckHostRegionsMapped(regions, "loopback"));
    KVT_ASSIGN_OR_RETURN(LayerTable layers, LayerTable::Create(regions));
    PeerDescriptor descriptor;
    descriptor.backend = "loopback";
    descriptor.address = address_;
    {
      std::lock_guard<std::mutex> lock(self_->mutex);
      self_->regions.assign(regions.begin(), regions.end());
    }
    std::lock_guard<std::mutex> lock(mutex_);
    local_.assign(regions.begin(), regions.end());
    layers_ = std::move(layers);
    for (const LocalRegion& r : regions) {
      descriptor.regions.push_back(RemoteRegion{r.base, r.length, r.item_len, {}});
    }
    return descriptor;
  }

  StatusOr<PeerId> Connect(const PeerDescriptor& peer) override {
    if (peer.backend != "loopback") {
      return InvalidArgument("peer uses backend '" + peer.backend + "', this side 'loopback'");
    }
    std::shared_ptr<Target> target = Directory::Get().Find(peer.address);
    if (!target) {
      return Unavailable("no loopback peer at '" + peer.address + "' (it has gone away)");
    }
    std::lock_guard<std::mutex> lock(mutex_);
    // Copy runs name the peer's buffer themselves; page writes check the lists match (PostPages).
    const PeerId id = next_peer_++;
    peers_[id] = Peer{target, peer.regions};
    return id;
  }

  Status Disconnect(PeerId peer, DisconnectMode) override {
    if (before_disconnect_) before_disconnect_(peer);
    std::lock_guard<std::mutex> lock(mutex_);
    if (peers_.erase(peer) == 0) return NotFound("no loopback peer " + std::to_string(peer));
    for (auto& [id, write] : writes_) {
      if (write.peer == peer && write.status.code() == StatusCode::kInProgress) {
        write.status = Aborted("peer disconnected before the write completed");
      }
    }
    return OkStatus();
  }

  StatusOr<WriteId> PostWrite(PeerId peer, std::span<const CopyRun> runs) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = peers_.find(peer);
    if (it == peers_.end()) return NotFound("no loopback peer " + std::to_string(peer));
    KVT_RETURN_IF_ERROR(CheckRuns(runs, local_, it->second.regions));
    const WriteId id = next_write_++;
    Write& write = writes_[id];
    write.peer = peer;
    write.runs.assign(runs.begin(), runs.end());
    write.ready_at = Clock::now() + delay_;
    write.status = InProgress();
    if (delay_.count() == 0) Complete(write);
    return id;
  }

  // Page lists are kept and scattered with the gather/scatter kernel's CPU reference.
  StatusOr<WriteId> PostPages(PeerId peer, const PageWrite& pages) override {
    if (!page_writes_) return Backend::PostPages(peer, pages);
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = peers_.find(peer);
    if (it == peers_.end()) return NotFound("no loopback peer " + std::to_string(peer));
    KVT_RETURN_IF_ERROR(CheckRegionCount(local_.size(), it->second.regions.size()));
    KVT_RETURN_IF_ERROR(layers_.CheckRange(pages.num_layers, pages.layer_begin, pages.layer_end));
    if (pages.src_pages.size() != pages.dst_pages.size()) {
      return InvalidArgument("page write with " + std::to_string(pages.src_pages.size()) +
                             " source pages but " + std::to_string(pages.dst_pages.size()) +
                             " destination pages; the lists pair up one to one");
    }
    const std::span<const uint32_t> buffers = layers_.Buffers(pages.layer_begin, pages.layer_end);
    // Express the write as runs too, so the range checks are the same as PostWrite's. Each
    // buffer has its own page bytes on either side.
    std::vector<CopyRun> runs;
    for (uint32_t b : buffers) {
      const uint64_t src_item = local_[b].item_len;
      const uint64_t dst_item = it->second.regions[b].item_len;
      if (pages.units.empty() && src_item != dst_item) {
        return InvalidArgument("whole-page write of buffer " + std::to_string(b) +
                               " between pages of " + std::to_string(src_item) +
                               " bytes here and " + std::to_string(dst_item) +
                               " bytes at the peer; pass units for pools of different layouts");
      }
      const PageUnit whole{0, 0, src_item};
      const std::span<const PageUnit> units =
          pages.units.empty() ? std::span<const PageUnit>(&whole, 1) : pages.units;
      for (size_t i = 0; i < pages.src_pages.size(); ++i) {
        if (pages.src_pages[i] < 0 || pages.dst_pages[i] < 0) {
          return OutOfRange("page write names page " +
                            std::to_string(std::min(pages.src_pages[i], pages.dst_pages[i])) +
                            " (pair " + std::to_string(i) + "); page indices are >= 0");
        }
        for (const PageUnit& u : units) {
          if (u.bytes > src_item || u.src_offset > src_item - u.bytes || u.bytes > dst_item ||
              u.dst_offset > dst_item - u.bytes) {
            return OutOfRange("unit [" + std::to_string(u.src_offset) + " -> " +
                              std::to_string(u.dst_offset) + ", +" + std::to_string(u.bytes) +
                              ") does not fit the pages of buffer " + std::to_string(b) + " (" +
                              std::to_string(src_item) + " bytes here, " +
                              std::to_string(dst_item) + " at the peer)");
          }
          runs.push_back(CopyRun{b, pages.src_pages[i] * src_item + u.src_offset,
                                 pages.dst_pages[i] * dst_item + u.dst_offset, u.bytes});
        }
      }
    }
    KVT_RETURN_IF_ERROR(CheckRuns(runs, local_, it->second.regions));
    if (pages.ready != nullptr) {
      KVT_RETURN_IF_ERROR(kvt::cuda::ToStatus(cudaEventSynchronize(pages.ready),
                                              "cudaEventSynchronize on the write's ready event"));
    }
    const WriteId id = next_write_++;
    Write& write = writes_[id];
    write.peer = peer;
    write.runs = std::move(runs);
    write.pages = PageJob{{pages.src_pages.begin(), pages.src_pages.end()},
                          {pages.dst_pages.begin(), pages.dst_pages.end()},
                          {buffers.begin(), buffers.end()},
                          {pages.units.begin(), pages.units.end()}};
    write.ready_at = Clock::now() + delay_;
    write.status = InProgress();
    if (delay_.count() == 0) Complete(write);
    return id;
  }

  Status Check(WriteId id) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = writes_.find(id);
    if (it == writes_.end()) return NotFound("no loopback write " + std::to_string(id));
    Write& write = it->second;
    if (write.status.code() == StatusCode::kInProgress && Clock::now() >= write.ready_at) {
      Complete(write);
    }
    return write.status;
  }

  void Release(WriteId id) override {
    std::unique_lock<std::mutex> lock(mutex_);
    auto it = writes_.find(id);
    if (it == writes_.end()) return;
    if (release_completes_ && it->second.status.code() == StatusCode::kInProgress) {
      // Waited out without the lock (other writes go on), then performed.
      const Clock::time_point ready_at = it->second.ready_at;
      lock.unlock();
      std::this_thread::sleep_until(ready_at);
      lock.lock();
      it = writes_.find(id);
      if (it == writes_.end()) return;
      if (it->second.status.code() == StatusCode::kInProgress) Complete(it->second);
    }
    writes_.erase(it);  // otherwise an in-flight write is simply never performed
  }

 private:
  struct Peer {
    std::shared_ptr<Target> target;
    std::vector<RemoteRegion> regions;
  };
  struct PageJob {
    std::vector<int32_t> src_pages;
    std::vector<int32_t> dst_pages;
    std::vector<uint32_t> buffers;  // in move order (LayerTable::Buffers)
    std::vector<PageUnit> units;    // empty: whole pages
  };
  struct Write {
    PeerId peer = 0;
    std::vector<CopyRun> runs;     // what the write moves (checked against the peer)
    std::optional<PageJob> pages;  // set for PostPages: performed as a page gather/scatter
    Clock::time_point ready_at;
    Status status;
  };

  // Performs the copy. Called with mutex_ held.
  void Complete(Write& write) {
    auto peer = peers_.find(write.peer);
    if (peer == peers_.end()) {
      write.status = Aborted("peer disconnected before the write completed");
      return;
    }
    Target& target = *peer->second.target;
    std::lock_guard<std::mutex> target_lock(target.mutex);
    if (!target.alive) {
      write.status = Unavailable("the loopback peer was destroyed");
      return;
    }
    // The peer may have re-registered since Connect: check against what it has now.
    std::vector<RemoteRegion> now;
    now.reserve(target.regions.size());
    for (const LocalRegion& r : target.regions) now.push_back({r.base, r.length, r.item_len, {}});
    Status fits = CheckRuns(write.runs, local_, now);
    if (!fits.ok()) {
      write.status = fits;
      return;
    }
    if (write.pages) {
      write.status = CopyPages(*write.pages, target);
      return;
    }
    for (const CopyRun& run : write.runs) {
      auto* dst = reinterpret_cast<uint8_t*>(target.regions[run.DstBuffer()].base) + run.dst_offset;
      const auto* src = reinterpret_cast<const uint8_t*>(local_[run.buffer].base) + run.src_offset;
      std::memcpy(dst, src, run.bytes);
    }
    write.status = OkStatus();
  }

  // One gather/scatter (CPU reference of the kernel) per buffer and unit: buffers differ in
  // page bytes (a draft model's or a latent group's pages).
  Status CopyPages(const PageJob& job, const Target& target) const {
    for (uint32_t b : job.buffers) {
      const uint64_t src_base = local_[b].base;
      const uint64_t dst_base = target.regions[b].base;
      const PageUnit whole{0, 0, local_[b].item_len};
      const std::span<const PageUnit> units =
          job.units.empty() ? std::span<const PageUnit>(&whole, 1) : job.units;
      for (const PageUnit& unit : units) {
        kernels::PageCopyArgs args;
        args.src_bases = &src_base;
        args.dst_bases = &dst_base;
        args.num_buffers = 1;
        args.src_pages = job.src_pages.data();
        args.dst_pages = job.dst_pages.data();
        args.num_pages = static_cast<int64_t>(job.src_pages.size());
        args.src_page_stride = static_cast<int64_t>(local_[b].item_len);
        args.dst_page_stride = static_cast<int64_t>(target.regions[b].item_len);
        args.src_offset = static_cast<int64_t>(unit.src_offset);
        args.dst_offset = static_cast<int64_t>(unit.dst_offset);
        args.bytes = static_cast<int64_t>(unit.bytes);
        KVT_RETURN_IF_ERROR(kernels::PageCopyCpu(args));
      }
    }
    return OkStatus();
  }

  const std::chrono::microseconds delay_;
  const bool page_writes_;
  const bool release_completes_;
  const std::function<void(uint64_t)> before_disconnect_;
  const std::shared_ptr<Target> self_;
  std::string address_;

  std::mutex mutex_;  // guards everything below
  std::vector<LocalRegion> local_;
  LayerTable layers_;  // which of local_ a page write of layers [a, b) moves
  std::unordered_map<PeerId, Peer> peers_;
  std::unordered_map<WriteId, Write> writes_;
  PeerId next_peer_ = 1;
  WriteId next_write_ = 1;
};

}  // namespace

StatusOr<std::unique_ptr<Backend>> CreateLoopbackBackend(const LoopbackOptions& options) {
  if (options.delay.count() < 0) {
    return InvalidArgument("loopback delay is " + std::to_string(options.delay.count()) +
                           " us; give 0 (copy at post time) or more");
  }
  return std::unique_ptr<Backend>(std::make_unique<LoopbackBackend>(options));
}

}  // namespace kvt::transfer

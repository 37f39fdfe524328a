// The loopback backend: peers are other loopback backends in this process, found by address in
// a process-wide directory; writes are memcpy. It exists for unit tests of the engine and for
// the backend conformance suite, and optionally delays completion to exercise in-flight paths.
#include "backends/loopback/loopback_backend.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>

#include "backends/run_check.h"

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
  explicit LoopbackBackend(const BackendOptions& options)
      : delay_(std::chrono::microseconds(options.loopback_delay_us)),
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
    PeerDescriptor descriptor;
    descriptor.backend = "loopback";
    descriptor.address = address_;
    {
      std::lock_guard<std::mutex> lock(self_->mutex);
      self_->regions.assign(regions.begin(), regions.end());
    }
    std::lock_guard<std::mutex> lock(mutex_);
    local_.assign(regions.begin(), regions.end());
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
    KVT_RETURN_IF_ERROR(CheckRegionCount(local_.size(), peer.regions.size()));
    const PeerId id = next_peer_++;
    peers_[id] = Peer{target, peer.regions};
    return id;
  }

  Status Disconnect(PeerId peer, DisconnectMode) override {
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
    std::lock_guard<std::mutex> lock(mutex_);
    writes_.erase(id);  // an in-flight write is simply never performed
  }

 private:
  struct Peer {
    std::shared_ptr<Target> target;
    std::vector<RemoteRegion> regions;
  };
  struct Write {
    PeerId peer = 0;
    std::vector<CopyRun> runs;
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
    for (const CopyRun& run : write.runs) {
      auto* dst = reinterpret_cast<uint8_t*>(target.regions[run.buffer].base) + run.dst_offset;
      const auto* src = reinterpret_cast<const uint8_t*>(local_[run.buffer].base) + run.src_offset;
      std::memcpy(dst, src, run.bytes);
    }
    write.status = OkStatus();
  }

  const std::chrono::microseconds delay_;
  const std::shared_ptr<Target> self_;
  std::string address_;

  std::mutex mutex_;  // guards everything below
  std::vector<LocalRegion> local_;
  std::unordered_map<PeerId, Peer> peers_;
  std::unordered_map<WriteId, Write> writes_;
  PeerId next_peer_ = 1;
  WriteId next_write_ = 1;
};

}  // namespace

std::unique_ptr<Backend> CreateLoopbackBackend(const BackendOptions& options) {
  return std::make_unique<LoopbackBackend>(options);
}

}  // namespace kvt::transfer

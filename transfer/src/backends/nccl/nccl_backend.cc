#include "backends/nccl/nccl_backend.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <mutex>
#include <random>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backends/common/layer_table.h"
#include "backends/common/run_check.h"
#include "backends/nccl/nccl_api.h"
#include "backends/nccl/nccl_pair.h"
#include "kvt/common/log.h"
#include "kvt/kernels/cuda_util.h"

namespace kvt::transfer {
namespace {

using nccl::NcclApi;
using nccl::NcclTuning;
using nccl::Pair;
using nccl::Registration;
using nccl::ScopedDevice;
using nccl::SenderJob;

std::string Num(uint64_t v) { return std::to_string(v); }
std::string Num(int32_t v) { return std::to_string(v); }

uint64_t RandomNonce() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ device();
}

// The page size every published buffer of the peer shares, or why there is none.
StatusOr<uint64_t> PeerItemLen(const PeerDescriptor& peer) {
  if (peer.regions.empty()) return InvalidArgument("the peer published no buffers");
  const uint64_t item_len = peer.regions.front().item_len;
  for (size_t i = 0; i < peer.regions.size(); ++i) {
    if (peer.regions[i].item_len == 0 || peer.regions[i].item_len != item_len) {
      return InvalidArgument("the peer's buffer " + Num(uint64_t{i}) + " has " +
                             Num(peer.regions[i].item_len) + "-byte pages, buffer 0 " +
                             Num(item_len) + "; the nccl backend needs one page size per pool");
    }
  }
  return item_len;
}

// The smallest length among the K and V buffers of layers [begin, end).
template <typename Region>
uint64_t MinLength(const std::vector<Region>& regions, int32_t num_layers, int32_t begin,
                   int32_t end) {
  uint64_t min_len = std::numeric_limits<uint64_t>::max();
  for (int32_t l = begin; l < end; ++l) {
    min_len = std::min(min_len, regions[static_cast<size_t>(l)].length);
    min_len = std::min(min_len, regions[static_cast<size_t>(num_layers + l)].length);
  }
  return min_len;
}

// OK when every page p of `pages` satisfies p * item_len + unit_end <= length.
Status CheckPages(std::span<const int32_t> pages, uint64_t item_len, uint64_t unit_end,
                  uint64_t length, const char* side) {
  for (size_t i = 0; i < pages.size(); ++i) {
    const int32_t p = pages[i];
    if (p < 0 || length < unit_end || static_cast<uint64_t>(p) > (length - unit_end) / item_len) {
      return OutOfRange(std::string(side) + " page " + Num(p) + " (entry " + Num(uint64_t{i}) +
                        ") lies outside the " + side + " buffers (" + Num(length) + " bytes, " +
                        Num(item_len) + " per page)");
    }
  }
  return OkStatus();
}

class NcclBackend final : public Backend {
 public:
  NcclBackend(const NcclApi& api, const NcclTuning& tuning) : api_(api), tuning_(tuning) {}

  ~NcclBackend() override {
    std::unordered_map<PeerId, PeerEntry> pairs;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      pairs.swap(pairs_);
    }
    for (auto& [id, entry] : pairs) {
      Status stopped = entry.pair->Stop(DisconnectMode::kGraceful);
      (void)stopped;
    }
  }

  std::string_view Name() const override { return "nccl"; }

  BackendCapabilities Capabilities() const override {
    BackendCapabilities caps;
    caps.cuda_memory = true;
    caps.inter_process = true;
    caps.inter_node = true;
    caps.page_writes = true;
    caps.two_sided = true;
    return caps;
  }

  StatusOr<PeerDescriptor> Register(std::span<const LocalRegion> regions) override {
    if (regions.empty() || regions.size() % 2 != 0) {
      return InvalidArgument(
          "the nccl backend registers a pool's 2 x layers buffers (K of every "
          "layer, then V), but got " +
          Num(uint64_t{regions.size()}));
    }
    const int32_t device = regions.front().device;
    const uint64_t item_len = regions.front().item_len;
    for (size_t i = 0; i < regions.size(); ++i) {
      const LocalRegion& r = regions[i];
      if (r.kind != MemoryKind::kCuda) {
        return InvalidArgument("buffer " + Num(uint64_t{i}) +
                               " is host memory; the nccl backend moves CUDA memory only: use "
                               "ucx for host pools");
      }
      if (r.base == 0 || r.length == 0) {
        return InvalidArgument("buffer " + Num(uint64_t{i}) + " has a null base or zero length");
      }
      if (r.device < 0 || r.device != device) {
        return InvalidArgument("buffer " + Num(uint64_t{i}) + " is on device " + Num(r.device) +
                               ", buffer 0 on device " + Num(device) +
                               "; an nccl pool lives on one GPU");
      }
      if (r.item_len == 0 || r.item_len != item_len) {
        return InvalidArgument("buffer " + Num(uint64_t{i}) + " has " + Num(r.item_len) +
                               "-byte pages, buffer 0 " + Num(item_len) +
                               "; the nccl backend needs one page size per pool");
      }
    }
    // Sends address buffer l (K) and num_layers + l (V) of a layer: refuse other layouts here
    // rather than move the wrong buffers.
    KVT_ASSIGN_OR_RETURN(LayerTable layers, LayerTable::Create(regions));
    KVT_RETURN_IF_ERROR(layers.CheckKeyValueOrder("the nccl backend"));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (registration_ != nullptr && registration_->device != device && !pairs_.empty()) {
        return FailedPrecondition("the pool moved from device " + Num(registration_->device) +
                                  " to " + Num(device) +
                                  " while peers are connected; disconnect them first");
      }
    }
    ScopedDevice scoped(device);
    KVT_RETURN_IF_ERROR(scoped.status());
    char bus_id[32] = {};
    KVT_CUDA_RETURN_IF_ERROR(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device));

    auto reg = std::make_shared<Registration>();
    reg->device = device;
    reg->num_layers = static_cast<int32_t>(regions.size() / 2);
    reg->item_len = item_len;
    reg->regions.assign(regions.begin(), regions.end());
    reg->layout.num_layers = reg->num_layers;
    reg->layout.item_len = item_len;
    std::vector<uint64_t> pair_bases(regions.size());
    for (int32_t l = 0; l < reg->num_layers; ++l) {
      pair_bases[2 * static_cast<size_t>(l)] = regions[static_cast<size_t>(l)].base;
      pair_bases[2 * static_cast<size_t>(l) + 1] =
          regions[static_cast<size_t>(reg->num_layers + l)].base;
    }
    for (const LocalRegion& r : regions) reg->layout.buffer_bytes.push_back(r.length);
    KVT_ASSIGN_OR_RETURN(reg->pair_bases, kvt::cuda::DeviceBuffer::Allocate(
                                              pair_bases.size() * sizeof(uint64_t), device));
    KVT_RETURN_IF_ERROR(kvt::cuda::Copy(reg->pair_bases.data(), pair_bases.data(),
                                        pair_bases.size() * sizeof(uint64_t)));

    nccl::ProcessAddress address;
    address.boot_id = nccl::ThisBootId();
    address.pid = static_cast<uint64_t>(getpid());
    address.device = device;
    address.pci_bus_id = bus_id;

    PeerDescriptor descriptor;
    descriptor.backend = "nccl";
    descriptor.address = nccl::EncodeAddress(address);
    for (const LocalRegion& r : regions) {
      descriptor.regions.push_back(RemoteRegion{r.base, r.length, r.item_len, {}});
    }
    std::lock_guard<std::mutex> lock(mutex_);
    registration_ = reg;
    address_ = address;
    for (auto& [id, entry] : pairs_) {
      if (entry.pair->role() == Pair::Role::kReceiver) entry.pair->SetRegistration(reg);
    }
    return descriptor;
  }

  StatusOr<PeerId> Connect(const PeerDescriptor& peer) override {
    KVT_ASSIGN_OR_RETURN(Prepared prepared, Prepare(peer, "Connect"));
    ncclUniqueId id;
    const ncclResult_t result = api_.GetUniqueId(&id);
    if (result != ncclSuccess) return api_.ToStatus(result, nullptr, "ncclGetUniqueId");
    Pair::Config config;
    config.role = Pair::Role::kSender;
    std::memcpy(config.token.unique_id.data(), &id, sizeof(id));
    config.token.slot_bytes = tuning_.slot_bytes;
    config.token.idle_tick_ms = static_cast<uint64_t>(tuning_.idle_tick.count());
    config.token.nonce = RandomNonce();
    return StartPair(std::move(config), std::move(prepared), peer);
  }

  StatusOr<std::string> ConnectToken(PeerId peer) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = pairs_.find(peer);
    if (it == pairs_.end()) return NotFound("no nccl peer " + Num(peer));
    if (it->second.pair->role() != Pair::Role::kSender) {
      return FailedPrecondition("nccl peer " + Num(peer) +
                                " joined with Accept; only Connect makes a token");
    }
    return nccl::EncodeToken(it->second.pair->token());
  }

  StatusOr<PeerId> Accept(const PeerDescriptor& peer, const std::string& token) override {
    KVT_ASSIGN_OR_RETURN(nccl::PairToken decoded, nccl::DecodeToken(token));
    KVT_ASSIGN_OR_RETURN(Prepared prepared, Prepare(peer, "Accept"));
    Pair::Config config;
    config.role = Pair::Role::kReceiver;
    config.token = decoded;
    return StartPair(std::move(config), std::move(prepared), peer);
  }

  Status Disconnect(PeerId peer, DisconnectMode mode) override {
    std::shared_ptr<Pair> pair;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = pairs_.find(peer);
      if (it == pairs_.end()) return NotFound("no nccl peer " + Num(peer));
      pair = it->second.pair;
      pairs_.erase(it);
    }
    return pair->Stop(mode);
  }

  StatusOr<WriteId> PostWrite(PeerId peer, std::span<const CopyRun> runs) override {
    return Unimplemented(
        "the nccl backend moves page lists (PostPages), not copy runs: the "
        "receiver unpacks pages it learns from the chunk headers");
  }

  StatusOr<WriteId> PostPages(PeerId peer, const PageWrite& write) override {
    std::shared_ptr<Pair> pair;
    std::shared_ptr<const Registration> reg;
    std::shared_ptr<const std::vector<RemoteRegion>> remote;
    uint64_t peer_item_len = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = pairs_.find(peer);
      if (it == pairs_.end()) return NotFound("no nccl peer " + Num(peer));
      pair = it->second.pair;
      remote = it->second.regions;
      peer_item_len = it->second.item_len;
      reg = registration_;
    }
    if (pair->role() != Pair::Role::kSender) {
      return FailedPrecondition("nccl peer " + Num(peer) +
                                " joined with Accept: the receiving side posts no writes");
    }
    const size_t buffers = reg->regions.size();
    if (write.num_layers <= 0 || static_cast<size_t>(write.num_layers) * 2 != buffers ||
        write.layer_begin < 0 || write.layer_begin >= write.layer_end ||
        write.layer_end > write.num_layers || write.src_pages.size() != write.dst_pages.size()) {
      return InvalidArgument("page write of layers [" + Num(write.layer_begin) + ", " +
                             Num(write.layer_end) + ") of " + Num(write.num_layers) + " with " +
                             Num(uint64_t{write.src_pages.size()}) + " / " +
                             Num(uint64_t{write.dst_pages.size()}) + " pages does not fit " +
                             Num(uint64_t{buffers}) + " registered buffers");
    }
    auto job = std::make_shared<SenderJob>();
    if (write.units.empty()) {
      if (reg->item_len != peer_item_len) {
        return InvalidArgument(
            "whole-page write between pools of different page sizes (this "
            "side " +
            Num(reg->item_len) + " bytes, the peer " + Num(peer_item_len) + "); pass units");
      }
      job->units.push_back(PageUnit{0, 0, reg->item_len});
    } else {
      job->units.assign(write.units.begin(), write.units.end());
    }
    uint64_t src_end = 0, dst_end = 0;
    for (size_t u = 0; u < job->units.size(); ++u) {
      const PageUnit& unit = job->units[u];
      if (unit.bytes == 0 || unit.bytes > reg->item_len ||
          unit.src_offset > reg->item_len - unit.bytes || unit.bytes > peer_item_len ||
          unit.dst_offset > peer_item_len - unit.bytes) {
        return OutOfRange("unit " + Num(uint64_t{u}) + " [" + Num(unit.src_offset) + " -> " +
                          Num(unit.dst_offset) + ", +" + Num(unit.bytes) +
                          ") does not fit pages of " + Num(reg->item_len) + " (here) / " +
                          Num(peer_item_len) + " (peer) bytes");
      }
      src_end = std::max(src_end, unit.src_offset + unit.bytes);
      dst_end = std::max(dst_end, unit.dst_offset + unit.bytes);
      job->unit_bytes.push_back(unit.bytes);
    }
    KVT_RETURN_IF_ERROR(CheckPages(
        write.src_pages, reg->item_len, src_end,
        MinLength(reg->regions, write.num_layers, write.layer_begin, write.layer_end), "local"));
    KVT_RETURN_IF_ERROR(CheckPages(
        write.dst_pages, peer_item_len, dst_end,
        MinLength(*remote, write.num_layers, write.layer_begin, write.layer_end), "peer"));

    nccl::ChunkPlanInput plan;
    plan.num_pages = static_cast<int64_t>(write.src_pages.size());
    plan.layer_begin = write.layer_begin;
    plan.layer_end = write.layer_end;
    plan.unit_bytes = job->unit_bytes;
    plan.payload_capacity = pair->token().slot_bytes - nccl::kHeaderBytes;
    KVT_ASSIGN_OR_RETURN(job->chunks, nccl::PlanChunks(plan));
    job->id = next_write_.fetch_add(1);
    job->src_pages.assign(write.src_pages.begin(), write.src_pages.end());
    job->dst_pages.assign(write.dst_pages.begin(), write.dst_pages.end());
    job->num_layers = write.num_layers;
    job->registration = std::move(reg);
    const WriteId id = job->id;
    KVT_RETURN_IF_ERROR(pair->Post(std::move(job), write.ready));
    std::lock_guard<std::mutex> lock(mutex_);
    writes_[id] = std::move(pair);
    return id;
  }

  Status Check(WriteId write) override {
    std::shared_ptr<Pair> pair;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = writes_.find(write);
      if (it == writes_.end()) return NotFound("no nccl write " + Num(write));
      pair = it->second;
    }
    return pair->Check(write);
  }

  void Release(WriteId write) override {
    std::shared_ptr<Pair> pair;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = writes_.find(write);
      if (it == writes_.end()) return;
      pair = std::move(it->second);
      writes_.erase(it);
    }
    pair->Release(write);
  }

 private:
  struct PeerEntry {
    std::shared_ptr<Pair> pair;
    std::shared_ptr<const std::vector<RemoteRegion>> regions;
    uint64_t item_len = 0;
  };

  // What Connect and Accept check and capture before starting a pair.
  struct Prepared {
    std::shared_ptr<const Registration> registration;
    uint64_t peer_item_len = 0;
  };

  StatusOr<Prepared> Prepare(const PeerDescriptor& peer, const char* call) {
    if (peer.backend != "nccl") {
      return InvalidArgument("peer uses backend '" + peer.backend + "', this side 'nccl'");
    }
    KVT_ASSIGN_OR_RETURN(nccl::ProcessAddress remote, nccl::DecodeAddress(peer.address));
    Prepared prepared;
    nccl::ProcessAddress local;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      prepared.registration = registration_;
      local = address_;
    }
    if (prepared.registration == nullptr) {
      return FailedPrecondition(std::string(call) +
                                " before Register: register the pool first (the pair's staging "
                                "lives on the pool's GPU)");
    }
    KVT_RETURN_IF_ERROR(nccl::CheckPeerPlacement(local, remote));
    KVT_RETURN_IF_ERROR(
        CheckRegionCount(prepared.registration->regions.size(), peer.regions.size()));
    KVT_ASSIGN_OR_RETURN(prepared.peer_item_len, PeerItemLen(peer));
    return prepared;
  }

  StatusOr<PeerId> StartPair(Pair::Config config, Prepared prepared, const PeerDescriptor& peer) {
    const PeerId id = next_peer_.fetch_add(1);
    config.id = id;
    config.device = prepared.registration->device;
    config.tuning = tuning_;
    config.peer = peer.address;
    config.registration = prepared.registration;
    KVT_ASSIGN_OR_RETURN(std::shared_ptr<Pair> pair, Pair::Start(api_, std::move(config)));
    PeerEntry entry;
    entry.pair = std::move(pair);
    entry.regions = std::make_shared<const std::vector<RemoteRegion>>(peer.regions);
    entry.item_len = prepared.peer_item_len;
    std::lock_guard<std::mutex> lock(mutex_);
    pairs_[id] = std::move(entry);
    return id;
  }

  const NcclApi& api_;
  const NcclTuning tuning_;
  std::atomic<PeerId> next_peer_{1};
  std::atomic<WriteId> next_write_{1};

  std::mutex mutex_;  // guards everything below
  std::shared_ptr<const Registration> registration_;
  nccl::ProcessAddress address_;
  std::unordered_map<PeerId, PeerEntry> pairs_;
  std::unordered_map<WriteId, std::shared_ptr<Pair>> writes_;
};

}  // namespace

StatusOr<std::unique_ptr<Backend>> CreateNcclBackendWithTuning(const nccl::NcclTuning& tuning) {
  const kvt::cuda::DeviceCountResult devices = kvt::cuda::DeviceCount();
  if (devices.count == 0) {
    return Unavailable("nccl backend needs a CUDA device: " + devices.reason +
                       "; pick ucx or loopback for host pools");
  }
  if (tuning.slot_bytes < nccl::kMinSlotBytes || tuning.slot_bytes > nccl::kMaxSlotBytes) {
    return InvalidArgument("nccl slot_bytes is " + std::to_string(tuning.slot_bytes) +
                           "; staging slots must be in [" + std::to_string(nccl::kMinSlotBytes) +
                           ", " + std::to_string(nccl::kMaxSlotBytes) + "] bytes");
  }
  for (const auto& [name, value] : {std::pair{"connect_timeout", tuning.connect_timeout},
                                    std::pair{"stall_timeout", tuning.stall_timeout}}) {
    if (value.count() < 1) {
      return InvalidArgument(std::string("nccl ") + name + " is " + std::to_string(value.count()) +
                             " ms; give at least 1 ms");
    }
  }
  KVT_ASSIGN_OR_RETURN(const NcclApi* api, nccl::LoadNccl());
  return std::unique_ptr<Backend>(std::make_unique<NcclBackend>(*api, tuning));
}

StatusOr<std::unique_ptr<Backend>> CreateNcclBackend(const NcclOptions& options) {
  nccl::NcclTuning tuning;
  tuning.slot_bytes = options.slot_bytes;
  tuning.connect_timeout = options.connect_timeout;
  tuning.stall_timeout = options.stall_timeout;
  return CreateNcclBackendWithTuning(tuning);
}

}  // namespace kvt::transfer

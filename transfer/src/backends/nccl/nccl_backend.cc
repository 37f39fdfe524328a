#include "backends/nccl/nccl_backend.h"

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backends/common/layer_table.h"
#include "backends/common/run_check.h"
#include "backends/nccl/nccl_api.h"
#include "backends/nccl/nccl_pair.h"
#include "kvt/common/log.h"
#include "kvt/common/random.h"
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

// OK when every buffer the peer published has pages (a page size of 0 is a broken hello).
Status CheckPeerPages(const PeerDescriptor& peer) {
  for (size_t i = 0; i < peer.regions.size(); ++i) {
    if (peer.regions[i].item_len == 0) {
      return InvalidArgument("the peer's buffer " + Num(uint64_t{i}) +
                             " has 0-byte pages; the peer must register its layout's page bytes");
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
    if (regions.empty()) {
      return InvalidArgument("the nccl backend got no buffers; register the layout's buffers");
    }
    const int32_t device = regions.front().device;
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
      if (r.item_len == 0) {
        return InvalidArgument("buffer " + Num(uint64_t{i}) +
                               " has 0-byte pages; give every buffer its page bytes");
      }
    }
    // Chunks carry the buffers of their layers in LayerTable order, each with its own page bytes.
    KVT_ASSIGN_OR_RETURN(LayerTable layers, LayerTable::Create(regions));
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
    reg->regions.assign(regions.begin(), regions.end());
    for (const LocalRegion& r : regions) {
      reg->layout.item_len.push_back(r.item_len);
      reg->layout.buffer_len.push_back(r.length);
    }
    std::vector<uint64_t> ordered_bases;
    for (uint32_t b : layers.Buffers(0, layers.num_layers())) {
      ordered_bases.push_back(regions[b].base);
      reg->ordered_item_len.push_back(regions[b].item_len);
    }
    reg->layout.layers = std::move(layers);
    KVT_ASSIGN_OR_RETURN(reg->ordered_bases, kvt::cuda::DeviceBuffer::Allocate(
                                                 ordered_bases.size() * sizeof(uint64_t), device));
    KVT_RETURN_IF_ERROR(kvt::cuda::Copy(reg->ordered_bases.data(), ordered_bases.data(),
                                        ordered_bases.size() * sizeof(uint64_t)));

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
    config.token.nonce = RandomU64();
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
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = pairs_.find(peer);
      if (it == pairs_.end()) return NotFound("no nccl peer " + Num(peer));
      pair = it->second.pair;
      remote = it->second.regions;
      reg = registration_;
    }
    if (pair->role() != Pair::Role::kSender) {
      return FailedPrecondition("nccl peer " + Num(peer) +
                                " joined with Accept: the receiving side posts no writes");
    }
    const std::vector<LocalRegion>& local = reg->regions;
    if (remote->size() != local.size()) {
      return InvalidArgument("the peer registered " + Num(uint64_t{remote->size()}) +
                             " buffers and this side " + Num(uint64_t{local.size()}) +
                             "; both sides must register the same layout");
    }
    KVT_RETURN_IF_ERROR(
        reg->layout.layers.CheckRange(write.num_layers, write.layer_begin, write.layer_end));
    // Pages and units against every buffer of the range, each with its own page bytes and
    // length on both sides.
    std::vector<PlanBuffer> buffers(local.size());
    for (size_t b = 0; b < local.size(); ++b) {
      buffers[b] = PlanBuffer{local[b].layer, local[b].item_len, (*remote)[b].item_len,
                              local[b].length, (*remote)[b].length};
    }
    PlanSpec spec;
    spec.src_pages = write.src_pages;
    spec.dst_pages = write.dst_pages;
    spec.num_layers = write.num_layers;
    spec.layer_begin = write.layer_begin;
    spec.layer_end = write.layer_end;
    spec.units = write.units;
    spec.buffers = buffers;
    KVT_RETURN_IF_ERROR(ValidatePlanSpec(spec));

    auto job = std::make_shared<SenderJob>();
    job->units.assign(write.units.begin(), write.units.end());  // empty: whole pages
    for (const PageUnit& unit : job->units) job->unit_bytes.push_back(unit.bytes);
    nccl::ChunkPlanInput plan;
    plan.num_pages = static_cast<int64_t>(write.src_pages.size());
    plan.layer_begin = write.layer_begin;
    plan.layer_end = write.layer_end;
    plan.layers = &reg->layout.layers;
    plan.item_len = reg->layout.item_len;
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
  };

  // What Connect and Accept check and capture before starting a pair.
  struct Prepared {
    std::shared_ptr<const Registration> registration;
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
    KVT_RETURN_IF_ERROR(CheckPeerPages(peer));
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

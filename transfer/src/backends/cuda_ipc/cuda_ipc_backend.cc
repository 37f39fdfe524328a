// The cuda_ipc backend (see cuda_ipc_backend.h).
//
// Register: every buffer must be device memory of one GPU, often a sub-range of a larger
// allocation (serving engines' caching allocators); the allocation holding it is found with
// kvt::cuda::FindAllocation (the driver's cuMemGetAddressRange, looked up at run time), the
// buffer must lie inside it, and each distinct allocation is exported once (cudaIpcGetMemHandle;
// memory without a legacy IPC handle, such as VMM or cudaMallocAsync memory, is refused saying
// what to allocate instead). Each buffer's key carries (allocation index and count, handle,
// offset in the allocation, allocation size).
//
// Connect: a peer of this process is written through its own addresses; a peer in another
// process of this host through a mapping of each of its allocations (cudaIpcOpenMemHandle, once
// per allocation; a buffer is the mapping's base plus its offset), held in a
// process-wide cache with one reference per connected peer, because CUDA maps an allocation
// once per process and several peers (or engines) may name the same one.
//
// Writes: each write is planned into page-copy launches (cuda_ipc_program.h); their tables are
// staged in pinned memory, copied to device scratch on the backend's stream, the launches
// follow (after waiting for PageWrite::ready on the GPU) and a completion event closes the
// write. Scratch (pinned + device + event) is recycled through a free list, so the hot path
// allocates nothing once warm: cudaMalloc and cudaFree synchronise the device.
#include "backends/cuda_ipc/cuda_ipc_backend.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backends/common/run_check.h"
#include "backends/cuda_ipc/cuda_ipc_codec.h"
#include "backends/cuda_ipc/cuda_ipc_program.h"
#include "kvt/common/hex.h"
#include "kvt/common/log.h"
#include "kvt/common/random.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/kernels/kernels.h"

namespace kvt::transfer {
namespace {

using Clock = std::chrono::steady_clock;
using cuda_ipc::CopyProgram;
using cuda_ipc::ProcessAddress;
using cuda_ipc::RegionKey;

static_assert(sizeof(cudaIpcMemHandle_t) == cuda_ipc::kIpcHandleBytes,
              "the key codec's handle size must match cudaIpcMemHandle_t");

// GPU work is local and always finishes, unless a write waits for a producer's event whose
// stream never advances. Waits are bounded by this; past it the backend logs and keeps (leaks)
// whatever the GPU may still touch rather than hang or free memory in use.
constexpr auto kGpuWaitLimit = std::chrono::seconds(30);

// Scratch blocks are at least this large and grow in powers of two.
constexpr size_t kMinScratchBytes = 4096;

std::string Num(uint64_t v) { return std::to_string(v); }

// Makes `device` current for a scope and restores the caller's device afterwards, so that the
// backend never changes a calling thread's CUDA state. cudaSetDevice is called even when the
// device is already the current one: since CUDA 12 it also makes the device's primary context
// current on this thread, which the driver calls (cuMemGetAddressRange) need.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();
      previous_ = -1;
    }
    status_ = cuda::ToStatus(cudaSetDevice(device_), "cudaSetDevice");
    if (!status_.ok()) {
      status_ = status_.WithContext("making device " + std::to_string(device_) + " current");
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0 && previous_ != device_ && cudaSetDevice(previous_) != cudaSuccess) {
      (void)cudaGetLastError();
    }
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  const Status& status() const { return status_; }

 private:
  const int device_;
  int previous_ = -1;
  Status status_;
};

// Polls `event` until it completed (OK), failed (its error) or `limit` passed (DeadlineExceeded).
// Polling rather than cudaEventSynchronize keeps the wait bounded.
Status WaitForEvent(cudaEvent_t event, Clock::duration limit, const std::string& what) {
  const auto give_up = Clock::now() + limit;
  auto pause = std::chrono::microseconds(5);
  while (true) {
    const cudaError_t err = cudaEventQuery(event);
    if (err == cudaSuccess) return OkStatus();
    if (err != cudaErrorNotReady) return cuda::ToStatus(err, what.c_str());
    (void)cudaGetLastError();  // not an error; keep it from being reported by a later launch
    if (Clock::now() > give_up) {
      return DeadlineExceeded(what + " did not finish in " +
                              Num(std::chrono::duration_cast<std::chrono::seconds>(limit).count()) +
                              " s (is a producer stream it waits for stuck?)");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

using cuda::Allocation;
using cuda::FindAllocation;

// ---- Exporting an allocation --------------------------------------------------------------

constexpr char kShareableMemoryAdvice[] =
    "allocate the pool with plain cudaMalloc (for PyTorch: leave expandable_segments:True out of "
    "PYTORCH_CUDA_ALLOC_CONF, so its caching allocator uses cudaMalloc), or use the ucx backend";

using PointerGetAttributeFn = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);

// The driver's cuPointerGetAttribute, found at run time (the library links the CUDA runtime
// only); null when the driver lacks it.
PointerGetAttributeFn PointerGetAttributeFunction() {
  static const PointerGetAttributeFn function = []() -> PointerGetAttributeFn {
    void* symbol = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuPointerGetAttribute", &symbol,
                                                             12000, cudaEnableDefault, &found);
#else
    const cudaError_t err =
        cudaGetDriverEntryPoint("cuPointerGetAttribute", &symbol, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || symbol == nullptr) {
      (void)cudaGetLastError();
      KVT_LOG_DEBUG("ipc", "the CUDA driver does not provide cuPointerGetAttribute ({})",
                    static_cast<int>(found));
      return nullptr;
    }
    return reinterpret_cast<PointerGetAttributeFn>(symbol);
  }();
  return function;
}

// Why legacy CUDA IPC (cudaIpcGetMemHandle) cannot share the allocation at `address`: memory of
// the virtual memory API (cuMemCreate + cuMemMap, which PyTorch's expandable segments use) or of
// a stream-ordered pool (cudaMallocAsync) has no legacy IPC handle. Empty when it can, or when
// the driver cannot tell (cudaIpcGetMemHandle then decides).
std::string WhyNotLegacyIpcCapable(uint64_t address) {
  const PointerGetAttributeFn get = PointerGetAttributeFunction();
  if (get == nullptr) return "";
  int capable = 0;  // zeroed in full: the driver writes a boolean
  if (get(&capable, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
          static_cast<CUdeviceptr>(address)) != CUDA_SUCCESS) {
    return "";
  }
  if (capable != 0) return "";
  CUmemoryPool pool = nullptr;
  if (get(&pool, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, static_cast<CUdeviceptr>(address)) ==
          CUDA_SUCCESS &&
      pool != nullptr) {
    return "comes from a stream-ordered memory pool (cudaMallocAsync / cudaMemPool)";
  }
  return "is memory of the CUDA virtual memory API (cuMemCreate + cuMemMap, as PyTorch's "
         "expandable_segments:True allocates)";
}

// The IPC handle of the whole allocation holding buffer `which`. The allocation's context is
// current.
StatusOr<cuda_ipc::IpcHandleBytes> ExportAllocation(const Allocation& alloc,
                                                    const std::string& which) {
  const std::string allocation = "the " + Num(alloc.bytes) + "-byte CUDA allocation [" +
                                 Hex(alloc.base) + ", " + Hex(alloc.base + alloc.bytes) +
                                 ") holding " + which;
  const std::string why_not = WhyNotLegacyIpcCapable(alloc.base);
  if (!why_not.empty()) {
    return FailedPrecondition(allocation + " " + why_not +
                              ", which CUDA IPC (cudaIpcGetMemHandle) cannot share; " +
                              kShareableMemoryAdvice);
  }
  cudaIpcMemHandle_t handle;
  const cudaError_t got = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(alloc.base));
  if (got != cudaSuccess) {
    return FailedPrecondition(cuda::ToStatus(got, "cudaIpcGetMemHandle").message() +
                              ": cannot share " + allocation +
                              "; cuda_ipc shares cudaMalloc memory only (not VMM memory from "
                              "cuMemCreate, cudaMallocAsync pools or managed memory): " +
                              kShareableMemoryAdvice);
  }
  cuda_ipc::IpcHandleBytes bytes;
  std::memcpy(bytes.data(), &handle, sizeof(handle));
  return bytes;
}

// ---- Process-wide cache of opened peer allocations ----------------------------------------

class MappingCache {
 public:
  static MappingCache& Get() {
    static MappingCache* cache = new MappingCache();  // never destroyed: used from destructors
    return *cache;
  }

  // Takes a reference on the mapping of `allocation`, opening it (on `device`, which the caller
  // made current) if this process has not yet. Returns its address here.
  StatusOr<uint64_t> Acquire(const cuda_ipc::PeerAllocation& allocation, int device) {
    const std::string id(allocation.handle.data(), allocation.handle.size());
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = mappings_.find(id);
    if (it != mappings_.end()) {
      ++it->second.references;
      return it->second.base;
    }
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, allocation.handle.data(), sizeof(handle));
    void* mapped = nullptr;
    const cudaError_t err = cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      return Unavailable(cuda::ToStatus(err, "cudaIpcOpenMemHandle").message() +
                         " (opening the peer's allocation of " + Num(allocation.bytes) +
                         " bytes on device " + std::to_string(device) +
                         "); the peer must be alive with its pool allocated, and its GPU "
                         "reachable from this one");
    }
    const uint64_t base = reinterpret_cast<uint64_t>(mapped);
    // A key that claims more than the handle maps would let writes run past the mapping.
    StatusOr<Allocation> range = FindAllocation(base);
    if (range.ok() && range->bytes < allocation.bytes) {
      if (cudaIpcCloseMemHandle(mapped) != cudaSuccess) (void)cudaGetLastError();
      return InvalidArgument("the peer's key claims an allocation of " + Num(allocation.bytes) +
                             " bytes, but its handle maps " + Num(range->bytes) +
                             "; the peer's descriptor is inconsistent");
    }
    if (!range.ok()) {
      KVT_LOG_DEBUG("ipc", "cannot size the mapping at {}: {}", Hex(base),
                    range.status().ToString());
    }
    mappings_.emplace(id, Mapping{base, device, 1});
    KVT_LOG_DEBUG("ipc", "opened a peer allocation of {} bytes at {} on device {}",
                  allocation.bytes, Hex(base), device);
    return base;
  }

  // Drops a reference; the last one closes the mapping.
  void Release(const std::string& id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = mappings_.find(id);
    if (it == mappings_.end()) {
      KVT_LOG_ERROR("ipc", "release of a peer mapping this process does not hold");
      return;
    }
    if (--it->second.references > 0) return;
    DeviceGuard guard(it->second.device);
    const cudaError_t err = cudaIpcCloseMemHandle(reinterpret_cast<void*>(it->second.base));
    if (err != cudaSuccess) {
      KVT_LOG_WARN("ipc", "{}", cuda::ToStatus(err, "cudaIpcCloseMemHandle").message());
    }
    mappings_.erase(it);
  }

  size_t Size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return mappings_.size();
  }

 private:
  struct Mapping {
    uint64_t base = 0;
    int device = -1;  // the device current when it was opened
    int references = 0;
  };
  std::mutex mutex_;                                   // guards mappings_
  std::unordered_map<std::string, Mapping> mappings_;  // by IPC handle bytes
};

// ---- The backend --------------------------------------------------------------------------

class CudaIpcBackend final : public Backend {
 public:
  CudaIpcBackend(uint64_t instance, const CudaIpcOptions& options)
      : instance_(instance), options_(options) {}

  ~CudaIpcBackend() override {
    std::lock_guard<std::mutex> lock(mutex_);
    Status drained = OkStatus();
    if (stream_.get() != nullptr) {
      DeviceGuard guard(device_);
      drained = guard.status();
      if (drained.ok()) drained = DrainLocked("the cuda_ipc stream at shutdown");
      // Host functions on the notify stream name this object: let them run out first.
      if (drained.ok() && notify_stream_.get() != nullptr) drained = notify_stream_.Synchronize();
      if (drained.ok() && copy_stream_.get() != nullptr) drained = copy_stream_.Synchronize();
    }
    if (!drained.ok()) {
      // The GPU may still read scratch tables or write through the mappings: keep them.
      KVT_LOG_ERROR("ipc",
                    "cuda_ipc backend destroyed while its GPU work did not finish ({}); leaking "
                    "its scratch memory and its peers' mappings",
                    drained.ToString());
      for (auto& [id, write] : writes_) (void)write.slot.release();
      for (auto& [peer, slot] : retiring_) (void)slot.release();
      for (auto& word : words_) (void)word.release();  // the stream may still set it
      writes_.clear();
      retiring_.clear();
      peers_.clear();
      return;
    }
    if (device_ < 0) return;  // never registered: nothing on a device
    DeviceGuard guard(device_);
    writes_.clear();
    retiring_.clear();
    free_.clear();
    for (auto& [id, peer] : peers_) ReleaseMappings(peer);
    peers_.clear();
  }

  std::string_view Name() const override { return "cuda_ipc"; }

  BackendCapabilities Capabilities() const override {
    BackendCapabilities caps;
    caps.cuda_memory = true;
    caps.inter_process = true;
    caps.page_writes = true;
    caps.notifies_completion = true;
    caps.completion_hints = word_.load(std::memory_order_acquire) != nullptr;
    return caps;
  }

  StatusOr<PeerDescriptor> Register(std::span<const LocalRegion> regions) override {
    if (regions.empty()) {
      return InvalidArgument(
          "cuda_ipc: no buffers to register; pass the pool's 2 x layers CUDA buffers");
    }
    const int32_t device = regions[0].device;
    for (size_t i = 0; i < regions.size(); ++i) {
      const LocalRegion& r = regions[i];
      const std::string which = "buffer " + Num(i);
      if (r.kind != MemoryKind::kCuda) {
        return InvalidArgument(which +
                               " is host memory, but cuda_ipc moves CUDA memory only; use the "
                               "ucx or loopback backend for host pools");
      }
      if (r.base == 0 || r.length == 0) {
        return InvalidArgument(which + " has a null base or zero length");
      }
      if (r.item_len == 0 || r.item_len > r.length) {
        return InvalidArgument(which + " has pages of " + Num(r.item_len) + " bytes in " +
                               Num(r.length) + " bytes; item_len must be in [1, length]");
      }
      if (r.device < 0) {
        return InvalidArgument(which + " is CUDA memory without a device (device = " +
                               std::to_string(r.device) + "); set LocalRegion::device");
      }
      if (r.device != device) {
        return InvalidArgument(
            "buffers on several devices (buffer 0 on device " + std::to_string(device) + ", " +
            which + " on device " + std::to_string(r.device) +
            "); one cuda_ipc backend serves one GPU: give each device's pool its own backend");
      }
    }
    KVT_ASSIGN_OR_RETURN(cuda_ipc::LocalBuffers local, cuda_ipc::LocalBuffers::Create(regions));
    const int device_count = cuda::DeviceCount().count;
    if (device >= device_count) {
      return InvalidArgument("buffers on device " + std::to_string(device) +
                             ", but this process sees " + std::to_string(device_count) +
                             " CUDA devices");
    }

    std::lock_guard<std::mutex> lock(mutex_);
    size_t in_flight = 0;
    for (auto& [id, write] : writes_) {
      PollLocked(id, write);
      if (write.status.code() == StatusCode::kInProgress) ++in_flight;
    }
    if (in_flight > 0) {
      return FailedPrecondition("cannot re-register buffers while " + Num(in_flight) +
                                " writes are in flight; wait for them (Check) or Release them");
    }
    if (!peers_.empty() && device_ >= 0 && device != device_) {
      return FailedPrecondition(
          "connected peers were set up for device " + std::to_string(device_) +
          "; disconnect them before registering buffers on device " + std::to_string(device));
    }
    DeviceGuard guard(device);
    KVT_RETURN_IF_ERROR(guard.status());

    // One IPC handle per distinct allocation, indexed in order of first use.
    std::map<uint64_t, uint32_t> allocation_index;  // by allocation base
    std::vector<RegionKey> exported;                // by allocation index, without an offset
    std::vector<RegionKey> keys;                    // by buffer
    for (size_t i = 0; i < regions.size(); ++i) {
      const LocalRegion& r = regions[i];
      const std::string which = "buffer " + Num(i) + " at " + Hex(r.base);
      cudaPointerAttributes attr = {};
      const cudaError_t err = cudaPointerGetAttributes(&attr, reinterpret_cast<void*>(r.base));
      if (err != cudaSuccess) {
        return InvalidArgument(cuda::ToStatus(err, "cudaPointerGetAttributes").message() + ": " +
                               which + " is not memory CUDA knows in this process");
      }
      if (attr.type != cudaMemoryTypeDevice) {
        return InvalidArgument(which + " is not device memory (cudaPointerGetAttributes type " +
                               std::to_string(static_cast<int>(attr.type)) +
                               "); cuda_ipc shares cudaMalloc memory only (no host, pinned or "
                               "managed memory)");
      }
      if (attr.device != device) {
        return InvalidArgument(which + " lives on device " + std::to_string(attr.device) +
                               " but is registered for device " + std::to_string(device));
      }
      StatusOr<Allocation> alloc = FindAllocation(r.base);
      if (!alloc.ok()) return alloc.status().WithContext("finding the allocation of " + which);
      if (r.base - alloc->base > alloc->bytes || r.length > alloc->bytes - (r.base - alloc->base)) {
        return InvalidArgument(
            "buffer " + Num(i) + " [" + Hex(r.base) + ", " + Hex(r.base + r.length) + ") of " +
            Num(r.length) + " bytes runs past the end of its CUDA allocation [" + Hex(alloc->base) +
            ", " + Hex(alloc->base + alloc->bytes) + ") of " + Num(alloc->bytes) +
            " bytes (the one holding its start); a registered buffer must lie inside one "
            "allocation "
            "(split a buffer that spans allocations, or allocate the pool in one piece)");
      }
      auto index = allocation_index.find(alloc->base);
      if (index == allocation_index.end()) {
        KVT_ASSIGN_OR_RETURN(cuda_ipc::IpcHandleBytes handle, ExportAllocation(*alloc, which));
        // A peer that maps an allocation of other than whole 2 MiB granules writes small
        // scattered pages into it several times slower (docs/performance.md, "External
        // memory"); caching allocators (PyTorch's) hand out whole granules, kvt's pool too.
        constexpr uint64_t kGranule = uint64_t{2} << 20;
        if (alloc->bytes % kGranule != 0) {
          KVT_LOG_WARN("cuda_ipc",
                       "{} lies in a CUDA allocation of {} bytes, not a multiple of 2 MiB: peers "
                       "write into it through CUDA IPC several times slower; allocate whole "
                       "2 MiB granules (round the cudaMalloc size up)",
                       which, alloc->bytes);
        }
        index = allocation_index.emplace(alloc->base, static_cast<uint32_t>(exported.size())).first;
        RegionKey key;
        key.allocation = index->second;
        key.handle = handle;
        key.allocation_bytes = alloc->bytes;
        exported.push_back(key);
      }
      RegionKey key = exported[index->second];
      key.offset = r.base - alloc->base;
      keys.push_back(key);
    }
    for (RegionKey& key : keys) key.allocations = static_cast<uint32_t>(exported.size());

    char pci[64] = {};
    KVT_CUDA_RETURN_IF_ERROR(cudaDeviceGetPCIBusId(pci, sizeof(pci) - 1, device));
    if (stream_.get() == nullptr || device != device_) {
      KVT_ASSIGN_OR_RETURN(cuda::Stream stream, cuda::Stream::Create(device));
      KVT_ASSIGN_OR_RETURN(cuda::Stream notify, cuda::Stream::Create(device));
      KVT_ASSIGN_OR_RETURN(cuda::Stream copy, cuda::Stream::Create(device));
      stream_ = std::move(stream);
      notify_stream_ = std::move(notify);
      copy_stream_ = std::move(copy);
      free_.clear();  // scratch of another device
      word_.store(nullptr, std::memory_order_release);
      if (options_.completion_word) {
        StatusOr<cuda::CompletionWord> word = cuda::CompletionWord::Create(device);
        if (word.ok()) {
          // A new word starts at 0, below every write id posted from now on.
          words_.push_back(std::make_unique<cuda::CompletionWord>(std::move(*word)));
          word_.store(words_.back().get(), std::memory_order_release);
        } else {
          KVT_LOG_INFO("ipc",
                       "no completion word on device {} ({}); completion is seen through "
                       "events alone",
                       device, word.status().ToString());
        }
      }
    }
    ProcessAddress self = Self();
    self.device = device;
    self.pci_bus_id = pci;
    self.instance = instance_;

    PeerDescriptor descriptor;
    descriptor.backend = "cuda_ipc";
    descriptor.address = cuda_ipc::EncodeAddress(self);
    for (size_t i = 0; i < regions.size(); ++i) {
      descriptor.regions.push_back(RemoteRegion{regions[i].base, regions[i].length,
                                                regions[i].item_len,
                                                cuda_ipc::EncodeRegionKey(keys[i])});
    }
    local_ = std::move(local);
    for (auto& [id, peer] : peers_) peer.shapes.Clear();  // built from the buffers replaced
    device_ = device;
    KVT_LOG_DEBUG("ipc", "registered {} buffers in {} allocations on device {} ({})",
                  regions.size(), exported.size(), device, self.pci_bus_id);
    return descriptor;
  }

  StatusOr<PeerId> Connect(const PeerDescriptor& descriptor) override {
    if (descriptor.backend != "cuda_ipc") {
      return InvalidArgument("peer uses backend '" + descriptor.backend +
                             "', this side 'cuda_ipc'");
    }
    StatusOr<ProcessAddress> address = cuda_ipc::DecodeAddress(descriptor.address);
    if (!address.ok()) return address.status().WithContext("the peer's cuda_ipc address");
    StatusOr<cuda_ipc::PeerKeys> keys = cuda_ipc::DecodePeerKeys(descriptor.regions);
    if (!keys.ok()) return keys.status();
    if (!cuda_ipc::SameHost(*address, Self())) {
      return FailedPrecondition(
          "cuda_ipc reaches peers on the same host only, but the peer's "
          "boot id '" +
          address->boot_id + "' differs from this host's '" + cuda_ipc::ThisBootId() +
          "'; use ucx");
    }

    std::lock_guard<std::mutex> lock(mutex_);
    if (local_.empty()) {
      return FailedPrecondition("register this side's buffers before connecting a peer");
    }
    // Page writes check that the buffer lists match (PlanPageWrite); copy runs name the peer's
    // buffer themselves, so a peer with another list may still take them.
    DeviceGuard guard(device_);
    KVT_RETURN_IF_ERROR(guard.status());
    int peer_device = -1;
    const cudaError_t found = cudaDeviceGetByPCIBusId(&peer_device, address->pci_bus_id.c_str());
    if (found != cudaSuccess) {
      return FailedPrecondition(
          cuda::ToStatus(found, "cudaDeviceGetByPCIBusId").message() + ": the peer's GPU (PCI " +
          address->pci_bus_id + ", its device " + std::to_string(address->device) +
          ") is not visible in this process; make it visible (CUDA_VISIBLE_DEVICES) or use ucx");
    }
    if (peer_device != device_) KVT_RETURN_IF_ERROR(EnablePeerAccessLocked(peer_device));

    Peer peer;
    peer.regions = descriptor.regions;
    peer.device = peer_device;
    if (cuda_ipc::SameProcess(*address, Self())) {
      // CUDA refuses to open this process's own handles; the addresses are valid as they are.
      for (const RemoteRegion& r : descriptor.regions) peer.dst_bases.push_back(r.base);
    } else {
      // Each allocation is opened once (through the process-wide cache); its buffers lie at
      // offsets from where it is mapped here.
      std::vector<uint64_t> mapped_base;  // by allocation index
      for (size_t a = 0; a < keys->allocations.size(); ++a) {
        const cuda_ipc::PeerAllocation& allocation = keys->allocations[a];
        StatusOr<uint64_t> base = MappingCache::Get().Acquire(allocation, device_);
        if (!base.ok()) {
          ReleaseMappings(peer);
          return base.status().WithContext("connecting to the peer's allocation " + Num(a) +
                                           " of " + Num(keys->allocations.size()));
        }
        peer.mapped.emplace_back(allocation.handle.data(), allocation.handle.size());
        mapped_base.push_back(*base);
      }
      for (size_t i = 0; i < descriptor.regions.size(); ++i) {
        peer.dst_bases.push_back(mapped_base[keys->allocation_of[i]] + keys->offsets[i]);
      }
    }
    const PeerId id = next_peer_++;
    KVT_LOG_DEBUG("ipc", "peer {} connected: {} buffers on device {}{}", id, peer.regions.size(),
                  peer_device,
                  peer.mapped.empty() ? " (this process)"
                                      : ", " + Num(peer.mapped.size()) + " allocations mapped");
    peers_.emplace(id, std::move(peer));
    return id;
  }

  Status Disconnect(PeerId id, DisconnectMode mode) override {
    std::unique_lock<std::mutex> lock(mutex_);
    auto it = peers_.find(id);
    if (it == peers_.end()) return NotFound("no cuda_ipc peer " + Num(id));
    Peer peer = std::move(it->second);
    peers_.erase(it);
    // Writes still running are reported Aborted; the GPU work itself is local and finishes
    // (even when the peer process died: its memory stays mapped here), so it is waited for
    // before the mappings can close.
    size_t in_flight = 0;
    for (auto& [wid, write] : writes_) {
      if (write.peer != id) continue;
      PollLocked(wid, write);
      if (write.status.code() == StatusCode::kInProgress) {
        write.aborted = true;
        ++in_flight;
      }
    }
    // Work for this peer that no longer has an entry here may still be on the stream: a write
    // another thread is releasing (it waits without the lock), one whose release gave up, the
    // launches of a post that failed part-way. The stream runs in order, so a marker behind
    // them tells when they are done.
    if (auto u = untracked_.find(id); u != untracked_.end()) in_flight += u->second;
    SweepRetiringLocked();
    for (const auto& [retiring_peer, slot] : retiring_) {
      if (retiring_peer == id) ++in_flight;
    }
    Status drained = OkStatus();
    if (in_flight > 0) {
      DeviceGuard guard(device_);
      drained = guard.status();
      if (drained.ok()) {
        StatusOr<cuda::Event> marker = cuda::Event::Create(/*timing=*/false);
        drained = marker.ok() ? marker->Record(stream_.get()) : marker.status();
        if (drained.ok()) {
          lock.unlock();
          drained =
              WaitForEvent(marker->get(), kGpuWaitLimit, "the writes in flight to peer " + Num(id));
          lock.lock();
        }
      }
    }
    if (!drained.ok()) {
      KVT_LOG_ERROR("ipc",
                    "peer {} disconnected ({}), but {} writes to it did not finish: {}; "
                    "keeping its mappings open",
                    id, mode == DisconnectMode::kPeerDead ? "dead" : "graceful", in_flight,
                    drained.ToString());
      return drained.WithContext("peer " + Num(id) + " is forgotten, but its mappings stay open");
    }
    for (auto& [wid, write] : writes_) {
      if (write.peer == id) PollLocked(wid, write);
    }
    ReleaseMappings(peer);
    KVT_LOG_DEBUG("ipc", "peer {} disconnected ({}), {} writes aborted", id,
                  mode == DisconnectMode::kPeerDead ? "dead" : "graceful", in_flight);
    return OkStatus();
  }

  StatusOr<WriteId> PostPages(PeerId id, const PageWrite& write) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = peers_.find(id);
    if (it == peers_.end()) return UnknownPeer(id);
    KVT_RETURN_IF_ERROR(cuda_ipc::PlanPageWriteInto(
        write, local_, it->second.regions, it->second.dst_bases, program_, &it->second.shapes));
    return EnqueueLocked(id, program_, write.ready);
  }

  StatusOr<WriteId> PostWrite(PeerId id, std::span<const CopyRun> runs) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = peers_.find(id);
    if (it == peers_.end()) return UnknownPeer(id);
    KVT_ASSIGN_OR_RETURN(
        CopyProgram program,
        cuda_ipc::PlanRunWrite(runs, local_, it->second.regions, it->second.dst_bases));
    return EnqueueLocked(id, program, nullptr);
  }

  Status Check(WriteId id) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = writes_.find(id);
    if (it == writes_.end()) return NotFound("no cuda_ipc write " + Num(id));
    PollLocked(it->first, it->second);
    return it->second.status;
  }

  void Release(WriteId id) override {
    std::unique_lock<std::mutex> lock(mutex_);
    auto it = writes_.find(id);
    if (it == writes_.end()) return;
    Write write = std::move(it->second);
    writes_.erase(it);
    PollLocked(id, write);
    if (!write.slot) return;  // finished (its scratch is recycled) or failed
    // Still running: a launched kernel cannot be cancelled, so wait for it (without the lock).
    // Meanwhile a Disconnect of its peer counts it (untracked_) and waits too.
    const cudaEvent_t done = write.slot->done.get();
    ++untracked_[write.peer];
    lock.unlock();
    const Status waited = WaitForEvent(done, kGpuWaitLimit, "cuda_ipc write " + Num(id));
    lock.lock();
    if (waited.ok()) {
      if (auto u = untracked_.find(write.peer); u != untracked_.end() && --u->second == 0) {
        untracked_.erase(u);
      }
      RecycleLocked(std::move(write.slot));
    } else {
      // The GPU may still write through the peer's mappings: it stays counted, for good.
      KVT_LOG_ERROR("ipc", "released write {} did not finish ({}); leaking its scratch", id,
                    waited.ToString());
      (void)write.slot.release();
    }
  }

 private:
  // Staging for one write's tables, and the event that says the GPU is done with them.
  struct Slot {
    cuda::PinnedBuffer host;
    cuda::DeviceBuffer device;
    cuda::Event staged;  // the tables' upload (copy stream) finished
    cuda::Event done;
  };
  struct Peer {
    std::vector<RemoteRegion> regions;
    std::vector<uint64_t> dst_bases;  // where each peer buffer is reachable from this process
    std::vector<std::string> mapped;  // handles holding one MappingCache reference each
    int device = -1;                  // the peer's GPU, in this process's numbering
    cuda_ipc::BatchShapes shapes;     // of the layer batches written to it (local_ as it is)
  };
  struct Write {
    PeerId peer = 0;
    std::unique_ptr<Slot> slot;  // until the GPU is done with the write's tables
    Status status;               // InProgress until the completion event fired
    bool aborted = false;        // its peer was disconnected while it ran
    bool signalled = false;      // the completion word reaches the write's id once it is done
  };

  static Status UnknownPeer(PeerId id) {
    return NotFound("no cuda_ipc peer " + Num(id) +
                    " (never connected, or disconnected); connect it again before writing");
  }

  ProcessAddress Self() const {
    ProcessAddress self;
    self.boot_id = cuda_ipc::ThisBootId();
    self.pid = static_cast<uint64_t>(getpid());
    self.process = cuda_ipc::ThisProcessToken();
    return self;
  }

  // Enables access from our device to `peer_device` (the current device is ours).
  Status EnablePeerAccessLocked(int peer_device) {
    int can = 0;
    KVT_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&can, device_, peer_device));
    if (can == 0) {
      return FailedPrecondition("this side's GPU (device " + std::to_string(device_) +
                                ") cannot reach the peer's GPU (device " +
                                std::to_string(peer_device) +
                                ") directly: cudaDeviceCanAccessPeer says no NVLink or PCIe "
                                "peer-to-peer path; use ucx");
    }
    const cudaError_t err = cudaDeviceEnablePeerAccess(peer_device, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
      return OkStatus();
    }
    return cuda::ToStatus(err, "cudaDeviceEnablePeerAccess");
  }

  void ReleaseMappings(Peer& peer) {
    for (const std::string& handle : peer.mapped) MappingCache::Get().Release(handle);
    peer.mapped.clear();
  }

  // Moves a write's status on when its completion word passed its id (no driver call) or its
  // completion event fired. mutex_ held.
  void PollLocked(WriteId id, Write& write) {
    if (write.status.code() != StatusCode::kInProgress || !write.slot) return;
    // The word is set behind the write's event on the same stream: past the id, both are done.
    const cuda::CompletionWord* word = word_.load(std::memory_order_relaxed);
    const cudaError_t err = write.signalled && word != nullptr && word->Load() >= id
                                ? cudaSuccess
                                : cudaEventQuery(write.slot->done.get());
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return;
    }
    if (err == cudaSuccess) {
      write.status = write.aborted ? Aborted(
                                         "the peer was disconnected while this write was in "
                                         "flight; its bytes may be incomplete at the peer")
                                   : OkStatus();
      RecycleLocked(std::move(write.slot));
      return;
    }
    write.status =
        cuda::ToStatus(err, "cudaEventQuery").WithContext("the cuda_ipc write failed on the GPU");
    write.slot.reset();
  }

  // Scratch of at least `bytes` for a write (0: only its events): a free one, else a new or
  // regrown one (the only place that allocates device or pinned memory; once warm, writes
  // reuse). mutex_ held, our device current.
  StatusOr<std::unique_ptr<Slot>> AcquireSlotLocked(size_t bytes) {
    SweepRetiringLocked();
    size_t best = free_.size();
    for (size_t i = 0; i < free_.size(); ++i) {
      if (free_[i]->host.size() >= bytes &&
          (best == free_.size() || free_[i]->host.size() < free_[best]->host.size())) {
        best = i;
      }
    }
    std::unique_ptr<Slot> slot;
    if (best != free_.size()) {
      slot = std::move(free_[best]);
      free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
      return slot;
    }
    if (!free_.empty()) {  // regrow a slot that is too small rather than add another
      slot = std::move(free_.back());
      free_.pop_back();
    } else {
      slot = std::make_unique<Slot>();
      KVT_ASSIGN_OR_RETURN(slot->staged, cuda::Event::Create(/*timing=*/false));
      KVT_ASSIGN_OR_RETURN(slot->done, cuda::Event::Create(/*timing=*/false));
      if (bytes == 0) return slot;  // tables in the launch's parameters: only the events
    }
    const size_t capacity = std::bit_ceil(std::max(bytes, kMinScratchBytes));
    slot->host = cuda::PinnedBuffer();
    slot->device = cuda::DeviceBuffer();
    KVT_ASSIGN_OR_RETURN(slot->host, cuda::PinnedBuffer::Allocate(capacity));
    KVT_ASSIGN_OR_RETURN(slot->device, cuda::DeviceBuffer::Allocate(capacity, device_));
    return slot;
  }

  void RecycleLocked(std::unique_ptr<Slot> slot) {
    if (slot) free_.push_back(std::move(slot));
  }

  // Recycles the scratch of failed posts once the GPU is done with it. mutex_ held.
  void SweepRetiringLocked() {
    for (size_t i = 0; i < retiring_.size();) {
      const cudaError_t err = cudaEventQuery(retiring_[i].second->done.get());
      if (err == cudaErrorNotReady) {
        (void)cudaGetLastError();
        ++i;
        continue;
      }
      if (err == cudaSuccess) {
        RecycleLocked(std::move(retiring_[i].second));
      } else {
        (void)cudaGetLastError();
        retiring_[i].second.reset();
      }
      retiring_.erase(retiring_.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }

  // Waits (bounded) until everything enqueued on the stream so far has run. mutex_ held, our
  // device current.
  Status DrainLocked(const std::string& what) {
    KVT_ASSIGN_OR_RETURN(cuda::Event marker, cuda::Event::Create(/*timing=*/false));
    KVT_RETURN_IF_ERROR(marker.Record(stream_.get()));
    return WaitForEvent(marker.get(), kGpuWaitLimit, what);
  }

  // Stages the program's tables (or, when they are small, passes them in the launches'
  // parameters), waits for `ready` on the GPU, launches and records the completion event.
  // mutex_ held.
  StatusOr<WriteId> EnqueueLocked(PeerId peer, const CopyProgram& program, cudaEvent_t ready) {
    if (program.launches.empty()) {
      Write write;
      write.peer = peer;
      write.status = OkStatus();  // nothing to move
      const WriteId id = next_write_++;
      writes_.emplace(id, std::move(write));
      return id;
    }
    DeviceGuard guard(device_);
    KVT_RETURN_IF_ERROR(guard.status());
    // Small tables (a one-page write's: two base tables and two one-entry page lists) ride in
    // the launch's parameters: no upload, event and stream wait before the kernel can start.
    const bool inline_tables = program.tables.size() <= kernels::kPageCopyInlineTableWords;
    const size_t bytes = inline_tables ? 0 : program.table_bytes();
    KVT_ASSIGN_OR_RETURN(std::unique_ptr<Slot> slot, AcquireSlotLocked(bytes));
    // A launch error left on this thread by the caller's own work must not be reported as ours.
    (void)cudaGetLastError();
    if (inline_tables) return LaunchLocked(peer, program, ready, std::move(slot), /*tables=*/0);
    std::memcpy(slot->host.data(), program.tables.data(), bytes);
    // The tables go up on the copy stream, so the upload overlaps the copies already queued on
    // the transfer stream instead of sitting between two of them; the transfer stream waits
    // for it first thing (so the completion event covers it).
    Status staged = cuda::ToStatus(cudaMemcpyAsync(slot->device.data(), slot->host.data(), bytes,
                                                   cudaMemcpyHostToDevice, copy_stream_.get()),
                                   "cudaMemcpyAsync of the write's tables");
    if (staged.ok()) staged = slot->staged.Record(copy_stream_.get());
    if (staged.ok()) {
      staged = cuda::ToStatus(cudaStreamWaitEvent(stream_.get(), slot->staged.get(), 0),
                              "cudaStreamWaitEvent on the tables' upload");
    }
    if (!staged.ok()) {
      // The upload may still read the pinned tables: retire the slot behind the copy stream.
      if (copy_stream_.Synchronize().ok()) {
        RecycleLocked(std::move(slot));
      } else {
        (void)slot.release();
      }
      return staged;
    }
    const uint64_t tables = reinterpret_cast<uint64_t>(slot->device.data());
    return LaunchLocked(peer, program, ready, std::move(slot), tables);
  }

  // Waits for `ready`, launches the program reading its tables at `tables` (device memory the
  // transfer stream already waits for; 0: in the launches' parameters), records the completion
  // event and arms the notifier. mutex_ held, our device current.
  StatusOr<WriteId> LaunchLocked(PeerId peer, const CopyProgram& program, cudaEvent_t ready,
                                 std::unique_ptr<Slot> slot, uint64_t tables) {
    const cudaStream_t stream = stream_.get();
    Status posted = OkStatus();
    if (ready != nullptr) {
      const cudaError_t err = cudaStreamWaitEvent(stream, ready, 0);
      if (err != cudaSuccess) {
        posted = cuda::ToStatus(err, "cudaStreamWaitEvent")
                     .WithContext("waiting for PageWrite::ready, which must be a live cudaEvent_t");
      }
    }
    const uint64_t host_tables = reinterpret_cast<uint64_t>(program.tables.data());
    for (size_t i = 0; posted.ok() && i < program.launches.size(); ++i) {
      const cuda_ipc::CopyLaunch& launch = program.launches[i];
      posted =
          tables != 0
              ? kernels::PageCopyCuda(cuda_ipc::LaunchArgs(program, launch, tables), stream)
              : kernels::PageCopyCudaInline(cuda_ipc::LaunchArgs(program, launch, host_tables),
                                            program.tables.data(), program.tables.size(), stream);
      if (!posted.ok()) {
        posted = posted.WithContext("launch " + Num(i) + " of " + Num(program.launches.size()) +
                                    " of a cuda_ipc write");
      }
    }
    const Status recorded = slot->done.Record(stream);
    if (!recorded.ok()) {
      // Without the event nobody can tell when the GPU is done with the tables: keep them.
      KVT_LOG_ERROR("ipc", "cannot record a write's completion ({}); leaking its scratch",
                    recorded.ToString());
      (void)slot.release();
      ++untracked_[peer];  // launches may have gone out, and nothing tells when they end
      return posted.ok() ? recorded : posted;
    }
    if (!posted.ok()) {
      // The staging copy may still read it, and launches before the failed one may still write
      // to the peer.
      retiring_.emplace_back(peer, std::move(slot));
      return posted;
    }
    Write write;
    write.peer = peer;
    const WriteId id = next_write_++;
    if (const cuda::CompletionWord* word = word_.load(std::memory_order_relaxed)) {
      const Status signalled = word->Signal(stream, id);
      if (signalled.ok()) {
        write.signalled = true;
      } else {
        // The write stands (its event tells); later writes go without the word.
        KVT_LOG_WARN("ipc", "{}; completion is seen through events from now on",
                     signalled.ToString());
        word_.store(nullptr, std::memory_order_release);
      }
    }
    if (!notices_on_demand_.load(std::memory_order_relaxed)) {
      NoticeAfterLocked(slot->done.get());
      armed_write_ = id;
    }
    write.slot = std::move(slot);
    write.status = InProgress();
    writes_.emplace(id, std::move(write));
    return id;
  }

  // Wakes the caller once the GPU passes `done`: a host function (run on CUDA's callback thread;
  // it only flags the caller) on a side stream that waits for the event, so the transfer
  // stream's next copy never waits for the callback thread. mutex_ held, our device current.
  void NoticeAfterLocked(cudaEvent_t done) {
    if (cudaStreamWaitEvent(notify_stream_.get(), done, 0) != cudaSuccess ||
        cudaLaunchHostFunc(notify_stream_.get(), &CudaIpcBackend::NotifyFromStream, this) !=
            cudaSuccess) {
      (void)cudaGetLastError();  // the caller's poll still sees the write complete
    }
  }

  // A notice as soon as the side stream gets to it (anything queued there waits behind writes
  // older than every write in flight, which have completed). mutex_ held, our device current.
  void NoticeNowLocked() {
    if (cudaLaunchHostFunc(notify_stream_.get(), &CudaIpcBackend::NotifyFromStream, this) !=
        cudaSuccess) {
      (void)cudaGetLastError();  // the caller's poll still sees the write complete
    }
  }

  // CUDA host function (no CUDA calls allowed): tells the installed notifier, if any.
  static void CUDART_CB NotifyFromStream(void* self) {
    auto* backend = static_cast<CudaIpcBackend*>(self);
    std::lock_guard<std::mutex> lock(backend->notify_mutex_);
    if (backend->notify_) backend->notify_();
  }

 public:
  void SetCompletionNotifier(std::function<void()> notify) override {
    std::lock_guard<std::mutex> lock(notify_mutex_);
    notify_ = std::move(notify);
  }

  void SetNoticesOnDemand(bool on_demand) override {
    notices_on_demand_.store(on_demand, std::memory_order_relaxed);
  }

  // Lock-free: words live as long as the backend, and a word that is no longer current holds
  // ids below every later write's, so a hint read through it is false, never a wrong true.
  bool CompletedHint(WriteId id) const override {
    const cuda::CompletionWord* word = word_.load(std::memory_order_acquire);
    return word != nullptr && word->Load() >= id;
  }

  // One notice behind the oldest write in flight, unless one is armed behind it already (writes
  // complete in the transfer stream's order, so the oldest completes first). The writes are
  // polled first: one that completed but that no caller has Checked since still reads in
  // progress here, and the notice armed behind it may have fired already, so it must not stand
  // for the writes behind it. A write seen completing here has been seen by no caller yet: it
  // gets a notice at once, and the caller arms again after it has looked.
  void ArmCompletionNotice() override {
    std::lock_guard<std::mutex> lock(mutex_);
    DeviceGuard guard(device_);
    if (!guard.status().ok()) return;  // the caller's next poll still sees the writes complete
    WriteId oldest = 0;
    bool completed_here = false;
    for (auto& [id, write] : writes_) {
      if (write.status.code() != StatusCode::kInProgress || !write.slot) continue;
      PollLocked(id, write);
      if (write.status.code() != StatusCode::kInProgress) {
        completed_here = true;
      } else if (oldest == 0 || id < oldest) {
        oldest = id;
      }
    }
    if (completed_here) {
      NoticeNowLocked();
      return;
    }
    if (oldest == 0 || oldest <= armed_write_) return;
    NoticeAfterLocked(writes_.at(oldest).slot->done.get());
    armed_write_ = oldest;
  }

 private:
  const uint64_t instance_;

  // The completion notifier; its own mutex, never held across CUDA calls, so a host function
  // waiting for it cannot stall a thread that waits for the stream under mutex_. The stream is
  // drained (no host function pending) before the backend goes away.
  std::mutex notify_mutex_;
  std::function<void()> notify_;
  std::atomic<bool> notices_on_demand_{false};
  const CudaIpcOptions options_;
  // The current completion word (null: none), set under mutex_, read by CompletedHint without
  // it; every word made stays in words_ until the backend goes (a hint may still read it).
  std::atomic<const cuda::CompletionWord*> word_{nullptr};

  std::mutex mutex_;            // guards everything below
  int device_ = -1;             // the registered buffers' device; -1 before Register
  cuda::Stream stream_;         // the transfer stream (non-blocking) on device_; destroyed last
  cuda::Stream notify_stream_;  // completion host functions, behind each write's event
  cuda::Stream copy_stream_;    // uploads of the writes' tables
  cuda_ipc::LocalBuffers local_;
  std::unordered_map<PeerId, Peer> peers_;
  std::unordered_map<WriteId, Write> writes_;
  std::vector<std::unique_ptr<Slot>> free_;  // recycled scratch
  // Scratch of failed posts, with the peer they wrote to, until their event.
  std::vector<std::pair<PeerId, std::unique_ptr<Slot>>> retiring_;
  // Per peer: writes no longer in writes_ whose GPU work may still run (a release waiting
  // without the lock, or one that gave up; a post whose completion could not be recorded).
  std::unordered_map<PeerId, size_t> untracked_;
  std::vector<std::unique_ptr<cuda::CompletionWord>> words_;
  CopyProgram program_;  // the page write being posted; its storage is reused write after write
  PeerId next_peer_ = 1;
  WriteId next_write_ = 1;
  WriteId armed_write_ = 0;  // the newest write a notice waits behind (0: none yet)
};

}  // namespace

StatusOr<std::unique_ptr<Backend>> CreateCudaIpcBackend(const CudaIpcOptions& options) {
  const cuda::DeviceCountResult devices = cuda::DeviceCount();
  if (devices.count <= 0) return Unavailable("cuda_ipc needs a CUDA device: " + devices.reason);
  // The driver's allocation lookup must exist (address 0 is in no allocation: InvalidArgument).
  const Status lookup = FindAllocation(0).status();
  if (!lookup.ok() && lookup.code() != StatusCode::kInvalidArgument) {
    return lookup.WithContext("cuda_ipc");
  }
  return std::unique_ptr<Backend>(std::make_unique<CudaIpcBackend>(RandomU64(), options));
}

size_t CudaIpcOpenMappingsForTest() { return MappingCache::Get().Size(); }

}  // namespace kvt::transfer

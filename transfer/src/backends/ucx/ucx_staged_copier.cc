#include "backends/ucx/ucx_staged_copier.h"

#include <cstring>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "backends/common/layer_table.h"
#include "kvt/common/log.h"
#include "kvt/kernels/kernels.h"

namespace kvt::transfer::ucx_staging {
namespace {

using Clock = std::chrono::steady_clock;

// Makes `device` current for the scope and restores the caller's device after, so that copier
// calls made on an engine's thread leave its CUDA state as they found it.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();
      previous_ = -1;
    }
    status_ = cuda::ToStatus(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    if (previous_ >= 0 && cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  const Status& status() const { return status_; }

 private:
  int previous_ = -1;
  Status status_;
};

// The pool as the copiers address it: buffer addresses and page bytes in LayerTable order, so
// that the buffers of layers [a, b) are one contiguous slice of both.
struct OrderedPool {
  LayerTable layers;
  std::vector<uint64_t> bases;
  std::vector<uint64_t> item_len;

  // Where the buffers of layers [begin, end) start in the ordered tables, and how many.
  size_t First(int32_t begin) const { return layers.Buffers(0, begin).size(); }
};

StatusOr<OrderedPool> OrderPool(std::span<const LocalRegion> regions, const char* who) {
  if (regions.empty()) {
    return InvalidArgument(std::string(who) + ": no buffers; register the layout's buffers");
  }
  for (size_t i = 0; i < regions.size(); ++i) {
    if (regions[i].item_len == 0) {
      return InvalidArgument(std::string(who) + ": buffer " + std::to_string(i) +
                             " has pages of 0 bytes; give every buffer its page bytes");
    }
  }
  OrderedPool pool;
  KVT_ASSIGN_OR_RETURN(pool.layers, LayerTable::Create(regions));
  const std::span<const uint32_t> order = pool.layers.Buffers(0, pool.layers.num_layers());
  for (uint32_t b : order) {
    pool.bases.push_back(regions[b].base);
    pool.item_len.push_back(regions[b].item_len);
  }
  return pool;
}

// The launches of a chunk: one pack/unpack per (unit, run of consecutive buffers of equal page
// bytes), each over the chunk's pages. A unit's segment holds the chunk's buffers one after
// another in layer order, `pages * bytes` each (ucx_staged_protocol.h), which is the kernel's
// buffer-major staging layout within a run. `launch` gets the arguments, the unit, the run's
// offset in the payload and the run's first index in the ordered tables.
template <typename Launch>
Status ForEachLaunch(const CopierChunk& chunk, const OrderedPool& pool, Launch&& launch) {
  const size_t first = pool.First(chunk.layer_begin);
  const size_t end = first + pool.layers.Buffers(chunk.layer_begin, chunk.layer_end).size();
  const int64_t pages = static_cast<int64_t>(chunk.pages.size());
  for (const ChunkUnit& unit : chunk.units) {
    uint64_t offset = unit.payload_offset;
    for (size_t i = first; i < end;) {
      size_t j = i + 1;
      while (j < end && pool.item_len[j] == pool.item_len[i]) ++j;
      const uint64_t bytes = unit.whole_page ? pool.item_len[i] : unit.bytes;
      kernels::PackArgs args;
      args.num_buffers = static_cast<int32_t>(j - i);
      args.num_pages = pages;
      args.page_stride = static_cast<int64_t>(pool.item_len[i]);
      args.bytes = static_cast<int64_t>(bytes);
      KVT_RETURN_IF_ERROR(launch(args, unit, offset, i));
      offset += static_cast<uint64_t>(j - i) * static_cast<uint64_t>(pages) * bytes;
      i = j;
    }
  }
  return OkStatus();
}

// ---- CUDA ------------------------------------------------------------------------------------

class CudaCopier final : public StagingCopier {
 public:
  CudaCopier(int device, const SlotMemory& slots, OrderedPool pool)
      : device_(device), slots_(slots), pool_(std::move(pool)) {}

  ~CudaCopier() override {
    DeviceGuard guard(device_);
    if (!guard.status().ok())
      KVT_LOG_ERROR("ucx", "staging teardown: {}", guard.status().ToString());
    if (res_) {
      // Nothing may still read or write the slots or the pool once we return.
      for (auto& s : res_->send) {
        if (s.stream.get() != nullptr) LogIf(s.stream.Synchronize(), "send slot stream");
      }
      for (auto& r : res_->recv) {
        if (r.stream.get() != nullptr) LogIf(r.stream.Synchronize(), "receive slot stream");
      }
      if (res_->gate.get() != nullptr) LogIf(res_->gate.Synchronize(), "gate stream");
    }
    res_.reset();
    for (void* base : peer_slots_) {
      LogIf(cuda::ToStatus(cudaHostUnregister(base), "cudaHostUnregister"), "a peer's slots");
    }
    if (registered_send_)
      LogIf(cuda::ToStatus(cudaHostUnregister(slots_.send_base), "cudaHostUnregister"),
            "send slots");
    if (registered_recv_)
      LogIf(cuda::ToStatus(cudaHostUnregister(slots_.recv_base), "cudaHostUnregister"),
            "receive slots");
  }

  Status Init(bool* host_registration_failed) {
    DeviceGuard guard(device_);
    KVT_RETURN_IF_ERROR(guard.status());
    res_ = std::make_unique<Resources>();
    const std::vector<uint64_t>& bases = pool_.bases;  // uploaded in layer order
    KVT_ASSIGN_OR_RETURN(res_->bases, cuda::DeviceBuffer::Allocate(bases.size() * 8, device_));
    KVT_RETURN_IF_ERROR(cuda::Copy(res_->bases.data(), bases.data(), bases.size() * 8));

    const size_t area = static_cast<size_t>(slots_.slots) * slots_.slot_bytes;
    if (!slots_.pinned) {
      cudaError_t err = cudaHostRegister(slots_.send_base, area, cudaHostRegisterPortable);
      if (err != cudaSuccess) {
        *host_registration_failed = true;
        return cuda::ToStatus(err, "cudaHostRegister of the UCX-allocated send slots");
      }
      registered_send_ = true;
      err = cudaHostRegister(slots_.recv_base, area, cudaHostRegisterPortable);
      if (err != cudaSuccess) {
        *host_registration_failed = true;
        return cuda::ToStatus(err, "cudaHostRegister of the UCX-allocated receive slots");
      }
      registered_recv_ = true;
    }

    const size_t page_list_bytes = static_cast<size_t>(kMaxChunkPages) * sizeof(int32_t);
    for (uint32_t i = 0; i < slots_.slots; ++i) {
      SendSlot s;
      KVT_ASSIGN_OR_RETURN(s.stream, cuda::Stream::Create(device_));
      KVT_ASSIGN_OR_RETURN(s.done, cuda::Event::Create(/*timing=*/false));
      KVT_ASSIGN_OR_RETURN(s.host_pages, cuda::PinnedBuffer::Allocate(page_list_bytes));
      KVT_ASSIGN_OR_RETURN(s.dev_pages, cuda::DeviceBuffer::Allocate(page_list_bytes, device_));
      KVT_ASSIGN_OR_RETURN(s.staging, cuda::DeviceBuffer::Allocate(slots_.slot_bytes, device_));
      res_->send.push_back(std::move(s));
      RecvSlot r;
      KVT_ASSIGN_OR_RETURN(r.stream, cuda::Stream::Create(device_));
      KVT_ASSIGN_OR_RETURN(r.done, cuda::Event::Create(/*timing=*/false));
      KVT_ASSIGN_OR_RETURN(r.staging, cuda::DeviceBuffer::Allocate(slots_.slot_bytes, device_));
      res_->recv.push_back(std::move(r));
    }
    KVT_ASSIGN_OR_RETURN(res_->gate, cuda::Stream::Create(device_));
    return OkStatus();
  }

  std::string_view Name() const override { return "cuda"; }

  Status Gate(cudaEvent_t ready, cuda::Event& gate) override {
    gate = cuda::Event();
    if (ready == nullptr) return OkStatus();
    DeviceGuard guard(device_);
    KVT_RETURN_IF_ERROR(guard.status());
    KVT_ASSIGN_OR_RETURN(cuda::Event event, cuda::Event::Create(/*timing=*/false));
    KVT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(res_->gate.get(), ready, 0));
    KVT_RETURN_IF_ERROR(event.Record(res_->gate.get()));
    gate = std::move(event);
    return OkStatus();
  }

  Status StartGather(uint32_t slot, const CopierChunk& chunk, cudaEvent_t gate) override {
    if (chunk.pages.size() > static_cast<size_t>(kMaxChunkPages)) {
      return Internal("gather of " + std::to_string(chunk.pages.size()) + " pages exceeds the cap");
    }
    DeviceGuard guard(device_);
    KVT_RETURN_IF_ERROR(guard.status());
    SendSlot& s = res_->send[slot];
    Status started = EnqueueGather(s, slot, chunk, gate);
    if (!started.ok()) {
      // Whatever was enqueued still touches the slot; let it drain before the slot is reused.
      (void)s.stream.Synchronize();
    }
    return started;
  }

  StatusOr<bool> GatherDone(uint32_t slot) override {
    return Query(res_->send[slot].done.get(),
                 "gather (pack kernel, then the copy into the send slot)");
  }

  Status StartScatter(uint32_t slot, const CopierChunk& chunk) override {
    DeviceGuard guard(device_);
    KVT_RETURN_IF_ERROR(guard.status());
    RecvSlot& r = res_->recv[slot];
    Status started = EnqueueScatter(r, slot, chunk);
    if (!started.ok()) (void)r.stream.Synchronize();
    return started;
  }

  StatusOr<bool> ScatterDone(uint32_t slot) override {
    return Query(res_->recv[slot].done.get(), "scatter (copy and unpack into the pool)");
  }

  bool NotifyCompletions(void (*notify)(void*), void* arg) override {
    notify_ = notify;
    notify_arg_ = arg;
    return true;
  }

  Status PinPeerSlots(void* base, size_t bytes) override {
    DeviceGuard guard(device_);
    KVT_RETURN_IF_ERROR(guard.status());
    (void)cudaGetLastError();
    KVT_CUDA_RETURN_IF_ERROR(cudaHostRegister(base, bytes, cudaHostRegisterPortable));
    peer_slots_.insert(base);
    return OkStatus();
  }

  void UnpinPeerSlots(void* base) override {
    if (peer_slots_.erase(base) == 0) return;
    DeviceGuard guard(device_);
    LogIf(cuda::ToStatus(cudaHostUnregister(base), "cudaHostUnregister"), "a peer's slots");
  }

 private:
  struct SendSlot {
    cuda::Stream stream;
    cuda::Event done;
    cuda::PinnedBuffer host_pages;  // the chunk's source page ids, uploaded per chunk
    cuda::DeviceBuffer dev_pages;
    cuda::DeviceBuffer staging;  // the payload's data, packed here, then copied to the slot
    std::vector<std::pair<uint64_t, uint64_t>> ranges;  // scratch of EnqueueGather
  };
  struct RecvSlot {
    cuda::Stream stream;
    cuda::Event done;
    cuda::DeviceBuffer staging;  // the payload, copied from the pinned receive slot
  };
  struct Resources {
    cuda::DeviceBuffer bases;  // the pool's buffer addresses in layer order (OrderedPool)
    std::vector<SendSlot> send;
    std::vector<RecvSlot> recv;
    cuda::Stream gate;
  };

  static void LogIf(const Status& s, const char* what) {
    if (!s.ok()) KVT_LOG_ERROR("ucx", "staging teardown ({}): {}", what, s.ToString());
  }

  StatusOr<bool> Query(cudaEvent_t event, const char* what) {
    cudaError_t err = cudaEventQuery(event);
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error; keep it out of later launch checks
      return false;
    }
    return cuda::ToStatus(err, what);
  }

  Status EnqueueGather(SendSlot& s, uint32_t slot, const CopierChunk& chunk, cudaEvent_t gate) {
    // A launch error left by someone else on this thread would otherwise be reported as ours.
    (void)cudaGetLastError();
    const size_t page_bytes = chunk.pages.size() * sizeof(int32_t);
    std::memcpy(s.host_pages.data(), chunk.pages.data(), page_bytes);
    if (gate != nullptr) KVT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s.stream.get(), gate, 0));
    KVT_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.dev_pages.data(), s.host_pages.data(), page_bytes,
                                             cudaMemcpyHostToDevice, s.stream.get()));
    // The kernel packs into device memory and a copy engine moves the data to the slot: the
    // receiver's copy engine reads slots across the same PCIe link the other way, and two copy
    // engines share the link's two directions, where a kernel storing across PCIe starves a copy
    // engine reading the other way (tools/bench/experiments/pcie_duplex.cu, performance.md).
    auto* staging = s.staging.as<uint8_t>();
    const auto* bases = res_->bases.as<const uint64_t>();
    std::vector<std::pair<uint64_t, uint64_t>>& ranges = s.ranges;  // [begin, end) of the payload
    ranges.clear();
    KVT_RETURN_IF_ERROR(ForEachLaunch(
        chunk, pool_,
        [&](kernels::PackArgs& args, const ChunkUnit& unit, uint64_t segment, size_t first_base) {
          args.bases = bases + first_base;
          args.pages = s.dev_pages.as<const int32_t>();
          args.offset = static_cast<int64_t>(unit.src_offset);
          args.staging = staging + segment;
          const uint64_t end = segment + static_cast<uint64_t>(args.num_buffers) *
                                             static_cast<uint64_t>(args.num_pages) *
                                             static_cast<uint64_t>(args.bytes);
          if (!ranges.empty() && ranges.back().second == segment) {
            ranges.back().second = end;
          } else {
            ranges.emplace_back(segment, end);
          }
          return kernels::PackCuda(args, s.stream.get());
        }));
    uint8_t* slot_host = slots_.send_base + static_cast<size_t>(slot) * slots_.slot_bytes;
    for (const auto& [begin, end] : ranges) {
      if (end > chunk.payload_bytes || end > slots_.slot_bytes) {
        return Internal("gather: payload bytes [" + std::to_string(begin) + ", " +
                        std::to_string(end) + ") outside the chunk's " +
                        std::to_string(chunk.payload_bytes) + " bytes or the slot's " +
                        std::to_string(slots_.slot_bytes));
      }
      KVT_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot_host + begin, staging + begin, end - begin,
                                               cudaMemcpyDeviceToHost, s.stream.get()));
    }
    KVT_RETURN_IF_ERROR(s.done.Record(s.stream.get()));
    return Notify(s.stream.get());
  }

  // After the work enqueued on `stream`: the owner's notify (NotifyCompletions), if any.
  Status Notify(cudaStream_t stream) {
    if (notify_ == nullptr) return OkStatus();
    return cuda::ToStatus(cudaLaunchHostFunc(stream, notify_, notify_arg_),
                          "cudaLaunchHostFunc (completion notice)");
  }

  Status EnqueueScatter(RecvSlot& r, uint32_t slot, const CopierChunk& chunk) {
    (void)cudaGetLastError();
    const uint8_t* host = slots_.recv_base + static_cast<size_t>(slot) * slots_.slot_bytes;
    auto* staging = r.staging.as<uint8_t>();
    if (chunk.data_source == nullptr) {
      KVT_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staging, host, chunk.payload_bytes,
                                               cudaMemcpyHostToDevice, r.stream.get()));
    } else {
      // The checked prefix from our slot, the data straight from the peer's.
      KVT_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staging, host, chunk.data_offset,
                                               cudaMemcpyHostToDevice, r.stream.get()));
      KVT_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
          staging + chunk.data_offset, chunk.data_source + chunk.data_offset,
          chunk.payload_bytes - chunk.data_offset, cudaMemcpyHostToDevice, r.stream.get()));
    }
    const auto* pages = reinterpret_cast<const int32_t*>(staging + chunk.pages_offset);
    const auto* bases = res_->bases.as<const uint64_t>();
    KVT_RETURN_IF_ERROR(ForEachLaunch(
        chunk, pool_,
        [&](kernels::PackArgs& args, const ChunkUnit& unit, uint64_t segment, size_t first_base) {
          args.bases = bases + first_base;
          args.pages = pages;
          args.offset = static_cast<int64_t>(unit.dst_offset);
          args.staging = staging + segment;
          return kernels::UnpackCuda(args, r.stream.get());
        }));
    KVT_RETURN_IF_ERROR(r.done.Record(r.stream.get()));
    return Notify(r.stream.get());
  }

  const int device_;
  const SlotMemory slots_;
  const OrderedPool pool_;
  bool registered_send_ = false;
  bool registered_recv_ = false;
  std::set<void*> peer_slots_;       // PinPeerSlots
  void (*notify_)(void*) = nullptr;  // NotifyCompletions
  void* notify_arg_ = nullptr;
  std::unique_ptr<Resources> res_;
};

// ---- host -------------------------------------------------------------------------------------

class HostCopier final : public StagingCopier {
 public:
  HostCopier(OrderedPool pool, const SlotMemory& slots, std::chrono::microseconds delay)
      : slots_(slots),
        pool_(std::move(pool)),
        delay_(delay),
        gather_started_(slots.slots),
        scatter_started_(slots.slots) {}

  std::string_view Name() const override { return "host"; }

  Status Gate(cudaEvent_t ready, cuda::Event& gate) override {
    gate = cuda::Event();
    // A CPU copy must not read before the producer's work is done; wait for it here.
    if (ready != nullptr) KVT_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(ready));
    return OkStatus();
  }

  Status StartGather(uint32_t slot, const CopierChunk& chunk, cudaEvent_t) override {
    uint8_t* payload = slots_.send_base + static_cast<size_t>(slot) * slots_.slot_bytes;
    KVT_RETURN_IF_ERROR(ForEachLaunch(
        chunk, pool_,
        [&](kernels::PackArgs& args, const ChunkUnit& unit, uint64_t segment, size_t first_base) {
          args.bases = pool_.bases.data() + first_base;
          args.pages = chunk.pages.data();
          args.offset = static_cast<int64_t>(unit.src_offset);
          args.staging = payload + segment;
          return kernels::PackCpu(args);
        }));
    gather_started_[slot] = Clock::now();
    return OkStatus();
  }

  StatusOr<bool> GatherDone(uint32_t slot) override {
    return Clock::now() - gather_started_[slot] >= delay_;
  }

  Status StartScatter(uint32_t slot, const CopierChunk& chunk) override {
    uint8_t* payload = slots_.recv_base + static_cast<size_t>(slot) * slots_.slot_bytes;
    if (chunk.data_source != nullptr) {
      std::memcpy(payload + chunk.data_offset, chunk.data_source + chunk.data_offset,
                  chunk.payload_bytes - chunk.data_offset);
    }
    KVT_RETURN_IF_ERROR(ForEachLaunch(
        chunk, pool_,
        [&](kernels::PackArgs& args, const ChunkUnit& unit, uint64_t segment, size_t first_base) {
          args.bases = pool_.bases.data() + first_base;
          args.pages = chunk.pages.data();
          args.offset = static_cast<int64_t>(unit.dst_offset);
          args.staging = payload + segment;
          return kernels::UnpackCpu(args);
        }));
    scatter_started_[slot] = Clock::now();
    return OkStatus();
  }

  StatusOr<bool> ScatterDone(uint32_t slot) override {
    return Clock::now() - scatter_started_[slot] >= delay_;
  }

 private:
  const SlotMemory slots_;
  const OrderedPool pool_;
  const std::chrono::microseconds delay_;
  std::vector<Clock::time_point> gather_started_;
  std::vector<Clock::time_point> scatter_started_;
};

}  // namespace

StatusOr<std::unique_ptr<StagingCopier>> CreateCudaCopier(int device,
                                                          std::span<const LocalRegion> regions,
                                                          const SlotMemory& slots,
                                                          bool* host_registration_failed) {
  *host_registration_failed = false;
  KVT_ASSIGN_OR_RETURN(OrderedPool pool, OrderPool(regions, "CUDA staging"));
  for (size_t i = 0; i < regions.size(); ++i) {
    if (regions[i].kind != MemoryKind::kCuda || regions[i].device != device) {
      return InvalidArgument("CUDA staging: buffer " + std::to_string(i) + " is not CUDA memory " +
                             "of device " + std::to_string(device) +
                             "; a staged pool lives on one device");
    }
  }
  auto copier = std::make_unique<CudaCopier>(device, slots, std::move(pool));
  KVT_RETURN_IF_ERROR(
      copier->Init(host_registration_failed)
          .WithContext("setting up CUDA staging on device " + std::to_string(device)));
  return std::unique_ptr<StagingCopier>(std::move(copier));
}

StatusOr<std::unique_ptr<StagingCopier>> CreateHostCopier(std::span<const LocalRegion> regions,
                                                          const SlotMemory& slots,
                                                          std::chrono::microseconds delay) {
  KVT_ASSIGN_OR_RETURN(OrderedPool pool, OrderPool(regions, "host staging"));
  return std::unique_ptr<StagingCopier>(
      std::make_unique<HostCopier>(std::move(pool), slots, delay));
}

}  // namespace kvt::transfer::ucx_staging

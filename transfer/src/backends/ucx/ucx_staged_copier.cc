#include "backends/ucx/ucx_staged_copier.h"

#include <cstring>
#include <string>
#include <vector>

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

Status CheckRegions(std::span<const LocalRegion> regions, const char* who) {
  if (regions.empty() || regions.size() % 2 != 0) {
    return InvalidArgument(std::string(who) + ": a staged pool registers 2L buffers (K then V), " +
                           "got " + std::to_string(regions.size()));
  }
  for (size_t i = 1; i < regions.size(); ++i) {
    if (regions[i].item_len != regions[0].item_len) {
      return Unimplemented(std::string(who) + ": buffer " + std::to_string(i) + " has pages of " +
                           std::to_string(regions[i].item_len) + " bytes and buffer 0 of " +
                           std::to_string(regions[0].item_len) +
                           "; staging needs one page size for every buffer");
    }
  }
  return OkStatus();
}

// The waits of a chunk's units: one pack/unpack launch per (unit, K or V), each over the
// chunk's layers, which are contiguous in the base table (K of l at l, V of l at L + l).
template <typename Launch>
Status ForEachLaunch(const CopierChunk& chunk, uint64_t item_len, Launch&& launch) {
  const int32_t layers = chunk.layer_end - chunk.layer_begin;
  const int64_t pages = static_cast<int64_t>(chunk.pages.size());
  for (const ChunkUnit& unit : chunk.units) {
    for (int kv = 0; kv < 2; ++kv) {
      kernels::PackArgs args;
      args.num_buffers = layers;
      args.num_pages = pages;
      args.page_stride = static_cast<int64_t>(item_len);
      args.bytes = static_cast<int64_t>(unit.bytes);
      const uint64_t segment =
          unit.payload_offset + static_cast<uint64_t>(kv) * layers * pages * unit.bytes;
      const size_t first_base = static_cast<size_t>(kv) * chunk.num_layers + chunk.layer_begin;
      KVT_RETURN_IF_ERROR(launch(args, unit, segment, first_base));
    }
  }
  return OkStatus();
}

// ---- CUDA ------------------------------------------------------------------------------------

class CudaCopier final : public StagingCopier {
 public:
  CudaCopier(int device, const SlotMemory& slots, uint64_t item_len)
      : device_(device), slots_(slots), item_len_(item_len) {}

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
    if (registered_send_)
      LogIf(cuda::ToStatus(cudaHostUnregister(slots_.send_base), "cudaHostUnregister"),
            "send slots");
    if (registered_recv_)
      LogIf(cuda::ToStatus(cudaHostUnregister(slots_.recv_base), "cudaHostUnregister"),
            "receive slots");
  }

  Status Init(std::span<const LocalRegion> regions, bool* host_registration_failed) {
    DeviceGuard guard(device_);
    KVT_RETURN_IF_ERROR(guard.status());
    res_ = std::make_unique<Resources>();
    std::vector<uint64_t> bases;
    for (const LocalRegion& r : regions) bases.push_back(r.base);
    KVT_ASSIGN_OR_RETURN(res_->bases, cuda::DeviceBuffer::Allocate(bases.size() * 8, device_));
    KVT_RETURN_IF_ERROR(cuda::Copy(res_->bases.data(), bases.data(), bases.size() * 8));

    const size_t area = static_cast<size_t>(slots_.slots) * slots_.slot_bytes;
    if (!slots_.pinned) {
      cudaError_t err = cudaHostRegister(slots_.send_base, area,
                                         cudaHostRegisterPortable | cudaHostRegisterMapped);
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
    void* mapped = nullptr;
    KVT_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&mapped, slots_.send_base, 0));
    send_dev_ = static_cast<uint8_t*>(mapped);

    const size_t page_list_bytes = static_cast<size_t>(kMaxChunkPages) * sizeof(int32_t);
    for (uint32_t i = 0; i < slots_.slots; ++i) {
      SendSlot s;
      KVT_ASSIGN_OR_RETURN(s.stream, cuda::Stream::Create(device_));
      KVT_ASSIGN_OR_RETURN(s.done, cuda::Event::Create(/*timing=*/false));
      KVT_ASSIGN_OR_RETURN(s.host_pages, cuda::PinnedBuffer::Allocate(page_list_bytes));
      KVT_ASSIGN_OR_RETURN(s.dev_pages, cuda::DeviceBuffer::Allocate(page_list_bytes, device_));
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
    return Query(res_->send[slot].done.get(), "gather (pack kernel into the send slot)");
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

 private:
  struct SendSlot {
    cuda::Stream stream;
    cuda::Event done;
    cuda::PinnedBuffer host_pages;  // the chunk's source page ids, uploaded per chunk
    cuda::DeviceBuffer dev_pages;
  };
  struct RecvSlot {
    cuda::Stream stream;
    cuda::Event done;
    cuda::DeviceBuffer staging;  // the payload, copied from the pinned receive slot
  };
  struct Resources {
    cuda::DeviceBuffer bases;  // the pool's 2L buffer addresses
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
    uint8_t* payload = send_dev_ + static_cast<size_t>(slot) * slots_.slot_bytes;
    const auto* bases = res_->bases.as<const uint64_t>();
    KVT_RETURN_IF_ERROR(ForEachLaunch(
        chunk, item_len_,
        [&](kernels::PackArgs& args, const ChunkUnit& unit, uint64_t segment, size_t first_base) {
          args.bases = bases + first_base;
          args.pages = s.dev_pages.as<const int32_t>();
          args.offset = static_cast<int64_t>(unit.src_offset);
          args.staging = payload + segment;
          return kernels::PackCuda(args, s.stream.get());
        }));
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
    KVT_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r.staging.data(), host, chunk.payload_bytes,
                                             cudaMemcpyHostToDevice, r.stream.get()));
    auto* staging = r.staging.as<uint8_t>();
    const auto* pages = reinterpret_cast<const int32_t*>(staging + chunk.pages_offset);
    const auto* bases = res_->bases.as<const uint64_t>();
    KVT_RETURN_IF_ERROR(ForEachLaunch(
        chunk, item_len_,
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
  const uint64_t item_len_;
  bool registered_send_ = false;
  bool registered_recv_ = false;
  uint8_t* send_dev_ = nullptr;      // device view of the send slots (mapped pinned memory)
  void (*notify_)(void*) = nullptr;  // NotifyCompletions
  void* notify_arg_ = nullptr;
  std::unique_ptr<Resources> res_;
};

// ---- host -------------------------------------------------------------------------------------

class HostCopier final : public StagingCopier {
 public:
  HostCopier(std::span<const LocalRegion> regions, const SlotMemory& slots,
             std::chrono::microseconds delay)
      : slots_(slots),
        item_len_(regions.empty() ? 0 : regions[0].item_len),
        delay_(delay),
        gather_started_(slots.slots),
        scatter_started_(slots.slots) {
    for (const LocalRegion& r : regions) bases_.push_back(r.base);
  }

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
        chunk, item_len_,
        [&](kernels::PackArgs& args, const ChunkUnit& unit, uint64_t segment, size_t first_base) {
          args.bases = bases_.data() + first_base;
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
    KVT_RETURN_IF_ERROR(ForEachLaunch(
        chunk, item_len_,
        [&](kernels::PackArgs& args, const ChunkUnit& unit, uint64_t segment, size_t first_base) {
          args.bases = bases_.data() + first_base;
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
  const uint64_t item_len_;
  const std::chrono::microseconds delay_;
  std::vector<uint64_t> bases_;
  std::vector<Clock::time_point> gather_started_;
  std::vector<Clock::time_point> scatter_started_;
};

}  // namespace

StatusOr<std::unique_ptr<StagingCopier>> CreateCudaCopier(int device,
                                                          std::span<const LocalRegion> regions,
                                                          const SlotMemory& slots,
                                                          bool* host_registration_failed) {
  *host_registration_failed = false;
  KVT_RETURN_IF_ERROR(CheckRegions(regions, "CUDA staging"));
  for (size_t i = 0; i < regions.size(); ++i) {
    if (regions[i].kind != MemoryKind::kCuda || regions[i].device != device) {
      return InvalidArgument("CUDA staging: buffer " + std::to_string(i) + " is not CUDA memory " +
                             "of device " + std::to_string(device) +
                             "; a staged pool lives on one device");
    }
  }
  auto copier = std::make_unique<CudaCopier>(device, slots, regions[0].item_len);
  KVT_RETURN_IF_ERROR(
      copier->Init(regions, host_registration_failed)
          .WithContext("setting up CUDA staging on device " + std::to_string(device)));
  return std::unique_ptr<StagingCopier>(std::move(copier));
}

std::unique_ptr<StagingCopier> CreateHostCopier(std::span<const LocalRegion> regions,
                                                const SlotMemory& slots,
                                                std::chrono::microseconds delay) {
  return std::make_unique<HostCopier>(regions, slots, delay);
}

}  // namespace kvt::transfer::ucx_staging

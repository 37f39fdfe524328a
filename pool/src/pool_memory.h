// PoolMemory: one zeroed, page-aligned allocation of pool storage, host or CUDA (private).
//
// Host memory comes from an anonymous mmap: page-aligned, zero-filled by the kernel without
// touching it (so inspecting huge layouts costs no RAM), released with munmap. When asked and a
// CUDA device is present it is pinned with cudaHostRegister (the reference's tensors on a CUDA
// box are device tensors; pinned host memory is what transfers from host pools need).
// Device memory is a kvt::cuda::DeviceBuffer zeroed with cudaMemset.
// Thread safety: none needed; owned by one KvPool.
#pragma once

#include <cstdint>
#include <memory>

#include "kvt/common/status.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/pool/pool_options.h"

namespace kvt::pool {

class PoolMemory {
 public:
  static StatusOr<std::unique_ptr<PoolMemory>> Allocate(
      MemoryKind kind, int64_t bytes, int device, bool pin_host, bool prefault = false,
      std::shared_ptr<HostAllocator> allocator = {});
  ~PoolMemory();
  PoolMemory(const PoolMemory&) = delete;
  PoolMemory& operator=(const PoolMemory&) = delete;

  void* data() const { return data_; }
  int64_t bytes() const { return bytes_; }
  MemoryKind kind() const { return kind_; }
  bool pinned() const { return pinned_; }

  // Sets every byte to zero (synchronously).
  Status Zero();

 private:
  PoolMemory() = default;

  MemoryKind kind_ = MemoryKind::kHost;
  void* data_ = nullptr;
  std::shared_ptr<HostAllocator> allocator_;  // set when data_ came from it
  int64_t bytes_ = 0;
  int device_ = 0;
  bool pinned_ = false;
  kvt::cuda::DeviceBuffer device_buffer_;  // kCuda only
};

// Makes `device` current for its lifetime and restores the previous device after. A negative
// device does nothing (host pools never touch the CUDA runtime).
class ScopedDevice {
 public:
  explicit ScopedDevice(int device);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  const Status& status() const { return status_; }

 private:
  int previous_ = -1;
  Status status_;
};

}  // namespace kvt::pool

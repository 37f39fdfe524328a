#include "pool_memory.h"

#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "kvt/common/log.h"

namespace kvt::pool {
namespace {

constexpr size_t kCudaAllocationGranule = size_t{2} << 20;

}  // namespace

StatusOr<std::unique_ptr<PoolMemory>> PoolMemory::Allocate(
    MemoryKind kind, int64_t bytes, int device, bool pin_host, bool prefault,
    std::shared_ptr<HostAllocator> allocator) {
  if (bytes <= 0) return InvalidArgument("pool allocation of " + std::to_string(bytes) + " bytes");
  std::unique_ptr<PoolMemory> mem(new PoolMemory());
  mem->kind_ = kind;
  mem->bytes_ = bytes;
  mem->device_ = device;
  if (kind == MemoryKind::kCuda) {
    ScopedDevice scoped(device);
    KVT_RETURN_IF_ERROR(scoped.status());
    // Whole 2 MiB granules: another process that maps a cudaMalloc allocation of any other size
    // through CUDA IPC (the cuda_ipc backend) writes small scattered items into it many times
    // slower (tools/bench/experiments/ipc_mapping.cu shows it; docs/performance.md). The slack
    // is never addressed.
    const size_t padded = (static_cast<size_t>(bytes) + kCudaAllocationGranule - 1) /
                          kCudaAllocationGranule * kCudaAllocationGranule;
    KVT_ASSIGN_OR_RETURN(mem->device_buffer_, kvt::cuda::DeviceBuffer::Allocate(padded, device));
    mem->data_ = mem->device_buffer_.data();
    KVT_RETURN_IF_ERROR(mem->Zero());
    return mem;
  }
  if (allocator) {
    KVT_ASSIGN_OR_RETURN(void* block, allocator->Allocate(bytes));
    if (reinterpret_cast<uintptr_t>(block) % 4096 != 0) {
      allocator->Free(block, bytes);
      return Internal(std::string("host allocator '") + std::string(allocator->name()) +
                      "' returned memory that is not page-aligned");
    }
    mem->data_ = block;
    mem->allocator_ = std::move(allocator);
    // Zeroing writes every page, which also prefaults it.
    std::memset(block, 0, static_cast<size_t>(bytes));
    return mem;
  }
  // MAP_NORESERVE: the pool may be far larger than what is ever touched (kvt-info layouts).
  void* p = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    return ResourceExhausted("cannot map " + std::to_string(bytes) +
                             " bytes of host memory for the pool: " + std::strerror(err) +
                             "; use a smaller size or fewer layers");
  }
  mem->data_ = p;  // zero-filled by the kernel
  if (prefault) {
    // Write every page now. A first touch costs microseconds per 4 KiB page (about two seconds
    // per GiB on this project's VMs, where the hypervisor backs guest memory lazily), which
    // would otherwise land on the first requests' transfer latency. madvise(MADV_POPULATE_WRITE)
    // is not enough there: it maps the pages in the guest without the hypervisor backing them.
    volatile char* c = static_cast<char*>(p);
    for (int64_t off = 0; off < bytes; off += 4096) c[off] = 0;
  }
  if (pin_host && kvt::cuda::HasDevice()) {
    const cudaError_t err =
        cudaHostRegister(p, static_cast<size_t>(bytes), cudaHostRegisterPortable);
    if (err == cudaSuccess) {
      mem->pinned_ = true;
    } else {
      // Pinning is an optimisation for transfers; the pool works without it.
      const Status st = kvt::cuda::ToStatus(err, "cudaHostRegister");
      KVT_LOG_WARN("pool", "host pool memory ({} bytes) left unpinned: {}", bytes, st.message());
    }
  }
  return mem;
}

PoolMemory::~PoolMemory() {
  if (kind_ == MemoryKind::kHost && data_ != nullptr) {
    if (pinned_) {
      const cudaError_t err = cudaHostUnregister(data_);
      if (err != cudaSuccess) {
        KVT_LOG_WARN("pool", "cudaHostUnregister failed: {}", cudaGetErrorString(err));
      }
    }
    if (allocator_) {
      allocator_->Free(data_, bytes_);
    } else if (munmap(data_, static_cast<size_t>(bytes_)) != 0) {
      KVT_LOG_WARN("pool", "munmap of {} bytes failed: {}", bytes_, std::strerror(errno));
    }
  }
  // kCuda: device_buffer_ frees itself.
}

Status PoolMemory::Zero() {
  if (kind_ == MemoryKind::kCuda) {
    ScopedDevice scoped(device_);
    KVT_RETURN_IF_ERROR(scoped.status());
    KVT_CUDA_RETURN_IF_ERROR(cudaMemset(data_, 0, static_cast<size_t>(bytes_)));
    return kvt::cuda::ToStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize after cudaMemset");
  }
  std::memset(data_, 0, static_cast<size_t>(bytes_));
  return OkStatus();
}

ScopedDevice::ScopedDevice(int device) {
  if (device < 0) return;  // host work: leave the CUDA runtime alone
  if (cudaGetDevice(&previous_) != cudaSuccess) {
    previous_ = -1;
    cudaGetLastError();  // clear the sticky error of the failed query
  }
  if (previous_ != device) status_ = kvt::cuda::ToStatus(cudaSetDevice(device), "cudaSetDevice");
}

ScopedDevice::~ScopedDevice() {
  if (previous_ >= 0 && status_.ok()) cudaSetDevice(previous_);
}

}  // namespace kvt::pool

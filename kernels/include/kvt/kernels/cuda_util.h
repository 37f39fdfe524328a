// Thin RAII wrappers over the CUDA runtime, and Status conversion for its errors.
//
// Every function works on a machine without a GPU: it reports why there is no device instead of
// crashing. Objects are movable, not copyable; destructors never throw and log failures.
// Thread safety: distinct objects may be used from different threads; one object is not
// synchronised.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvt/common/status.h"

namespace kvt::cuda {

// OK for cudaSuccess; otherwise Internal (or Unavailable for "no device"/"driver" errors)
// with "<what>: <cudaGetErrorName>: <cudaGetErrorString>". Clears the sticky last error.
Status ToStatus(cudaError_t err, const char* what);

// OK when the last kernel launch on this thread succeeded; the error otherwise.
Status LastLaunchStatus(const char* kernel_name);

struct DeviceCountResult {
  int count = 0;
  std::string reason;  // why count is 0 ("no CUDA driver", "no device", ...); empty otherwise
};

// How many CUDA devices this process can use, and if none, why. Never fails.
DeviceCountResult DeviceCount();

// True when at least one CUDA device is usable.
bool HasDevice();

// Device memory from cudaMalloc. Empty when default-constructed.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  static StatusOr<DeviceBuffer> Allocate(size_t bytes, int device = 0);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  size_t size() const { return bytes_; }
  int device() const { return device_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  void Reset();
  void* data_ = nullptr;
  size_t bytes_ = 0;
  int device_ = 0;
};

// Page-locked host memory from cudaHostAlloc (portable | mapped).
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  static StatusOr<PinnedBuffer> Allocate(size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  void* data() const { return data_; }
  size_t size() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  void Reset();
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// A non-blocking CUDA stream.
class Stream {
 public:
  Stream() = default;
  static StatusOr<Stream> Create(int device = 0);
  ~Stream();
  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  cudaStream_t get() const { return stream_; }
  Status Synchronize() const;

 private:
  void Reset();
  cudaStream_t stream_ = nullptr;
};

// A CUDA event (timing enabled unless asked otherwise).
class Event {
 public:
  Event() = default;
  static StatusOr<Event> Create(bool timing = true);
  ~Event();
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  cudaEvent_t get() const { return event_; }
  Status Record(cudaStream_t stream) const;
  Status Synchronize() const;
  // Milliseconds from `start` to this event; both must have completed.
  StatusOr<float> ElapsedMsSince(const Event& start) const;

 private:
  void Reset();
  cudaEvent_t event_ = nullptr;
};

// The CUDA allocation (cudaMalloc block) that holds `address`, from the driver's
// cuMemGetAddressRange, found at run time (cudaGetDriverEntryPointByVersion), so binaries do not
// link libcuda and still load on machines without a driver. The device's context must be current.
// InvalidArgument when the address is not inside an allocation of this process; Unavailable
// when the driver lacks the entry point.
struct Allocation {
  uint64_t base = 0;
  uint64_t bytes = 0;
};
StatusOr<Allocation> FindAllocation(uint64_t address);

// A 64-bit word in mapped pinned host memory that a stream sets (the driver's
// cuStreamWriteValue64, found at run time like cuMemGetAddressRange) once the work enqueued
// before it has completed, so a host thread sees that completion with one load: no driver call
// (cudaEventQuery costs about 2 µs and takes locks a thread that launches needs too). The write
// carries the driver's default memory barrier: what the earlier work wrote (a kernel's stores
// into a peer's memory too) is visible before the word is. The word only grows when its
// signals are enqueued with growing values on one stream.
class CompletionWord {
 public:
  CompletionWord() = default;
  // Allocates the word (0) and checks the device runs a stream write into it. Unavailable when
  // the driver lacks cuStreamWriteValue64 or the device refuses 64-bit stream memory operations
  // (CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS). Device `device` must be current.
  static StatusOr<CompletionWord> Create(int device);
  CompletionWord(CompletionWord&&) noexcept = default;
  CompletionWord& operator=(CompletionWord&&) noexcept = default;

  bool valid() const { return host_.data() != nullptr; }
  // Enqueues "the word = value" on `stream` behind everything enqueued there before.
  Status Signal(cudaStream_t stream, uint64_t value) const;
  // The last value a signal wrote that this thread can see (acquire: what the work before that
  // signal wrote is visible after it). Any thread; no CUDA call.
  uint64_t Load() const;

 private:
  PinnedBuffer host_;
  uint64_t device_address_ = 0;
};

// Copies `bytes` with cudaMemcpy (kind inferred by UVA) and waits until they are at the
// destination (also from pageable host memory), so work on any stream may read them after.
Status Copy(void* dst, const void* src, size_t bytes);

}  // namespace kvt::cuda

#define KVT_CUDA_RETURN_IF_ERROR(call) KVT_RETURN_IF_ERROR(::kvt::cuda::ToStatus((call), #call))

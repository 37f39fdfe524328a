#include "kvt/kernels/cuda_util.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <utility>

#include "kvt/common/log.h"

namespace kvt::cuda {
namespace {

// Errors that mean "no usable GPU or driver here" rather than a bug: callers may retry elsewhere
// or skip GPU work, so they map to Unavailable.
bool IsNoDeviceError(cudaError_t err) {
  switch (err) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorStubLibrary:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorSystemNotReady:
    case cudaErrorCallRequiresNewerDriver:
      return true;
    default:
      return false;
  }
}

std::string Describe(cudaError_t err, const char* what) {
  std::string out = what ? what : "cuda";
  out += ": ";
  out += cudaGetErrorName(err);
  out += ": ";
  out += cudaGetErrorString(err);
  return out;
}

// Destructors cannot return a Status; they log instead.
void LogIfError(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    KVT_LOG_WARN("kern", "{}", Describe(err, what));
    (void)cudaGetLastError();
  }
}

}  // namespace

Status ToStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return OkStatus();
  // Clear the (non-sticky) last error so a later LastLaunchStatus does not report it again.
  (void)cudaGetLastError();
  std::string message = Describe(err, what);
  if (IsNoDeviceError(err)) return Unavailable(std::move(message));
  return Internal(std::move(message));
}

Status LastLaunchStatus(const char* kernel_name) {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return OkStatus();
  std::string what = std::string("launch of ") + (kernel_name ? kernel_name : "kernel");
  return ToStatus(err, what.c_str());
}

DeviceCountResult DeviceCount() {
  DeviceCountResult result;
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    result.count = 0;
    result.reason = Describe(err, "cudaGetDeviceCount");
    if (err == cudaErrorInsufficientDriver) {
      // The static runtime reports a missing libcuda this way too; say both possibilities.
      result.reason += " (no NVIDIA driver loaded, or one older than this CUDA runtime)";
    }
    return result;
  }
  if (count <= 0) {
    result.count = 0;
    result.reason = "cudaGetDeviceCount: 0 devices";
    return result;
  }
  result.count = count;
  return result;
}

bool HasDevice() {
  // The answer cannot change during a process's life in any way we support; cache it so that
  // hot paths and every test may ask cheaply.
  static const bool has_device = DeviceCount().count > 0;
  return has_device;
}

// ---- DeviceBuffer -------------------------------------------------------------------------

StatusOr<DeviceBuffer> DeviceBuffer::Allocate(size_t bytes, int device) {
  DeviceBuffer buffer;
  buffer.device_ = device;
  if (bytes == 0) return buffer;
  KVT_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  void* ptr = nullptr;
  cudaError_t err = cudaMalloc(&ptr, bytes);
  if (err != cudaSuccess) {
    Status status = ToStatus(err, "cudaMalloc");
    if (err == cudaErrorMemoryAllocation) {
      return ResourceExhausted("cudaMalloc of " + std::to_string(bytes) + " bytes on device " +
                               std::to_string(device) + ": " + status.message());
    }
    return status;
  }
  buffer.data_ = ptr;
  buffer.bytes_ = bytes;
  return buffer;
}

DeviceBuffer::~DeviceBuffer() { Reset(); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      device_(other.device_) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    device_ = other.device_;
  }
  return *this;
}

void DeviceBuffer::Reset() {
  if (data_ != nullptr) LogIfError(cudaFree(data_), "cudaFree");
  data_ = nullptr;
  bytes_ = 0;
}

// ---- PinnedBuffer -------------------------------------------------------------------------

StatusOr<PinnedBuffer> PinnedBuffer::Allocate(size_t bytes) {
  PinnedBuffer buffer;
  if (bytes == 0) return buffer;
  void* ptr = nullptr;
  cudaError_t err = cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable | cudaHostAllocMapped);
  if (err != cudaSuccess) {
    Status status = ToStatus(err, "cudaHostAlloc");
    if (err == cudaErrorMemoryAllocation) {
      return ResourceExhausted("cudaHostAlloc of " + std::to_string(bytes) +
                               " bytes: " + status.message());
    }
    return status;
  }
  buffer.data_ = ptr;
  buffer.bytes_ = bytes;
  return buffer;
}

PinnedBuffer::~PinnedBuffer() { Reset(); }

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void PinnedBuffer::Reset() {
  if (data_ != nullptr) LogIfError(cudaFreeHost(data_), "cudaFreeHost");
  data_ = nullptr;
  bytes_ = 0;
}

// ---- Stream -------------------------------------------------------------------------------

StatusOr<Stream> Stream::Create(int device) {
  KVT_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  Stream stream;
  KVT_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream.stream_, cudaStreamNonBlocking));
  return stream;
}

Stream::~Stream() { Reset(); }

Stream::Stream(Stream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    Reset();
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

Status Stream::Synchronize() const {
  return ToStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

void Stream::Reset() {
  if (stream_ != nullptr) LogIfError(cudaStreamDestroy(stream_), "cudaStreamDestroy");
  stream_ = nullptr;
}

// ---- Event --------------------------------------------------------------------------------

StatusOr<Event> Event::Create(bool timing) {
  Event event;
  unsigned flags = timing ? cudaEventDefault : cudaEventDisableTiming;
  KVT_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event.event_, flags));
  return event;
}

Event::~Event() { Reset(); }

Event::Event(Event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    Reset();
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

Status Event::Record(cudaStream_t stream) const {
  if (event_ == nullptr) return FailedPrecondition("Event::Record on an empty Event");
  return ToStatus(cudaEventRecord(event_, stream), "cudaEventRecord");
}

Status Event::Synchronize() const {
  if (event_ == nullptr) return FailedPrecondition("Event::Synchronize on an empty Event");
  return ToStatus(cudaEventSynchronize(event_), "cudaEventSynchronize");
}

StatusOr<float> Event::ElapsedMsSince(const Event& start) const {
  if (event_ == nullptr || start.event_ == nullptr) {
    return FailedPrecondition("Event::ElapsedMsSince on an empty Event");
  }
  float ms = 0.0f;
  KVT_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start.event_, event_));
  return ms;
}

void Event::Reset() {
  if (event_ != nullptr) LogIfError(cudaEventDestroy(event_), "cudaEventDestroy");
  event_ = nullptr;
}

// ---- Copy ---------------------------------------------------------------------------------

namespace {

using MemGetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

std::string HexAddress(uint64_t address) {
  char text[32];
  std::snprintf(text, sizeof(text), "%llx", static_cast<unsigned long long>(address));
  return text;
}

// The driver's entry point `name` (its CUDA 12 version), found at run time: the libraries link
// the CUDA runtime only, so binaries load on machines without a driver.
StatusOr<void*> DriverSymbol(const char* name) {
  void* symbol = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion(name, &symbol, 12000, cudaEnableDefault, &found);
#else
  const cudaError_t err = cudaGetDriverEntryPoint(name, &symbol, cudaEnableDefault, &found);
#endif
  if (err != cudaSuccess) {
    return ToStatus(err, ("cudaGetDriverEntryPoint(" + std::string(name) + ")").c_str());
  }
  if (found != cudaDriverEntryPointSuccess || symbol == nullptr) {
    return Unavailable("the CUDA driver does not provide " + std::string(name) +
                       " (lookup result " + std::to_string(static_cast<int>(found)) +
                       "); update the NVIDIA driver");
  }
  return symbol;
}

StatusOr<MemGetAddressRangeFn> AddressRangeFunction() {
  static const StatusOr<MemGetAddressRangeFn> function = []() -> StatusOr<MemGetAddressRangeFn> {
    KVT_ASSIGN_OR_RETURN(void* symbol, DriverSymbol("cuMemGetAddressRange"));
    return reinterpret_cast<MemGetAddressRangeFn>(symbol);
  }();
  return function;
}

using StreamWriteValue64Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using DeviceGetAttributeFn = CUresult (*)(int*, CUdevice_attribute, CUdevice);

struct StreamMemOps {
  StreamWriteValue64Fn write64 = nullptr;
  DeviceGetAttributeFn attribute = nullptr;
};

StatusOr<StreamMemOps> StreamMemOpFunctions() {
  static const StatusOr<StreamMemOps> functions = []() -> StatusOr<StreamMemOps> {
    StreamMemOps ops;
    KVT_ASSIGN_OR_RETURN(void* write, DriverSymbol("cuStreamWriteValue64"));
    KVT_ASSIGN_OR_RETURN(void* attribute, DriverSymbol("cuDeviceGetAttribute"));
    ops.write64 = reinterpret_cast<StreamWriteValue64Fn>(write);
    ops.attribute = reinterpret_cast<DeviceGetAttributeFn>(attribute);
    return ops;
  }();
  return functions;
}

}  // namespace

// ---- FindAllocation -----------------------------------------------------------------------

StatusOr<Allocation> FindAllocation(uint64_t address) {
  KVT_ASSIGN_OR_RETURN(MemGetAddressRangeFn range, AddressRangeFunction());
  CUdeviceptr base = 0;
  size_t bytes = 0;
  const CUresult result = range(&base, &bytes, static_cast<CUdeviceptr>(address));
  if (result != CUDA_SUCCESS) {
    return InvalidArgument("cuMemGetAddressRange(0x" + HexAddress(address) +
                           ") failed with CUresult " + std::to_string(static_cast<int>(result)) +
                           ": the address is not inside a CUDA allocation of this process");
  }
  return Allocation{static_cast<uint64_t>(base), static_cast<uint64_t>(bytes)};
}

// ---- CompletionWord -----------------------------------------------------------------------

StatusOr<CompletionWord> CompletionWord::Create(int device) {
  KVT_ASSIGN_OR_RETURN(StreamMemOps ops, StreamMemOpFunctions());
  int supported = 0;
  // A CUdevice is the device's ordinal (cuDeviceGet returns it unchanged).
  const CUresult queried =
      ops.attribute(&supported, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, device);
  if (queried != CUDA_SUCCESS || supported == 0) {
    return Unavailable("device " + std::to_string(device) +
                       " does not run 64-bit stream memory operations (cuDeviceGetAttribute "
                       "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS: CUresult " +
                       std::to_string(static_cast<int>(queried)) + ", value " +
                       std::to_string(supported) + ")");
  }
  CompletionWord word;
  KVT_ASSIGN_OR_RETURN(word.host_, PinnedBuffer::Allocate(sizeof(uint64_t)));
  *word.host_.as<uint64_t>() = 0;
  void* mapped = nullptr;
  KVT_RETURN_IF_ERROR(ToStatus(cudaHostGetDevicePointer(&mapped, word.host_.data(), 0),
                               "cudaHostGetDevicePointer"));
  word.device_address_ = reinterpret_cast<uint64_t>(mapped);
  // One signal end to end, so that a device or driver that takes the call but cannot run it is
  // found here and not by a caller that would wait for the word for ever.
  KVT_ASSIGN_OR_RETURN(Stream probe, Stream::Create(device));
  KVT_RETURN_IF_ERROR(word.Signal(probe.get(), 1));
  // Bounded, as every wait on the GPU here: a signal that never runs makes the word unusable.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (word.Load() != 1) {
    if (std::chrono::steady_clock::now() > give_up) {
      // The stream may still write the word: its memory is left allocated.
      (void)new PinnedBuffer(std::move(word.host_));
      return Unavailable("a stream write into mapped pinned memory on device " +
                         std::to_string(device) + " did not reach the host within 5 s");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  std::atomic_ref<uint64_t>(*word.host_.as<uint64_t>()).store(0, std::memory_order_release);
  return word;
}

Status CompletionWord::Signal(cudaStream_t stream, uint64_t value) const {
  KVT_ASSIGN_OR_RETURN(StreamMemOps ops, StreamMemOpFunctions());
  const CUresult result =
      ops.write64(reinterpret_cast<CUstream>(stream), static_cast<CUdeviceptr>(device_address_),
                  value, CU_STREAM_WRITE_VALUE_DEFAULT);
  if (result != CUDA_SUCCESS) {
    return Internal("cuStreamWriteValue64 of a completion word failed with CUresult " +
                    std::to_string(static_cast<int>(result)));
  }
  return OkStatus();
}

uint64_t CompletionWord::Load() const {
  return std::atomic_ref<uint64_t>(*host_.as<uint64_t>()).load(std::memory_order_acquire);
}

Status Copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return OkStatus();
  if (dst == nullptr || src == nullptr) {
    return InvalidArgument("cuda::Copy of " + std::to_string(bytes) + " bytes with a null " +
                           (dst == nullptr ? "dst" : "src") + " pointer");
  }
  KVT_RETURN_IF_ERROR(ToStatus(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "cudaMemcpy"));
  // From pageable host memory cudaMemcpy returns once the bytes are staged, before the DMA into
  // device memory completes; work on non-blocking streams (every kvt stream) does not wait for
  // the legacy stream, so wait here: on return the bytes are at the destination.
  return ToStatus(cudaStreamSynchronize(cudaStreamLegacy),
                  "cudaStreamSynchronize after cudaMemcpy");
}

}  // namespace kvt::cuda

#include "bench_gpu.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "bench_common.h"
#include "gpu_spin.h"
#include "kvt/common/log.h"

namespace kvt::bench {

namespace {

// Every op's samples over `iters` rounds of one run each (odd rounds in reverse order), after
// `warmup` untimed rounds: the loop behind TimeGpu and TimeGpuInterleaved.
StatusOr<std::vector<std::vector<double>>> TimeRounds(
    cudaStream_t stream, int warmup, int iters, const std::vector<std::function<Status()>>& ops) {
  KVT_ASSIGN_OR_RETURN(cuda::Event start, cuda::Event::Create());
  KVT_ASSIGN_OR_RETURN(cuda::Event stop, cuda::Event::Create());
  for (int i = 0; i < warmup; ++i) {
    for (const auto& op : ops) KVT_RETURN_IF_ERROR(op());
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  std::vector<std::vector<double>> ms(ops.size());
  for (int i = 0; i < iters; ++i) {
    for (size_t j = 0; j < ops.size(); ++j) {
      const size_t k = i % 2 == 0 ? j : ops.size() - 1 - j;
      KVT_RETURN_IF_ERROR(start.Record(stream));
      KVT_RETURN_IF_ERROR(ops[k]());
      KVT_RETURN_IF_ERROR(stop.Record(stream));
      KVT_RETURN_IF_ERROR(stop.Synchronize());
      KVT_ASSIGN_OR_RETURN(float t, stop.ElapsedMsSince(start));
      ms[k].push_back(t);
    }
  }
  return ms;
}

}  // namespace

StatusOr<double> TimeGpu(cudaStream_t stream, int warmup, int iters,
                         const std::function<Status()>& op, std::vector<double>* samples) {
  KVT_ASSIGN_OR_RETURN(std::vector<std::vector<double>> ms,
                       TimeRounds(stream, warmup, iters, {op}));
  if (samples != nullptr) *samples = ms[0];
  return Median(ms[0]);
}

StatusOr<std::vector<double>> TimeGpuInterleaved(cudaStream_t stream, int warmup, int iters,
                                                 const std::vector<std::function<Status()>>& ops) {
  KVT_ASSIGN_OR_RETURN(std::vector<std::vector<double>> ms, TimeRounds(stream, warmup, iters, ops));
  std::vector<double> medians;
  for (const auto& m : ms) medians.push_back(Median(m));
  return medians;
}

std::vector<int64_t> EvenSubset(int64_t total, int64_t limit) {
  const int64_t n = (limit <= 0 || limit >= total) ? total : limit;
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(std::max<int64_t>(n, 0)));
  for (int64_t k = 0; k < n; ++k) out.push_back(k * total / n);
  return out;
}

double CopyList::bytes() const {
  double total = 0;
  for (size_t s : sizes) total += static_cast<double>(s);
  return total;
}

Status MemcpyEach(const CopyList& list, cudaStream_t stream) {
  for (size_t k = 0; k < list.size(); ++k) {
    BENCH_CUDA(cudaMemcpyAsync(list.dsts[k], list.srcs[k], list.sizes[k], cudaMemcpyDeviceToDevice,
                               stream));
  }
  return OkStatus();
}

Status MemcpyBatch(const CopyList& list, cudaStream_t stream) {
  if (list.size() == 0) return OkStatus();
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t attr_index = 0;
  return cuda::ToStatus(cudaMemcpyBatchAsync(list.dsts.data(), list.srcs.data(), list.sizes.data(),
                                             list.size(), &attr, &attr_index, 1, stream),
                        "cudaMemcpyBatchAsync");
}

Status LaunchSpin(int64_t ns, int blocks, cudaStream_t stream) {
  if (blocks <= 0) {
    int device = 0;
    BENCH_CUDA(cudaGetDevice(&device));
    BENCH_CUDA(cudaDeviceGetAttribute(&blocks, cudaDevAttrMultiProcessorCount, device));
  }
  // One warp per block; short sleeps leave the issue slots to the transfer's copy kernels.
  const tools::GpuSpinShape shape{
      .blocks = static_cast<unsigned>(blocks), .threads = 32, .sleep_ns = 256};
  return cuda::ToStatus(
      tools::LaunchGpuSpin(static_cast<uint64_t>(std::max<int64_t>(ns, 0)), nullptr, shape, stream),
      "spin kernel launch");
}

StatusOr<int> ParseCudaDevice(const std::string& text) {
  constexpr char kPrefix[] = "cuda:";
  const size_t prefix_len = sizeof(kPrefix) - 1;
  if (text.compare(0, prefix_len, kPrefix) == 0 && text.size() > prefix_len) {
    try {
      size_t pos = 0;
      const int d = std::stoi(text.substr(prefix_len), &pos);
      if (pos == text.size() - prefix_len && d >= 0) return d;
    } catch (...) {
    }
  }
  return InvalidArgument("device '" + text + "' is not cuda:N (e.g. cuda:0)");
}

StatusOr<IpcMapping> IpcMapping::Open(const cudaIpcMemHandle_t& handle, int device) {
  BENCH_CUDA(cudaSetDevice(device));
  IpcMapping m;
  m.device_ = device;
  BENCH_CUDA(cudaIpcOpenMemHandle(&m.data_, handle, cudaIpcMemLazyEnablePeerAccess));
  return m;
}

IpcMapping::~IpcMapping() { Reset(); }

IpcMapping::IpcMapping(IpcMapping&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), device_(other.device_) {}

IpcMapping& IpcMapping::operator=(IpcMapping&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    device_ = other.device_;
  }
  return *this;
}

void IpcMapping::Reset() {
  if (data_ == nullptr) return;
  int current = 0;
  const bool switch_device = cudaGetDevice(&current) == cudaSuccess && current != device_;
  if (switch_device) (void)cudaSetDevice(device_);
  const cudaError_t err = cudaIpcCloseMemHandle(data_);
  if (err != cudaSuccess) {
    KVT_LOG_WARN("tool", "cudaIpcCloseMemHandle: {}", cudaGetErrorString(err));
    (void)cudaGetLastError();
  }
  if (switch_device) (void)cudaSetDevice(current);
  data_ = nullptr;
}

std::string IpcHandleBytes(const cudaIpcMemHandle_t& handle) {
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

StatusOr<cudaIpcMemHandle_t> IpcHandleFromBytes(const std::string& bytes) {
  cudaIpcMemHandle_t handle{};
  if (bytes.size() != sizeof(handle)) {
    return DataLoss(
        fmt::format("an IPC handle has {} bytes, not {}", bytes.size(), sizeof(handle)));
  }
  std::memcpy(&handle, bytes.data(), sizeof(handle));
  return handle;
}

}  // namespace kvt::bench

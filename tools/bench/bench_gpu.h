// GPU helpers shared by kvt-bench subcommands: event timing, the peers' copy ways
// (cudaMemcpyAsync per item, cudaMemcpyBatchAsync), a spin kernel that stands in for a layer of
// a forward pass, device allocation ranges and CUDA IPC mappings.
//
// Every function reports a missing device or a CUDA failure as a Status (never crashes), so the
// callers work on a machine without a GPU up to the point where they need one.
// Thread safety: functions are reentrant; objects are not synchronised (one thread each).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kvt/common/status.h"
#include "kvt/kernels/cuda_util.h"

#define BENCH_CUDA(call) KVT_RETURN_IF_ERROR(::kvt::cuda::ToStatus((call), #call))

namespace kvt::bench {

// Times `op` on `stream` with CUDA events: `warmup` untimed runs, then `iters` timed runs (each
// between two events, waited for). Returns the median in ms; `samples` (if given) gets all.
StatusOr<double> TimeGpu(cudaStream_t stream, int warmup, int iters,
                         const std::function<Status()>& op, std::vector<double>* samples = nullptr);

// Times several ops on `stream` interleaved: `warmup` untimed rounds, then `iters` rounds that
// each run every op once between two events (odd rounds in reverse order), so that slow drifts
// of the card (clocks, temperature) and what one op leaves behind for the next fall on all of
// them alike. Returns each op's median in ms, in the ops' order.
StatusOr<std::vector<double>> TimeGpuInterleaved(cudaStream_t stream, int warmup, int iters,
                                                 const std::vector<std::function<Status()>>& ops);

// `limit` evenly spread indices of [0, total) (all of them when limit <= 0 or >= total).
std::vector<int64_t> EvenSubset(int64_t total, int64_t limit);

// A list of copies for the peers' ways (device pointers, as seen by this process).
struct CopyList {
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  void Add(void* dst, const void* src, size_t bytes) {
    dsts.push_back(dst);
    srcs.push_back(src);
    sizes.push_back(bytes);
  }
  size_t size() const { return dsts.size(); }
  double bytes() const;
};

// The peers' ways, enqueued on `stream`: one cudaMemcpyAsync (device to device) per entry, and
// one cudaMemcpyBatchAsync over the whole list (stream-ordered source access).
Status MemcpyEach(const CopyList& list, cudaStream_t stream);
Status MemcpyBatch(const CopyList& list, cudaStream_t stream);

// Enqueues a kernel of `blocks` blocks x 32 threads that spins (reading %globaltimer, with
// __nanosleep) for `ns` nanoseconds: a compute-bound stand-in for one layer of a forward pass that
// neither reads nor writes memory. blocks <= 0: one per multiprocessor of the current device.
// %globaltimer ticks coarsely (about a microsecond), so time the real duration with events.
Status LaunchSpin(int64_t ns, int blocks, cudaStream_t stream);

// "cuda:N" -> N. InvalidArgument for anything else.
StatusOr<int> ParseCudaDevice(const std::string& text);

// An allocation of another process, mapped into this one with cudaIpcOpenMemHandle
// (cudaIpcMemLazyEnablePeerAccess); closed on destruction. Opening a handle this process has
// open already (e.g. in a transfer backend) returns the same mapping, reference counted.
class IpcMapping {
 public:
  IpcMapping() = default;
  static StatusOr<IpcMapping> Open(const cudaIpcMemHandle_t& handle, int device);
  ~IpcMapping();
  IpcMapping(IpcMapping&& other) noexcept;
  IpcMapping& operator=(IpcMapping&& other) noexcept;
  IpcMapping(const IpcMapping&) = delete;
  IpcMapping& operator=(const IpcMapping&) = delete;

  void* data() const { return data_; }

 private:
  void Reset();
  void* data_ = nullptr;
  int device_ = 0;
};

// cudaIpcMemHandle_t <-> raw bytes (for hex transport on the benchmark's pipe).
std::string IpcHandleBytes(const cudaIpcMemHandle_t& handle);
StatusOr<cudaIpcMemHandle_t> IpcHandleFromBytes(const std::string& bytes);

}  // namespace kvt::bench

#include "gpu_spin.h"

namespace kvt::tools {
namespace {

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void SpinKernel(uint64_t nanoseconds, const volatile uint32_t* cancel,
                           unsigned sleep_ns) {
  const uint64_t start = GlobalTimerNs();
  while (GlobalTimerNs() - start < nanoseconds) {
    if (cancel != nullptr && *cancel != 0) return;
    __nanosleep(sleep_ns);
  }
}

}  // namespace

cudaError_t LaunchGpuSpin(uint64_t nanoseconds, const volatile uint32_t* cancel,
                          const GpuSpinShape& shape, cudaStream_t stream) {
  SpinKernel<<<shape.blocks, shape.threads, 0, stream>>>(nanoseconds, cancel, shape.sleep_ns);
  return cudaGetLastError();
}

}  // namespace kvt::tools

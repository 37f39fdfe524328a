#include "simulated_compute.h"

namespace kvt::tools {
namespace {

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void SpinKernel(uint64_t nanoseconds, const volatile uint32_t* cancel) {
  const uint64_t start = GlobalTimerNs();
  while (GlobalTimerNs() - start < nanoseconds) {
    if (cancel != nullptr && *cancel != 0) return;
    // Sleep the warp between checks: the kernel holds one SM slot, not its issue bandwidth.
    __nanosleep(2000);
  }
}

}  // namespace

cudaError_t LaunchSimulatedCompute(uint64_t nanoseconds, const volatile uint32_t* cancel,
                                   cudaStream_t stream) {
  SpinKernel<<<1, 1, 0, stream>>>(nanoseconds, cancel);
  return cudaGetLastError();
}

}  // namespace kvt::tools

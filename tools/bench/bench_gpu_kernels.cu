// Device code for kvt-bench (kept free of kvt headers: device code is C++17).
#include <cuda_runtime.h>

namespace kvt::bench::detail {
namespace {

// Spins for `ns` nanoseconds of %globaltimer. __nanosleep keeps the warp's issue slots free for
// whatever else runs on the multiprocessor (the transfer's copy kernels).
__global__ void SpinKernel(unsigned long long ns) {
  unsigned long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(256);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

}  // namespace

cudaError_t LaunchSpinKernel(long long ns, int blocks, cudaStream_t stream) {
  SpinKernel<<<blocks, 32, 0, stream>>>(static_cast<unsigned long long>(ns < 0 ? 0 : ns));
  return cudaGetLastError();
}

}  // namespace kvt::bench::detail

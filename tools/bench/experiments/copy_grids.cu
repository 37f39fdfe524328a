// Experiment (not part of the build): what the page copy kernel's ceiling is, and why the page
// copy uses a one-pass grid.
//  1. Is the ceiling kvt-bench compares against, a device-to-device cudaMemcpyAsync, done by the
//     copy engines or by a kernel? It is timed on a second stream while a kernel holds every
//     multiprocessor (two 1024-thread blocks with 110 KiB of shared memory each per SM, sleeping
//     for 20 ms). Copy engines would finish 1 GiB in about 0.5 ms beside it; a kernel has to wait
//     for the SMs (docs/performance.md: on an H200 it waits, so the ceiling is a kernel).
//  2. The same contiguous 1 GiB copied by SM kernels of one shape (16-byte loads, 4 per thread
//     before their stores, streaming hints) under two grid policies: a persistent grid of the
//     blocks that fit at once, threads striding over the buffer, against a one-pass grid of one
//     block per tile, handed to the SMs by the hardware as earlier blocks finish.
// Build and run (on a machine with a GPU):
//   nvcc -O3 -std=c++17 -arch=sm_90 tools/bench/experiments/copy_grids.cu -o copy_grids
//   ./copy_grids
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define CHECK(x)                                                                             \
  do {                                                                                       \
    cudaError_t e = (x);                                                                     \
    if (e != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

namespace {

constexpr int kUnroll = 4;

// Holds its SM's threads and shared memory for `ns` nanoseconds.
__global__ void __launch_bounds__(1024) Hog(unsigned long long ns) {
  extern __shared__ char smem[];
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
  if (t == 0) smem[threadIdx.x] = 1;  // keeps the allocation
}

// Persistent: every thread strides over the whole buffer, kUnroll vectors per round.
__global__ void GridStride(const uint4* __restrict__ s, uint4* __restrict__ d, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    uint4 r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = __ldcs(s + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) __stcs(d + i + u * stride, r[u]);
  }
  for (; i < n; i += stride) d[i] = s[i];
}

// One-pass: block b copies tile b (blockDim * kUnroll vectors) and exits.
__global__ void OnePass(const uint4* __restrict__ s, uint4* __restrict__ d, size_t n) {
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x * kUnroll + threadIdx.x;
  uint4 r[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (i + u * blockDim.x < n) r[u] = __ldcs(s + i + u * blockDim.x);
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (i + u * blockDim.x < n) __stcs(d + i + u * blockDim.x, r[u]);
  }
}

// One-pass, strided: as many threads as a quarter of the vectors; thread t copies vectors
// t, t + n/4, t + n/2 and t + 3n/4 (the grid-stride kernel with a grid that covers the buffer
// in one round).
__global__ void OnePassStrided(const uint4* __restrict__ s, uint4* __restrict__ d, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  uint4 r[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (i + u * stride < n) r[u] = __ldcs(s + i + u * stride);
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (i + u * stride < n) __stcs(d + i + u * stride, r[u]);
  }
}

double MedianMs(cudaStream_t stream, const std::function<void()>& op) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) op();
  std::vector<float> ms;
  for (int i = 0; i < 15; ++i) {
    CHECK(cudaEventRecord(a, stream));
    op();
    CHECK(cudaEventRecord(b, stream));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main() {
  constexpr size_t kBytes = size_t{1} << 30;
  const size_t n = kBytes / 16;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  char *src, *dst;
  CHECK(cudaMalloc(&src, kBytes));
  CHECK(cudaMalloc(&dst, kBytes));
  CHECK(cudaMemset(src, 1, kBytes));
  cudaStream_t s1, s2;
  CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));

  // 1. The memcpy beside a kernel that holds every SM.
  constexpr int kHogSmem = 110 * 1024;
  CHECK(cudaFuncSetAttribute(Hog, cudaFuncAttributeMaxDynamicSharedMemorySize, kHogSmem));
  cudaEvent_t launched, a, b;
  CHECK(cudaEventCreate(&launched));
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int rep = 0; rep < 3; ++rep) {
    CHECK(cudaEventRecord(launched, s1));
    Hog<<<sms * 2, 1024, kHogSmem, s1>>>(20'000'000ull);
    CHECK(cudaStreamWaitEvent(s2, launched));  // no dependency on the hog itself
    CHECK(cudaEventRecord(a, s2));
    CHECK(cudaMemcpyAsync(dst, src, kBytes, cudaMemcpyDeviceToDevice, s2));
    CHECK(cudaEventRecord(b, s2));
    CHECK(cudaDeviceSynchronize());
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    std::printf("D2D memcpy of 1 GiB beside a 20 ms all-SM kernel: %.3f ms (%.1f GB/s)\n", ms,
                kBytes / ms / 1e6);
  }

  // 2. Grid policies for the same copy, as ratios to the memcpy.
  const auto* s4 = reinterpret_cast<const uint4*>(src);
  auto* d4 = reinterpret_cast<uint4*>(dst);
  const double memcpy_ms =
      MedianMs(s1, [&] { CHECK(cudaMemcpyAsync(dst, src, kBytes, cudaMemcpyDeviceToDevice, s1)); });
  std::printf("D2D memcpy alone: %.1f GB/s\n", kBytes / memcpy_ms / 1e6);
  for (int threads : {256, 512, 1024}) {
    for (int blocks_per_sm : {1, 2, 4, 8}) {
      if (threads * blocks_per_sm > 2048) continue;
      const double ms =
          MedianMs(s1, [&] { GridStride<<<sms * blocks_per_sm, threads, 0, s1>>>(s4, d4, n); });
      std::printf("persistent grid %d x %d threads per SM: %.3f of the memcpy\n", blocks_per_sm,
                  threads, memcpy_ms / ms);
    }
  }
  const unsigned tiles = static_cast<unsigned>((n + 256 * kUnroll - 1) / (256 * kUnroll));
  const double one_pass_ms = MedianMs(s1, [&] { OnePass<<<tiles, 256, 0, s1>>>(s4, d4, n); });
  std::printf("one-pass grid of %u blocks of 256 (tiles): %.3f of the memcpy\n", tiles,
              memcpy_ms / one_pass_ms);
  const double strided_ms = MedianMs(s1, [&] { OnePassStrided<<<tiles, 256, 0, s1>>>(s4, d4, n); });
  std::printf("one-pass grid of %u blocks of 256 (strided): %.3f of the memcpy\n", tiles,
              memcpy_ms / strided_ms);
  CHECK(cudaFree(src));
  CHECK(cudaFree(dst));
  return 0;
}

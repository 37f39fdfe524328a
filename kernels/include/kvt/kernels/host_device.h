// KVT_HOST_DEVICE: marks small pure functions that must compile, unchanged, into both the CPU
// references (host compiler) and the CUDA kernels (nvcc device pass), so that the two produce
// bit-identical results. Thread safety: not applicable (a macro).
#pragma once

#if defined(__CUDACC__)
#define KVT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVT_HOST_DEVICE inline
#endif

// FillPatternCuda / VerifyPatternCuda: block per (layer, kv, token) row in a grid-stride loop,
// one thread per 8-byte word of the row. Verify counts differing bytes and keeps the first one
// in (layer, kv, token, byte) order as an atomicMin over the linear index
// ((j * 2 + kv) * num_tokens + token) * row_bytes + byte; a one-thread kernel then decodes it
// and reads the actual byte, so the host never dereferences device tables.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kvt/kernels/cuda_util.h"
#include "kvt/kernels/kernels.h"
#include "page_copy_internal.h"
#include "pattern_byte.h"
#include "validate.h"

namespace kvt::kernels {
namespace {

constexpr int kPatternThreads = 256;

struct VerifyResult {
  unsigned long long mismatches;
  unsigned long long first;  // linear index; ~0 when none
  unsigned int actual;
};

struct RowRef {
  int32_t j;
  int32_t kv;
  int64_t token;
  uint8_t* ptr;
};

__device__ __forceinline__ RowRef RowOf(const PatternArgs& a, int64_t r) {
  RowRef ref;
  const int64_t per_layer = 2 * a.num_tokens;
  ref.j = static_cast<int32_t>(r / per_layer);
  const int64_t rem = r - static_cast<int64_t>(ref.j) * per_layer;
  ref.kv = rem >= a.num_tokens ? 1 : 0;
  ref.token = rem - ref.kv * a.num_tokens;
  const uint64_t base = ref.kv == 0 ? __ldg(a.k_bases + ref.j) : __ldg(a.v_bases + ref.j);
  const int64_t row = static_cast<int64_t>(__ldg(a.pages + ref.token / a.page_size)) * a.page_size +
                      ref.token % a.page_size;
  ref.ptr = reinterpret_cast<uint8_t*>(base) + row * a.row_bytes;
  return ref;
}

__global__ void FillPatternKernel(const PatternArgs a) {
  const int64_t rows = 2 * static_cast<int64_t>(a.num_layers) * a.num_tokens;
  const int64_t words = (a.row_bytes + 7) / 8;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const RowRef ref = RowOf(a, r);
    const uint64_t seed =
        internal::PatternRowSeed(a.request, a.first_layer + ref.j, ref.kv, ref.token);
    for (int64_t w = threadIdx.x; w < words; w += blockDim.x) {
      const uint64_t word = internal::PatternWord(seed, w);
      uint8_t* p = ref.ptr + w * 8;
      if ((reinterpret_cast<uint64_t>(p) & 7) == 0 && w * 8 + 8 <= a.row_bytes) {
        *reinterpret_cast<uint64_t*>(p) = word;
      } else {
        for (int k = 0; k < 8 && w * 8 + k < a.row_bytes; ++k) {
          p[k] = static_cast<uint8_t>(word >> (8 * k));
        }
      }
    }
  }
}

__global__ void VerifyPatternKernel(const PatternArgs a, VerifyResult* result) {
  const int64_t rows = 2 * static_cast<int64_t>(a.num_layers) * a.num_tokens;
  const int64_t words = (a.row_bytes + 7) / 8;
  unsigned long long count = 0;
  unsigned long long first = ~0ull;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const RowRef ref = RowOf(a, r);
    const uint64_t seed =
        internal::PatternRowSeed(a.request, a.first_layer + ref.j, ref.kv, ref.token);
    for (int64_t w = threadIdx.x; w < words; w += blockDim.x) {
      const uint64_t expected = internal::PatternWord(seed, w);
      const uint8_t* p = ref.ptr + w * 8;
      const int valid = a.row_bytes - w * 8 < 8 ? static_cast<int>(a.row_bytes - w * 8) : 8;
      uint64_t actual = 0;
      if ((reinterpret_cast<uint64_t>(p) & 7) == 0 && valid == 8) {
        actual = *reinterpret_cast<const uint64_t*>(p);
      } else {
        for (int k = 0; k < valid; ++k) actual |= static_cast<uint64_t>(p[k]) << (8 * k);
      }
      uint64_t diff = actual ^ expected;
      if (valid < 8) diff &= (1ull << (8 * valid)) - 1;
      if (diff == 0) continue;
      int first_k = -1;
      for (int k = 0; k < 8; ++k) {
        if ((diff >> (8 * k)) & 0xFF) {
          ++count;
          if (first_k < 0) first_k = k;
        }
      }
      // Rows are visited in increasing r by each block, and r is already in (layer, kv, token)
      // order, so the linear index is r * row_bytes + byte.
      const unsigned long long idx =
          static_cast<unsigned long long>(r) * a.row_bytes + w * 8 + first_k;
      first = min(first, idx);
    }
  }
  // Warp reduction, then one atomic of each kind per warp.
  for (int off = 16; off > 0; off >>= 1) {
    count += __shfl_down_sync(0xFFFFFFFFu, count, off);
    first = min(first, __shfl_down_sync(0xFFFFFFFFu, first, off));
  }
  if ((threadIdx.x & 31) == 0 && count > 0) {
    atomicAdd(&result->mismatches, count);
    atomicMin(&result->first, first);
  }
}

__global__ void VerifyReportKernel(const PatternArgs a, VerifyResult* result) {
  if (result->mismatches == 0) return;
  const unsigned long long idx = result->first;
  const int64_t r = static_cast<int64_t>(idx / a.row_bytes);
  const int64_t byte = static_cast<int64_t>(idx % a.row_bytes);
  result->actual = RowOf(a, r).ptr[byte];
}

}  // namespace

Status FillPatternCuda(const PatternArgs& args, cudaStream_t stream) {
  KVT_RETURN_IF_ERROR(internal::ValidatePattern(args, "FillPatternCuda"));
  if (args.num_layers == 0 || args.num_tokens == 0 || args.row_bytes == 0) return OkStatus();
  KVT_ASSIGN_OR_RETURN(int sms, internal::CurrentDeviceSmCount());
  const int64_t rows = 2 * static_cast<int64_t>(args.num_layers) * args.num_tokens;
  const unsigned grid =
      static_cast<unsigned>(std::min<int64_t>(rows, static_cast<int64_t>(sms) * 8));
  FillPatternKernel<<<grid, kPatternThreads, 0, stream>>>(args);
  return cuda::LastLaunchStatus("FillPatternKernel");
}

StatusOr<PatternCheck> VerifyPatternCuda(const PatternArgs& args, cudaStream_t stream) {
  KVT_RETURN_IF_ERROR(internal::ValidatePattern(args, "VerifyPatternCuda"));
  PatternCheck check;
  if (args.num_layers == 0 || args.num_tokens == 0 || args.row_bytes == 0) return check;
  KVT_ASSIGN_OR_RETURN(int sms, internal::CurrentDeviceSmCount());
  // The result word comes from the stream-ordered allocator, so checking a request does not
  // synchronise the whole device (cudaFree would, stalling other streams' transfers); devices
  // without memory pools fall back to cudaMalloc.
  void* raw = nullptr;
  cuda::DeviceBuffer fallback;
  if (cudaMallocAsync(&raw, sizeof(VerifyResult), stream) != cudaSuccess) {
    (void)cudaGetLastError();
    int device = 0;
    KVT_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
    KVT_ASSIGN_OR_RETURN(fallback, cuda::DeviceBuffer::Allocate(sizeof(VerifyResult), device));
    raw = nullptr;
  }
  struct AsyncFree {
    void* p;
    cudaStream_t s;
    ~AsyncFree() {
      if (p != nullptr) (void)cudaFreeAsync(p, s);
    }
  } release{raw, stream};
  VerifyResult host{0, ~0ull, 0};
  auto* dev = raw != nullptr ? static_cast<VerifyResult*>(raw) : fallback.as<VerifyResult>();
  KVT_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dev, &host, sizeof(host), cudaMemcpyHostToDevice, stream));
  const int64_t rows = 2 * static_cast<int64_t>(args.num_layers) * args.num_tokens;
  const unsigned grid =
      static_cast<unsigned>(std::min<int64_t>(rows, static_cast<int64_t>(sms) * 8));
  VerifyPatternKernel<<<grid, kPatternThreads, 0, stream>>>(args, dev);
  KVT_RETURN_IF_ERROR(cuda::LastLaunchStatus("VerifyPatternKernel"));
  VerifyReportKernel<<<1, 1, 0, stream>>>(args, dev);
  KVT_RETURN_IF_ERROR(cuda::LastLaunchStatus("VerifyReportKernel"));
  KVT_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(&host, dev, sizeof(host), cudaMemcpyDeviceToHost, stream));
  KVT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  check.mismatches = host.mismatches;
  if (host.mismatches > 0) {
    const int64_t r = static_cast<int64_t>(host.first / args.row_bytes);
    const int64_t per_layer = 2 * args.num_tokens;
    const int32_t j = static_cast<int32_t>(r / per_layer);
    const int64_t rem = r - j * per_layer;
    check.layer = args.first_layer + j;
    check.kv = rem >= args.num_tokens ? 1 : 0;
    check.token = rem - check.kv * args.num_tokens;
    check.byte = static_cast<int64_t>(host.first % args.row_bytes);
    check.expected = PatternByteHost(args.request, check.layer, check.kv, check.token, check.byte);
    check.actual = static_cast<uint8_t>(host.actual);
  }
  return check;
}

}  // namespace kvt::kernels

// Experiment (not part of the build): does the way another process's GPU memory is mapped decide
// how fast small scattered writes into it are? (Why CUDA pools allocate whole 2 MiB granules:
// pool/src/pool_memory.cc, docs/performance.md.) This program times a scatter (random 2 KiB
// source items of a local 1 GiB buffer into random 2 KiB slots of a destination of S bytes) into
//   local  - the child's own cudaMalloc(S),
//   ipc    - the parent's cudaMalloc(S) opened with cudaIpcOpenMemHandle,
//   cumem  - the parent's cuMemCreate(S) (recommended granularity) exported as a POSIX file
//            descriptor, imported with cuMemImportFromShareableHandle + cuMemMap;
// and the same with the destination split like a kvt pool into 64 buffers of S / 64 bytes plus
// one 2 KiB page (a size that is not a multiple of 2 MiB), items spread over them buffer-major:
//   local64 - 64 cudaMalloc of the child,  ipc64 - 64 cudaMalloc of the parent through IPC,
//   ipc64even - the same with sizes rounded up to 2 MiB.
// The parent allocates and exports, then runs itself as the child (fork + exec, the descriptor
// inherited), which imports and times. Build and run (on a machine with a GPU):
//   nvcc -O3 -std=c++17 -arch=sm_90 tools/bench/experiments/ipc_mapping.cu -lcuda -o ipc_mapping
//   ./ipc_mapping 9   # destination of 9 GiB
#include <cuda.h>
#include <cuda_runtime.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#define CK(x)                                                                           \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                     \
    }                                                                                   \
  } while (0)
#define CU(x)                                                                      \
  do {                                                                             \
    CUresult r_ = (x);                                                             \
    if (r_ != CUDA_SUCCESS) {                                                      \
      const char* s_ = nullptr;                                                    \
      cuGetErrorString(r_, &s_);                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_ ? s_ : "?"); \
      std::exit(2);                                                                \
    }                                                                              \
  } while (0)

constexpr size_t kItem = 2048;
constexpr size_t kSrcBytes = size_t{1} << 30;
constexpr size_t kItems = kSrcBytes / kItem;  // 524288 items, 1 GiB moved per launch

// One warp per item, 16-byte accesses, 4 in flight per lane (the shape of PageCopyKernel).
__global__ void Scatter(const uint4* __restrict__ src, uint4* __restrict__ dst,
                        const uint32_t* __restrict__ src_item, const uint32_t* __restrict__ dst_item,
                        size_t items) {
  const size_t warps = (size_t(gridDim.x) * blockDim.x) / 32;
  const int lane = threadIdx.x & 31;
  constexpr int kVec = kItem / 16;  // 128 uint4 per item: 4 per lane
  for (size_t w = (size_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; w < items; w += warps) {
    const uint4* s = src + size_t(src_item[w]) * kVec + lane;
    uint4* d = dst + size_t(dst_item[w]) * kVec + lane;
    uint4 r[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) r[u] = __ldcs(s + u * 32);
#pragma unroll
    for (int u = 0; u < 4; ++u) __stcs(d + u * 32, r[u]);
  }
}

// Median of 6 timed launches (after one untimed) of `launch(sms)`, CUDA events, in ms.
template <typename Launch>
double MedianMs(Launch launch) {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int i = 0; i < 7; ++i) {
    CK(cudaEventRecord(a));
    launch(sms);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float t = 0;
    CK(cudaEventElapsedTime(&t, a, b));
    if (i > 0) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Item w goes to buffer w / (items / 64) (buffer-major, as PageCopyKernel enumerates), slot
// dst_item[w] of that buffer.
__global__ void Scatter64(const uint4* __restrict__ src, uint4* const* __restrict__ dst,
                          const uint32_t* __restrict__ src_item,
                          const uint32_t* __restrict__ dst_item, size_t items) {
  const size_t warps = (size_t(gridDim.x) * blockDim.x) / 32;
  const int lane = threadIdx.x & 31;
  constexpr int kVec = kItem / 16;
  const size_t per_buffer = items / 64;
  for (size_t w = (size_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; w < items; w += warps) {
    const uint4* s = src + size_t(src_item[w]) * kVec + lane;
    uint4* d = dst[w / per_buffer] + size_t(dst_item[w]) * kVec + lane;
    uint4 r[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) r[u] = __ldcs(s + u * 32);
#pragma unroll
    for (int u = 0; u < 4; ++u) __stcs(d + u * 32, r[u]);
  }
}

// The 64-buffer variant: `dsts` are the buffers, each holding `buffer_bytes`.
double TimeScatter64(const std::vector<void*>& dsts, size_t buffer_bytes) {
  void* src = nullptr;
  CK(cudaMalloc(&src, kSrcBytes));
  CK(cudaMemset(src, 1, kSrcBytes));
  std::mt19937 rng(7);
  std::vector<uint32_t> s(kItems), d(kItems);
  std::iota(s.begin(), s.end(), 0u);
  std::shuffle(s.begin(), s.end(), rng);
  const size_t slots = buffer_bytes / kItem, per_buffer = kItems / 64;
  std::vector<uint32_t> all(slots);
  for (size_t b = 0; b < 64; ++b) {
    std::iota(all.begin(), all.end(), 0u);
    std::shuffle(all.begin(), all.end(), rng);
    std::copy(all.begin(), all.begin() + per_buffer, d.begin() + b * per_buffer);
  }
  uint32_t *ds = nullptr, *dd = nullptr;
  void** table = nullptr;
  CK(cudaMalloc(&ds, kItems * 4));
  CK(cudaMalloc(&dd, kItems * 4));
  CK(cudaMalloc(&table, 64 * sizeof(void*)));
  CK(cudaMemcpy(ds, s.data(), kItems * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dd, d.data(), kItems * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(table, dsts.data(), 64 * sizeof(void*), cudaMemcpyHostToDevice));
  return MedianMs([&](int sms) {
    Scatter64<<<sms * 4, 256>>>(static_cast<const uint4*>(src),
                                reinterpret_cast<uint4* const*>(table), ds, dd, kItems);
  });
}

std::string Hex(const cudaIpcMemHandle_t& h) {
  std::string hex;
  for (size_t i = 0; i < sizeof(h); ++i) {
    char b[3];
    std::snprintf(b, sizeof(b), "%02x", static_cast<unsigned char>(h.reserved[i]));
    hex += b;
  }
  return hex;
}

cudaIpcMemHandle_t Unhex(const std::string& arg) {
  cudaIpcMemHandle_t h;
  for (size_t i = 0; i < sizeof(h); ++i) {
    h.reserved[i] = char(std::stoi(arg.substr(2 * i, 2), nullptr, 16));
  }
  return h;
}

double TimeScatter(void* dst, size_t dst_bytes) {
  void* src = nullptr;
  CK(cudaMalloc(&src, kSrcBytes));
  CK(cudaMemset(src, 1, kSrcBytes));
  std::mt19937 rng(7);
  std::vector<uint32_t> s(kItems), d;
  std::iota(s.begin(), s.end(), 0u);
  std::shuffle(s.begin(), s.end(), rng);
  std::vector<uint32_t> all(dst_bytes / kItem);
  std::iota(all.begin(), all.end(), 0u);
  std::shuffle(all.begin(), all.end(), rng);
  d.assign(all.begin(), all.begin() + kItems);
  uint32_t *ds = nullptr, *dd = nullptr;
  CK(cudaMalloc(&ds, kItems * 4));
  CK(cudaMalloc(&dd, kItems * 4));
  CK(cudaMemcpy(ds, s.data(), kItems * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dd, d.data(), kItems * 4, cudaMemcpyHostToDevice));
  const double ms = MedianMs([&](int sms) {
    Scatter<<<sms * 4, 256>>>(static_cast<const uint4*>(src), static_cast<uint4*>(dst), ds, dd,
                              kItems);
  });
  CK(cudaFree(src));
  CK(cudaFree(ds));
  CK(cudaFree(dd));
  return ms;
}

void Report(const char* mode, size_t bytes, double ms) {
  std::printf("%-6s dst %5.1f GiB: %8.1f us  %7.1f GB/s\n", mode, double(bytes) / (1 << 30),
              ms * 1000, double(kSrcBytes) / (ms * 1e-3) / 1e9);
}

int Child(const std::string& mode, const std::string& arg, size_t bytes) {
  CK(cudaSetDevice(0));
  CU(cuInit(0));
  void* dst = nullptr;
  if (mode == "local64" || mode == "ipc64" || mode == "ipc64even") {
    // bytes = one buffer's size; arg = 64 handles, concatenated hex (ipc modes)
    std::vector<void*> dsts(64);
    for (size_t b = 0; b < 64; ++b) {
      if (mode == "local64") {
        CK(cudaMalloc(&dsts[b], bytes));
      } else {
        const size_t len = 2 * sizeof(cudaIpcMemHandle_t);
        CK(cudaIpcOpenMemHandle(&dsts[b], Unhex(arg.substr(b * len, len)),
                                cudaIpcMemLazyEnablePeerAccess));
      }
    }
    Report(mode.c_str(), 64 * bytes, TimeScatter64(dsts, bytes));
    return 0;
  }
  if (mode == "local") {
    CK(cudaMalloc(&dst, bytes));
  } else if (mode == "ipc") {
    CK(cudaIpcOpenMemHandle(&dst, Unhex(arg), cudaIpcMemLazyEnablePeerAccess));
  } else {
    CUmemGenericAllocationHandle handle;
    CU(cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(intptr_t(std::stoi(arg))),
                                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    CUdeviceptr va = 0;
    CU(cuMemAddressReserve(&va, bytes, size_t{2} << 20, 0, 0));
    CU(cuMemMap(va, bytes, 0, handle, 0));
    CUmemAccessDesc access = {};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = 0;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CU(cuMemSetAccess(va, bytes, &access, 1));
    dst = reinterpret_cast<void*>(va);
  }
  Report(mode.c_str(), bytes, TimeScatter(dst, bytes));
  return 0;
}

int RunChild(const char* self, const std::string& mode, const std::string& arg, size_t bytes) {
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string b = std::to_string(bytes);
    execl(self, self, "child", mode.c_str(), arg.c_str(), b.c_str(), nullptr);
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

int main(int argc, char** argv) {
  if (argc == 5 && std::string(argv[1]) == "child") {
    return Child(argv[2], argv[3], std::stoull(argv[4]));
  }
  const double gib = argc > 1 ? std::atof(argv[1]) : 9.0;
  CK(cudaSetDevice(0));
  CU(cuInit(0));
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t gran = 0;
  CU(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  const size_t bytes = (size_t(gib * double(size_t{1} << 30)) + gran - 1) / gran * gran;
  std::printf("destination %zu bytes, cuMem granularity %zu\n", bytes, gran);

  RunChild(argv[0], "local", "-", bytes);

  void* ipc_dst = nullptr;
  CK(cudaMalloc(&ipc_dst, bytes));
  cudaIpcMemHandle_t h;
  CK(cudaIpcGetMemHandle(&h, ipc_dst));
  RunChild(argv[0], "ipc", Hex(h), bytes);
  CK(cudaFree(ipc_dst));

  // A kvt-like pool: 64 buffers of S / 64 + one 2 KiB page (odd size), and rounded to 2 MiB.
  const size_t odd = bytes / 64 / kItem * kItem + kItem;
  const size_t even = (odd + (size_t{2} << 20) - 1) / (size_t{2} << 20) * (size_t{2} << 20);
  RunChild(argv[0], "local64", "-", odd);
  for (size_t size : {odd, even}) {
    std::vector<void*> bufs(64);
    std::string all;
    for (void*& p : bufs) {
      CK(cudaMalloc(&p, size));
      cudaIpcMemHandle_t hb;
      CK(cudaIpcGetMemHandle(&hb, p));
      all += Hex(hb);
    }
    RunChild(argv[0], size == odd ? "ipc64" : "ipc64even", all, size);
    for (void* p : bufs) CK(cudaFree(p));
  }

  CUmemGenericAllocationHandle handle;
  CU(cuMemCreate(&handle, bytes, &prop, 0));
  int fd = -1;
  CU(cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  fcntl(fd, F_SETFD, 0);  // inherited by the child across exec
  RunChild(argv[0], "cumem", std::to_string(fd), bytes);
  close(fd);
  CU(cuMemRelease(handle));
  return 0;
}

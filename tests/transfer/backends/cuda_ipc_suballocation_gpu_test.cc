// GPU tests of the cuda_ipc backend on buffers that are sub-ranges of large allocations, as
// serving engines' caching allocators hand them out (label gpu; each test skips itself without
// a CUDA device):
//  - the descriptor names each allocation once (index, count, offsets);
//  - another process opens each allocation once, and page writes land byte-exact in buffers
//    carved at 256-byte-aligned offsets of two allocations, with the gaps untouched;
//  - Register refuses a buffer that crosses the end of its allocation, naming both ranges, and
//    memory without a legacy IPC handle (cuMemCreate + cuMemMap; cudaMallocAsync) saying what to
//    allocate instead.
// The second process is this binary re-executed (child_process.h); every wait is bounded.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kvt/common/hex.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/testing/gpu.h"
#include "kvt/testing/status.h"
#include "kvt/transfer/backend.h"
#include "kvt/transfer/backends.h"
// Private headers of kvt::transfer.
#include "backend_test_util.h"
#include "backends/cuda_ipc/cuda_ipc_backend.h"
#include "backends/cuda_ipc/cuda_ipc_codec.h"
#include "carved_pool.h"
#include "child_process.h"

namespace kvt::transfer {
namespace {

using testing::CarvedPool;
using testing::DistinctPages;
using ::testing::HasSubstr;
using testing::RandomBytes;
using testing::WaitFor;

constexpr int kLayers = 3;  // 6 buffers
constexpr int32_t kPages = 48;
constexpr uint64_t kItem = 1280;

std::unique_ptr<Backend> NewBackend() {
  auto backend = CreateBackend("cuda_ipc");
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? std::move(backend).value() : nullptr;
}

// ---- The descriptor -----------------------------------------------------------------------

TEST(CudaIpcSubAllocations, TheDescriptorNamesEachAllocationOnceWithTheBuffersOffsets) {
  KVT_SKIP_WITHOUT_GPU();
  CarvedPool pool;
  KVT_ASSERT_OK(pool.Init(kLayers, kPages, kItem, /*allocations=*/2));
  auto backend = NewBackend();
  ASSERT_TRUE(backend);
  auto descriptor = backend->Register(pool.Regions());
  ASSERT_TRUE(descriptor.ok()) << descriptor.status();
  auto keys = cuda_ipc::DecodePeerKeys(descriptor->regions);
  ASSERT_TRUE(keys.ok()) << keys.status();
  ASSERT_EQ(keys->allocations.size(), 2u) << "one IPC handle per allocation";
  EXPECT_NE(keys->allocations[0].handle, keys->allocations[1].handle);
  for (int b = 0; b < 2 * kLayers; ++b) {
    EXPECT_EQ(keys->allocation_of[b], pool.AllocationOf(b)) << "buffer " << b;
    EXPECT_EQ(keys->offsets[b], pool.Offset(b)) << "buffer " << b;
    EXPECT_NE(keys->offsets[b] % 4096, 0u) << "buffer " << b << " is meant to sit off any page";
    EXPECT_EQ(keys->offsets[b] % CarvedPool::kAlign, 0u);
  }
  for (size_t a = 0; a < 2; ++a) {
    EXPECT_GE(keys->allocations[a].bytes, pool.AllocationBytes(a)) << "allocation " << a;
  }

  // One allocation: every key names allocation 0 of 1.
  CarvedPool one;
  KVT_ASSERT_OK(one.Init(kLayers, kPages, kItem));
  auto single = backend->Register(one.Regions());
  ASSERT_TRUE(single.ok()) << single.status();
  for (const RemoteRegion& r : single->regions) {
    auto key = cuda_ipc::DecodeRegionKey(r.key, r.length);
    ASSERT_TRUE(key.ok()) << key.status();
    EXPECT_EQ(key->allocation, 0u);
    EXPECT_EQ(key->allocations, 1u);
  }
}

TEST(CudaIpcSubAllocations, ABufferCrossingTheEndOfItsAllocationIsRefusedNamingBothRanges) {
  KVT_SKIP_WITHOUT_GPU();
  CarvedPool pool;
  KVT_ASSERT_OK(pool.Init(kLayers, kPages, kItem));
  std::vector<LocalRegion> regions = pool.Regions();
  const uint64_t end = pool.AllocationBase(0) + pool.AllocationBytes(0);
  LocalRegion& last = regions[5];
  last.length = end - last.base + CarvedPool::kAlign;  // 256 bytes past the end
  auto backend = NewBackend();
  ASSERT_TRUE(backend);
  auto refused = backend->Register(regions);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  const std::string& message = refused.status().message();
  EXPECT_THAT(message,
              HasSubstr("buffer 5 [" + Hex(last.base) + ", " + Hex(last.base + last.length) + ")"));
  EXPECT_THAT(message,
              HasSubstr("allocation [" + Hex(pool.AllocationBase(0)) + ", " + Hex(end) + ")"));
  EXPECT_THAT(message, HasSubstr("inside one allocation"));

  // Ending exactly at the end is fine.
  last.length = end - last.base;
  auto fits = backend->Register(regions);
  EXPECT_TRUE(fits.ok()) << fits.status();
}

// The driver's virtual memory API, found at run time like the library finds its driver calls.
template <typename Fn>
Fn Driver(const char* name) {
  void* symbol = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion(name, &symbol, 12000, cudaEnableDefault, &found);
#else
  const cudaError_t err = cudaGetDriverEntryPoint(name, &symbol, cudaEnableDefault, &found);
#endif
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return reinterpret_cast<Fn>(symbol);
}

TEST(CudaIpcSubAllocations, VirtualMemoryApiAllocationsAreRefusedSayingWhatToUse) {
  KVT_SKIP_WITHOUT_GPU();
  auto granularity_fn =
      Driver<CUresult (*)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags)>(
          "cuMemGetAllocationGranularity");
  auto create = Driver<CUresult (*)(CUmemGenericAllocationHandle*, size_t,
                                    const CUmemAllocationProp*, unsigned long long)>("cuMemCreate");
  auto reserve =
      Driver<CUresult (*)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long)>(
          "cuMemAddressReserve");
  auto map = Driver<CUresult (*)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                                 unsigned long long)>("cuMemMap");
  auto set_access =
      Driver<CUresult (*)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t)>("cuMemSetAccess");
  auto unmap = Driver<CUresult (*)(CUdeviceptr, size_t)>("cuMemUnmap");
  auto release = Driver<CUresult (*)(CUmemGenericAllocationHandle)>("cuMemRelease");
  auto free_range = Driver<CUresult (*)(CUdeviceptr, size_t)>("cuMemAddressFree");
  ASSERT_TRUE(granularity_fn && create && reserve && map && set_access && unmap && release &&
              free_range)
      << "the driver lacks the virtual memory API";
  KVT_ASSERT_OK(cuda::ToStatus(cudaSetDevice(0), "cudaSetDevice"));
  KVT_ASSERT_OK(cuda::ToStatus(cudaFree(nullptr), "cudaFree(nullptr)"));  // a current context

  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  size_t granularity = 0;
  ASSERT_EQ(granularity_fn(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), CUDA_SUCCESS);
  const size_t bytes = granularity * ((4 << 20) / granularity + 1);
  CUmemGenericAllocationHandle handle = 0;
  ASSERT_EQ(create(&handle, bytes, &prop, 0), CUDA_SUCCESS);
  CUdeviceptr base = 0;
  ASSERT_EQ(reserve(&base, bytes, 0, 0, 0), CUDA_SUCCESS);
  ASSERT_EQ(map(base, bytes, 0, handle, 0), CUDA_SUCCESS);
  CUmemAccessDesc access = {};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ASSERT_EQ(set_access(base, bytes, &access, 1), CUDA_SUCCESS);

  const std::vector<LocalRegion> regions = {
      {base + 4096, 1 << 20, 4096, MemoryKind::kCuda, 0, 0},
      {base + 4096 + (1 << 20), 1 << 20, 4096, MemoryKind::kCuda, 0, 0}};
  auto backend = NewBackend();
  ASSERT_TRUE(backend);
  auto refused = backend->Register(regions);
  EXPECT_EQ(unmap(base, bytes), CUDA_SUCCESS);
  EXPECT_EQ(free_range(base, bytes), CUDA_SUCCESS);
  EXPECT_EQ(release(handle), CUDA_SUCCESS);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status();
  const std::string& message = refused.status().message();
  EXPECT_THAT(message, HasSubstr("buffer 0"));
  EXPECT_THAT(message, HasSubstr("virtual memory API (cuMemCreate + cuMemMap"));
  EXPECT_THAT(message, HasSubstr("plain cudaMalloc"));
  EXPECT_THAT(message, HasSubstr("expandable_segments:True"));
  EXPECT_THAT(message, HasSubstr("PYTORCH_CUDA_ALLOC_CONF"));
}

TEST(CudaIpcSubAllocations, StreamOrderedPoolMemoryIsRefusedSayingWhatToUse) {
  KVT_SKIP_WITHOUT_GPU();
  KVT_ASSERT_OK(cuda::ToStatus(cudaSetDevice(0), "cudaSetDevice"));
  void* memory = nullptr;
  const size_t bytes = 4 << 20;
  KVT_ASSERT_OK(
      cuda::ToStatus(cudaMallocAsync(&memory, bytes, cudaStreamLegacy), "cudaMallocAsync"));
  KVT_ASSERT_OK(cuda::ToStatus(cudaStreamSynchronize(cudaStreamLegacy), "cudaStreamSynchronize"));
  const uint64_t base = reinterpret_cast<uint64_t>(memory);
  const LocalRegion region{base + 512, 1 << 20, 4096, MemoryKind::kCuda, 0, 0};
  auto backend = NewBackend();
  ASSERT_TRUE(backend);
  auto refused = backend->Register({&region, 1});
  EXPECT_EQ(cudaFreeAsync(memory, cudaStreamLegacy), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(cudaStreamLegacy), cudaSuccess);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().code(),
              ::testing::AnyOf(StatusCode::kFailedPrecondition, StatusCode::kInvalidArgument))
      << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("cudaMalloc")) << refused.status();
}

// ---- Two processes ------------------------------------------------------------------------

constexpr char kChildEnv[] = "KVT_CUDA_IPC_SUBALLOCATION_CHILD_FDS";
constexpr uint32_t kChildSeed = 5;

using testing::Channel;

// The destination's pool, identical in both processes (the layout is deterministic), so the
// parent can compute the child's expected image.
Status InitDestination(CarvedPool& pool) {
  return pool.Init(kLayers, kPages, kItem, /*allocations=*/2);
}

// The hidden child: owns the destination pool (random bytes everywhere, gaps included),
// publishes it and compares it with the images the parent sends.
TEST(CudaIpcSubAllocationChild, DISABLED_Owner) {
  const char* fds = std::getenv(kChildEnv);
  if (fds == nullptr) GTEST_SKIP() << "runs only as the child of the two-process tests";
  int in = -1, out = -1;
  ASSERT_EQ(std::sscanf(fds, "%d,%d", &in, &out), 2);
  Channel channel(in, out);
  ASSERT_TRUE(cuda::HasDevice()) << cuda::DeviceCount().reason;
  CarvedPool pool;
  KVT_ASSERT_OK(InitDestination(pool));
  KVT_ASSERT_OK(pool.Upload(RandomBytes(pool.bytes(), kChildSeed)));
  auto backend = NewBackend();
  ASSERT_TRUE(backend);
  auto descriptor = backend->Register(pool.Regions());
  ASSERT_TRUE(descriptor.ok()) << descriptor.status();
  KVT_ASSERT_OK(channel.Send(testing::EncodeDescriptor(*descriptor)));
  while (true) {
    auto command = channel.Receive(std::chrono::seconds(120));
    if (!command.ok()) break;  // the parent is gone
    if (*command == "verify") {
      auto expected = channel.Receive(std::chrono::seconds(60));
      ASSERT_TRUE(expected.ok()) << expected.status();
      auto actual = pool.Download();
      ASSERT_TRUE(actual.ok()) << actual.status();
      const std::vector<uint8_t> want(expected->begin(), expected->end());
      KVT_ASSERT_OK(channel.Send(testing::DescribeCarvedMismatch(pool, want, *actual)));
    } else if (*command == "exit") {
      KVT_ASSERT_OK(channel.Send("bye"));
      break;
    }
  }
}

TEST(CudaIpcSubAllocationTwoProcesses, EachAllocationIsOpenedOnceAndPagesLandByteExact) {
  KVT_SKIP_WITHOUT_GPU();
  signal(SIGPIPE, SIG_IGN);  // a dead child must fail a write, not kill the test
  CarvedPool src;
  KVT_ASSERT_OK(src.Init(kLayers, kPages, kItem));
  const std::vector<uint8_t> src_image = RandomBytes(src.bytes(), 77);
  KVT_ASSERT_OK(src.Upload(src_image));
  auto sender = NewBackend();
  ASSERT_TRUE(sender);
  auto own = sender->Register(src.Regions());
  ASSERT_TRUE(own.ok()) << own.status();

  CarvedPool dst;  // this process's copy of the child's layout (and its expected image)
  KVT_ASSERT_OK(InitDestination(dst));
  std::vector<uint8_t> expected = RandomBytes(dst.bytes(), kChildSeed);

  testing::ChildProcess child;
  KVT_ASSERT_OK(child.Start(kChildEnv, "CudaIpcSubAllocationChild.DISABLED_Owner"));
  auto message = child.channel().Receive(std::chrono::seconds(60));
  ASSERT_TRUE(message.ok()) << message.status();
  auto decoded = testing::DecodeDescriptor(*message);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  const PeerDescriptor& descriptor = decoded->descriptor;
  auto keys = cuda_ipc::DecodePeerKeys(descriptor.regions);
  ASSERT_TRUE(keys.ok()) << keys.status();
  ASSERT_EQ(keys->allocations.size(), 2u) << "the child's 6 buffers lie in 2 allocations";
  for (int b = 0; b < 2 * kLayers; ++b) EXPECT_EQ(keys->offsets[b], dst.Offset(b));

  const size_t before = CudaIpcOpenMappingsForTest();
  auto peer = sender->Connect(descriptor);
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_EQ(CudaIpcOpenMappingsForTest(), before + 2) << "one mapping per allocation";
  auto again = sender->Connect(descriptor);  // a second connection shares both mappings
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(CudaIpcOpenMappingsForTest(), before + 2);

  std::mt19937 rng(21);
  std::vector<std::vector<int32_t>> pages;  // alive until the writes are posted
  std::vector<PageWrite> writes;
  for (auto [begin, end] : {std::pair{0, 1}, std::pair{1, 3}}) {
    pages.push_back(DistinctPages(11, kPages, rng));
    pages.push_back(DistinctPages(11, kPages, rng));
    PageWrite w;
    w.src_pages = pages[pages.size() - 2];
    w.dst_pages = pages.back();
    w.num_layers = kLayers;
    w.layer_begin = begin;
    w.layer_end = end;
    writes.push_back(w);
  }
  const std::vector<PageUnit> units = {{0, 256, 512}, {1000, 3, 277}};
  pages.push_back(DistinctPages(7, kPages, rng));
  pages.push_back(DistinctPages(7, kPages, rng));
  PageWrite parts;
  parts.src_pages = pages[pages.size() - 2];
  parts.dst_pages = pages.back();
  parts.num_layers = kLayers;
  parts.layer_begin = 0;
  parts.layer_end = kLayers;
  parts.units = units;
  writes.push_back(parts);
  for (const PageWrite& w : writes) {
    auto id = sender->PostPages(*peer, w);
    ASSERT_TRUE(id.ok()) << id.status();
    KVT_ASSERT_OK(WaitFor(*sender, *id));  // in order: later writes may overwrite earlier pages
    sender->Release(*id);
    testing::ApplyCarvedPageWrite(w, src, src_image, dst, expected);
  }
  auto verdict = child.Verify(expected);
  ASSERT_TRUE(verdict.ok()) << verdict.status();
  EXPECT_EQ(*verdict, "") << "the child's allocations differ";

  KVT_ASSERT_OK(sender->Disconnect(*peer));
  EXPECT_EQ(CudaIpcOpenMappingsForTest(), before + 2) << "the second connection holds them";
  KVT_ASSERT_OK(sender->Disconnect(*again));
  EXPECT_EQ(CudaIpcOpenMappingsForTest(), before) << "each closed once, at the last disconnect";
  auto exit_code = child.Stop(std::chrono::seconds(30));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
}

}  // namespace
}  // namespace kvt::transfer

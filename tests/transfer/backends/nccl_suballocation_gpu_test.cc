// The nccl backend on buffers that are sub-ranges of large allocations, as serving engines'
// caching allocators hand them out (label gpu). NCCL packs and unpacks through the buffers'
// device addresses, so buffers at 256-byte-aligned offsets of one or several allocations must
// move byte-exact, and the gaps between them stay untouched.
//
// Two processes, one GPU each (NCCL refuses two ranks on one GPU): skips below 2 devices. This
// binary re-executes itself (child_process.h) as the decode side on device 1 and pairs with it
// as the engines do (hello, Connect, ConnectToken, hello-ack, Accept). Every wait is bounded.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kvt/kernels/cuda_util.h"
#include "kvt/testing/gpu.h"
#include "kvt/testing/status.h"
#include "kvt/transfer/backend.h"
// Private headers of kvt::transfer.
#include "backend_test_util.h"
#include "backends/nccl/nccl_backend.h"
#include "backends/nccl/nccl_protocol.h"
#include "carved_pool.h"
#include "child_process.h"

namespace kvt::transfer {
namespace {

using Clock = std::chrono::steady_clock;
using testing::CarvedPool;
using testing::Channel;
using testing::DistinctPages;
using testing::RandomBytes;

constexpr int kLayers = 3;  // 6 buffers
constexpr int32_t kPages = 65;
constexpr uint64_t kItem = 4096;
constexpr int kParentDevice = 0;
constexpr int kChildDevice = 1;
constexpr uint32_t kChildSeed = 8;
constexpr char kChildEnv[] = "KVT_NCCL_SUBALLOCATION_CHILD";  // "<in fd>,<out fd>,<device>"

// Small slots so that every write spans many chunks.
StatusOr<std::unique_ptr<Backend>> NewBackend() {
  nccl::NcclTuning tuning;
  tuning.slot_bytes = nccl::kHeaderBytes + 48 * 1024;
  tuning.connect_timeout = std::chrono::seconds(60);
  tuning.stall_timeout = std::chrono::seconds(3);
  tuning.drain_timeout = std::chrono::seconds(20);
  tuning.idle_tick = std::chrono::milliseconds(2);
  tuning.receiver_silence_timeout = std::chrono::seconds(30);
  return CreateNcclBackendWithTuning(tuning);
}

// The decode side's pool, identical in both processes (the layout is deterministic).
Status InitDestination(CarvedPool& pool) {
  return pool.Init(kLayers, kPages, kItem, /*allocations=*/2, kChildDevice);
}

// The hidden child: owns the destination pool on device 1 (random bytes everywhere, gaps
// included), joins with Accept and compares its pool with the images the parent sends.
TEST(NcclSubAllocationChild, DISABLED_Decode) {
  const char* spec = std::getenv(kChildEnv);
  if (spec == nullptr) GTEST_SKIP() << "runs only as the child of the two-process tests";
  int in = -1, out = -1, device = -1;
  ASSERT_EQ(std::sscanf(spec, "%d,%d,%d", &in, &out, &device), 3);
  Channel channel(in, out);
  KVT_ASSERT_OK(cuda::ToStatus(cudaSetDevice(device), "cudaSetDevice"));
  CarvedPool pool;
  KVT_ASSERT_OK(InitDestination(pool));
  KVT_ASSERT_OK(pool.Upload(RandomBytes(pool.bytes(), kChildSeed)));
  auto backend = NewBackend();
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto descriptor = (*backend)->Register(pool.Regions());
  ASSERT_TRUE(descriptor.ok()) << descriptor.status();
  KVT_ASSERT_OK(channel.Send(testing::EncodeDescriptor(*descriptor)));
  auto ack = channel.Receive(std::chrono::seconds(120));
  ASSERT_TRUE(ack.ok()) << ack.status();
  auto hello = testing::DecodeDescriptor(*ack);
  ASSERT_TRUE(hello.ok()) << hello.status();
  auto peer = (*backend)->Accept(hello->descriptor, hello->token);
  KVT_ASSERT_OK(channel.Send(peer.ok() ? std::string("accepted") : peer.status().ToString()));
  ASSERT_TRUE(peer.ok()) << peer.status();
  while (true) {
    auto command = channel.Receive(std::chrono::seconds(300));
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

TEST(NcclSubAllocationTwoProcesses, PageWritesBetweenCarvedBuffersAreByteExact) {
  KVT_SKIP_WITHOUT_GPUS(2, "NCCL cannot put two ranks on one GPU");
  signal(SIGPIPE, SIG_IGN);  // a dead child must fail a write, not kill the test
  KVT_ASSERT_OK(cuda::ToStatus(cudaSetDevice(kParentDevice), "cudaSetDevice"));
  auto sender = NewBackend();
  if (!sender.ok() && sender.status().code() == StatusCode::kUnavailable) {
    GTEST_SKIP() << sender.status();
  }
  ASSERT_TRUE(sender.ok()) << sender.status();
  CarvedPool src;
  KVT_ASSERT_OK(src.Init(kLayers, kPages, kItem, /*allocations=*/1, kParentDevice));
  const std::vector<uint8_t> src_image = RandomBytes(src.bytes(), 31);
  KVT_ASSERT_OK(src.Upload(src_image));
  CarvedPool dst;  // this process's copy of the child's layout, for its expected image
  KVT_ASSERT_OK(InitDestination(dst));
  std::vector<uint8_t> expected = RandomBytes(dst.bytes(), kChildSeed);
  auto own = (*sender)->Register(src.Regions());
  ASSERT_TRUE(own.ok()) << own.status();

  testing::ChildProcess child;
  KVT_ASSERT_OK(child.Start(kChildEnv, "NcclSubAllocationChild.DISABLED_Decode",
                            "," + std::to_string(kChildDevice)));
  auto message = child.channel().Receive(std::chrono::seconds(120));
  ASSERT_TRUE(message.ok()) << message.status();
  auto hello = testing::DecodeDescriptor(*message);
  ASSERT_TRUE(hello.ok()) << hello.status();
  auto peer = (*sender)->Connect(hello->descriptor);
  ASSERT_TRUE(peer.ok()) << peer.status();
  auto token = (*sender)->ConnectToken(*peer);
  ASSERT_TRUE(token.ok()) << token.status();
  KVT_ASSERT_OK(child.channel().Send(testing::EncodeDescriptor(*own, *token)));
  auto accepted = child.channel().Receive(std::chrono::seconds(60));
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  ASSERT_EQ(*accepted, "accepted");

  std::mt19937 rng(17);
  // Destination pages disjoint across writes, so the expected image does not depend on order.
  const std::vector<int32_t> dst_all = DistinctPages(kPages - 1, kPages, rng);
  size_t next = 0;
  std::vector<std::vector<int32_t>> pages;  // alive until posted
  std::vector<PageWrite> writes;
  auto add = [&](int32_t begin, int32_t end, size_t n, std::span<const PageUnit> units) {
    pages.push_back(DistinctPages(static_cast<int64_t>(n), kPages, rng));
    pages.emplace_back(dst_all.begin() + next, dst_all.begin() + next + n);
    next += n;
    PageWrite w;
    w.src_pages = pages[pages.size() - 2];
    w.dst_pages = pages.back();
    w.num_layers = kLayers;
    w.layer_begin = begin;
    w.layer_end = end;
    w.units = units;
    writes.push_back(w);
  };
  const std::vector<PageUnit> units = {{0, 512, 1024}, {3072, 0, 512}, {2048, 2049, 7}};
  pages.reserve(8);  // the spans of earlier writes must stay valid
  add(0, 1, 20, {});
  add(1, 3, 25, {});
  add(0, kLayers, 15, units);
  std::vector<WriteId> ids;
  for (const PageWrite& w : writes) {
    auto id = (*sender)->PostPages(*peer, w);
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
    testing::ApplyCarvedPageWrite(w, src, src_image, dst, expected);
  }
  for (WriteId id : ids) {
    KVT_ASSERT_OK(testing::WaitFor(**sender, id, std::chrono::seconds(60)));
    (*sender)->Release(id);
  }
  auto verdict = child.Verify(expected);
  ASSERT_TRUE(verdict.ok()) << verdict.status();
  EXPECT_EQ(*verdict, "") << "the child's allocations differ";

  // Close the pair first so the child's backend goes away at once.
  KVT_ASSERT_OK((*sender)->Disconnect(*peer, Backend::DisconnectMode::kGraceful));
  auto exit_code = child.Stop(std::chrono::seconds(60));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0) << "the child's own checks failed";
}

}  // namespace
}  // namespace kvt::transfer

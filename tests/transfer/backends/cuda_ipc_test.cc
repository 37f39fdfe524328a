// The cuda_ipc backend's pieces that need no GPU: creation without a device, its place among
// the backend names, the buffer-key and address codecs, and the planner that turns writes into
// page-copy launches (executed here with the CPU reference of the kernel, so the tables and
// launches the GPU would get are checked byte for byte).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "backend_test_util.h"
#include "backends/cuda_ipc/cuda_ipc_codec.h"
#include "backends/cuda_ipc/cuda_ipc_program.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/kernels/kernels.h"
#include "kvt/testing/status.h"
#include "kvt/transfer/backend.h"
#include "kvt/transfer/backends.h"

namespace kvt::transfer::cuda_ipc {
namespace {

using testing::DistinctPages;
using ::testing::HasSubstr;

// ---- Creation and names -------------------------------------------------------------------

TEST(CudaIpcBackendTest, CreateNamesTheMissingDevice) {
  auto backend = CreateBackend("cuda_ipc");
  if (cuda::HasDevice()) {
    // On a GPU machine the same call must succeed and describe the backend.
    ASSERT_TRUE(backend.ok()) << backend.status();
    EXPECT_EQ((*backend)->Name(), "cuda_ipc");
    const BackendCapabilities caps = (*backend)->Capabilities();
    EXPECT_TRUE(caps.cuda_memory && caps.inter_process && caps.page_writes);
    EXPECT_FALSE(caps.host_memory || caps.inter_node);
    return;
  }
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), StatusCode::kUnavailable) << backend.status();
  EXPECT_THAT(backend.status().message(), HasSubstr("cuda_ipc needs a CUDA device: "));
  const std::string reason = cuda::DeviceCount().reason;
  ASSERT_FALSE(reason.empty());
  EXPECT_THAT(backend.status().message(), HasSubstr(reason));
}

TEST(CudaIpcBackendTest, BackendNamesListCudaIpcAfterUcx) {
  const std::vector<std::string> names = BackendNames();
  auto ucx = std::find(names.begin(), names.end(), "ucx");
  auto ipc = std::find(names.begin(), names.end(), "cuda_ipc");
  ASSERT_NE(ipc, names.end());
  ASSERT_NE(ucx, names.end());
  EXPECT_EQ(ipc, ucx + 1);
  auto unknown = CreateBackend("nvlink");
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.status().message(), HasSubstr("cuda_ipc"));
}

// ---- Buffer keys --------------------------------------------------------------------------

RegionKey SampleKey() {
  RegionKey key;
  for (size_t i = 0; i < key.handle.size(); ++i) key.handle[i] = static_cast<char>(i * 37 + 1);
  key.allocation = 2;
  key.allocations = 3;
  key.offset = 4096;
  key.allocation_bytes = uint64_t{3} << 32;  // above 4 GiB: all eight bytes matter
  return key;
}

TEST(CudaIpcKeyTest, RoundTrips) {
  const RegionKey key = SampleKey();
  const std::string bytes = EncodeRegionKey(key);
  EXPECT_EQ(bytes.size(), kKeyBytes);
  auto decoded = DecodeRegionKey(bytes, 1 << 20);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, key);
}

TEST(CudaIpcKeyTest, AcceptsABufferEndingExactlyAtTheAllocationEnd) {
  RegionKey key = SampleKey();
  key.allocation_bytes = 10000;
  key.offset = 6000;
  EXPECT_TRUE(DecodeRegionKey(EncodeRegionKey(key), 4000).ok());
  auto past = DecodeRegionKey(EncodeRegionKey(key), 4001);
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(past.status().message(), HasSubstr("past its end"));
  EXPECT_THAT(past.status().message(), HasSubstr("6000"));
}

TEST(CudaIpcKeyTest, RefusesShortAndLongKeys) {
  const std::string bytes = EncodeRegionKey(SampleKey());
  for (size_t size : {size_t{0}, size_t{3}, size_t{8}, kKeyBytes - 1, kKeyBytes + 1}) {
    std::string key = size <= bytes.size() ? bytes.substr(0, size) : bytes + std::string(1, 'x');
    auto decoded = DecodeRegionKey(key, 64);
    ASSERT_FALSE(decoded.ok()) << size;
    EXPECT_EQ(decoded.status().code(), StatusCode::kInvalidArgument);
    if (size >= 5) {
      EXPECT_THAT(decoded.status().message(), HasSubstr(std::to_string(size) + " bytes"));
      EXPECT_THAT(decoded.status().message(), HasSubstr(std::to_string(kKeyBytes)));
    }
  }
}

TEST(CudaIpcKeyTest, RefusesOtherMagicVersionAndHandleSize) {
  const std::string good = EncodeRegionKey(SampleKey());
  std::string ucx_key = good;
  ucx_key[0] = 'U';
  auto magic = DecodeRegionKey(ucx_key, 64);
  ASSERT_FALSE(magic.ok());
  EXPECT_THAT(magic.status().message(), HasSubstr("not a cuda_ipc buffer key"));

  std::string v3 = good;
  v3[4] = 3;
  auto version = DecodeRegionKey(v3, 64);
  ASSERT_FALSE(version.ok());
  EXPECT_EQ(version.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(version.status().message(), HasSubstr("version 3"));
  EXPECT_THAT(version.status().message(), HasSubstr("reads version 2"));

  std::string handle = good;
  handle[5] = 32;
  auto size = DecodeRegionKey(handle, 64);
  ASSERT_FALSE(size.ok());
  EXPECT_THAT(size.status().message(), HasSubstr("32-byte IPC handle"));

  std::string reserved = good;
  reserved[7] = 1;
  EXPECT_FALSE(DecodeRegionKey(reserved, 64).ok());
}

TEST(CudaIpcKeyTest, RefusesOffsetsPastTheAllocation) {
  RegionKey key = SampleKey();
  key.allocation_bytes = 1 << 20;
  key.offset = (1 << 20) + 1;
  auto past = DecodeRegionKey(EncodeRegionKey(key), 0);
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.status().code(), StatusCode::kInvalidArgument);

  key.offset = std::numeric_limits<uint64_t>::max() - 10;  // offset + length wraps around
  auto wrap = DecodeRegionKey(EncodeRegionKey(key), 100);
  ASSERT_FALSE(wrap.ok());
  EXPECT_THAT(wrap.status().message(), HasSubstr("past its end"));

  key.offset = 0;
  auto longer = DecodeRegionKey(EncodeRegionKey(key), (1 << 20) + 1);  // buffer > allocation
  EXPECT_FALSE(longer.ok());

  key.allocation_bytes = 0;
  auto empty = DecodeRegionKey(EncodeRegionKey(key), 0);
  ASSERT_FALSE(empty.ok());
  EXPECT_THAT(empty.status().message(), HasSubstr("0 bytes"));
}

// ---- Addresses ----------------------------------------------------------------------------

ProcessAddress SampleAddress() {
  ProcessAddress a;
  a.boot_id = "4b0c3a0e-9f7e-4a57-8a43-5b8c0d3f1e22";
  a.pid = 4242;
  a.process = 0xfeedfacecafebeefULL;
  a.device = 3;
  a.pci_bus_id = "0000:9A:00.0";
  a.instance = 0x1234;
  return a;
}

TEST(CudaIpcAddressTest, RoundTrips) {
  const ProcessAddress a = SampleAddress();
  const std::string text = EncodeAddress(a);
  EXPECT_TRUE(text.starts_with("cuda_ipc/1 "));
  auto decoded = DecodeAddress(text);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, a);
}

TEST(CudaIpcAddressTest, RefusesOtherFormatsAndVersions) {
  auto ucx = DecodeAddress(std::string("\x01\x02ucx-worker-address", 20));
  ASSERT_FALSE(ucx.ok());
  EXPECT_EQ(ucx.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(ucx.status().message(), HasSubstr("not a cuda_ipc address"));

  std::string v2 = EncodeAddress(SampleAddress());
  v2.replace(0, 10, "cuda_ipc/2");
  auto version = DecodeAddress(v2);
  ASSERT_FALSE(version.ok());
  EXPECT_THAT(version.status().message(), HasSubstr("'cuda_ipc/2'"));

  EXPECT_FALSE(DecodeAddress("").ok());
}

TEST(CudaIpcAddressTest, RefusesMissingAndMalformedFields) {
  const std::string good = EncodeAddress(SampleAddress());
  for (const char* field : {"boot", "pid", "proc", "dev", "pci", "inst"}) {
    // Drop " field=value".
    std::string text = good;
    const size_t at = text.find(std::string(" ") + field + "=");
    ASSERT_NE(at, std::string::npos) << field;
    const size_t end = text.find(' ', at + 1);
    text.erase(at, end == std::string::npos ? std::string::npos : end - at);
    auto decoded = DecodeAddress(text);
    ASSERT_FALSE(decoded.ok()) << field;
    EXPECT_THAT(decoded.status().message(), HasSubstr(std::string("'") + field + "='"));
  }
  std::string bad_pid = good;
  bad_pid.replace(bad_pid.find("pid=4242"), 8, "pid=42x2");
  auto pid = DecodeAddress(bad_pid);
  ASSERT_FALSE(pid.ok());
  EXPECT_THAT(pid.status().message(), HasSubstr("pid=42x2"));

  std::string bad_dev = good;
  bad_dev.replace(bad_dev.find("dev=3"), 5, "dev=-1");
  EXPECT_FALSE(DecodeAddress(bad_dev).ok());

  std::string no_equals = good + " stray";
  EXPECT_FALSE(DecodeAddress(no_equals).ok());
}

TEST(CudaIpcAddressTest, IgnoresFieldsOfLaterRevisions) {
  auto decoded = DecodeAddress(EncodeAddress(SampleAddress()) + " numa=1");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, SampleAddress());
}

TEST(CudaIpcAddressTest, TellsHostsAndProcessesApart) {
  const ProcessAddress a = SampleAddress();
  ProcessAddress other_backend = a;
  other_backend.instance = 99;
  other_backend.device = 0;
  EXPECT_TRUE(SameProcess(a, other_backend));

  ProcessAddress other_process = a;
  other_process.pid = 4243;
  EXPECT_TRUE(SameHost(a, other_process));
  EXPECT_FALSE(SameProcess(a, other_process));

  ProcessAddress same_pid_other_container = a;  // pid namespaces: equal pids, other process
  same_pid_other_container.process = 1;
  EXPECT_FALSE(SameProcess(a, same_pid_other_container));

  ProcessAddress other_host = a;
  other_host.boot_id = "0e7c1b32-0000-4000-8000-000000000000";
  EXPECT_FALSE(SameHost(a, other_host));
  EXPECT_FALSE(SameProcess(a, other_host));
}

TEST(CudaIpcAddressTest, ThisProcessHasAStableIdentity) {
  EXPECT_FALSE(ThisBootId().empty());
  EXPECT_EQ(ThisBootId().find(' '), std::string::npos);
  EXPECT_EQ(&ThisBootId(), &ThisBootId());
  EXPECT_EQ(ThisProcessToken(), ThisProcessToken());
  // The address of this process survives the codec with its identity.
  ProcessAddress self;
  self.boot_id = ThisBootId();
  self.pid = 7;
  self.process = ThisProcessToken();
  self.device = 0;
  self.pci_bus_id = "0000:01:00.0";
  auto decoded = DecodeAddress(EncodeAddress(self));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_TRUE(SameProcess(*decoded, self));
}

// ---- The planner, run with the CPU kernel -------------------------------------------------

// A host stand-in for a pool: 2L buffers of `pages` pages of `item` bytes, K of every layer
// then V (buffer b of transfer layer b % L).
struct HostPool {
  HostPool(int layers, uint64_t pages, uint64_t item, uint8_t fill) : layers(layers), item(item) {
    buffers.assign(2 * static_cast<size_t>(layers), std::vector<uint8_t>(pages * item, fill));
  }
  void Randomize(std::mt19937& rng) {
    for (auto& b : buffers) testing::FillRandom(b, rng);
  }
  LocalBuffers Local() {
    std::vector<LocalRegion> out;
    for (size_t b = 0; b < buffers.size(); ++b) {
      out.push_back({reinterpret_cast<uint64_t>(buffers[b].data()), buffers[b].size(), item,
                     MemoryKind::kCuda, 0, static_cast<int32_t>(b % layers)});
    }
    auto local = LocalBuffers::Create(out);
    EXPECT_TRUE(local.ok()) << local.status();
    return std::move(local).value();
  }
  std::vector<RemoteRegion> Remote() {
    std::vector<RemoteRegion> out;
    for (auto& b : buffers)
      out.push_back({reinterpret_cast<uint64_t>(b.data()), b.size(), item, ""});
    return out;
  }
  std::vector<uint64_t> Bases() {
    std::vector<uint64_t> out;
    for (auto& b : buffers) out.push_back(reinterpret_cast<uint64_t>(b.data()));
    return out;
  }
  int layers;
  uint64_t item;
  std::vector<std::vector<uint8_t>> buffers;
};

// Runs every launch of the program with PageCopyCpu, its tables where they are.
Status Execute(const CopyProgram& program) {
  for (const CopyLaunch& launch : program.launches) {
    KVT_RETURN_IF_ERROR(kernels::PageCopyCpu(
        LaunchArgs(program, launch, reinterpret_cast<uint64_t>(program.tables.data()))));
  }
  return OkStatus();
}

// What a page write must leave in the destination, computed independently of the planner.
void ApplyPageWrite(const PageWrite& w, const HostPool& src, HostPool& dst) {
  testing::ApplyPageWrite(
      w, src.item, [&](int32_t b, int32_t page) { return src.buffers[b].data() + page * src.item; },
      [&](int32_t b, int32_t page) { return dst.buffers[b].data() + page * dst.item; });
}

constexpr int kLayers = 4;
constexpr int32_t kPages = 32;

TEST(CudaIpcProgramTest, WholePagesOfALayerBatchAreOneLaunchAndByteExact) {
  std::mt19937 rng(11);
  HostPool src(kLayers, kPages, 1024, 0);
  HostPool dst(kLayers, kPages, 1024, 0xEE);
  src.Randomize(rng);
  HostPool expected = dst;
  const std::vector<int32_t> src_pages = DistinctPages(9, kPages, rng);
  const std::vector<int32_t> dst_pages = DistinctPages(9, kPages, rng);
  PageWrite w;
  w.src_pages = src_pages;
  w.dst_pages = dst_pages;
  w.num_layers = kLayers;
  w.layer_begin = 1;
  w.layer_end = 3;
  auto local = src.Local();
  auto remote = dst.Remote();
  auto bases = dst.Bases();
  auto program = PlanPageWrite(w, local, remote, bases);
  ASSERT_TRUE(program.ok()) << program.status();
  ASSERT_EQ(program->launches.size(), 1u);
  EXPECT_EQ(program->launches[0].num_buffers, 4);  // K and V of layers 1 and 2
  EXPECT_EQ(program->bytes, 4u * 9 * 1024);
  ASSERT_TRUE(Execute(*program).ok());
  ApplyPageWrite(w, src, expected);
  for (size_t b = 0; b < dst.buffers.size(); ++b) {
    EXPECT_EQ(dst.buffers[b], expected.buffers[b]) << "buffer " << b;
  }
}

TEST(CudaIpcProgramTest, UnitsAreOneLaunchEachIncludingUnalignedOnes) {
  std::mt19937 rng(12);
  HostPool src(kLayers, kPages, 512, 0);
  HostPool dst(kLayers, kPages, 512, 0xEE);
  src.Randomize(rng);
  HostPool expected = dst;
  const std::vector<int32_t> src_pages = DistinctPages(7, kPages, rng);
  const std::vector<int32_t> dst_pages = DistinctPages(7, kPages, rng);
  const std::vector<PageUnit> units = {{0, 256, 128}, {256, 0, 64}, {3, 401, 111}, {500, 500, 0}};
  PageWrite w;
  w.src_pages = src_pages;
  w.dst_pages = dst_pages;
  w.num_layers = kLayers;
  w.layer_begin = 0;
  w.layer_end = kLayers;
  w.units = units;
  auto local = src.Local();
  auto remote = dst.Remote();
  auto bases = dst.Bases();
  auto program = PlanPageWrite(w, local, remote, bases);
  ASSERT_TRUE(program.ok()) << program.status();
  EXPECT_EQ(program->launches.size(), 3u);  // the empty unit launches nothing
  ASSERT_TRUE(Execute(*program).ok());
  ApplyPageWrite(w, src, expected);
  for (size_t b = 0; b < dst.buffers.size(); ++b) {
    EXPECT_EQ(dst.buffers[b], expected.buffers[b]) << "buffer " << b;
  }
}

TEST(CudaIpcProgramTest, BuffersOfDifferentPageSizesGetOneLaunchPerSize) {
  // The V buffers of the peer have larger pages (a layout with more heads there): units move
  // the same head range into a different place of each page.
  std::mt19937 rng(13);
  HostPool src(2, kPages, 256, 0);
  src.Randomize(rng);
  HostPool dst(2, kPages, 256, 0xEE);
  dst.buffers[2].assign(kPages * 512, 0xEE);
  dst.buffers[3].assign(kPages * 512, 0xEE);
  auto remote = dst.Remote();
  remote[2].item_len = remote[3].item_len = 512;
  auto local = src.Local();
  auto bases = dst.Bases();
  const std::vector<int32_t> src_pages = {5, 9, 2};
  const std::vector<int32_t> dst_pages = {1, 30, 7};
  const std::vector<PageUnit> units = {{64, 0, 128}};
  PageWrite w;
  w.src_pages = src_pages;
  w.dst_pages = dst_pages;
  w.num_layers = 2;
  w.layer_begin = 0;
  w.layer_end = 2;
  w.units = units;
  auto program = PlanPageWrite(w, local, remote, bases);
  ASSERT_TRUE(program.ok()) << program.status();
  EXPECT_EQ(program->launches.size(), 2u);
  ASSERT_TRUE(Execute(*program).ok());
  for (int b = 0; b < 4; ++b) {
    const uint64_t dst_item = b < 2 ? 256 : 512;
    std::vector<uint8_t> want(kPages * dst_item, 0xEE);
    for (size_t i = 0; i < src_pages.size(); ++i) {
      std::memcpy(want.data() + dst_pages[i] * dst_item,
                  src.buffers[b].data() + src_pages[i] * 256 + 64, 128);
    }
    EXPECT_EQ(dst.buffers[b], want) << "buffer " << b;
  }
  // Whole pages between different page sizes cannot be planned.
  w.units = {};
  auto whole = PlanPageWrite(w, local, remote, bases);
  ASSERT_FALSE(whole.ok());
  EXPECT_EQ(whole.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(whole.status().message(), HasSubstr("pass units"));
}

TEST(CudaIpcProgramTest, AReusedProgramPlansEachWriteAsAFreshOne) {
  // The backend plans every page write into one CopyProgram: a large write, a refused one and
  // a small one in turn must each read exactly as if planned alone.
  std::mt19937 rng(14);
  HostPool src(kLayers, kPages, 256, 0);
  HostPool dst(kLayers, kPages, 256, 0xEE);
  src.Randomize(rng);
  auto local = src.Local();
  auto remote = dst.Remote();
  auto bases = dst.Bases();
  const std::vector<int32_t> many_src = DistinctPages(20, kPages, rng);
  const std::vector<int32_t> many_dst = DistinctPages(20, kPages, rng);
  const std::vector<int32_t> few_src = DistinctPages(3, kPages, rng);
  const std::vector<int32_t> few_dst = DistinctPages(3, kPages, rng);
  const std::vector<int32_t> outside = {1, kPages};
  const std::vector<PageUnit> units = {{0, 0, 64}, {128, 128, 32}};
  PageWrite large;
  large.src_pages = many_src;
  large.dst_pages = many_dst;
  large.num_layers = kLayers;
  large.layer_end = kLayers;
  large.units = units;
  PageWrite refused = large;
  refused.src_pages = outside;
  refused.dst_pages = outside;
  PageWrite small;
  small.src_pages = few_src;
  small.dst_pages = few_dst;
  small.num_layers = kLayers;
  small.layer_begin = 2;
  small.layer_end = 3;

  CopyProgram reused;
  ASSERT_TRUE(PlanPageWriteInto(large, local, remote, bases, reused).ok());
  auto fresh_large = PlanPageWrite(large, local, remote, bases);
  ASSERT_TRUE(fresh_large.ok()) << fresh_large.status();
  EXPECT_EQ(reused.tables, fresh_large->tables);
  EXPECT_EQ(reused.launches.size(), fresh_large->launches.size());
  EXPECT_EQ(reused.bytes, fresh_large->bytes);

  const Status bad = PlanPageWriteInto(refused, local, remote, bases, reused);
  EXPECT_EQ(bad.code(), StatusCode::kOutOfRange) << bad;
  EXPECT_THAT(bad.message(), HasSubstr("page " + std::to_string(kPages)));
  EXPECT_TRUE(reused.launches.empty());
  EXPECT_EQ(reused.bytes, 0u);

  ASSERT_TRUE(PlanPageWriteInto(small, local, remote, bases, reused).ok());
  auto fresh_small = PlanPageWrite(small, local, remote, bases);
  ASSERT_TRUE(fresh_small.ok()) << fresh_small.status();
  EXPECT_EQ(reused.tables, fresh_small->tables);
  EXPECT_EQ(reused.src_pages, fresh_small->src_pages);
  EXPECT_EQ(reused.dst_pages, fresh_small->dst_pages);
  ASSERT_EQ(reused.launches.size(), 1u);
  EXPECT_EQ(reused.launches[0].num_buffers, 2);  // K and V of layer 2
  EXPECT_EQ(reused.bytes, fresh_small->bytes);
  HostPool expected = dst;
  ASSERT_TRUE(Execute(reused).ok());
  ApplyPageWrite(small, src, expected);
  for (size_t b = 0; b < dst.buffers.size(); ++b) {
    EXPECT_EQ(dst.buffers[b], expected.buffers[b]) << "buffer " << b;
  }
}

TEST(CudaIpcProgramTest, EmptyWritesHaveNoLaunches) {
  HostPool src(kLayers, kPages, 256, 0);
  HostPool dst(kLayers, kPages, 256, 0);
  auto local = src.Local();
  auto remote = dst.Remote();
  auto bases = dst.Bases();
  const std::vector<int32_t> pages = {1, 2};
  PageWrite no_pages;
  no_pages.num_layers = kLayers;
  no_pages.layer_end = kLayers;
  auto a = PlanPageWrite(no_pages, local, remote, bases);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(a->launches.empty());
  PageWrite no_layers;
  no_layers.src_pages = pages;
  no_layers.dst_pages = pages;
  no_layers.num_layers = kLayers;
  no_layers.layer_begin = no_layers.layer_end = 2;
  auto b = PlanPageWrite(no_layers, local, remote, bases);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(b->launches.empty());
  EXPECT_EQ(b->bytes, 0u);
}

TEST(CudaIpcProgramTest, RefusesPageWritesOutsideEitherSide) {
  HostPool src(kLayers, kPages, 256, 0);
  HostPool dst(kLayers, 16, 256, 0);  // the peer's pool is smaller
  auto local = src.Local();
  auto remote = dst.Remote();
  auto bases = dst.Bases();
  const std::vector<int32_t> ok_pages = {1, 2, 3};
  const std::vector<int32_t> two = {1, 2};
  const std::vector<int32_t> negative = {1, -3, 2};
  const std::vector<int32_t> past_dst = {1, 16, 2};
  const std::vector<int32_t> past_src = {1, 32, 2};
  auto plan = [&](std::span<const int32_t> s, std::span<const int32_t> d, int32_t layers,
                  int32_t begin, int32_t end, std::span<const PageUnit> units = {}) {
    PageWrite w;
    w.src_pages = s;
    w.dst_pages = d;
    w.num_layers = layers;
    w.layer_begin = begin;
    w.layer_end = end;
    w.units = units;
    return PlanPageWrite(w, local, remote, bases);
  };
  auto expect = [](const StatusOr<CopyProgram>& r, StatusCode code, const std::string& text) {
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), code) << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(text));
  };
  EXPECT_TRUE(plan(ok_pages, ok_pages, kLayers, 0, kLayers).ok());
  expect(plan(ok_pages, two, kLayers, 0, 1), StatusCode::kInvalidArgument, "3 source pages but 2");
  expect(plan(ok_pages, ok_pages, 0, 0, 0), StatusCode::kInvalidArgument, "num_layers = 0");
  expect(plan(ok_pages, ok_pages, kLayers + 1, 0, 1), StatusCode::kInvalidArgument,
         "the registered buffers have 4 transfer layers");
  expect(plan(ok_pages, ok_pages, kLayers, 2, 1), StatusCode::kInvalidArgument, "[2, 1)");
  expect(plan(ok_pages, ok_pages, kLayers, 0, kLayers + 1), StatusCode::kInvalidArgument,
         "[0, 5) is not inside the registered layers [0, 4]");
  expect(plan(negative, ok_pages, kLayers, 0, 1), StatusCode::kOutOfRange, "page -3");
  expect(plan(ok_pages, past_dst, kLayers, 0, 1), StatusCode::kOutOfRange,
         "writes page 16 of the peer's buffer 0, which holds 16 pages");
  expect(plan(past_src, ok_pages, kLayers, 0, 1), StatusCode::kOutOfRange,
         "reads page 32 of local buffer 0, which holds 32 pages");
  const std::vector<PageUnit> wide = {{200, 0, 57}};
  expect(plan(ok_pages, ok_pages, kLayers, 0, 1, wide), StatusCode::kOutOfRange,
         "unit 0 reads [200, +57)");
  const std::vector<PageUnit> shifted = {{0, 255, 2}};
  expect(plan(ok_pages, ok_pages, kLayers, 0, 1, shifted), StatusCode::kOutOfRange,
         "unit 0 writes [255, +2)");

  // The peer publishing another buffer count is the caller's state to fix.
  std::vector<RemoteRegion> fewer(remote.begin(), remote.end() - 1);
  std::vector<uint64_t> fewer_bases(bases.begin(), bases.end() - 1);
  PageWrite w;
  w.src_pages = ok_pages;
  w.dst_pages = ok_pages;
  w.num_layers = kLayers;
  w.layer_end = 1;
  auto count = PlanPageWrite(w, local, fewer, fewer_bases);
  ASSERT_FALSE(count.ok());
  EXPECT_EQ(count.status().code(), StatusCode::kFailedPrecondition);
}

TEST(CudaIpcProgramTest, MixedLayoutMovesTheBuffersOfTheLayersByteExact) {
  // Target K/V (256-byte pages), a latent group (96) and a draft model's K/V (512): one launch
  // per page size present in a batch, every buffer of the batch's layers, nothing else.
  const testing::MixedLayout layout;
  std::mt19937 rng(31);
  std::vector<uint8_t> src(layout.ImageBytes()), dst(layout.ImageBytes());
  testing::FillRandom(src, rng);
  testing::FillRandom(dst, rng);
  std::vector<uint8_t> expected = dst;
  auto local = LocalBuffers::Create(layout.Regions(reinterpret_cast<uint64_t>(src.data())));
  ASSERT_TRUE(local.ok()) << local.status();
  std::vector<RemoteRegion> remote;
  std::vector<uint64_t> bases;
  for (const LocalRegion& r : layout.Regions(reinterpret_cast<uint64_t>(dst.data()))) {
    remote.push_back({r.base, r.length, r.item_len, ""});
    bases.push_back(r.base);
  }
  const std::vector<int32_t> src_pages = DistinctPages(11, layout.pages, rng);
  const std::vector<int32_t> dst_pages = DistinctPages(11, layout.pages, rng);
  struct Batch {
    int32_t begin, end;
    size_t launches;
    uint64_t bytes;
  };
  // [0, 3): K/V of layers 0, 1 (4 x 256) and the latent buffer of layer 2 (96);
  // [3, 5): the latent buffer of layer 3 (96) and the draft's K/V of layer 4 (2 x 512).
  for (const Batch& batch :
       {Batch{0, 3, 2, 11 * (4 * 256 + 96)}, Batch{3, 5, 2, 11 * (96 + 1024)}}) {
    PageWrite w;
    w.src_pages = src_pages;
    w.dst_pages = dst_pages;
    w.num_layers = layout.num_layers;
    w.layer_begin = batch.begin;
    w.layer_end = batch.end;
    auto program = PlanPageWrite(w, *local, remote, bases);
    ASSERT_TRUE(program.ok()) << program.status();
    EXPECT_EQ(program->launches.size(), batch.launches);
    EXPECT_EQ(program->bytes, batch.bytes);
    ASSERT_TRUE(Execute(*program).ok());
    layout.Apply(w, src, expected);
    EXPECT_EQ(layout.Mismatch(expected, dst), "")
        << "layers [" << batch.begin << ", " << batch.end << ")";
  }
}

TEST(CudaIpcProgramTest, RefusesRegionLayersThatSkipOrGoBack) {
  const testing::MixedLayout layout;
  std::vector<LocalRegion> regions = layout.Regions(0x10000);
  regions[6].layer = 5;  // the draft's K names layer 5 before any buffer of layer 4
  auto skipped = LocalBuffers::Create(regions);
  ASSERT_FALSE(skipped.ok());
  EXPECT_EQ(skipped.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(skipped.status().message(), HasSubstr("buffer 6 has transfer layer 5"));
  regions = layout.Regions(0x10000);
  regions[0].layer = 1;
  auto first = LocalBuffers::Create(regions);
  ASSERT_FALSE(first.ok());
  EXPECT_THAT(first.status().message(), HasSubstr("buffer 0 has transfer layer 1; expected 0"));
}

TEST(CudaIpcProgramTest, CopyRunsOfOneLengthShareALaunchAndAreByteExact) {
  std::mt19937 rng(21);
  HostPool src(kLayers, kPages, 4096, 0);
  HostPool dst(kLayers, kPages, 4096, 0xEE);
  src.Randomize(rng);
  HostPool expected = dst;
  std::vector<CopyRun> runs;
  std::vector<uint64_t> dst_pages(kPages);
  std::iota(dst_pages.begin(), dst_pages.end(), 0);
  std::shuffle(dst_pages.begin() + 1, dst_pages.end(), rng);
  std::set<uint64_t> lengths;
  for (uint32_t b = 0; b < 2 * kLayers; ++b) {
    for (uint64_t p = 1; p < 10; ++p) {
      const uint64_t bytes = p % 3 == 0 ? 4096 : 1 + rng() % 4096;  // partial and odd lengths
      runs.push_back({b, p * 4096, dst_pages[p] * 4096, bytes});
      lengths.insert(bytes);
    }
  }
  runs.push_back({0, 0, 0, 0});  // empty runs move nothing
  auto local = src.Local();
  auto remote = dst.Remote();
  auto bases = dst.Bases();
  auto program = PlanRunWrite(runs, local, remote, bases);
  ASSERT_TRUE(program.ok()) << program.status();
  EXPECT_EQ(program->launches.size(), lengths.size());
  ASSERT_TRUE(Execute(*program).ok());
  uint64_t total = 0;
  for (const CopyRun& r : runs) {
    std::memcpy(expected.buffers[r.buffer].data() + r.dst_offset,
                src.buffers[r.buffer].data() + r.src_offset, r.bytes);
    total += r.bytes;
  }
  EXPECT_EQ(program->bytes, total);
  for (size_t b = 0; b < dst.buffers.size(); ++b) {
    EXPECT_EQ(dst.buffers[b], expected.buffers[b]) << "buffer " << b;
  }
}

TEST(CudaIpcProgramTest, RefusesRunsOutsideEitherSide) {
  HostPool src(1, 4, 256, 0);
  HostPool dst(1, 2, 256, 0);
  auto local = src.Local();
  auto remote = dst.Remote();
  auto bases = dst.Bases();
  const CopyRun past_dst[] = {{0, 0, 400, 200}};
  auto a = PlanRunWrite(past_dst, local, remote, bases);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kOutOfRange);
  EXPECT_THAT(a.status().message(), HasSubstr("past the end of remote buffer 0"));
  const CopyRun bad_buffer[] = {{5, 0, 0, 1}};
  auto b = PlanRunWrite(bad_buffer, local, remote, bases);
  ASSERT_FALSE(b.ok());
  EXPECT_THAT(b.status().message(), HasSubstr("reads buffer 5 but only 2 are registered"));
  const CopyRun bad_peer_buffer[] = {{0, 0, 0, 1, 2}};  // the peer published buffers 0 and 1
  auto c = PlanRunWrite(bad_peer_buffer, local, remote, bases);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("writes buffer 2 but the peer published only 2"));
  const CopyRun crossed[] = {{1, 0, 256, 256, 0}};  // our buffer 1 -> the peer's buffer 0
  auto d = PlanRunWrite(crossed, local, remote, bases);
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_EQ(d->launches.size(), 1u);
  EXPECT_EQ(d->tables[0], local[1].base);
  EXPECT_EQ(d->tables[1], bases[0] + 256);
  auto none = PlanRunWrite({}, local, remote, bases);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->launches.empty());
}

// ---- Batch shapes kept per peer -----------------------------------------------------------

// Buffers at made-up addresses (planning only): two per layer, page sizes and page counts
// differing per buffer and per side, so that a batch's bounds are set by different buffers.
struct ShapedSides {
  ShapedSides(int layers, std::mt19937& rng) {
    std::vector<LocalRegion> regions;
    for (int b = 0; b < 2 * layers; ++b) {
      const uint64_t src_item = rng() % 2 ? 64 : 128;
      const uint64_t dst_item = rng() % 8 ? src_item : 192;
      const uint64_t src_pages = 5 + rng() % 5;
      const uint64_t dst_pages = 5 + rng() % 5;
      const uint64_t src_base = 0x100000 * (b + 1);
      const uint64_t dst_base = 0x40000000 + 0x100000 * (b + 1);
      // A few bytes past the last whole page: a partial page is not a page.
      regions.push_back({src_base, src_pages * src_item + rng() % src_item, src_item,
                         MemoryKind::kCuda, 0, b / 2});
      remote.push_back({dst_base, dst_pages * dst_item + rng() % dst_item, dst_item, ""});
      bases.push_back(dst_base);
    }
    auto created = LocalBuffers::Create(regions);
    EXPECT_TRUE(created.ok()) << created.status();
    local = std::move(created).value();
  }
  // Whether every check of a page write passes, decided buffer by buffer from the regions.
  bool Valid(const PageWrite& w) const {
    for (uint32_t b : local.layers().Buffers(w.layer_begin, w.layer_end)) {
      const uint64_t src_item = local[b].item_len, dst_item = remote[b].item_len;
      for (size_t i = 0; i < w.src_pages.size(); ++i) {
        if ((w.src_pages[i] + 1) * src_item > local[b].length) return false;
        if ((w.dst_pages[i] + 1) * dst_item > remote[b].length) return false;
      }
      if (w.units.empty() && src_item != dst_item) return false;
      for (const PageUnit& u : w.units) {
        if (u.src_offset + u.bytes > src_item || u.dst_offset + u.bytes > dst_item) return false;
      }
    }
    return true;
  }
  LocalBuffers local;
  std::vector<RemoteRegion> remote;
  std::vector<uint64_t> bases;
};

void ExpectSamePrograms(const CopyProgram& a, const CopyProgram& b) {
  EXPECT_EQ(a.tables, b.tables);
  EXPECT_EQ(a.src_pages, b.src_pages);
  EXPECT_EQ(a.dst_pages, b.dst_pages);
  EXPECT_EQ(a.bytes, b.bytes);
  ASSERT_EQ(a.launches.size(), b.launches.size());
  for (size_t i = 0; i < a.launches.size(); ++i) {
    const CopyLaunch& x = a.launches[i];
    const CopyLaunch& y = b.launches[i];
    EXPECT_EQ(std::tie(x.src_bases, x.dst_bases, x.num_buffers, x.indexed, x.num_pages,
                       x.src_page_stride, x.dst_page_stride, x.src_offset, x.dst_offset, x.bytes),
              std::tie(y.src_bases, y.dst_bases, y.num_buffers, y.indexed, y.num_pages,
                       y.src_page_stride, y.dst_page_stride, y.src_offset, y.dst_offset, y.bytes))
        << "launch " << i;
  }
}

TEST(CudaIpcProgramTest, KeptBatchShapesPlanAndRefuseExactlyAsFreshPlanning) {
  // Random writes, in and out of bounds, against one BatchShapes kept across all of them: each
  // is refused exactly when some buffer of its batch refuses it, with the message fresh planning
  // gives, and otherwise planned to the same program.
  std::mt19937 rng(57);
  constexpr int kShapeLayers = 6;
  const ShapedSides sides(kShapeLayers, rng);
  BatchShapes shapes;
  CopyProgram kept;
  int planned = 0, refused = 0;
  for (int iter = 0; iter < 600; ++iter) {
    SCOPED_TRACE(iter);
    PageWrite w;
    w.num_layers = kShapeLayers;
    w.layer_begin = static_cast<int32_t>(rng() % kShapeLayers);
    w.layer_end = w.layer_begin + 1 + static_cast<int32_t>(rng() % (kShapeLayers - w.layer_begin));
    std::vector<int32_t> src_pages, dst_pages;
    const uint32_t page_limit = rng() % 4 ? 5 : 10;  // pages 0..4 exist in every buffer
    for (size_t n = 1 + rng() % 4; n > 0; --n) {
      src_pages.push_back(static_cast<int32_t>(rng() % page_limit));
      dst_pages.push_back(static_cast<int32_t>(rng() % page_limit));
    }
    w.src_pages = src_pages;
    w.dst_pages = dst_pages;
    std::vector<PageUnit> units;
    if (rng() % 2) {
      for (size_t n = 1 + rng() % 2; n > 0; --n) {
        const uint64_t reach = rng() % 4 ? 64 : 160;  // 64: inside every page
        const uint64_t bytes = 1 + rng() % (reach / 2);
        units.push_back(PageUnit{rng() % (reach - bytes + 1), rng() % (reach - bytes + 1), bytes});
      }
    }
    w.units = units;
    const Status with_shapes =
        PlanPageWriteInto(w, sides.local, sides.remote, sides.bases, kept, &shapes);
    auto fresh = PlanPageWrite(w, sides.local, sides.remote, sides.bases);
    EXPECT_EQ(with_shapes.ok(), sides.Valid(w)) << with_shapes;
    ASSERT_EQ(with_shapes.ok(), fresh.ok()) << with_shapes << " / " << fresh.status();
    if (!with_shapes.ok()) {
      EXPECT_EQ(with_shapes.code(), fresh.status().code());
      EXPECT_EQ(with_shapes.message(), fresh.status().message());
      EXPECT_NE(with_shapes.code(), StatusCode::kInternal) << with_shapes;
      EXPECT_TRUE(kept.launches.empty());
      ++refused;
      continue;
    }
    ExpectSamePrograms(kept, *fresh);
    ++planned;
  }
  EXPECT_GE(planned, 100);
  EXPECT_GE(refused, 100);
  EXPECT_LE(shapes.size(), static_cast<size_t>(kShapeLayers * (kShapeLayers + 1) / 2));
}

TEST(CudaIpcProgramTest, BatchShapesStayBoundedAndClearWithTheBuffers) {
  // More layer batches than are kept: the oldest go, and every write still plans as fresh.
  std::mt19937 rng(58);
  constexpr int kManyLayers = 24;  // 300 layer batches
  ShapedSides sides(kManyLayers, rng);
  BatchShapes shapes;
  CopyProgram kept;
  const std::vector<int32_t> page = {0};
  const std::vector<PageUnit> unit = {{0, 0, 32}};
  for (int round = 0; round < 2; ++round) {
    for (int32_t begin = 0; begin < kManyLayers; ++begin) {
      for (int32_t end = begin + 1; end <= kManyLayers; ++end) {
        PageWrite w;
        w.src_pages = page;
        w.dst_pages = page;
        w.num_layers = kManyLayers;
        w.layer_begin = begin;
        w.layer_end = end;
        w.units = unit;
        KVT_ASSERT_OK(PlanPageWriteInto(w, sides.local, sides.remote, sides.bases, kept, &shapes));
        auto fresh = PlanPageWrite(w, sides.local, sides.remote, sides.bases);
        ASSERT_TRUE(fresh.ok()) << fresh.status();
        ExpectSamePrograms(kept, *fresh);
        ASSERT_LE(shapes.size(), BatchShapes::kMaxShapes);
      }
    }
  }
  EXPECT_GT(shapes.size(), 0u);
  shapes.Clear();
  EXPECT_EQ(shapes.size(), 0u);
}

}  // namespace
}  // namespace kvt::transfer::cuda_ipc

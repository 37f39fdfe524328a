// The nccl backend's pieces that need no GPU: creation without a device, loading NCCL at run
// time, the address and token codecs (including the one-GPU-per-rank placement check), the
// chunk planner over uniform and mixed layouts (draft and latent groups with their own page
// bytes), the chunk header and ack codecs with the receiver's checks, and the staging layout —
// a whole write is packed, sent as headers and payloads and unpacked with the CPU reference of
// the kernels, exactly as the two progress threads launch them on the GPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "backend_test_util.h"
#include "backends/common/layer_table.h"
#include "backends/nccl/nccl_api.h"
#include "backends/nccl/nccl_backend.h"
#include "backends/nccl/nccl_protocol.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/kernels/kernels.h"
#include "kvt/transfer/backend.h"

namespace kvt::transfer::nccl {
namespace {

using ::testing::HasSubstr;

// ---- Creation and loading -------------------------------------------------------------------

TEST(NcclBackendTest, CreateWithoutDeviceIsUnavailableWithTheReason) {
  auto backend = CreateNcclBackend(NcclOptions{});
  if (cuda::HasDevice()) {
    if (!backend.ok()) {
      // A GPU machine without NCCL: the reason must say how to proceed.
      EXPECT_EQ(backend.status().code(), StatusCode::kUnavailable) << backend.status();
      EXPECT_THAT(backend.status().message(), HasSubstr("pick cuda_ipc/ucx"));
      return;
    }
    EXPECT_EQ((*backend)->Name(), "nccl");
    const BackendCapabilities caps = (*backend)->Capabilities();
    EXPECT_TRUE(caps.cuda_memory && caps.inter_process && caps.inter_node && caps.page_writes &&
                caps.two_sided);
    EXPECT_FALSE(caps.host_memory);
    return;
  }
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), StatusCode::kUnavailable) << backend.status();
  EXPECT_THAT(backend.status().message(), HasSubstr("nccl backend needs a CUDA device: "));
  const std::string reason = cuda::DeviceCount().reason;
  ASSERT_FALSE(reason.empty());
  EXPECT_THAT(backend.status().message(), HasSubstr(reason));
}

TEST(NcclBackendTest, SlotSizeOutsideTheLimitsIsRefusedBeforeAnythingElse) {
  NcclTuning tuning;
  tuning.slot_bytes = 1024;
  auto backend = CreateNcclBackendWithTuning(tuning);
  ASSERT_FALSE(backend.ok());
  // Without a device the device is the first complaint; with one, the slot size.
  if (cuda::HasDevice()) {
    EXPECT_EQ(backend.status().code(), StatusCode::kInvalidArgument) << backend.status();
    EXPECT_THAT(backend.status().message(), HasSubstr("1024"));
  } else {
    EXPECT_EQ(backend.status().code(), StatusCode::kUnavailable) << backend.status();
  }
}

TEST(NcclApiTest, MissingLibraryIsUnavailableWithDlerrorAndAdvice) {
  auto api = LoadNcclLibrary("libkvt-no-such-nccl.so.2");
  ASSERT_FALSE(api.ok());
  EXPECT_EQ(api.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(api.status().message(),
              HasSubstr("nccl backend: libkvt-no-such-nccl.so.2 not found: "));
  EXPECT_THAT(api.status().message(), HasSubstr("libkvt-no-such-nccl.so.2"));  // dlerror's text
  EXPECT_THAT(api.status().message(), HasSubstr("; install NCCL or pick cuda_ipc/ucx"));
}

TEST(NcclApiTest, LoadingForcesNvlsOffAndResolvesEveryEntryPoint) {
  setenv("NCCL_NVLS_ENABLE", "1", 1);
  auto api = LoadNccl();
  // Whether or not the library is present, NVLS is off once the backend looked for NCCL.
  const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
  ASSERT_NE(nvls, nullptr);
  EXPECT_STREQ(nvls, "0");
  if (!api.ok()) {
    EXPECT_EQ(api.status().code(), StatusCode::kUnavailable);
    EXPECT_THAT(api.status().message(), HasSubstr("pick cuda_ipc/ucx"));
    GTEST_SKIP() << "no usable libnccl.so.2 here: " << api.status();
  }
  const NcclApi& nccl = **api;
  EXPECT_GE(nccl.version, kMinNcclVersion);
  for (const void* fn :
       {reinterpret_cast<const void*>(nccl.GetUniqueId),
        reinterpret_cast<const void*>(nccl.CommInitRankConfig),
        reinterpret_cast<const void*>(nccl.CommFinalize),
        reinterpret_cast<const void*>(nccl.CommDestroy),
        reinterpret_cast<const void*>(nccl.CommAbort),
        reinterpret_cast<const void*>(nccl.CommGetAsyncError),
        reinterpret_cast<const void*>(nccl.Send), reinterpret_cast<const void*>(nccl.Recv),
        reinterpret_cast<const void*>(nccl.GroupStart),
        reinterpret_cast<const void*>(nccl.GroupEnd),
        reinterpret_cast<const void*>(nccl.GetErrorString),
        reinterpret_cast<const void*>(nccl.GetLastError)}) {
    EXPECT_NE(fn, nullptr);
  }
  // Errors read like every other kvt error, with NCCL's own words.
  Status remote = nccl.ToStatus(ncclRemoteError, nullptr, "sending step 7");
  EXPECT_EQ(remote.code(), StatusCode::kUnavailable);
  EXPECT_THAT(remote.message(), HasSubstr("sending step 7: "));
  EXPECT_THAT(remote.message(), HasSubstr(nccl.GetErrorString(ncclRemoteError)));
  EXPECT_EQ(nccl.ToStatus(ncclInternalError, nullptr, "x").code(), StatusCode::kInternal);
  EXPECT_TRUE(nccl.ToStatus(ncclSuccess, nullptr, "x").ok());
  // The table is loaded once per process.
  auto again = LoadNccl();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *api);
}

// ---- Addresses and placement ----------------------------------------------------------------

ProcessAddress Address(std::string boot, uint64_t pid, int32_t device, std::string pci) {
  ProcessAddress a;
  a.boot_id = std::move(boot);
  a.pid = pid;
  a.device = device;
  a.pci_bus_id = std::move(pci);
  return a;
}

TEST(NcclAddressTest, RoundTripsAndIgnoresUnknownFields) {
  const ProcessAddress a = Address("8d3c0c1e-aaaa-bbbb-cccc-0123456789ab", 4242, 1, "0000:3B:00.0");
  const std::string text = EncodeAddress(a);
  EXPECT_EQ(text.rfind("nccl/1 ", 0), 0u) << text;
  auto decoded = DecodeAddress(text);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, a);
  auto extended = DecodeAddress(text + " future=7");
  ASSERT_TRUE(extended.ok()) << extended.status();
  EXPECT_EQ(*extended, a);
}

TEST(NcclAddressTest, MalformedAddressesAreInvalidArgumentSayingWhat) {
  const struct {
    std::string text;
    std::string says;
  } cases[] = {
      {"", "not an nccl address"},
      {"cuda_ipc/1 boot=x pid=1 dev=0 pci=0000:01:00.0", "the peer must use the nccl backend"},
      {"nccl/2 boot=x pid=1 dev=0 pci=0000:01:00.0", "run the same kvt version on both sides"},
      {"nccl/1 pid=1 dev=0 pci=0000:01:00.0", "lacks the 'boot=' field"},
      {"nccl/1 boot=x dev=0 pci=0000:01:00.0", "lacks the 'pid=' field"},
      {"nccl/1 boot=x pid=1 pci=0000:01:00.0", "lacks the 'dev=' field"},
      {"nccl/1 boot=x pid=1 dev=0", "lacks the 'pci=' field"},
      {"nccl/1 boot=x pid=one dev=0 pci=p", "malformed value"},
      {"nccl/1 boot=x pid=1 dev=-1 pci=p", "malformed value"},
      {"nccl/1 boot=x pid=1 dev=0 pci", "is not name=value"},
  };
  for (const auto& c : cases) {
    auto decoded = DecodeAddress(c.text);
    ASSERT_FALSE(decoded.ok()) << c.text;
    EXPECT_EQ(decoded.status().code(), StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(decoded.status().message(), HasSubstr(c.says)) << c.text;
  }
}

TEST(NcclAddressTest, SameGpuOfOneHostIsRefusedOtherPlacementsPass) {
  const ProcessAddress local = Address("boot-a", 100, 0, "0000:3B:00.0");
  // Same host, same GPU (another process, another ordinal, other letter case): refused.
  Status same = CheckPeerPlacement(local, Address("boot-a", 200, 3, "0000:3b:00.0"));
  EXPECT_EQ(same.code(), StatusCode::kFailedPrecondition) << same;
  EXPECT_THAT(same.message(), HasSubstr("nccl needs one GPU per rank; use cuda_ipc on one GPU"));
  EXPECT_THAT(same.message(), HasSubstr("uses GPU 0000:3b:00.0"));
  EXPECT_THAT(same.message(), HasSubstr("pid 200"));
  // Same host, another GPU: fine.
  EXPECT_TRUE(CheckPeerPlacement(local, Address("boot-a", 200, 1, "0000:5E:00.0")).ok());
  // Another host with a GPU at the same bus id is another GPU: fine.
  EXPECT_TRUE(CheckPeerPlacement(local, Address("boot-b", 100, 0, "0000:3B:00.0")).ok());
  EXPECT_FALSE(ThisBootId().empty());
}

// ---- Tokens ---------------------------------------------------------------------------------

PairToken SampleToken() {
  PairToken token;
  for (size_t i = 0; i < token.unique_id.size(); ++i) {
    token.unique_id[i] = static_cast<char>((i * 37 + 11) & 0xFF);
  }
  token.slot_bytes = uint64_t{8} << 20;
  token.idle_tick_ms = 2;
  token.nonce = 0xfeedface01234567ULL;
  return token;
}

TEST(NcclTokenTest, RoundTripsEveryByteOfTheUniqueId) {
  PairToken token = SampleToken();
  token.unique_id[0] = '\0';
  token.unique_id[127] = static_cast<char>(0xFF);
  const std::string text = EncodeToken(token);
  EXPECT_EQ(text.rfind("nccl-token/1 ", 0), 0u) << text;
  EXPECT_EQ(text.find('\0'), std::string::npos);  // text-safe for any carrier
  auto decoded = DecodeToken(text);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, token);
}

TEST(NcclTokenTest, MalformedTokensAreInvalidArgumentSayingWhat) {
  const std::string good = EncodeToken(SampleToken());
  const std::string id = good.substr(good.find("id=") + 3);
  std::string bad_digit = good;
  bad_digit[bad_digit.size() - 5] = 'g';
  const struct {
    std::string text;
    std::string says;
  } cases[] = {
      {"", "not an nccl pair token"},
      {"hello", "not an nccl pair token"},
      {"nccl-token/9 slot=1 nonce=1 id=00", "run the same kvt version on both sides"},
      {"nccl-token/1 tick=2 nonce=1 id=" + id, "lacks the 'slot=' field"},
      {"nccl-token/1 slot=8388608 nonce=1 id=" + id, "lacks the 'tick=' field"},
      {"nccl-token/1 slot=8388608 tick=2 id=" + id, "lacks the 'nonce=' field"},
      {"nccl-token/1 slot=8388608 tick=2 nonce=1", "lacks the 'id=' field"},
      {"nccl-token/1 slot=8388608 tick=2 nonce=1 id=" + id.substr(2),
       "254 hex digits, expected 256"},
      {bad_digit, "non-hex digit"},
      {"nccl-token/1 slot=big tick=2 nonce=1 id=" + id, "slot 'big' is not a number"},
      {"nccl-token/1 slot=8388608 tick=-1 nonce=1 id=" + id, "tick '-1' is not a number"},
      {"nccl-token/1 slot=8388608 tick=2 nonce=xyz id=" + id, "nonce 'xyz' is not hex"},
      {"nccl-token/1 slot=100 tick=2 nonce=1 id=" + id, "100-byte staging slots"},
      {"nccl-token/1 slot=8388608 tick=2 nonce=1 id", "is not name=value"},
  };
  for (const auto& c : cases) {
    auto decoded = DecodeToken(c.text);
    ASSERT_FALSE(decoded.ok()) << c.text;
    EXPECT_EQ(decoded.status().code(), StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(decoded.status().message(), HasSubstr(c.says)) << c.text;
  }
}

// ---- Chunk planning -------------------------------------------------------------------------

// A pool's buffers as the planner sees them: the layer table and each buffer's page bytes.
struct Pool {
  LayerTable layers;
  std::vector<uint64_t> item_len;
};

Pool MakePool(const std::vector<int32_t>& layers, const std::vector<uint64_t>& items) {
  auto table = LayerTable::FromLayers(layers);
  EXPECT_TRUE(table.ok()) << table.status();
  return Pool{std::move(table).value(), items};
}

// K of layers 0..L-1 then V, every page `item` bytes.
Pool KeyValuePool(int32_t num_layers, uint64_t item) {
  std::vector<int32_t> layers;
  for (int kv = 0; kv < 2; ++kv) {
    for (int32_t l = 0; l < num_layers; ++l) layers.push_back(l);
  }
  return MakePool(layers, std::vector<uint64_t>(layers.size(), item));
}

ChunkPlanInput PlanInput(const Pool& pool, int64_t pages, int32_t begin, int32_t end,
                         std::span<const uint64_t> unit_bytes, uint64_t capacity) {
  ChunkPlanInput in;
  in.num_pages = pages;
  in.layer_begin = begin;
  in.layer_end = end;
  in.layers = &pool.layers;
  in.item_len = pool.item_len;
  in.unit_bytes = unit_bytes;
  in.payload_capacity = capacity;
  return in;
}

// Checks the planner's contract on one input: every (layer, page) exactly once (each chunk
// carries every buffer of its layers and every unit), payload within capacity and as the
// chunk's own buffers' page bytes declare, pages per chunk within the header's limit, chunks in
// layer-major order.
void ExpectCoversExactlyOnce(const ChunkPlanInput& in, const std::vector<ChunkSpec>& chunks) {
  std::map<std::pair<int32_t, int64_t>, int> seen;
  int32_t last_layer = in.layer_begin;
  for (const ChunkSpec& c : chunks) {
    ASSERT_GE(c.layer_begin, in.layer_begin);
    ASSERT_LE(c.layer_end, in.layer_end);
    ASSERT_LT(c.layer_begin, c.layer_end);
    ASSERT_GE(c.page_begin, 0);
    ASSERT_LE(c.page_end, in.num_pages);
    ASSERT_LT(c.page_begin, c.page_end);
    ASSERT_LE(static_cast<uint64_t>(c.page_end - c.page_begin), in.max_pages);
    EXPECT_GE(c.layer_begin, last_layer);  // layers outermost: a layer batch streams in order
    last_layer = c.layer_begin;
    const std::vector<uint64_t> page_bytes =
        ChunkPageBytes(*in.layers, in.item_len, c.layer_begin, c.layer_end);
    EXPECT_EQ(c.payload_bytes, ChunkPayloadBytes(page_bytes, in.unit_bytes,
                                                 static_cast<uint64_t>(c.page_end - c.page_begin)));
    EXPECT_LE(c.payload_bytes, in.payload_capacity);
    for (int32_t l = c.layer_begin; l < c.layer_end; ++l) {
      for (int64_t p = c.page_begin; p < c.page_end; ++p) ++seen[{l, p}];
    }
  }
  const int64_t cells = in.num_pages * (in.layer_end - in.layer_begin);
  EXPECT_EQ(static_cast<int64_t>(seen.size()), cells);
  for (const auto& [cell, count] : seen) {
    ASSERT_EQ(count, 1) << "layer " << cell.first << " page " << cell.second;
  }
}

TEST(NcclChunkPlanTest, WholeLayersShareAChunkWhileTheyFit) {
  const Pool pool = KeyValuePool(8, 4096);  // whole 4 KiB pages
  // One layer: 10 x 2 x 4 KiB = 80 KiB; two layers per chunk.
  const ChunkPlanInput in = PlanInput(pool, 10, 2, 8, {}, 200 << 10);
  auto chunks = PlanChunks(in);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  ASSERT_EQ(chunks->size(), 3u);
  EXPECT_EQ((*chunks)[0], (ChunkSpec{2, 4, 0, 10, 2 * 80 << 10}));
  EXPECT_EQ((*chunks)[2], (ChunkSpec{6, 8, 0, 10, 2 * 80 << 10}));
  ExpectCoversExactlyOnce(in, *chunks);
}

TEST(NcclChunkPlanTest, ALayerLargerThanASlotIsSplitIntoEvenPageRanges) {
  const Pool pool = KeyValuePool(2, 4096);
  const ChunkPlanInput in = PlanInput(pool, 1000, 0, 2, {}, 300 * 8192);  // 300 pages of K and V
  auto chunks = PlanChunks(in);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  ASSERT_EQ(chunks->size(), 8u);  // 4 even ranges of 250 pages per layer
  for (const ChunkSpec& c : *chunks) EXPECT_EQ(c.page_end - c.page_begin, 250);
  ExpectCoversExactlyOnce(in, *chunks);
}

TEST(NcclChunkPlanTest, TinyUnitsAreLimitedByThePagesAHeaderCanName) {
  const Pool pool = KeyValuePool(1, 4096);
  const std::vector<uint64_t> units = {16, 16};
  const ChunkPlanInput in = PlanInput(pool, 20000, 0, 1, units, 64 << 20);
  auto chunks = PlanChunks(in);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  for (const ChunkSpec& c : *chunks) {
    EXPECT_LE(static_cast<uint64_t>(c.page_end - c.page_begin), kMaxChunkPages);
  }
  EXPECT_EQ(chunks->size(), (20000 + kMaxChunkPages - 1) / kMaxChunkPages);
  ExpectCoversExactlyOnce(in, *chunks);
}

// The mixed layout (K/V of 2 layers at 256 bytes, latent layers of 96, a draft layer's K/V at
// 512): one page of each layer weighs 512, 512, 96, 96, 1024 bytes in a whole-page payload.
TEST(NcclChunkPlanTest, MixedLayoutChunksAreSizedByEachLayersOwnBuffers) {
  const testing::MixedLayout mixed;
  const Pool pool = MakePool(mixed.layers, mixed.items);
  // 4 pages: 2048, 2048, 384, 384, 4096 bytes per layer. Every window of two layers fits 4480
  // (the heaviest is layers 3 and 4), no window of three does: two layers per chunk.
  ChunkPlanInput in = PlanInput(pool, 4, 0, 5, {}, 4480);
  auto chunks = PlanChunks(in);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  ASSERT_EQ(chunks->size(), 3u);
  EXPECT_EQ((*chunks)[0], (ChunkSpec{0, 2, 0, 4, 4096}));
  EXPECT_EQ((*chunks)[1], (ChunkSpec{2, 4, 0, 4, 768}));
  EXPECT_EQ((*chunks)[2], (ChunkSpec{4, 5, 0, 4, 4096}));
  ExpectCoversExactlyOnce(in, *chunks);

  // The draft layer's 4 pages do not fit 3000 bytes: every layer gets its own page ranges,
  // sized by its own buffers (layer 4: two ranges of 2 pages; the others: all 4 pages).
  in.payload_capacity = 3000;
  chunks = PlanChunks(in);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  ASSERT_EQ(chunks->size(), 6u);
  EXPECT_EQ((*chunks)[0], (ChunkSpec{0, 1, 0, 4, 2048}));
  EXPECT_EQ((*chunks)[4], (ChunkSpec{4, 5, 0, 2, 2048}));
  EXPECT_EQ((*chunks)[5], (ChunkSpec{4, 5, 2, 4, 2048}));
  ExpectCoversExactlyOnce(in, *chunks);

  // Units weigh the same in every buffer: 5 buffers' worth of 40 bytes per page of layers 2..4.
  const std::vector<uint64_t> units = {32, 8};
  in = PlanInput(pool, 4, 2, 5, units, 1 << 20);
  chunks = PlanChunks(in);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  ASSERT_EQ(chunks->size(), 1u);
  EXPECT_EQ((*chunks)[0].payload_bytes, 40u * 4 * 4);
  ExpectCoversExactlyOnce(in, *chunks);

  // One page of the draft layer is 1024 bytes: a smaller slot is refused naming the layer.
  in = PlanInput(pool, 4, 0, 5, {}, 1000);
  auto refused = PlanChunks(in);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("one page of transfer layer 4"));
  EXPECT_THAT(refused.status().message(), HasSubstr("2 buffers, 1024 bytes"));
  EXPECT_THAT(refused.status().message(), HasSubstr("raise the nccl slot size"));
}

// A random layout: a K/V group, optionally latent and draft groups, random page bytes.
Pool RandomPool(std::mt19937_64& rng) {
  std::vector<int32_t> layers;
  std::vector<uint64_t> items;
  int32_t next = 0;
  const int groups = 1 + static_cast<int>(rng() % 3);
  for (int g = 0; g < groups; ++g) {
    const int32_t n = 1 + static_cast<int32_t>(rng() % 4);
    const uint64_t item = 64 + rng() % 3000;
    const int per_layer = rng() % 2 == 0 ? 2 : 1;  // K/V or latent
    for (int kv = 0; kv < per_layer; ++kv) {
      for (int32_t l = 0; l < n; ++l) {
        layers.push_back(next + l);
        items.push_back(item);
      }
    }
    next += n;
  }
  return MakePool(layers, items);
}

TEST(NcclChunkPlanTest, RandomWritesOfRandomLayoutsAreCoveredExactlyOnce) {
  std::mt19937_64 rng(20240611);
  for (int trial = 0; trial < 400; ++trial) {
    const Pool pool = RandomPool(rng);
    const int32_t num_layers = pool.layers.num_layers();
    std::vector<uint64_t> units(rng() % 3 == 0 ? 0 : 1 + rng() % 4);
    for (uint64_t& u : units) u = 1 + rng() % 64;
    const int32_t begin = static_cast<int32_t>(rng() % (num_layers + 1));
    const int32_t end = begin + static_cast<int32_t>(rng() % (num_layers - begin + 1));
    uint64_t heaviest = 1;
    for (int32_t l = 0; l < num_layers; ++l) {
      heaviest = std::max(
          heaviest,
          ChunkPayloadBytes(ChunkPageBytes(pool.layers, pool.item_len, l, l + 1), units, 1));
    }
    ChunkPlanInput in = PlanInput(pool, static_cast<int64_t>(rng() % 700), begin, end, units,
                                  heaviest + rng() % (heaviest * 300));
    in.max_pages = 1 + static_cast<uint32_t>(rng() % 400);
    auto chunks = PlanChunks(in);
    ASSERT_TRUE(chunks.ok()) << chunks.status();
    if (in.num_pages == 0 || in.layer_begin == in.layer_end) {
      EXPECT_TRUE(chunks->empty());
      continue;
    }
    ExpectCoversExactlyOnce(in, *chunks);
  }
}

TEST(NcclChunkPlanTest, ImpossibleWritesAreRefusedNamingTheValues) {
  const Pool pool = KeyValuePool(1, 4096);
  ChunkPlanInput in = PlanInput(pool, 4, 0, 1, {}, 8191);  // K and V of one page need 8192
  auto too_big = PlanChunks(in);
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(too_big.status().message(), HasSubstr("2 buffers, 8192 bytes"));
  EXPECT_THAT(too_big.status().message(),
              HasSubstr("at least " + std::to_string(8192 + kHeaderBytes)));

  in.payload_capacity = 1 << 20;
  const std::vector<uint64_t> zero = {64, 0};
  in.unit_bytes = zero;
  auto zero_unit = PlanChunks(in);
  EXPECT_THAT(zero_unit.status().message(), HasSubstr("unit 1 of the page write has 0 bytes"));
  const std::vector<uint64_t> many(kMaxUnits + 1, 8);
  in.unit_bytes = many;
  EXPECT_THAT(PlanChunks(in).status().message(), HasSubstr("65 units"));
  in.unit_bytes = {};
  in.num_pages = -1;
  EXPECT_EQ(PlanChunks(in).status().code(), StatusCode::kInvalidArgument);
  in.num_pages = 4;
  in.layer_end = 2;  // the pool has one layer
  EXPECT_THAT(PlanChunks(in).status().message(), HasSubstr("layers [0, 2) of a pool of 1"));
  in.layer_end = 1;
  const std::vector<uint64_t> short_items = {4096};
  in.item_len = short_items;
  EXPECT_THAT(PlanChunks(in).status().message(), HasSubstr("1 page sizes for a pool of 2"));
  in.layers = nullptr;
  EXPECT_EQ(PlanChunks(in).status().code(), StatusCode::kInvalidArgument);
}

// ---- Staging launches -----------------------------------------------------------------------

TEST(NcclStagingTest, OneLaunchPerUnitAndRunOfEqualPageBytes) {
  // Layers 0..4 of the mixed layout in layer order: 256 256 256 256 96 96 512 512.
  const std::vector<uint64_t> page_bytes = {256, 256, 256, 256, 96, 96, 512, 512};
  const std::vector<uint64_t> bases = {1, 2, 3, 4, 5, 6, 7, 8};
  const int32_t pages[3] = {4, 5, 6};
  std::vector<uint8_t> staging(8192);
  uint8_t* payload = staging.data();
  auto whole = ChunkStagingArgs(bases.data(), page_bytes, pages, 3, {}, payload);
  ASSERT_EQ(whole.size(), 3u);
  EXPECT_EQ(whole[0].num_buffers, 4);
  EXPECT_EQ(whole[0].bytes, 256);
  EXPECT_EQ(whole[1].bases, bases.data() + 4);
  EXPECT_EQ(whole[1].page_stride, 96);
  EXPECT_EQ(whole[1].staging, payload + 4 * 3 * 256);
  EXPECT_EQ(whole[2].staging, payload + 4 * 3 * 256 + 2 * 3 * 96);
  EXPECT_EQ(whole[2].bytes, 512);

  const std::vector<UnitSpan> units = {{8, 16}, {40, 8}};
  auto parts = ChunkStagingArgs(bases.data(), page_bytes, pages, 3, units, payload);
  ASSERT_EQ(parts.size(), 6u);
  const std::vector<uint64_t> unit_bytes = {16, 8};
  EXPECT_EQ(parts[3].staging, payload + UnitPayloadOffset(unit_bytes, 1, 8, 3));
  EXPECT_EQ(parts[3].offset, 40);
  EXPECT_EQ(parts[3].bytes, 8);
  EXPECT_EQ(parts[4].page_stride, 96);
  EXPECT_EQ(parts[4].staging, payload + UnitPayloadOffset(unit_bytes, 1, 8, 3) + 4 * 3 * 8);
}

// ---- Chunk headers --------------------------------------------------------------------------

ChunkHeader SampleHeader() {
  ChunkHeader h;
  h.kind = HeaderKind::kChunk;
  h.step = 41;
  h.write_id = 9000000001ULL;
  h.chunk_index = 3;
  h.chunk_count = 7;
  h.num_layers = 32;
  h.layer_begin = 4;
  h.layer_end = 6;
  h.num_buffers = 4;  // K and V of two layers
  h.units = {{0, 256}, {512, 256}};
  h.dst_pages = {17, 3, 99, 1, 42};
  h.payload_bytes = 512 * 4 * 5;
  return h;
}

// Layers 2..4 of the mixed layout as whole pages: 96 + 96 + 512 + 512 bytes per page.
ChunkHeader WholePageHeader() {
  ChunkHeader h;
  h.kind = HeaderKind::kChunk;
  h.step = 41;
  h.write_id = 12;
  h.chunk_index = 0;
  h.chunk_count = 1;
  h.num_layers = 5;
  h.layer_begin = 2;
  h.layer_end = 5;
  h.num_buffers = 4;
  h.whole_pages = true;
  h.dst_pages = {1, 7, 23};
  h.payload_bytes = (96 + 96 + 512 + 512) * 3;
  return h;
}

TEST(NcclHeaderTest, RoundTripsEveryKind) {
  std::vector<uint8_t> buffer(kHeaderBytes, 0xAB);
  const ChunkHeader chunk = SampleHeader();
  EncodeChunkHeader(chunk, buffer);
  auto decoded = DecodeChunkHeader(buffer, 41, 1 << 20);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, chunk);

  // The page table sits at kPagesOffset as little-endian int32: the unpack kernel reads it there.
  int32_t third = 0;
  std::memcpy(&third, buffer.data() + kPagesOffset + 8, sizeof(third));
  EXPECT_EQ(third, 99);

  const ChunkHeader whole = WholePageHeader();
  EncodeChunkHeader(whole, buffer);
  auto whole_back = DecodeChunkHeader(buffer, 41, 1 << 20);
  ASSERT_TRUE(whole_back.ok()) << whole_back.status();
  EXPECT_EQ(*whole_back, whole);
  EXPECT_TRUE(whole_back->units.empty());

  for (HeaderKind kind : {HeaderKind::kIdle, HeaderKind::kClose}) {
    ChunkHeader h;
    h.kind = kind;
    h.step = 5;
    EncodeChunkHeader(h, buffer);
    auto back = DecodeChunkHeader(buffer, 5, 1 << 20);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, h);
  }

  // The largest chunk a header can describe.
  ChunkHeader full = SampleHeader();
  full.units.assign(kMaxUnits, UnitSpan{8, 8});
  full.dst_pages.assign(kMaxChunkPages, 7);
  full.dst_pages.back() = 12345;
  full.payload_bytes = uint64_t{8} * kMaxUnits * full.num_buffers * kMaxChunkPages;
  EncodeChunkHeader(full, buffer);
  auto big = DecodeChunkHeader(buffer, 41, full.payload_bytes);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(*big, full);
}

// Encodes `header`, lets `mutate` change its bytes, decodes it as step 41 with 1 MiB slots.
Status DecodeMutated(const ChunkHeader& header,
                     const std::function<void(std::vector<uint8_t>&)>& mutate) {
  std::vector<uint8_t> buffer(kHeaderBytes);
  EncodeChunkHeader(header, buffer);
  mutate(buffer);
  return DecodeChunkHeader(buffer, 41, 1 << 20).status();
}

void PutU32(std::vector<uint8_t>& b, size_t at, uint32_t v) { std::memcpy(&b[at], &v, 4); }
void PutU64(std::vector<uint8_t>& b, size_t at, uint64_t v) { std::memcpy(&b[at], &v, 8); }

TEST(NcclHeaderTest, MalformedHeadersAreDataLossNamingFieldAndValue) {
  const struct {
    ChunkHeader header;
    std::function<void(std::vector<uint8_t>&)> mutate;
    std::string says;
  } cases[] = {
      {SampleHeader(), [](auto& b) { b[0] = 'X'; }, "lacks the 'KVNH' magic"},
      {SampleHeader(), [](auto& b) { b[4] = 1; }, "is version 1, this build speaks 2"},
      {SampleHeader(), [](auto& b) { b[6] = 9; }, "unknown kind 9"},
      {SampleHeader(), [](auto& b) { PutU64(b, 8, 40); }, "says it is step 40"},
      {SampleHeader(), [](auto& b) { PutU32(b, 24, 7); }, "chunk index out of range"},
      {SampleHeader(), [](auto& b) { PutU32(b, 44, 0); }, "num_units = 0 with whole_pages = 0"},
      {SampleHeader(), [](auto& b) { PutU32(b, 44, kMaxUnits + 1); }, "num_units = 65"},
      {SampleHeader(), [](auto& b) { PutU32(b, 48, 0); }, "num_pages = 0"},
      {SampleHeader(), [](auto& b) { PutU32(b, 48, kMaxChunkPages + 1); },
       "num_pages = " + std::to_string(kMaxChunkPages + 1) + "; 1 to"},
      {SampleHeader(), [](auto& b) { PutU32(b, 40, 33); }, "has layers [4, 33) of 32"},
      {SampleHeader(), [](auto& b) { PutU32(b, 40, 4); }, "has layers [4, 4)"},
      {SampleHeader(), [](auto& b) { PutU32(b, 52, 1); }, "num_buffers = 1 for layers [4, 6)"},
      {SampleHeader(), [](auto& b) { PutU32(b, 52, 3); }, "declares payload_bytes = 10240"},
      {SampleHeader(), [](auto& b) { PutU64(b, kUnitsOffset + 8, 0); }, "unit 0 has 0 bytes"},
      {SampleHeader(), [](auto& b) { PutU64(b, 56, 4096); }, "declares payload_bytes = 4096"},
      {SampleHeader(), [](auto& b) { PutU32(b, 64, 2); }, "whole_pages = 2; expected 0 or 1"},
      {SampleHeader(), [](auto& b) { PutU32(b, 64, 1); }, "num_units = 2 with whole_pages = 1"},
      {SampleHeader(), [](auto& b) { PutU32(b, 68, 5); }, "reserved bytes at 68 hold 5"},
      {SampleHeader(), [](auto& b) { b[kUnitsOffset - 1] = 1; }, "reserved bytes at 124"},
      {WholePageHeader(), [](auto& b) { PutU64(b, 56, 3650); },
       "payload_bytes = 3650, not a positive multiple of its 3 whole pages"},
      {WholePageHeader(), [](auto& b) { PutU64(b, 56, 0); }, "payload_bytes = 0"},
  };
  for (const auto& c : cases) {
    Status status = DecodeMutated(c.header, c.mutate);
    EXPECT_EQ(status.code(), StatusCode::kDataLoss) << status;
    EXPECT_THAT(status.message(), HasSubstr(c.says)) << status;
  }
  std::vector<uint8_t> buffer(kHeaderBytes);
  EncodeChunkHeader(SampleHeader(), buffer);
  auto small_slots = DecodeChunkHeader(buffer, 41, 1000);
  EXPECT_THAT(small_slots.status().message(), HasSubstr("this side's slots hold 1000"));
  auto truncated = DecodeChunkHeader(std::span<const uint8_t>(buffer.data(), 100), 41, 1 << 20);
  EXPECT_EQ(truncated.status().code(), StatusCode::kDataLoss);
}

ReceiverLayout LayoutOf(const Pool& pool, int64_t pages) {
  ReceiverLayout layout;
  layout.layers = pool.layers;
  layout.item_len = pool.item_len;
  for (uint64_t item : pool.item_len) layout.buffer_len.push_back(item * pages);
  return layout;
}

TEST(NcclHeaderTest, ChunksThatDoNotFitThePoolAreRefusedNamingTheValue) {
  const ReceiverLayout layout = LayoutOf(KeyValuePool(32, 1024), 100);  // pages 0..99
  const ChunkHeader good = SampleHeader();
  EXPECT_TRUE(CheckChunkFits(good, layout).ok());

  ChunkHeader other_model = good;
  other_model.num_layers = 40;
  EXPECT_EQ(CheckChunkFits(other_model, layout).code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(CheckChunkFits(other_model, layout).message(), HasSubstr("40 transfer layers"));

  ChunkHeader other_buffers = good;
  other_buffers.num_buffers = 3;
  EXPECT_EQ(CheckChunkFits(other_buffers, layout).code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(CheckChunkFits(other_buffers, layout).message(),
              HasSubstr("num_buffers = 3 for layers [4, 6), which hold 4 buffers here"));

  ChunkHeader wide_unit = good;
  wide_unit.units[1] = {900, 256};
  EXPECT_EQ(CheckChunkFits(wide_unit, layout).code(), StatusCode::kOutOfRange);
  EXPECT_THAT(CheckChunkFits(wide_unit, layout).message(), HasSubstr("unit 1 writes [900, +256)"));

  ChunkHeader far_page = good;
  far_page.dst_pages[2] = 100;
  EXPECT_EQ(CheckChunkFits(far_page, layout).code(), StatusCode::kOutOfRange);
  EXPECT_THAT(CheckChunkFits(far_page, layout).message(), HasSubstr("destination page 100"));
  far_page.dst_pages[2] = -1;
  EXPECT_EQ(CheckChunkFits(far_page, layout).code(), StatusCode::kOutOfRange);

  // One short buffer among the chunk's (V of layer 5) limits every page of the chunk.
  ReceiverLayout short_v = layout;
  short_v.buffer_len[32 + 5] = 50 * 1024;
  Status status = CheckChunkFits(good, short_v);
  EXPECT_EQ(status.code(), StatusCode::kOutOfRange);
  EXPECT_THAT(status.message(), HasSubstr("destination page 99"));
  EXPECT_THAT(status.message(), HasSubstr("buffer 37 (51200 bytes"));
  // ... but not chunks of other layers.
  ChunkHeader layer_zero = good;
  layer_zero.layer_begin = 0;
  layer_zero.layer_end = 1;
  layer_zero.num_buffers = 2;
  EXPECT_TRUE(CheckChunkFits(layer_zero, short_v).ok());
}

TEST(NcclHeaderTest, MixedLayoutChunksAreCheckedAgainstEveryBuffersOwnPages) {
  const testing::MixedLayout mixed;
  const ReceiverLayout layout = LayoutOf(MakePool(mixed.layers, mixed.items), mixed.pages);
  const ChunkHeader whole = WholePageHeader();
  EXPECT_TRUE(CheckChunkFits(whole, layout).ok());

  // The sender's pages of these layers are other sizes: dropped, saying what to do.
  ChunkHeader other_pages = whole;
  other_pages.payload_bytes = (96 + 96 + 256 + 256) * 3;
  Status status = CheckChunkFits(other_pages, layout);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("carries 2112 bytes of 3 whole pages"));
  EXPECT_THAT(status.message(), HasSubstr("take 3648"));
  EXPECT_THAT(status.message(), HasSubstr("pass units"));

  // A unit fits the 512-byte draft pages but not the 96-byte latent ones (buffer 4).
  ChunkHeader units = whole;
  units.whole_pages = false;
  units.units = {{64, 64}};
  units.payload_bytes = 64 * 4 * 3;
  status = CheckChunkFits(units, layout);
  EXPECT_EQ(status.code(), StatusCode::kOutOfRange);
  EXPECT_THAT(status.message(), HasSubstr("buffer 4 has 96-byte pages"));
  units.units = {{0, 96}};
  EXPECT_TRUE(CheckChunkFits(units, layout).ok());

  ChunkHeader far_page = whole;
  far_page.dst_pages[1] = static_cast<int32_t>(mixed.pages);
  status = CheckChunkFits(far_page, layout);
  EXPECT_EQ(status.code(), StatusCode::kOutOfRange);
  EXPECT_THAT(status.message(), HasSubstr("destination page 24 (entry 1)"));
}

// ---- Acks -----------------------------------------------------------------------------------

TEST(NcclAckTest, RoundTripsAndTruncatesLongMessages) {
  std::vector<uint8_t> buffer(kAckBytes);
  Ack ok;
  ok.step = 77;
  EncodeAck(ok, buffer);
  auto back = DecodeAck(buffer, 77);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, ok);

  Ack refused;
  refused.step = 78;
  refused.code = StatusCode::kOutOfRange;
  refused.write_id = 12;
  refused.chunk_index = 4;
  refused.message = std::string(1000, 'm');
  EncodeAck(refused, buffer);
  auto refused_back = DecodeAck(buffer, 78);
  ASSERT_TRUE(refused_back.ok()) << refused_back.status();
  EXPECT_EQ(refused_back->code, StatusCode::kOutOfRange);
  EXPECT_EQ(refused_back->write_id, 12u);
  EXPECT_EQ(refused_back->chunk_index, 4u);
  EXPECT_FALSE(refused_back->message.empty());
  EXPECT_LT(refused_back->message.size(), kAckBytes);
  EXPECT_EQ(refused_back->message, refused.message.substr(0, refused_back->message.size()));

  auto wrong_step = DecodeAck(buffer, 79);
  EXPECT_EQ(wrong_step.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(wrong_step.status().message(), HasSubstr("says it is step 78"));
  buffer[1] = 'x';
  EXPECT_THAT(DecodeAck(buffer, 78).status().message(), HasSubstr("'KVNA' magic"));
  EncodeAck(refused, buffer);
  uint32_t bogus_code = 99;
  std::memcpy(&buffer[16], &bogus_code, 4);
  EXPECT_THAT(DecodeAck(buffer, 78).status().message(), HasSubstr("unknown status code 99"));
}

// ---- The staging layout, end to end on the CPU ----------------------------------------------

// A pool in host memory: one buffer per entry of `layers`, `pages` pages of items[b] bytes each.
struct HostPool {
  HostPool(const std::vector<int32_t>& layers, const std::vector<uint64_t>& items, int64_t pages,
           uint8_t seed)
      : pool(MakePool(layers, items)) {
    for (size_t b = 0; b < layers.size(); ++b) {
      buffers.emplace_back(static_cast<size_t>(pages) * items[b]);
      for (size_t i = 0; i < buffers.back().size(); ++i) {
        buffers.back()[i] = seed == 0 ? 0 : static_cast<uint8_t>((i * 131 + b * 31 + seed) % 251);
      }
    }
    for (uint32_t b : pool.layers.Buffers(0, pool.layers.num_layers())) {
      ordered_bases.push_back(reinterpret_cast<uint64_t>(buffers[b].data()));
      ordered_items.push_back(items[b]);
    }
    layout = LayoutOf(pool, pages);
  }
  size_t First(int32_t layer) const { return pool.layers.Buffers(0, layer).size(); }
  std::span<const uint64_t> PageBytes(int32_t begin, int32_t end) const {
    return std::span<const uint64_t>(ordered_items)
        .subspan(First(begin), First(end) - First(begin));
  }

  Pool pool;
  ReceiverLayout layout;
  std::vector<std::vector<uint8_t>> buffers;
  std::vector<uint64_t> ordered_bases;  // LayerTable order
  std::vector<uint64_t> ordered_items;
};

// Runs one write through the sender's planner, header and pack launches and the receiver's
// header decode, fit check and unpack launches (CPU kernels), as the two progress threads do.
void SendOnCpu(const HostPool& src, HostPool& dst, std::span<const int32_t> src_pages,
               std::span<const int32_t> dst_pages, int32_t layer_begin, int32_t layer_end,
               std::span<const PageUnit> units, uint64_t slot_bytes) {
  std::vector<uint64_t> unit_bytes;
  std::vector<UnitSpan> src_units, dst_units;
  for (const PageUnit& u : units) {
    unit_bytes.push_back(u.bytes);
    src_units.push_back({u.src_offset, u.bytes});
    dst_units.push_back({u.dst_offset, u.bytes});
  }
  const ChunkPlanInput in = PlanInput(src.pool, static_cast<int64_t>(src_pages.size()), layer_begin,
                                      layer_end, unit_bytes, slot_bytes - kHeaderBytes);
  auto chunks = PlanChunks(in);
  ASSERT_TRUE(chunks.ok()) << chunks.status();

  std::vector<uint8_t> slot(slot_bytes);
  for (size_t c = 0; c < chunks->size(); ++c) {
    const ChunkSpec& spec = (*chunks)[c];
    const int64_t pages = spec.page_end - spec.page_begin;
    const std::span<const uint64_t> src_bytes = src.PageBytes(spec.layer_begin, spec.layer_end);
    // Sender: header, then pack into the payload.
    ChunkHeader header;
    header.kind = HeaderKind::kChunk;
    header.step = 100 + c;
    header.write_id = 5;
    header.chunk_index = static_cast<uint32_t>(c);
    header.chunk_count = static_cast<uint32_t>(chunks->size());
    header.num_layers = src.pool.layers.num_layers();
    header.layer_begin = spec.layer_begin;
    header.layer_end = spec.layer_end;
    header.num_buffers = static_cast<uint32_t>(src_bytes.size());
    header.whole_pages = units.empty();
    header.units = dst_units;
    header.dst_pages.assign(dst_pages.begin() + spec.page_begin, dst_pages.begin() + spec.page_end);
    header.payload_bytes = spec.payload_bytes;
    EncodeChunkHeader(header, std::span<uint8_t>(slot.data(), kHeaderBytes));
    std::fill(slot.begin() + kHeaderBytes, slot.end(), uint8_t{0xEE});
    uint64_t packed = 0;
    for (const kernels::PackArgs& args : ChunkStagingArgs(
             src.ordered_bases.data() + src.First(spec.layer_begin), src_bytes,
             src_pages.data() + spec.page_begin, pages, src_units, slot.data() + kHeaderBytes)) {
      ASSERT_TRUE(kernels::PackCpu(args).ok());
      packed = static_cast<uint64_t>(static_cast<uint8_t*>(args.staging) -
                                     (slot.data() + kHeaderBytes)) +
               static_cast<uint64_t>(args.num_buffers * args.num_pages * args.bytes);
    }
    // The payload fills exactly what the header declares.
    EXPECT_EQ(packed, spec.payload_bytes);
    // Receiver: decode and check the header, then unpack with the page table inside the header.
    auto decoded = DecodeChunkHeader(std::span<const uint8_t>(slot.data(), kHeaderBytes), 100 + c,
                                     slot_bytes - kHeaderBytes);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    ASSERT_TRUE(CheckChunkFits(*decoded, dst.layout).ok()) << CheckChunkFits(*decoded, dst.layout);
    const auto* table = reinterpret_cast<const int32_t*>(slot.data() + kPagesOffset);
    for (const kernels::PackArgs& args :
         ChunkStagingArgs(dst.ordered_bases.data() + dst.First(decoded->layer_begin),
                          dst.PageBytes(decoded->layer_begin, decoded->layer_end), table,
                          static_cast<int64_t>(decoded->dst_pages.size()), decoded->units,
                          slot.data() + kHeaderBytes)) {
      ASSERT_TRUE(kernels::UnpackCpu(args).ok());
    }
  }
}

// The reference: what the write must leave in the receiver's pool (PageCopyCpu per buffer of
// the range and unit; whole pages are each buffer's own page bytes), from the definition.
void ExpectedOnCpu(const HostPool& src, HostPool& dst, std::span<const int32_t> src_pages,
                   std::span<const int32_t> dst_pages, int32_t layer_begin, int32_t layer_end,
                   std::span<const PageUnit> units, const std::vector<int32_t>& layers) {
  for (size_t b = 0; b < layers.size(); ++b) {
    if (layers[b] < layer_begin || layers[b] >= layer_end) continue;
    const uint64_t s = reinterpret_cast<uint64_t>(src.buffers[b].data());
    const uint64_t d = reinterpret_cast<uint64_t>(dst.buffers[b].data());
    const PageUnit whole{0, 0, src.pool.item_len[b]};
    for (const PageUnit& u : units.empty() ? std::span<const PageUnit>(&whole, 1) : units) {
      kernels::PageCopyArgs args;
      args.src_bases = &s;
      args.dst_bases = &d;
      args.num_buffers = 1;
      args.src_pages = src_pages.data();
      args.dst_pages = dst_pages.data();
      args.num_pages = static_cast<int64_t>(src_pages.size());
      args.src_page_stride = static_cast<int64_t>(src.pool.item_len[b]);
      args.dst_page_stride = static_cast<int64_t>(dst.pool.item_len[b]);
      args.src_offset = static_cast<int64_t>(u.src_offset);
      args.dst_offset = static_cast<int64_t>(u.dst_offset);
      args.bytes = static_cast<int64_t>(u.bytes);
      ASSERT_TRUE(kernels::PageCopyCpu(args).ok());
    }
  }
}

std::vector<int32_t> KeyValueLayers(int32_t num_layers) {
  std::vector<int32_t> layers;
  for (int kv = 0; kv < 2; ++kv) {
    for (int32_t l = 0; l < num_layers; ++l) layers.push_back(l);
  }
  return layers;
}

TEST(NcclStagingTest, PackHeaderUnpackMovesExactlyTheWritesBytes) {
  std::mt19937_64 rng(7);
  const int32_t layers = 6;
  const int64_t pool_pages = 300;
  const std::vector<int32_t> table = KeyValueLayers(layers);
  for (int trial = 0; trial < 12; ++trial) {
    // Whole pages on even trials; head ranges (TP mismatch: other page sizes) on odd ones.
    const bool partial = trial % 2 == 1;
    const uint64_t src_item = 2048;
    const uint64_t dst_item = partial ? 1024 : 2048;
    std::vector<PageUnit> units;
    if (partial) units = {{256, 0, 512}, {1536, 512, 256}, {1800, 768, 200}};
    const std::vector<uint64_t> src_items(table.size(), src_item);
    const std::vector<uint64_t> dst_items(table.size(), dst_item);
    HostPool src(table, src_items, pool_pages, 1 + trial);
    HostPool dst(table, dst_items, pool_pages, 0);
    HostPool expected(table, dst_items, pool_pages, 0);
    std::vector<int32_t> all(pool_pages - 1);
    std::iota(all.begin(), all.end(), 1);
    std::shuffle(all.begin(), all.end(), rng);
    const size_t n = 1 + rng() % 250;
    std::vector<int32_t> src_pages(all.begin(), all.begin() + n);
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int32_t> dst_pages(all.begin(), all.begin() + n);
    const int32_t begin = static_cast<int32_t>(rng() % layers);
    const int32_t end = begin + 1 + static_cast<int32_t>(rng() % (layers - begin));
    // Small slots so that most writes span many chunks (a write larger than all slots).
    const uint64_t slot_bytes = kHeaderBytes + 8192 * (1 + rng() % 40);
    SendOnCpu(src, dst, src_pages, dst_pages, begin, end, units, slot_bytes);
    ExpectedOnCpu(src, expected, src_pages, dst_pages, begin, end, units, table);
    for (size_t b = 0; b < dst.buffers.size(); ++b) {
      ASSERT_EQ(dst.buffers[b], expected.buffers[b]) << "trial " << trial << " buffer " << b;
    }
  }
}

// The mixed layout (K/V, latent and draft groups of different page bytes), whole pages and
// units, over every layer range and slots from one page of the heaviest layer up: byte-exact
// against MixedLayout::Apply (whole pages) and the per-buffer reference (units).
TEST(NcclStagingTest, MixedLayoutMovesEveryBufferOfTheRangeByteExact) {
  const testing::MixedLayout mixed;
  std::mt19937 rng(11);
  for (int trial = 0; trial < 40; ++trial) {
    const bool partial = trial % 3 == 2;
    std::vector<PageUnit> units;
    if (partial) units = {{8, 40, 24}, {64, 0, 32}};  // inside every 96-byte page
    const int32_t begin = static_cast<int32_t>(rng() % mixed.num_layers);
    const int32_t end = begin + 1 + static_cast<int32_t>(rng() % (mixed.num_layers - begin));
    const int64_t n = 1 + static_cast<int64_t>(rng() % (mixed.pages - 1));
    const std::vector<int32_t> src_pages = testing::DistinctPages(n, mixed.pages, rng);
    const std::vector<int32_t> dst_pages = testing::DistinctPages(n, mixed.pages, rng);
    // From one page of the draft layer (1024 bytes) to the whole write in one chunk.
    const uint64_t slot_bytes = kHeaderBytes + 1024 + rng() % 40000;
    HostPool src(mixed.layers, mixed.items, mixed.pages, static_cast<uint8_t>(1 + trial));
    HostPool dst(mixed.layers, mixed.items, mixed.pages, 0);
    SendOnCpu(src, dst, src_pages, dst_pages, begin, end, units, slot_bytes);

    HostPool expected(mixed.layers, mixed.items, mixed.pages, 0);
    ExpectedOnCpu(src, expected, src_pages, dst_pages, begin, end, units, mixed.layers);
    if (!partial) {
      // Whole pages: also the layout's own definition, on images of the pools.
      auto image = [&](const HostPool& pool) {
        std::vector<uint8_t> bytes;
        for (const auto& b : pool.buffers) bytes.insert(bytes.end(), b.begin(), b.end());
        return bytes;
      };
      std::vector<uint8_t> want(mixed.ImageBytes(), 0);
      PageWrite w;
      w.src_pages = src_pages;
      w.dst_pages = dst_pages;
      w.num_layers = mixed.num_layers;
      w.layer_begin = begin;
      w.layer_end = end;
      mixed.Apply(w, image(src), want);
      ASSERT_EQ(mixed.Mismatch(want, image(dst)), "")
          << "trial " << trial << " layers [" << begin << ", " << end << ")";
    }
    for (size_t b = 0; b < dst.buffers.size(); ++b) {
      ASSERT_EQ(dst.buffers[b], expected.buffers[b]) << "trial " << trial << " buffer " << b;
    }
  }
}

}  // namespace
}  // namespace kvt::transfer::nccl

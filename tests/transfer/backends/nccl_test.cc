// The nccl backend's pieces that need no GPU: creation without a device, loading NCCL at run
// time, the address and token codecs (including the one-GPU-per-rank placement check), the
// chunk planner, the chunk header and ack codecs with the receiver's checks, and the staging
// layout — a whole write is packed, sent as headers and payloads and unpacked with the CPU
// reference of the kernels, exactly as the two progress threads launch them on the GPU.
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

// Checks the planner's contract on one input: every (layer, page) exactly once (each chunk
// carries K and V of its layers and every unit), payload within capacity and as declared,
// pages per chunk within the header's limit, chunks in layer-major order.
void ExpectCoversExactlyOnce(const ChunkPlanInput& in, const std::vector<ChunkSpec>& chunks) {
  const uint64_t unit_sum =
      std::accumulate(in.unit_bytes.begin(), in.unit_bytes.end(), uint64_t{0});
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
    const uint64_t expected = unit_sum * 2 * static_cast<uint64_t>(c.layer_end - c.layer_begin) *
                              static_cast<uint64_t>(c.page_end - c.page_begin);
    EXPECT_EQ(c.payload_bytes, expected);
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
  const std::vector<uint64_t> units = {4096};  // whole 4 KiB pages
  ChunkPlanInput in;
  in.num_pages = 10;  // one layer: 10 x 2 x 4 KiB = 80 KiB
  in.layer_begin = 2;
  in.layer_end = 8;
  in.unit_bytes = units;
  in.payload_capacity = 200 << 10;  // two layers per chunk
  auto chunks = PlanChunks(in);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  ASSERT_EQ(chunks->size(), 3u);
  EXPECT_EQ((*chunks)[0], (ChunkSpec{2, 4, 0, 10, 2 * 80 << 10}));
  EXPECT_EQ((*chunks)[2], (ChunkSpec{6, 8, 0, 10, 2 * 80 << 10}));
  ExpectCoversExactlyOnce(in, *chunks);
}

TEST(NcclChunkPlanTest, ALayerLargerThanASlotIsSplitIntoEvenPageRanges) {
  const std::vector<uint64_t> units = {4096};
  ChunkPlanInput in;
  in.num_pages = 1000;  // 8000 KiB per layer
  in.layer_begin = 0;
  in.layer_end = 2;
  in.unit_bytes = units;
  in.payload_capacity = 300 * 8192;  // 300 pages of K and V
  auto chunks = PlanChunks(in);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  ASSERT_EQ(chunks->size(), 8u);  // 4 even ranges of 250 pages per layer
  for (const ChunkSpec& c : *chunks) EXPECT_EQ(c.page_end - c.page_begin, 250);
  ExpectCoversExactlyOnce(in, *chunks);
}

TEST(NcclChunkPlanTest, TinyUnitsAreLimitedByThePagesAHeaderCanName) {
  const std::vector<uint64_t> units = {16, 16};
  ChunkPlanInput in;
  in.num_pages = 20000;
  in.layer_begin = 0;
  in.layer_end = 1;
  in.unit_bytes = units;
  in.payload_capacity = 64 << 20;
  auto chunks = PlanChunks(in);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  for (const ChunkSpec& c : *chunks) {
    EXPECT_LE(static_cast<uint64_t>(c.page_end - c.page_begin), kMaxChunkPages);
  }
  EXPECT_EQ(chunks->size(), (20000 + kMaxChunkPages - 1) / kMaxChunkPages);
  ExpectCoversExactlyOnce(in, *chunks);
}

TEST(NcclChunkPlanTest, RandomWritesAreCoveredExactlyOnce) {
  std::mt19937_64 rng(20240611);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<uint64_t> units(1 + rng() % 4);
    for (uint64_t& u : units) u = 1 + rng() % 3000;
    const uint64_t unit_sum = std::accumulate(units.begin(), units.end(), uint64_t{0});
    ChunkPlanInput in;
    in.num_pages = static_cast<int64_t>(rng() % 700);
    in.layer_begin = static_cast<int32_t>(rng() % 5);
    in.layer_end = in.layer_begin + static_cast<int32_t>(rng() % 6);
    in.unit_bytes = units;
    in.payload_capacity = 2 * unit_sum + rng() % (2 * unit_sum * 300);
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
  const std::vector<uint64_t> page = {4096};
  ChunkPlanInput in;
  in.num_pages = 4;
  in.layer_begin = 0;
  in.layer_end = 1;
  in.unit_bytes = page;
  in.payload_capacity = 8191;  // K and V of one page need 8192
  auto too_big = PlanChunks(in);
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(too_big.status().message(), HasSubstr("2 x 4096 bytes"));
  EXPECT_THAT(too_big.status().message(), HasSubstr("raise the nccl slot size"));

  in.payload_capacity = 1 << 20;
  const std::vector<uint64_t> none;
  in.unit_bytes = none;
  EXPECT_EQ(PlanChunks(in).status().code(), StatusCode::kInvalidArgument);
  const std::vector<uint64_t> zero = {64, 0};
  in.unit_bytes = zero;
  auto zero_unit = PlanChunks(in);
  EXPECT_THAT(zero_unit.status().message(), HasSubstr("unit 1 of the page write has 0 bytes"));
  const std::vector<uint64_t> many(kMaxUnits + 1, 8);
  in.unit_bytes = many;
  EXPECT_THAT(PlanChunks(in).status().message(), HasSubstr("1 to 64"));
  in.unit_bytes = page;
  in.num_pages = -1;
  EXPECT_EQ(PlanChunks(in).status().code(), StatusCode::kInvalidArgument);
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
  h.units = {{0, 256}, {512, 256}};
  h.dst_pages = {17, 3, 99, 1, 42};
  h.payload_bytes = HeaderPayloadBytes(h);
  return h;
}

TEST(NcclHeaderTest, RoundTripsEveryKind) {
  std::vector<uint8_t> buffer(kHeaderBytes, 0xAB);
  const ChunkHeader chunk = SampleHeader();
  EXPECT_EQ(chunk.payload_bytes, 512u * 2 * 2 * 5);
  EncodeChunkHeader(chunk, buffer);
  auto decoded = DecodeChunkHeader(buffer, 41, 1 << 20);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, chunk);

  // The page table sits at kPagesOffset as little-endian int32: the unpack kernel reads it there.
  int32_t third = 0;
  std::memcpy(&third, buffer.data() + kPagesOffset + 8, sizeof(third));
  EXPECT_EQ(third, 99);

  for (HeaderKind kind : {HeaderKind::kIdle, HeaderKind::kClose}) {
    ChunkHeader h;
    h.kind = kind;
    h.step = 5;
    EncodeChunkHeader(h, buffer);
    auto back = DecodeChunkHeader(buffer, 5, 1 << 20);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, h);
    EXPECT_EQ(HeaderPayloadBytes(*back), 0u);
  }

  // The largest chunk a header can describe.
  ChunkHeader full = SampleHeader();
  full.units.assign(kMaxUnits, UnitSpan{8, 8});
  full.dst_pages.assign(kMaxChunkPages, 7);
  full.dst_pages.back() = 12345;
  full.payload_bytes = HeaderPayloadBytes(full);
  EncodeChunkHeader(full, buffer);
  auto big = DecodeChunkHeader(buffer, 41, full.payload_bytes);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(*big, full);
}

// Encodes SampleHeader, lets `mutate` change its bytes, decodes it as step 41 with 1 MiB slots.
Status DecodeMutated(const std::function<void(std::vector<uint8_t>&)>& mutate) {
  std::vector<uint8_t> buffer(kHeaderBytes);
  EncodeChunkHeader(SampleHeader(), buffer);
  mutate(buffer);
  return DecodeChunkHeader(buffer, 41, 1 << 20).status();
}

void PutU32(std::vector<uint8_t>& b, size_t at, uint32_t v) { std::memcpy(&b[at], &v, 4); }
void PutU64(std::vector<uint8_t>& b, size_t at, uint64_t v) { std::memcpy(&b[at], &v, 8); }

TEST(NcclHeaderTest, MalformedHeadersAreDataLossSayingWhat) {
  const struct {
    std::function<void(std::vector<uint8_t>&)> mutate;
    std::string says;
  } cases[] = {
      {[](auto& b) { b[0] = 'X'; }, "lacks the 'KVNH' magic"},
      {[](auto& b) { b[4] = 2; }, "this build speaks 1"},
      {[](auto& b) { b[6] = 9; }, "unknown kind 9"},
      {[](auto& b) { PutU64(b, 8, 40); }, "says it is step 40"},
      {[](auto& b) { PutU32(b, 24, 7); }, "chunk index out of range"},
      {[](auto& b) { PutU32(b, 44, 0); }, "names 0 units"},
      {[](auto& b) { PutU32(b, 44, kMaxUnits + 1); }, "names 65 units"},
      {[](auto& b) { PutU32(b, 48, 0); }, "names 0 pages"},
      {[](auto& b) { PutU32(b, 48, kMaxChunkPages + 1); }, "pages; 1 to"},
      {[](auto& b) { PutU32(b, 40, 33); }, "has layers [4, 33) of 32"},
      {[](auto& b) { PutU32(b, 40, 4); }, "has layers [4, 4)"},
      {[](auto& b) { PutU64(b, kUnitsOffset + 8, 0); }, "unit 0 has 0 bytes"},
      {[](auto& b) { PutU64(b, 56, 4096); }, "declares 4096 payload bytes"},
  };
  for (const auto& c : cases) {
    Status status = DecodeMutated(c.mutate);
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

TEST(NcclHeaderTest, ChunksThatDoNotFitThePoolAreRefusedNamingTheValue) {
  ReceiverLayout layout;
  layout.num_layers = 32;
  layout.item_len = 1024;
  layout.buffer_bytes.assign(64, 100 * 1024);  // pages 0..99
  const ChunkHeader good = SampleHeader();
  EXPECT_TRUE(CheckChunkFits(good, layout).ok());

  ChunkHeader other_model = good;
  other_model.num_layers = 40;
  EXPECT_EQ(CheckChunkFits(other_model, layout).code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(CheckChunkFits(other_model, layout).message(), HasSubstr("40 layers"));

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
  short_v.buffer_bytes[32 + 5] = 50 * 1024;
  Status status = CheckChunkFits(good, short_v);
  EXPECT_EQ(status.code(), StatusCode::kOutOfRange);
  EXPECT_THAT(status.message(), HasSubstr("destination page 99"));
  // ... but not chunks of other layers.
  ChunkHeader layer_zero = good;
  layer_zero.layer_begin = 0;
  layer_zero.layer_end = 1;
  EXPECT_TRUE(CheckChunkFits(layer_zero, short_v).ok());
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

// A pool of `layers` layers in host memory: 2L buffers of `pages` pages of `item_len` bytes.
struct HostPool {
  HostPool(int32_t layers, int64_t pages, uint64_t item_len, uint8_t seed)
      : num_layers(layers), item_len(item_len) {
    for (int32_t b = 0; b < 2 * layers; ++b) {
      buffers.emplace_back(static_cast<size_t>(pages) * item_len);
      for (size_t i = 0; i < buffers.back().size(); ++i) {
        buffers.back()[i] = seed == 0 ? 0 : static_cast<uint8_t>((i * 131 + b * 31 + seed) % 251);
      }
    }
    for (int32_t l = 0; l < layers; ++l) {
      pair_bases.push_back(reinterpret_cast<uint64_t>(buffers[l].data()));
      pair_bases.push_back(reinterpret_cast<uint64_t>(buffers[layers + l].data()));
    }
  }
  int32_t num_layers;
  uint64_t item_len;
  std::vector<std::vector<uint8_t>> buffers;
  std::vector<uint64_t> pair_bases;  // K 0, V 0, K 1, V 1, ...
};

// Runs one write through the sender's planner, header and pack launches and the receiver's
// header decode, fit check and unpack launches (CPU kernels), and returns the receiver's pool.
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
  ChunkPlanInput in;
  in.num_pages = static_cast<int64_t>(src_pages.size());
  in.layer_begin = layer_begin;
  in.layer_end = layer_end;
  in.unit_bytes = unit_bytes;
  in.payload_capacity = slot_bytes - kHeaderBytes;
  auto chunks = PlanChunks(in);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  ReceiverLayout layout;
  layout.num_layers = dst.num_layers;
  layout.item_len = dst.item_len;
  for (const auto& b : dst.buffers) layout.buffer_bytes.push_back(b.size());

  std::vector<uint8_t> slot(slot_bytes);
  for (size_t c = 0; c < chunks->size(); ++c) {
    const ChunkSpec& spec = (*chunks)[c];
    const int64_t pages = spec.page_end - spec.page_begin;
    // Sender: header, then pack into the payload.
    ChunkHeader header;
    header.kind = HeaderKind::kChunk;
    header.step = 100 + c;
    header.write_id = 5;
    header.chunk_index = static_cast<uint32_t>(c);
    header.chunk_count = static_cast<uint32_t>(chunks->size());
    header.num_layers = src.num_layers;
    header.layer_begin = spec.layer_begin;
    header.layer_end = spec.layer_end;
    header.units = dst_units;
    header.dst_pages.assign(dst_pages.begin() + spec.page_begin, dst_pages.begin() + spec.page_end);
    header.payload_bytes = spec.payload_bytes;
    EncodeChunkHeader(header, std::span<uint8_t>(slot.data(), kHeaderBytes));
    std::fill(slot.begin() + kHeaderBytes, slot.end(), uint8_t{0xEE});
    for (const kernels::PackArgs& args :
         ChunkStagingArgs(src.pair_bases.data(), spec.layer_begin, spec.layer_end,
                          src_pages.data() + spec.page_begin, pages, src.item_len, src_units,
                          slot.data() + kHeaderBytes)) {
      ASSERT_TRUE(kernels::PackCpu(args).ok());
    }
    // The payload fills exactly what the header declares.
    EXPECT_EQ(UnitPayloadOffset(unit_bytes, unit_bytes.size(),
                                2 * (spec.layer_end - spec.layer_begin), pages),
              spec.payload_bytes);
    // Receiver: decode and check the header, then unpack with the page table inside the header.
    auto decoded = DecodeChunkHeader(std::span<const uint8_t>(slot.data(), kHeaderBytes), 100 + c,
                                     slot_bytes - kHeaderBytes);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    ASSERT_TRUE(CheckChunkFits(*decoded, layout).ok());
    const auto* table = reinterpret_cast<const int32_t*>(slot.data() + kPagesOffset);
    for (const kernels::PackArgs& args :
         ChunkStagingArgs(dst.pair_bases.data(), decoded->layer_begin, decoded->layer_end, table,
                          static_cast<int64_t>(decoded->dst_pages.size()), dst.item_len,
                          decoded->units, slot.data() + kHeaderBytes)) {
      ASSERT_TRUE(kernels::UnpackCpu(args).ok());
    }
  }
}

// The reference: what the write must leave in the receiver's pool (PageCopyCpu per unit).
void ExpectedOnCpu(const HostPool& src, HostPool& dst, std::span<const int32_t> src_pages,
                   std::span<const int32_t> dst_pages, int32_t layer_begin, int32_t layer_end,
                   std::span<const PageUnit> units) {
  for (int32_t l = layer_begin; l < layer_end; ++l) {
    for (int32_t b : {l, src.num_layers + l}) {
      const uint64_t s = reinterpret_cast<uint64_t>(src.buffers[b].data());
      const uint64_t d = reinterpret_cast<uint64_t>(dst.buffers[b].data());
      for (const PageUnit& u : units) {
        kernels::PageCopyArgs args;
        args.src_bases = &s;
        args.dst_bases = &d;
        args.num_buffers = 1;
        args.src_pages = src_pages.data();
        args.dst_pages = dst_pages.data();
        args.num_pages = static_cast<int64_t>(src_pages.size());
        args.src_page_stride = static_cast<int64_t>(src.item_len);
        args.dst_page_stride = static_cast<int64_t>(dst.item_len);
        args.src_offset = static_cast<int64_t>(u.src_offset);
        args.dst_offset = static_cast<int64_t>(u.dst_offset);
        args.bytes = static_cast<int64_t>(u.bytes);
        ASSERT_TRUE(kernels::PageCopyCpu(args).ok());
      }
    }
  }
}

TEST(NcclStagingTest, PackHeaderUnpackMovesExactlyTheWritesBytes) {
  std::mt19937_64 rng(7);
  const int32_t layers = 6;
  const int64_t pool_pages = 300;
  for (int trial = 0; trial < 12; ++trial) {
    // Whole pages on even trials; head ranges (TP mismatch: other page sizes) on odd ones.
    const bool partial = trial % 2 == 1;
    const uint64_t src_item = 2048;
    const uint64_t dst_item = partial ? 1024 : 2048;
    std::vector<PageUnit> units;
    if (partial) {
      units = {{256, 0, 512}, {1536, 512, 256}, {1800, 768, 200}};
    } else {
      units = {{0, 0, src_item}};
    }
    HostPool src(layers, pool_pages, src_item, 1 + trial);
    HostPool dst(layers, pool_pages, dst_item, 0);
    HostPool expected(layers, pool_pages, dst_item, 0);
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
    ExpectedOnCpu(src, expected, src_pages, dst_pages, begin, end, units);
    for (size_t b = 0; b < dst.buffers.size(); ++b) {
      ASSERT_EQ(dst.buffers[b], expected.buffers[b]) << "trial " << trial << " buffer " << b;
    }
  }
}

}  // namespace
}  // namespace kvt::transfer::nccl

// The ucx backend's staged path for CUDA pools, tested without a GPU: the pure pieces (chunk
// plan, wire format, credits, descriptor trailer), the mode choice on this UCX, and the whole
// staged protocol over real UCX transports with host pools copied by the CPU reference kernels
// (UcxTestHooks), which exercises everything but the CUDA copier.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "backend_test_util.h"
#include "backends/common/layer_table.h"
#include "backends/ucx/ucx_backend.h"
#include "backends/ucx/ucx_staged_protocol.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/transfer/backend.h"
#include "kvt/transfer/backends.h"

namespace kvt::transfer {
namespace {

using testing::DistinctPages;
using testing::MixedLayout;
using ucx_staging::ChunkPlan;
using ucx_staging::CreditWindow;
using ucx_staging::PayloadBytes;
using ucx_staging::PlanChunks;

// A pool's layer table and page bytes by buffer index.
struct Pool {
  LayerTable table;
  std::vector<uint64_t> items;
  std::vector<int32_t> layers;
};

Pool MakePool(std::vector<int32_t> layers, std::vector<uint64_t> items) {
  Pool pool;
  auto table = LayerTable::FromLayers(layers);
  EXPECT_TRUE(table.ok()) << table.status();
  pool.table = *table;
  pool.items = std::move(items);
  pool.layers = std::move(layers);
  return pool;
}

// K of layers 0..n-1 then V, every page `item` bytes.
Pool KeyValuePool(int32_t n, uint64_t item) {
  std::vector<int32_t> layers;
  for (int kv = 0; kv < 2; ++kv) {
    for (int32_t l = 0; l < n; ++l) layers.push_back(l);
  }
  return MakePool(layers, std::vector<uint64_t>(layers.size(), item));
}

Pool MixedPool() {
  const MixedLayout mixed;
  return MakePool(mixed.layers, mixed.items);
}

// A random valid layout: groups of K/V (2 buffers a layer) or latent (1 a layer) buffers, each
// group with its own page bytes.
Pool RandomPool(std::mt19937& rng) {
  std::vector<int32_t> layers;
  std::vector<uint64_t> items;
  int32_t next = 0;
  const int groups = 1 + static_cast<int>(rng() % 3);
  for (int g = 0; g < groups; ++g) {
    const int32_t n = 1 + static_cast<int32_t>(rng() % 12);
    const uint64_t item = 16 * (1 + rng() % 256);
    const int copies = rng() % 2 == 0 ? 2 : 1;
    for (int c = 0; c < copies; ++c) {
      for (int32_t l = 0; l < n; ++l) {
        layers.push_back(next + l);
        items.push_back(item);
      }
    }
    next += n;
  }
  return MakePool(layers, items);
}

uint64_t ChunkPayload(const Pool& pool, int32_t begin, int32_t end, int64_t pages,
                      std::span<const PageUnit> units) {
  return PayloadBytes(pages, units,
                      ucx_staging::ChunkPageBytes(pool.table, pool.items, begin, end));
}

// ---- chunk plan ---------------------------------------------------------------------------------

// Every (buffer, page position) of the write lies in exactly one chunk and no payload exceeds the
// slot, over many random layouts (draft and latent groups of other page bytes) and shapes (whole
// pages and units, slots from tight to roomy).
TEST(StagingPlan, ChunksFitTheSlotAndCoverEveryBufferPageOnce) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const Pool pool =
        trial % 3 == 0 ? KeyValuePool(1 + static_cast<int32_t>(rng() % 40), 4096) : RandomPool(rng);
    const int32_t num_layers = pool.table.num_layers();
    const int32_t begin = static_cast<int32_t>(rng() % num_layers);
    const int32_t end = begin + 1 + static_cast<int32_t>(rng() % (num_layers - begin));
    const int64_t pages = static_cast<int64_t>(rng() % 300);
    const uint64_t smallest = *std::min_element(pool.items.begin(), pool.items.end());
    std::vector<PageUnit> units;
    if (rng() % 2 == 1) {
      const int n = 1 + static_cast<int>(rng() % 4);
      for (int u = 0; u < n; ++u) units.push_back({0, 0, 1 + rng() % smallest});
    }
    uint64_t slot = 0;
    for (int32_t l = begin; l < end; ++l)
      slot = std::max(slot, ChunkPayload(pool, l, l + 1, 1, units));
    slot += rng() % (256 * 1024);
    auto plan = PlanChunks(begin, end, pages, units, pool.table, pool.items, slot);
    ASSERT_TRUE(plan.ok()) << plan.status();
    std::map<std::pair<uint32_t, int64_t>, int> seen;  // (buffer, page position) -> times
    for (uint32_t c = 0; c < plan->count(); ++c) {
      const ucx_staging::Chunk chunk = plan->Get(c);
      ASSERT_LT(chunk.layer_begin, chunk.layer_end);
      ASSERT_LT(chunk.page_begin, chunk.page_end);
      EXPECT_LE(ChunkPayload(pool, chunk.layer_begin, chunk.layer_end,
                             chunk.page_end - chunk.page_begin, units),
                slot)
          << "trial " << trial << " chunk " << c;
      for (uint32_t b : pool.table.Buffers(chunk.layer_begin, chunk.layer_end)) {
        for (int64_t p = chunk.page_begin; p < chunk.page_end; ++p) ++seen[{b, p}];
      }
    }
    size_t expected = 0;
    for (int32_t layer : pool.layers) expected += layer >= begin && layer < end ? pages : 0;
    ASSERT_EQ(seen.size(), expected) << "trial " << trial;
    for (const auto& [key, times] : seen) {
      EXPECT_EQ(times, 1) << "buffer " << key.first << " page " << key.second;
      EXPECT_GE(pool.layers[key.first], begin);
      EXPECT_LT(pool.layers[key.first], end);
      EXPECT_LT(key.second, pages);
    }
  }
}

TEST(StagingPlan, BalancesChunksAndSplitsLayersOnlyWhenAPageOfAllLayersDoesNotFit) {
  const Pool kv4 = KeyValuePool(4, 4096);
  // Room for 90 pages of 4 layers: 100 pages become two chunks of 50.
  const uint64_t slot = ChunkPayload(kv4, 0, 4, 90, {});
  auto plan = PlanChunks(0, 4, 100, {}, kv4.table, kv4.items, slot);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->count(), 2u);
  EXPECT_EQ(plan->pages_per_chunk, 50);
  EXPECT_EQ(plan->layers_per_chunk, 4);

  // One page of 32 layers (256 KiB of K and V) does not fit 100 KiB: layers are split, one page
  // a chunk, and the groups are even.
  const Pool kv32 = KeyValuePool(32, 4096);
  auto split = PlanChunks(0, 32, 3, {}, kv32.table, kv32.items, 100 * 1024);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->pages_per_chunk, 1);
  EXPECT_LT(split->layers_per_chunk, 32);
  EXPECT_GE(split->layers_per_chunk, 11);  // 12 layers fit; 3 groups of 11
  EXPECT_EQ(split->count(), static_cast<uint32_t>(split->layer_groups * 3));
}

// The heaviest layers bound the chunk: in the mixed layout layer 4 (two 512-byte buffers) weighs
// twice layer 0 (two of 256) and ten times layer 2 (one of 96), and a slot sized for two pages of
// layers [0, 2) holds one of layer 4 only.
TEST(StagingPlan, MixedPageBytesSizeChunksByTheirHeaviestLayers) {
  const Pool mixed = MixedPool();
  EXPECT_EQ(ucx_staging::ChunkPageBytes(mixed.table, mixed.items, 0, 5),
            (std::vector<uint64_t>{256, 256, 256, 256, 96, 96, 512, 512}));
  EXPECT_EQ(ucx_staging::ChunkPageBytes(mixed.table, mixed.items, 1, 3),
            (std::vector<uint64_t>{256, 256, 96}));
  const uint64_t one_of_layer4 = ChunkPayload(mixed, 4, 5, 1, {});
  EXPECT_EQ(one_of_layer4,
            ucx_staging::LayoutPayload(1, {}, std::vector<uint64_t>{512, 512}).payload_bytes);
  auto plan = PlanChunks(0, 5, 10, {}, mixed.table, mixed.items, one_of_layer4 + 256);
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (uint32_t c = 0; c < plan->count(); ++c) {
    const ucx_staging::Chunk chunk = plan->Get(c);
    EXPECT_LE(ChunkPayload(mixed, chunk.layer_begin, chunk.layer_end,
                           chunk.page_end - chunk.page_begin, {}),
              one_of_layer4 + 256);
  }
  auto tight = PlanChunks(0, 5, 10, {}, mixed.table, mixed.items, one_of_layer4 - 1);
  ASSERT_FALSE(tight.ok());
  EXPECT_EQ(tight.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(tight.status().message().find("transfer layer 4"), std::string::npos) << tight.status();
  // Units: the same bytes for every buffer, so the layers with most buffers weigh most.
  const std::vector<PageUnit> unit = {{0, 0, 64}};
  EXPECT_EQ(ChunkPayload(mixed, 2, 4, 3, unit),
            ucx_staging::LayoutPayload(3, unit, std::vector<uint64_t>{96, 96}).payload_bytes);
}

TEST(StagingPlan, RefusesASlotTooSmallForOnePageAndMalformedWrites) {
  const Pool big = KeyValuePool(2, 1 << 20);
  auto small = PlanChunks(0, 2, 4, {}, big.table, big.items, 1 << 20);
  ASSERT_FALSE(small.ok());
  EXPECT_EQ(small.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(small.status().message().find("ucx staging_slot_bytes"), std::string::npos);

  const Pool kv = KeyValuePool(3, 4096);
  auto empty_range = PlanChunks(2, 2, 4, {}, kv.table, kv.items, 8 << 20);
  EXPECT_EQ(empty_range.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(empty_range.status().message().find("[2, 2)"), std::string::npos);
  auto outside = PlanChunks(0, 4, 4, {}, kv.table, kv.items, 8 << 20);
  EXPECT_EQ(outside.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(outside.status().message().find("[0, 4)"), std::string::npos);
  const std::vector<uint64_t> short_items = {4096};
  auto counts = PlanChunks(0, 1, 4, {}, kv.table, short_items, 8 << 20);
  EXPECT_EQ(counts.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(counts.status().message().find("1 page sizes for a pool of 6"), std::string::npos);
  const std::vector<PageUnit> empty_unit = {{0, 0, 0}};
  auto empty = PlanChunks(0, 1, 4, empty_unit, kv.table, kv.items, 8 << 20);
  EXPECT_EQ(empty.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(empty.status().message().find("unit 0 has 0 bytes"), std::string::npos);

  auto none = PlanChunks(0, 3, 0, {}, kv.table, kv.items, 8 << 20);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->count(), 0u);
}

// ---- chunk wire format --------------------------------------------------------------------------

struct EncodedChunk {
  ucx_staging::ChunkHeader header;
  std::vector<int32_t> pages;
  std::vector<PageUnit> units;
  std::vector<uint64_t> page_bytes;
  std::vector<uint8_t> payload;
};

// A chunk of layers [1, 4) of the mixed layout (buffers 1 3 4 5: 256, 256, 96, 96 bytes a
// page): with units, or of whole pages.
EncodedChunk MakeChunk(bool whole_pages = false) {
  const Pool mixed = MixedPool();
  EncodedChunk c;
  c.pages = {3, 9, 4, 17};
  if (!whole_pages) c.units = {{0, 64, 16}, {256, 0, 32}};
  c.page_bytes = ucx_staging::ChunkPageBytes(mixed.table, mixed.items, 1, 4);
  c.header.sender = 0x1122334455667788ull;
  c.header.link = 7;
  c.header.write = 42;
  c.header.chunk = 2;
  c.header.chunk_count = 5;
  c.header.num_layers = 5;
  c.header.layer_begin = 1;
  c.header.layer_end = 4;
  c.header.num_pages = 4;
  c.header.num_units = static_cast<uint32_t>(c.units.size());
  c.header.num_buffers = static_cast<uint32_t>(c.page_bytes.size());
  c.header.payload_bytes = PayloadBytes(4, c.units, c.page_bytes);
  c.payload.assign(c.header.payload_bytes, 0xAB);
  EXPECT_TRUE(
      ucx_staging::EncodeChunkPrefix(c.header, c.pages, c.units, c.page_bytes, c.payload).ok());
  return c;
}

// The receiver's pool: the mixed layout, 24 pages a buffer.
ucx_staging::ChunkLimits MixedLimits() {
  const MixedLayout mixed;
  const Pool pool = MixedPool();
  ucx_staging::ChunkLimits limits;
  limits.layers = pool.table;
  limits.item_len = pool.items;
  for (size_t b = 0; b < mixed.buffers(); ++b) limits.buffer_len.push_back(mixed.BufferBytes(b));
  return limits;
}

TEST(StagingWire, ChunkHeadersRoundTrip) {
  for (bool whole : {false, true}) {
    EncodedChunk c = MakeChunk(whole);
    auto decoded = ucx_staging::DecodeChunk(c.payload, MixedLimits());
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(decoded->header, c.header);
    EXPECT_EQ(decoded->dst_pages, c.pages);
    const ucx_staging::PayloadLayout layout = ucx_staging::LayoutPayload(4, c.units, c.page_bytes);
    ASSERT_EQ(decoded->layout.units.size(), whole ? 1u : 2u);
    for (size_t u = 0; u < decoded->layout.units.size(); ++u) {
      EXPECT_EQ(decoded->layout.units[u].whole_page, whole);
      if (!whole) {
        EXPECT_EQ(decoded->layout.units[u].dst_offset, c.units[u].dst_offset);
        EXPECT_EQ(decoded->layout.units[u].bytes, c.units[u].bytes);
      }
      EXPECT_EQ(decoded->layout.units[u].payload_offset, layout.units[u].payload_offset);
      EXPECT_EQ(decoded->layout.units[u].payload_offset % ucx_staging::kPayloadAlign, 0u);
    }
    EXPECT_EQ(decoded->layout.data_offset, layout.data_offset);
    if (whole) {
      // One segment: 4 pages of each buffer's own page bytes.
      EXPECT_EQ(layout.payload_bytes, layout.data_offset + 4 * (256 + 256 + 96 + 96));
    } else {
      // The second unit's segment follows the first one's 4 buffers x 4 pages x 16 bytes,
      // rounded up to the alignment.
      EXPECT_GE(layout.units[1].payload_offset, layout.units[0].payload_offset + 4 * 4 * 16);
      EXPECT_EQ(layout.payload_bytes, layout.units[1].payload_offset + 4 * 4 * 32);
    }
  }
}

TEST(StagingWire, EncodeRefusesAHeaderThatDisagreesWithItsLists) {
  EncodedChunk c = MakeChunk();
  ucx_staging::ChunkHeader h = c.header;
  h.num_pages = 3;
  EXPECT_EQ(ucx_staging::EncodeChunkPrefix(h, c.pages, c.units, c.page_bytes, c.payload).code(),
            StatusCode::kInvalidArgument);
  h = c.header;
  h.num_buffers = 3;
  Status buffers = ucx_staging::EncodeChunkPrefix(h, c.pages, c.units, c.page_bytes, c.payload);
  EXPECT_EQ(buffers.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(buffers.message().find("3 buffers"), std::string::npos) << buffers;
  h = c.header;
  h.payload_bytes += 1;
  EXPECT_EQ(ucx_staging::EncodeChunkPrefix(h, c.pages, c.units, c.page_bytes, c.payload).code(),
            StatusCode::kInvalidArgument);
  std::vector<uint8_t> tiny(16);
  EXPECT_EQ(ucx_staging::EncodeChunkPrefix(c.header, c.pages, c.units, c.page_bytes, tiny).code(),
            StatusCode::kInvalidArgument);
}

// Each corruption of a valid payload is refused with the code and a message naming the field and
// the value.
TEST(StagingWire, MalformedChunksAreRefused) {
  struct Case {
    const char* name;
    bool whole;
    std::function<void(std::vector<uint8_t>&)> corrupt;
    StatusCode code;
    const char* says;
  };
  auto put32 = [](std::vector<uint8_t>& p, size_t at, uint32_t v) { std::memcpy(&p[at], &v, 4); };
  auto put64 = [](std::vector<uint8_t>& p, size_t at, uint64_t v) { std::memcpy(&p[at], &v, 8); };
  const size_t pages_at = ucx_staging::kChunkHeaderBytes;
  const size_t units_at = pages_at + 4 * 4;
  const std::vector<Case> cases = {
      {"truncated header", false, [](auto& p) { p.resize(40); }, StatusCode::kDataLoss, "shorter"},
      {"bad magic", false, [&](auto& p) { put32(p, 0, 0xdeadbeef); }, StatusCode::kDataLoss,
       "magic 3735928559"},
      {"version 1", false, [](auto& p) { p[4] = 1; }, StatusCode::kDataLoss,
       "chunk wire version 1"},
      {"reserved", false, [&](auto& p) { put32(p, 68, 9); }, StatusCode::kDataLoss,
       "reserved field is 9"},
      {"chunk beyond count", false, [&](auto& p) { put32(p, 32, 5); }, StatusCode::kDataLoss,
       "chunk = 5"},
      {"too many units", false,
       [](auto& p) {
         p[6] = 0xff;
         p[7] = 0x7f;
       },
       StatusCode::kDataLoss, "num_units = 32767"},
      {"too many pages", false, [&](auto& p) { put32(p, 52, 1u << 30); }, StatusCode::kDataLoss,
       "num_pages = 1073741824"},
      {"no pages", false, [&](auto& p) { put32(p, 52, 0); }, StatusCode::kDataLoss,
       "num_pages = 0"},
      {"other pool", false, [&](auto& p) { put32(p, 40, 7); }, StatusCode::kOutOfRange,
       "num_layers = 7"},
      {"layers outside", false, [&](auto& p) { put32(p, 48, 9); }, StatusCode::kOutOfRange,
       "layer range [1, 9)"},
      {"empty layers", false, [&](auto& p) { put32(p, 48, 1); }, StatusCode::kOutOfRange,
       "layer range [1, 1)"},
      {"buffer count", false, [&](auto& p) { put32(p, 64, 6); }, StatusCode::kOutOfRange,
       "num_buffers = 6"},
      {"K/V buffer count", true, [&](auto& p) { put32(p, 64, 6); }, StatusCode::kOutOfRange,
       "hold 4 buffers"},
      {"page 0", false, [&](auto& p) { put32(p, pages_at + 4, 0); }, StatusCode::kOutOfRange,
       "page 0"},
      {"page past the pool", false, [&](auto& p) { put32(p, pages_at + 8, 24); },
       StatusCode::kOutOfRange, "page 24"},
      {"negative page", false, [&](auto& p) { put32(p, pages_at, 0xffffffffu); },
       StatusCode::kOutOfRange, "page -1"},
      // 100 bytes at offset 0 fit the 256-byte pages but not the 96-byte latent ones.
      {"unit past a latent page", false, [&](auto& p) { put64(p, units_at + 8, 100); },
       StatusCode::kOutOfRange, "buffer 4 (96 bytes)"},
      {"empty unit", false, [&](auto& p) { put64(p, units_at + 24, 0); }, StatusCode::kDataLoss,
       "unit 1 has 0 bytes"},
      {"payload bytes lie", false, [&](auto& p) { put64(p, 56, p.size() + 1); },
       StatusCode::kDataLoss, "payload_bytes"},
      {"short payload", false, [](auto& p) { p.pop_back(); }, StatusCode::kDataLoss, "arrived"},
      {"long payload", true, [](auto& p) { p.push_back(0); }, StatusCode::kDataLoss, "arrived"},
  };
  for (const Case& c : cases) {
    std::vector<uint8_t> payload = MakeChunk(c.whole).payload;
    c.corrupt(payload);
    auto decoded = ucx_staging::DecodeChunk(payload, MixedLimits());
    ASSERT_FALSE(decoded.ok()) << c.name;
    EXPECT_EQ(decoded.status().code(), c.code) << c.name << ": " << decoded.status();
    EXPECT_NE(decoded.status().message().find(c.says), std::string::npos)
        << c.name << ": " << decoded.status();
  }
}

// A receiver whose pool has other page bytes for the same layers (a draft model of another
// head count) refuses whole-page chunks: their layout over its page bytes disagrees.
TEST(StagingWire, WholePageChunksForOtherPageBytesAreRefused) {
  EncodedChunk c = MakeChunk(/*whole_pages=*/true);
  ucx_staging::ChunkLimits limits = MixedLimits();
  limits.item_len[4] = 128;
  limits.buffer_len[4] = 128 * 24;
  auto decoded = ucx_staging::DecodeChunk(c.payload, limits);
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(
      decoded.status().message().find("payload_bytes = " + std::to_string(c.header.payload_bytes)),
      std::string::npos)
      << decoded.status();
}

TEST(StagingWire, ControlMessagesRoundTripAndRefuseMalformedBytes) {
  using namespace ucx_staging;
  // Every message carries its link's token, here a different one in each.
  const ChunkNotice notice{1, 2, 3, 4, 0x7001};
  EXPECT_EQ(*DecodeChunkNotice(Encode(notice)), notice);
  Hello hello{5, 6};
  hello.token = 0x7002;
  EXPECT_EQ(*DecodeHello(Encode(hello)), hello);
  const HelloAck hello_ack{7, 8, StatusCode::kFailedPrecondition, 9, 10, false, 0x7003};
  EXPECT_EQ(*DecodeHelloAck(Encode(hello_ack)), hello_ack);
  const ChunkAck ack{11, 12, 13, StatusCode::kDataLoss, 0x7004};
  EXPECT_EQ(*DecodeChunkAck(Encode(ack)), ack);
  const Bye bye{14, 15, 0x7005};
  EXPECT_EQ(*DecodeBye(Encode(bye)), bye);

  // A hello without a token opens no link, and an ack's reserved bytes are zero.
  Hello tokenless = hello;
  tokenless.token = 0;
  auto no_token = DecodeHello(Encode(tokenless));
  EXPECT_EQ(no_token.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(no_token.status().message().find("sender 5 link 6 carries link token 0"),
            std::string::npos)
      << no_token.status();
  std::vector<uint8_t> ack_reserved = Encode(ack);
  ack_reserved[28] = 2;
  auto odd_reserved = DecodeChunkAck(ack_reserved);
  EXPECT_EQ(odd_reserved.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(odd_reserved.status().message().find("reserved field is 2"), std::string::npos)
      << odd_reserved.status();

  std::vector<uint8_t> short_ack = Encode(ack);
  short_ack.pop_back();
  EXPECT_EQ(DecodeChunkAck(short_ack).status().code(), StatusCode::kDataLoss);
  // A message of one kind is not accepted as another of the same size.
  EXPECT_EQ(DecodeBye(Encode(hello)).status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(DecodeChunkAck(Encode(notice)).status().code(), StatusCode::kDataLoss);
  // An unknown status code from the wire is an internal error, not a success.
  std::vector<uint8_t> odd = Encode(ack);
  odd[4] = 200;
  EXPECT_EQ(DecodeChunkAck(odd)->code, StatusCode::kInternal);
}

TEST(StagingWire, DescriptorTrailerRoundTripsAndIsOptional) {
  const std::string worker = "\x01\x02worker-address\x00\xff";
  const ucx_staging::AddressTrailer trailer{0xabcdef, true, 8, 4 << 20};
  const std::string address = ucx_staging::AppendTrailer(worker, trailer);
  const ucx_staging::SplitAddress split = ucx_staging::SplitPeerAddress(address);
  EXPECT_EQ(split.worker_address, worker);
  ASSERT_TRUE(split.trailer.has_value());
  EXPECT_EQ(*split.trailer, trailer);

  const ucx_staging::SplitAddress plain = ucx_staging::SplitPeerAddress(worker);
  EXPECT_EQ(plain.worker_address, worker);
  EXPECT_FALSE(plain.trailer.has_value());
}

TEST(StagingWire, TrailerCarriesTheRunsAddressBetweenWorkerAddressAndTrailer) {
  const std::string worker = "\x01\x02worker-address";
  const std::string runs = "\x03runs-worker\x00";
  const std::string address = ucx_staging::AppendTrailer(worker, {0x1234, false, 0, 0}, runs);
  const ucx_staging::SplitAddress split = ucx_staging::SplitPeerAddress(address);
  EXPECT_EQ(split.worker_address, worker);
  EXPECT_EQ(split.runs_address, runs);
  ASSERT_TRUE(split.trailer.has_value());
  EXPECT_EQ(split.trailer->runs_address_bytes, runs.size());
  EXPECT_EQ(split.trailer->instance, 0x1234u);
  // A runs address that cannot fit is left out (the worker address check then refuses it).
  std::string lying = address;
  const size_t field = lying.size() - ucx_staging::kTrailerBytes + 20;
  const uint32_t huge = 1u << 30;
  std::memcpy(lying.data() + field, &huge, sizeof(huge));
  const ucx_staging::SplitAddress bad = ucx_staging::SplitPeerAddress(lying);
  EXPECT_TRUE(bad.runs_address.empty());
  EXPECT_EQ(bad.worker_address.size(), worker.size() + runs.size());
}

TEST(StagingWire, HelloNamesItsModeAndRefusesUnknownOnes) {
  ucx_staging::Hello hello{7, 8, ucx_staging::LinkMode::kRuns};
  hello.token = 0x70c3;
  auto decoded = ucx_staging::DecodeHello(ucx_staging::Encode(hello));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, hello);
  std::vector<uint8_t> odd = ucx_staging::Encode(hello);
  odd[6] = 5;
  auto refused = ucx_staging::DecodeHello(odd);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("link mode 5"), std::string::npos);
}

TEST(StagingWire, SlotOffersAndSlotNoticesRoundTripAndRefuseWhatCannotBeRight) {
  using namespace ucx_staging;
  const Hello offer{7, 8, LinkMode::kStaged, 0x7f0000000000, 16 << 20, 8, 112, 0x70c3};
  auto decoded = DecodeHello(Encode(offer));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, offer);
  const HelloAck in_place{1, 2, StatusCode::kOk, 8, 16 << 20, true, 0x70c3};
  EXPECT_EQ(*DecodeHelloAck(Encode(in_place)), in_place);
  const SlotNotice notice{{1, 2, 3, 4, 0x70c3}, 5, 4096};
  EXPECT_EQ(*DecodeSlotNotice(Encode(notice)), notice);

  // Each refusal names what is wrong.
  auto refused = [](Hello h) {
    auto r = DecodeHello(Encode(h));
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
    return r.ok() ? std::string() : std::string(r.status().message());
  };
  Hello keyless = offer;
  keyless.key_bytes = 0;
  EXPECT_NE(refused(keyless).find("8 slots with a key of 0 bytes"), std::string::npos);
  Hello big_key = offer;
  big_key.key_bytes = kMaxKeyBytes + 1;
  EXPECT_NE(refused(big_key).find("key of 4097 bytes"), std::string::npos);
  Hello many = offer;
  many.slots = kMaxOfferedSlots + 1;
  EXPECT_NE(refused(many).find("offers 1025 slots"), std::string::npos);
  Hello tiny = offer;
  tiny.slot_bytes = 100;
  EXPECT_NE(refused(tiny).find("slots of 100 bytes"), std::string::npos);
  Hello wraps = offer;
  wraps.slots_base = ~uint64_t{0} - 4096;
  EXPECT_NE(refused(wraps).find("end inside the address space"), std::string::npos);

  std::vector<uint8_t> flags = Encode(in_place);
  flags[28] = 3;
  auto odd_ack = DecodeHelloAck(flags);
  ASSERT_FALSE(odd_ack.ok());
  EXPECT_NE(odd_ack.status().message().find("flags 3"), std::string::npos);
  std::vector<uint8_t> reserved = Encode(notice);
  reserved[36] = 1;
  auto odd_notice = DecodeSlotNotice(reserved);
  ASSERT_FALSE(odd_notice.ok());
  EXPECT_NE(odd_notice.status().message().find("reserved field is 1"), std::string::npos);
  // Not a chunk notice, nor the other way round.
  EXPECT_FALSE(DecodeChunkNotice(Encode(notice)).ok());
  EXPECT_FALSE(DecodeSlotNotice(Encode(notice.notice)).ok());
}

// A chunk read in place is checked from a copy of its prefix: the same result as the whole
// payload, and a prefix cut short or a size that disagrees is refused.
TEST(StagingWire, APrefixDecodesLikeTheWholePayload) {
  for (bool whole : {false, true}) {
    EncodedChunk c = MakeChunk(whole);
    const uint64_t prefix = ucx_staging::ChunkPrefixBytes(c.payload);
    EXPECT_EQ(prefix, ucx_staging::kChunkHeaderBytes + 4 * sizeof(int32_t) + 16 * c.units.size());
    const std::vector<uint8_t> head(c.payload.begin(), c.payload.begin() + prefix);
    auto from_prefix = ucx_staging::DecodeChunkPrefix(head, c.payload.size(), MixedLimits());
    ASSERT_TRUE(from_prefix.ok()) << from_prefix.status();
    auto from_whole = ucx_staging::DecodeChunk(c.payload, MixedLimits());
    ASSERT_TRUE(from_whole.ok());
    EXPECT_EQ(from_prefix->header, from_whole->header);
    EXPECT_EQ(from_prefix->dst_pages, from_whole->dst_pages);
    EXPECT_EQ(from_prefix->layout.data_offset, from_whole->layout.data_offset);
    EXPECT_GE(from_prefix->layout.data_offset, prefix);

    const std::vector<uint8_t> cut(head.begin(), head.end() - 1);
    auto short_prefix = ucx_staging::DecodeChunkPrefix(cut, c.payload.size(), MixedLimits());
    EXPECT_EQ(short_prefix.status().code(), StatusCode::kDataLoss);
    auto wrong_size = ucx_staging::DecodeChunkPrefix(head, c.payload.size() + 256, MixedLimits());
    EXPECT_EQ(wrong_size.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(wrong_size.status().message().find(std::to_string(c.payload.size() + 256) +
                                                 " bytes arrived"),
              std::string::npos)
        << wrong_size.status();
  }
  // Counts past the caps are capped, so a hostile header cannot make the receiver copy more.
  std::vector<uint8_t> huge(ucx_staging::kChunkHeaderBytes, 0xff);
  EXPECT_EQ(ucx_staging::ChunkPrefixBytes(huge), ucx_staging::kChunkHeaderBytes +
                                                     ucx_staging::kMaxChunkPages * 4 +
                                                     16 * ucx_staging::kMaxUnits);
}

TEST(StagingWire, RunMessagesRoundTripAndRefuseWhatDoesNotDescribeItself) {
  using ucx_staging::RunSegment;
  const std::vector<uint64_t> buffers = {4096, 8192};
  const std::vector<RunSegment> segments = {{0, 0, 4096}, {1, 100, 8000}, {0, 10, 1}};
  const ucx_staging::RunsHeader header{1, 2, 3, 4, 3, 0x70c3};
  auto bytes = ucx_staging::EncodeRuns(header, segments);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(bytes->size(), ucx_staging::RunsHeaderSize(3));
  auto decoded = ucx_staging::DecodeRuns(*bytes, buffers, 4096 + 8000 + 1);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->header, header);
  EXPECT_EQ(decoded->segments, segments);

  auto expect = [&](std::vector<uint8_t> b, uint64_t data, StatusCode code, std::string words) {
    auto r = ucx_staging::DecodeRuns(b, buffers, data);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), code) << r.status();
    EXPECT_NE(r.status().message().find(words), std::string::npos) << r.status();
  };
  expect(*bytes, 4096 + 8000, StatusCode::kDataLoss, "hold 12097 bytes but 12096 arrived");
  std::vector<uint8_t> shorter(bytes->begin(), bytes->end() - 1);
  expect(shorter, 12097, StatusCode::kDataLoss, "expected 120");
  expect(std::vector<uint8_t>(bytes->begin(), bytes->begin() + 47), 0, StatusCode::kDataLoss,
         "at least 48");
  // Whom to answer is read from the fixed part even of a header that does not decode.
  const std::optional<ucx_staging::ChunkNotice> answer = ucx_staging::RunsNotice(shorter);
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(*answer, (ucx_staging::ChunkNotice{1, 2, 3, 4, 0x70c3}));
  EXPECT_FALSE(ucx_staging::RunsNotice(std::vector<uint8_t>(bytes->begin(), bytes->begin() + 47))
                   .has_value());
  std::vector<uint8_t> magic = *bytes;
  magic[0] ^= 1;
  expect(magic, 12097, StatusCode::kDataLoss, "magic");
  std::vector<uint8_t> version = *bytes;
  version[4] = 99;
  expect(version, 12097, StatusCode::kDataLoss, "wire version 99");
  std::vector<uint8_t> reserved = *bytes;
  reserved[ucx_staging::RunsHeaderSize(1) + 4] = 1;
  expect(reserved, 12097, StatusCode::kDataLoss, "run segment 1 has reserved bytes");
  auto none = ucx_staging::EncodeRuns({1, 2, 3, 4, 0}, {});
  ASSERT_TRUE(none.ok());
  expect(*none, 0, StatusCode::kDataLoss, "names 0 segments");

  auto one = [&](RunSegment s) {
    return ucx_staging::EncodeRuns({1, 2, 3, 4, 1}, std::vector<RunSegment>{s}).value();
  };
  expect(one({2, 0, 1}), 1, StatusCode::kOutOfRange, "names buffer 2; this side registered 2");
  expect(one({1, 8000, 193}), 193, StatusCode::kOutOfRange,
         "of 193 bytes at offset 8000 does not fit buffer 1 (8192 bytes)");
  expect(one({1, ~uint64_t{0}, 2}), 2, StatusCode::kOutOfRange, "does not fit buffer 1");
  expect(one({0, 0, 0}), 0, StatusCode::kDataLoss, "segment 0 has 0 bytes");
  // The encoder refuses a header that disagrees with its segments.
  EXPECT_EQ(ucx_staging::EncodeRuns({1, 2, 3, 4, 2}, segments).status().code(),
            StatusCode::kInvalidArgument);
}

// ---- credits ------------------------------------------------------------------------------------

TEST(StagingCredits, NeverMoreOutstandingThanTheLimitAndAcksCountOnce) {
  CreditWindow window(3);
  EXPECT_TRUE(window.Acquire(1, 0));
  EXPECT_FALSE(window.Acquire(1, 0));  // the same chunk twice
  EXPECT_TRUE(window.Acquire(1, 1));
  EXPECT_TRUE(window.Acquire(2, 0));
  EXPECT_FALSE(window.Acquire(2, 1));  // the receiver has 3 slots
  EXPECT_EQ(window.available(), 0u);

  EXPECT_TRUE(window.Release(1, 0));
  EXPECT_FALSE(window.Release(1, 0));  // a duplicated ack gives no second credit
  EXPECT_FALSE(window.Release(9, 9));  // nor does an ack for a chunk never sent
  EXPECT_EQ(window.available(), 1u);
  EXPECT_TRUE(window.Acquire(2, 1));

  EXPECT_EQ(window.HeldBy(2), 2u);
  EXPECT_EQ(window.ReleaseWrite(2), 2u);
  EXPECT_EQ(window.outstanding(), 1u);
  EXPECT_TRUE(window.Holds(1, 1));

  window.SetLimit(1);  // a receiver with fewer slots: nothing new until below the limit
  EXPECT_FALSE(window.Acquire(3, 0));
  EXPECT_TRUE(window.Release(1, 1));
  EXPECT_TRUE(window.Acquire(3, 0));
  EXPECT_EQ(window.ReleaseWrite(~uint64_t{0}), 0u);
}

// A simulated sender against a receiver with a random ack order: the window bounds the chunks in
// flight at every step and every chunk is sent exactly once.
TEST(StagingCredits, RandomAckOrderKeepsTheBound) {
  std::mt19937 rng(3);
  const uint32_t slots = 4;
  CreditWindow window(slots);
  std::vector<std::pair<uint64_t, uint32_t>> in_flight;
  std::set<std::pair<uint64_t, uint32_t>> sent;
  uint64_t write = 1;
  uint32_t chunk = 0;
  for (int step = 0; step < 5000; ++step) {
    if (rng() % 2 == 0 && window.Acquire(write, chunk)) {
      EXPECT_TRUE(sent.insert({write, chunk}).second);
      in_flight.push_back({write, chunk});
      if (++chunk == 7) {
        chunk = 0;
        ++write;
      }
    } else if (!in_flight.empty()) {
      const size_t i = rng() % in_flight.size();
      EXPECT_TRUE(window.Release(in_flight[i].first, in_flight[i].second));
      in_flight.erase(in_flight.begin() + static_cast<long>(i));
    }
    ASSERT_LE(window.outstanding(), slots);
    ASSERT_EQ(window.outstanding(), in_flight.size());
  }
}

// ---- the mode choice on this UCX ----------------------------------------------------------------

std::vector<LocalRegion> FakeCudaRegions(int layers) {
  std::vector<LocalRegion> regions;
  for (int b = 0; b < 2 * layers; ++b) {
    regions.push_back(LocalRegion{0x7f0000000000ull + b * (1ull << 20), 1 << 20, 4096,
                                  MemoryKind::kCuda, 0, b % layers});
  }
  return regions;
}

TEST(UcxCudaMode, DirectModeWithoutCudaSupportIsAFailedPreconditionNamingTheBuild) {
  auto backend = CreateBackend(UcxOptions{.cuda_mode = UcxCudaMode::kDirect});
  ASSERT_TRUE(backend.ok()) << backend.status();
  if ((*backend)->Capabilities().cuda_memory) GTEST_SKIP() << "this UCX handles CUDA memory";
  auto regions = FakeCudaRegions(2);
  auto registered = (*backend)->Register(regions);
  ASSERT_FALSE(registered.ok());
  EXPECT_EQ(registered.status().code(), StatusCode::kFailedPrecondition);
  const std::string& message = registered.status().message();
  EXPECT_NE(message.find(UcxVersion()), std::string::npos) << message;
  EXPECT_NE(message.find("host"), std::string::npos) << message;
  EXPECT_NE(message.find("staged"), std::string::npos) << message;
  EXPECT_FALSE((*backend)->Capabilities().page_writes);
}

TEST(UcxCudaMode, StagedRegisterWithoutADeviceIsUnavailable) {
  if (cuda::HasDevice()) GTEST_SKIP() << "a CUDA device is present; the GPU test covers staging";
  for (UcxCudaMode mode : {UcxCudaMode::kStaged, UcxCudaMode::kAuto}) {
    auto backend = CreateBackend(UcxOptions{.cuda_mode = mode});
    ASSERT_TRUE(backend.ok()) << backend.status();
    if (mode == UcxCudaMode::kAuto && (*backend)->Capabilities().cuda_memory) continue;
    auto regions = FakeCudaRegions(2);
    auto registered = (*backend)->Register(regions);
    ASSERT_FALSE(registered.ok()) << UcxCudaModeName(mode);
    EXPECT_EQ(registered.status().code(), StatusCode::kUnavailable) << registered.status();
    EXPECT_NE(registered.status().message().find("CUDA device"), std::string::npos)
        << registered.status();
    EXPECT_NE(registered.status().message().find(cuda::DeviceCount().reason), std::string::npos)
        << registered.status();
  }
}

TEST(UcxCudaMode, UnknownModeAndMixedMemoryAreRefused) {
  auto bad = ParseUcxCudaMode("sometimes");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'sometimes'"), std::string::npos);
  EXPECT_NE(bad.status().message().find("'auto', 'staged' or 'direct'"), std::string::npos);
  for (UcxCudaMode mode : {UcxCudaMode::kAuto, UcxCudaMode::kStaged, UcxCudaMode::kDirect}) {
    EXPECT_EQ(*ParseUcxCudaMode(UcxCudaModeName(mode)), mode);
  }

  auto backend = CreateBackend(UcxOptions{.cuda_mode = UcxCudaMode::kStaged});
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto regions = FakeCudaRegions(1);
  std::vector<uint8_t> host(1 << 20);
  regions[1] = LocalRegion{reinterpret_cast<uint64_t>(host.data()), host.size(), 4096,
                           MemoryKind::kHost, -1};
  auto registered = (*backend)->Register(regions);
  ASSERT_FALSE(registered.ok());
  EXPECT_EQ(registered.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(registered.status().message().find("buffer 1 is host memory"), std::string::npos);
}

// ---- the staged protocol over UCX, host pools copied by the CPU ---------------------------------

// A fake pool: 2L host buffers (K of layers 0..L-1, then V) of `pages` pages of `item` bytes.
struct HostPool {
  HostPool(int32_t layers, int64_t pages, uint64_t item, uint8_t fill)
      : layers(layers), pages(pages), item(item), buffers(2 * layers) {
    for (auto& b : buffers) b.assign(pages * item, fill);
  }
  std::vector<LocalRegion> Regions() {
    std::vector<LocalRegion> regions;
    for (size_t b = 0; b < buffers.size(); ++b) {
      regions.push_back(LocalRegion{reinterpret_cast<uint64_t>(buffers[b].data()),
                                    buffers[b].size(), item, MemoryKind::kHost, -1,
                                    static_cast<int32_t>(b % static_cast<size_t>(layers))});
    }
    return regions;
  }
  void Randomize(uint32_t seed) {
    std::mt19937 rng(seed);
    for (auto& b : buffers) testing::FillRandom(b, rng);
  }
  // Applies a page write to `this` (the destination) from `src`, as the backend must.
  void Apply(const HostPool& src, const std::vector<int32_t>& src_pages,
             const std::vector<int32_t>& dst_pages, int32_t begin, int32_t end,
             const std::vector<PageUnit>& units) {
    PageWrite w;
    w.src_pages = src_pages;
    w.dst_pages = dst_pages;
    w.num_layers = layers;
    w.layer_begin = begin;
    w.layer_end = end;
    w.units = units;
    testing::ApplyPageWrite(
        w, item, [&](int32_t b, int32_t page) { return src.buffers[b].data() + page * item; },
        [&](int32_t b, int32_t page) { return buffers[b].data() + page * item; });
  }
  int32_t layers;
  int64_t pages;
  uint64_t item;
  std::vector<std::vector<uint8_t>> buffers;
};

Status WaitFor(Backend& backend, WriteId id,
               std::chrono::seconds bound = std::chrono::seconds(20)) {
  return testing::WaitFor(backend, id, bound, std::chrono::microseconds(100));
}

constexpr int32_t kLayers = 4;
constexpr int64_t kPages = 64;
constexpr uint64_t kItem = 1024;

// Parameter: UCX transports ("" = UCX's choice), then "+payloads" to keep receivers from
// reading senders' slots in place.
class StagedHostProtocol : public ::testing::TestWithParam<std::string> {
 protected:
  std::string Transports() const { return GetParam().substr(0, GetParam().find('+')); }
  bool InPlaceAllowed() const { return GetParam().find("+payloads") == std::string::npos; }

  UcxOptions Options(int slots, size_t slot_bytes) const {
    UcxOptions options;
    options.transports = Transports();
    options.staging_in_place = InPlaceAllowed();
    options.cuda_mode = UcxCudaMode::kStaged;
    options.staging_slots = slots;
    options.staging_slot_bytes = slot_bytes;
    return options;
  }

  void Start(int sender_slots, int receiver_slots, size_t slot_bytes, int delay_us = 0) {
    UcxTestHooks hooks;
    hooks.stage_host_memory = true;
    hooks.host_copy_delay_us = delay_us;
    auto a = CreateUcxBackendForTest(Options(sender_slots, slot_bytes), hooks);
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = CreateUcxBackendForTest(Options(receiver_slots, slot_bytes), hooks);
    ASSERT_TRUE(b.ok()) << b.status();
    sender_ = std::move(a).value();
    receiver_ = std::move(b).value();
    src_.Randomize(5);
    auto src_regions = src_.Regions();
    auto dst_regions = dst_.Regions();
    auto sd = sender_->Register(src_regions);
    ASSERT_TRUE(sd.ok()) << sd.status();
    sender_descriptor_ = *sd;
    auto rd = receiver_->Register(dst_regions);
    ASSERT_TRUE(rd.ok()) << rd.status();
    receiver_descriptor_ = *rd;
    EXPECT_TRUE(sender_->Capabilities().page_writes);
    for (const RemoteRegion& r : rd->regions) EXPECT_TRUE(r.key.empty());
    auto peer = sender_->Connect(receiver_descriptor_);
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
  }

  void TearDown() override {
    sender_.reset();
    receiver_.reset();
  }

  StatusOr<WriteId> Post(const std::vector<int32_t>& src, const std::vector<int32_t>& dst,
                         int32_t begin, int32_t end, const std::vector<PageUnit>& units = {}) {
    return PostTo(peer_, src, dst, begin, end, units);
  }
  StatusOr<WriteId> PostTo(PeerId peer, const std::vector<int32_t>& src,
                           const std::vector<int32_t>& dst, int32_t begin, int32_t end,
                           const std::vector<PageUnit>& units = {}) {
    PageWrite w;
    w.src_pages = src;
    w.dst_pages = dst;
    w.num_layers = kLayers;
    w.layer_begin = begin;
    w.layer_end = end;
    w.units = units;
    return sender_->PostPages(peer, w);
  }

  void ExpectPoolsEqual(const HostPool& expected) {
    for (size_t b = 0; b < dst_.buffers.size(); ++b) {
      ASSERT_EQ(dst_.buffers[b], expected.buffers[b]) << "buffer " << b;
    }
  }

  HostPool src_{kLayers, kPages, kItem, 0};
  HostPool dst_{kLayers, kPages, kItem, 0xEE};
  std::unique_ptr<Backend> sender_;
  std::unique_ptr<Backend> receiver_;
  PeerDescriptor sender_descriptor_;
  PeerDescriptor receiver_descriptor_;
  PeerId peer_ = 0;
};

// Random page lists across several layer batches; slots of 8 KiB (a few pages a chunk) and only
// two of them on the receiver, so every write is many chunks and reuses credits and slots.
TEST_P(StagedHostProtocol, PageWritesAcrossLayerBatchesAreByteExact) {
  Start(/*sender_slots=*/3, /*receiver_slots=*/2, /*slot_bytes=*/8192);
  std::mt19937 rng(17);
  HostPool expected(kLayers, kPages, kItem, 0xEE);
  std::vector<WriteId> writes;
  const std::vector<std::pair<int32_t, int32_t>> batches = {{0, 1}, {1, 3}, {3, 4}};
  const std::vector<int32_t> src = DistinctPages(40, kPages, rng);
  const std::vector<int32_t> dst = DistinctPages(40, kPages, rng);
  for (auto [begin, end] : batches) {
    auto w = Post(src, dst, begin, end);
    ASSERT_TRUE(w.ok()) << w.status();
    writes.push_back(*w);
    expected.Apply(src_, src, dst, begin, end, {});
  }
  for (WriteId w : writes) {
    ASSERT_TRUE(WaitFor(*sender_, w).ok()) << sender_->Check(w);
    sender_->Release(w);
  }
  ExpectPoolsEqual(expected);
}

// Over shared memory the receiver reads the sender's slots in place; over tcp (another host, as
// far as UCX can tell) or with it switched off, chunks travel as payloads. Both land the same.
TEST_P(StagedHostProtocol, ReceiversReadSlotsInPlaceWhereTheyMapThere) {
  Start(/*sender_slots=*/4, /*receiver_slots=*/4, /*slot_bytes=*/16384);
  std::mt19937 rng(23);
  const std::vector<int32_t> src = DistinctPages(48, kPages, rng);
  const std::vector<int32_t> dst = DistinctPages(48, kPages, rng);
  HostPool expected(kLayers, kPages, kItem, 0xEE);
  auto w = Post(src, dst, 0, kLayers);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(WaitFor(*sender_, *w).ok()) << sender_->Check(*w);
  sender_->Release(*w);
  expected.Apply(src_, src, dst, 0, kLayers, {});
  ExpectPoolsEqual(expected);
  const bool shared_memory = Transports() != "tcp";
  auto path = UcxPeerPath(*sender_, peer_);
  ASSERT_TRUE(path.ok()) << path.status();
  EXPECT_EQ(*path, shared_memory && InPlaceAllowed() ? "staged-in-place" : "staged");
}

// A sender that registers again gets new slot memory (and a new key): the link opened before
// sends payloads from then on, a new link is read in place from the new slots, and both land
// byte-exact, also when the new slots sit where the old ones did.
TEST_P(StagedHostProtocol, ASenderThatRegistersAgainIsReadFromItsNewSlots) {
  Start(/*sender_slots=*/4, /*receiver_slots=*/4, /*slot_bytes=*/16384);
  std::mt19937 rng(29);
  HostPool expected(kLayers, kPages, kItem, 0xEE);
  auto write = [&](PeerId peer, uint32_t seed) {
    src_.Randomize(seed);
    const std::vector<int32_t> src = DistinctPages(32, kPages, rng);
    const std::vector<int32_t> dst = DistinctPages(32, kPages, rng);
    auto id = PostTo(peer, src, dst, 0, kLayers);
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_TRUE(WaitFor(*sender_, *id).ok()) << sender_->Check(*id);
    sender_->Release(*id);
    expected.Apply(src_, src, dst, 0, kLayers, {});
    ExpectPoolsEqual(expected);
  };
  write(peer_, 31);
  const bool in_place = Transports() != "tcp" && InPlaceAllowed();
  for (int round = 0; round < 2; ++round) {
    auto src_regions = src_.Regions();
    auto again = sender_->Register(src_regions);
    ASSERT_TRUE(again.ok()) << again.status();
    auto fresh = sender_->Connect(receiver_descriptor_);
    ASSERT_TRUE(fresh.ok()) << fresh.status();
    write(*fresh, 40 + round);
    EXPECT_EQ(*UcxPeerPath(*sender_, *fresh), in_place ? "staged-in-place" : "staged");
    write(peer_, 50 + round);  // the older link
    EXPECT_EQ(*UcxPeerPath(*sender_, peer_), "staged");
    ASSERT_TRUE(sender_->Disconnect(peer_).ok());
    peer_ = *fresh;
  }
}

// One write bigger than every slot of both sides together.
TEST_P(StagedHostProtocol, AWriteLargerThanAllSlotsReusesThem) {
  Start(2, 2, 8192);
  std::mt19937 rng(23);
  const std::vector<int32_t> src = DistinctPages(kPages - 1, kPages, rng);
  const std::vector<int32_t> dst = DistinctPages(kPages - 1, kPages, rng);
  // 63 pages x 8 buffers x 1 KiB = 504 KiB through 4 slots of 8 KiB.
  auto w = Post(src, dst, 0, kLayers);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(WaitFor(*sender_, *w).ok()) << sender_->Check(*w);
  sender_->Release(*w);
  HostPool expected(kLayers, kPages, kItem, 0xEE);
  expected.Apply(src_, src, dst, 0, kLayers, {});
  ExpectPoolsEqual(expected);
}

TEST_P(StagedHostProtocol, UnitsMovePartsOfPages) {
  Start(4, 4, 16384);
  std::mt19937 rng(29);
  const std::vector<PageUnit> units = {{0, 512, 128}, {640, 0, 256}, {1000, 1000, 24}};
  const std::vector<int32_t> src = DistinctPages(30, kPages, rng);
  const std::vector<int32_t> dst = DistinctPages(30, kPages, rng);
  auto w = Post(src, dst, 1, 4, units);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(WaitFor(*sender_, *w).ok()) << sender_->Check(*w);
  HostPool expected(kLayers, kPages, kItem, 0xEE);
  expected.Apply(src_, src, dst, 1, 4, units);
  ExpectPoolsEqual(expected);
}

TEST_P(StagedHostProtocol, ManyWritesFromTwoThreads) {
  Start(4, 3, 8192);
  HostPool expected(kLayers, kPages, kItem, 0xEE);
  std::vector<int32_t> all(kPages - 1);
  std::iota(all.begin(), all.end(), 1);
  std::mt19937 rng(31);
  std::shuffle(all.begin(), all.end(), rng);
  // Thread t moves pages all[t*31 .. t*31+31) one page at a time to the same page ids.
  auto worker = [&](int t) {
    for (int i = 0; i < 31; ++i) {
      const std::vector<int32_t> page = {all[t * 31 + i]};
      auto w = Post(page, page, 0, kLayers);
      ASSERT_TRUE(w.ok()) << w.status();
      ASSERT_TRUE(WaitFor(*sender_, *w).ok());
      sender_->Release(*w);
    }
  };
  std::thread t1(worker, 0), t2(worker, 1);
  t1.join();
  t2.join();
  for (int i = 0; i < 62; ++i) {
    const std::vector<int32_t> page = {all[i]};
    expected.Apply(src_, page, page, 0, kLayers, {});
  }
  ExpectPoolsEqual(expected);
}

TEST_P(StagedHostProtocol, RefusesCopyRunsBadPagesAndMismatchedPeers) {
  Start(2, 2, 8192);
  CopyRun run{0, kItem, kItem, kItem};
  auto runs = sender_->PostWrite(peer_, {&run, 1});
  EXPECT_EQ(runs.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(runs.status().message().find("page writes"), std::string::npos) << runs.status();

  const std::vector<int32_t> bad_src = {1, static_cast<int32_t>(kPages)};
  const std::vector<int32_t> dst = {1, 2};
  auto bad = Post(bad_src, dst, 0, 1);
  EXPECT_EQ(bad.status().code(), StatusCode::kOutOfRange) << bad.status();
  EXPECT_EQ(Post(dst, dst, 0, kLayers + 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dst_.buffers[0][kItem], 0xEE);

  // A host-registered backend (puts) and a staged one do not connect, in either direction.
  HostPool plain(kLayers, kPages, kItem, 0);
  auto host = CreateBackend(Options(2, 8192));
  ASSERT_TRUE(host.ok()) << host.status();
  auto regions = plain.Regions();
  auto host_descriptor = (*host)->Register(regions);
  ASSERT_TRUE(host_descriptor.ok()) << host_descriptor.status();
  EXPECT_FALSE((*host)->Capabilities().page_writes);
  auto a = sender_->Connect(*host_descriptor);
  EXPECT_EQ(a.status().code(), StatusCode::kFailedPrecondition) << a.status();
  auto b = (*host)->Connect(receiver_descriptor_);
  EXPECT_EQ(b.status().code(), StatusCode::kFailedPrecondition) << b.status();
  EXPECT_NE(b.status().message().find("stages"), std::string::npos) << b.status();
  PageWrite w;
  EXPECT_EQ((*host)->PostPages(1, w).status().code(), StatusCode::kUnimplemented);
}

// Release of a write in flight returns after its chunks on the wire are acknowledged; nothing of
// it lands afterwards.
TEST_P(StagedHostProtocol, ReleaseInFlightLandsNothingLater) {
  Start(2, 2, 8192, /*delay_us=*/20000);
  std::mt19937 rng(37);
  const std::vector<int32_t> src = DistinctPages(kPages - 1, kPages, rng);
  const std::vector<int32_t> dst = DistinctPages(kPages - 1, kPages, rng);
  auto w = Post(src, dst, 0, kLayers);
  ASSERT_TRUE(w.ok()) << w.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_EQ(sender_->Check(*w).code(), StatusCode::kInProgress);
  const auto start = std::chrono::steady_clock::now();
  sender_->Release(*w);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(sender_->Check(*w).code(), StatusCode::kNotFound);
  const auto snapshot = dst_.buffers;
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  for (size_t b = 0; b < dst_.buffers.size(); ++b) EXPECT_EQ(dst_.buffers[b], snapshot[b]);
  // Not everything arrived (the write was cut short), and the link still works afterwards.
  HostPool full(kLayers, kPages, kItem, 0xEE);
  full.Apply(src_, src, dst, 0, kLayers, {});
  EXPECT_NE(dst_.buffers, full.buffers);
  const std::vector<int32_t> one = {5};
  auto again = Post(one, one, 0, 1);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(WaitFor(*sender_, *again).ok());
}

// kPeerDead with chunks in flight: every write fails (Aborted) promptly, none hangs.
TEST_P(StagedHostProtocol, PeerDeadDisconnectFailsWritesInFlightWithoutHanging) {
  Start(2, 2, 8192, /*delay_us=*/20000);
  std::mt19937 rng(41);
  std::vector<WriteId> writes;
  for (int i = 0; i < 3; ++i) {
    const std::vector<int32_t> src = DistinctPages(40, kPages, rng);
    const std::vector<int32_t> dst = DistinctPages(40, kPages, rng);
    auto w = Post(src, dst, 0, kLayers);
    ASSERT_TRUE(w.ok()) << w.status();
    writes.push_back(*w);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(sender_->Disconnect(peer_, Backend::DisconnectMode::kPeerDead).ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  for (WriteId w : writes) {
    Status st = WaitFor(*sender_, w, std::chrono::seconds(5));
    EXPECT_EQ(st.code(), StatusCode::kAborted) << st;
    sender_->Release(w);
  }
  const std::vector<int32_t> one = {5};
  EXPECT_EQ(Post(one, one, 0, 1).status().code(), StatusCode::kNotFound);
}

// A graceful disconnect waits for the chunks on the wire, cancels the rest, and the write fails.
TEST_P(StagedHostProtocol, GracefulDisconnectAbortsUnfinishedWrites) {
  Start(2, 2, 8192, /*delay_us=*/5000);
  std::mt19937 rng(43);
  const std::vector<int32_t> src = DistinctPages(kPages - 1, kPages, rng);
  const std::vector<int32_t> dst = DistinctPages(kPages - 1, kPages, rng);
  auto w = Post(src, dst, 0, kLayers);
  ASSERT_TRUE(w.ok()) << w.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_TRUE(sender_->Disconnect(peer_).ok());
  EXPECT_EQ(sender_->Check(*w).code(), StatusCode::kAborted);
  // Reconnecting works and moves data again.
  auto again = sender_->Connect(receiver_descriptor_);
  ASSERT_TRUE(again.ok()) << again.status();
  peer_ = *again;
  const std::vector<int32_t> one = {7};
  auto w2 = Post(one, one, 2, 3);
  ASSERT_TRUE(w2.ok()) << w2.status();
  EXPECT_TRUE(WaitFor(*sender_, *w2).ok());
  EXPECT_EQ(
      std::memcmp(dst_.buffers[2].data() + 7 * kItem, src_.buffers[2].data() + 7 * kItem, kItem),
      0);
}

// A receiver that disconnects a sender drops its chunks: the sender's writes fail, not hang.
TEST_P(StagedHostProtocol, ReceiverDropsChunksOfAPeerItDisconnected) {
  Start(2, 2, 8192);
  auto back = receiver_->Connect(sender_descriptor_);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_TRUE(receiver_->Disconnect(*back).ok());
  std::mt19937 rng(47);
  const std::vector<int32_t> src = DistinctPages(10, kPages, rng);
  const std::vector<int32_t> dst = DistinctPages(10, kPages, rng);
  // Either the sender already learned it is refused (its hello was answered after the drop) and
  // the post fails, or the chunks are refused on arrival and the write fails; it never hangs.
  auto w = Post(src, dst, 0, kLayers);
  if (!w.ok()) {
    EXPECT_EQ(w.status().code(), StatusCode::kFailedPrecondition) << w.status();
    EXPECT_NE(w.status().message().find("disconnected"), std::string::npos) << w.status();
  } else {
    Status st = WaitFor(*sender_, *w, std::chrono::seconds(10));
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.code(), StatusCode::kDeadlineExceeded) << st;
  }
  for (const auto& b : dst_.buffers) {
    EXPECT_TRUE(std::all_of(b.begin(), b.end(), [](uint8_t v) { return v == 0xEE; }));
  }
}

// A receiver fences a sender it declared dead, but the sender is alive (a partition only one side
// saw, or one that healed): its chunks, read in place or sent as payloads, are refused with an
// ack naming the fence, so its writes fail at once (not at their deadline) and land nothing;
// another sender's writes land meanwhile, and the fenced sender lands again on a new connection.
TEST_P(StagedHostProtocol, AnAliveFencedSenderFailsItsWritesAtOnceAndOtherSendersLand) {
  Start(2, 2, 8192);
  std::mt19937 rng(53);
  HostPool expected(kLayers, kPages, kItem, 0xEE);
  auto write = [&](Backend& backend, PeerId peer, const HostPool& src, int64_t pages) {
    const std::vector<int32_t> src_pages = DistinctPages(pages, kPages, rng);
    const std::vector<int32_t> dst_pages = DistinctPages(pages, kPages, rng);
    PageWrite w;
    w.src_pages = src_pages;
    w.dst_pages = dst_pages;
    w.num_layers = kLayers;
    w.layer_begin = 0;
    w.layer_end = kLayers;
    auto id = backend.PostPages(peer, w);
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_TRUE(WaitFor(backend, *id).ok()) << backend.Check(*id);
    backend.Release(*id);
    expected.Apply(src, src_pages, dst_pages, 0, kLayers, {});
    ExpectPoolsEqual(expected);
  };
  // The link is open (its hello answered) before the fence; its chunks are slot notices where
  // the receiver reads the sender's slots in place, rendezvous payloads elsewhere.
  write(*sender_, peer_, src_, 8);
  const bool in_place = Transports() != "tcp" && InPlaceAllowed();
  EXPECT_EQ(*UcxPeerPath(*sender_, peer_), in_place ? "staged-in-place" : "staged");

  receiver_->FenceSender(sender_descriptor_);
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<int32_t> src = DistinctPages(40, kPages, rng);
  const std::vector<int32_t> dst = DistinctPages(40, kPages, rng);
  auto refused = Post(src, dst, 0, kLayers);  // many chunks: 40 pages x 8 buffers of 1 KiB
  ASSERT_TRUE(refused.ok()) << refused.status();
  const Status st = WaitFor(*sender_, *refused, std::chrono::seconds(5));
  EXPECT_EQ(st.code(), StatusCode::kAborted) << st;
  EXPECT_NE(st.message().find("was fenced here"), std::string::npos) << st;
  EXPECT_NE(st.message().find("reconnect"), std::string::npos) << st;
  sender_->Release(*refused);  // nothing left unacknowledged: no wait
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  ExpectPoolsEqual(expected);

  UcxTestHooks hooks;
  hooks.stage_host_memory = true;
  auto other = CreateUcxBackendForTest(Options(2, 8192), hooks);
  ASSERT_TRUE(other.ok()) << other.status();
  HostPool other_src(kLayers, kPages, kItem, 0);
  other_src.Randomize(59);
  auto other_regions = other_src.Regions();
  ASSERT_TRUE((*other)->Register(other_regions).ok());
  auto other_peer = (*other)->Connect(receiver_descriptor_);
  ASSERT_TRUE(other_peer.ok()) << other_peer.status();
  write(**other, *other_peer, other_src, 12);

  // Told to reconnect, the fenced sender does; the new connection's writes land.
  auto again = sender_->Connect(receiver_descriptor_);
  ASSERT_TRUE(again.ok()) << again.status();
  write(*sender_, *again, src_, 12);
  other->reset();
  // The new session ends (its bye comes; the fenced link's never will): the slots mapped for it
  // go, though the endpoint stays to refuse what still arrives on the fenced link.
  if (in_place) {
    auto mapped = UcxMappedSenderSlots(*receiver_);
    ASSERT_TRUE(mapped.ok()) << mapped.status();
    EXPECT_EQ(*mapped, 1u);
  }
  ASSERT_TRUE(sender_->Disconnect(*again).ok());
  size_t still = 1;
  for (int i = 0; i < 200 && still != 0; ++i) {  // the bye is handled by the receiver's progress
    auto mapped = UcxMappedSenderSlots(*receiver_);
    ASSERT_TRUE(mapped.ok()) << mapped.status();
    still = *mapped;
    if (still != 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(still, 0u) << "a sender's slots stay mapped after its only open link ended";
}

// A mixed layout (K/V of 256-byte pages, latent buffers of 96, a draft model's K/V of 512:
// layers 0 1 0 1 2 3 4 4) moves byte-exact over layer batches that cross groups, through slots
// small enough that chunks split layers and pages; pages outside the writes stay untouched.
TEST_P(StagedHostProtocol, MixedLayoutsMoveEveryBufferOfTheLayersByteExact) {
  const MixedLayout mixed;
  UcxTestHooks hooks;
  hooks.stage_host_memory = true;
  auto a = CreateUcxBackendForTest(Options(3, 4096), hooks);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = CreateUcxBackendForTest(Options(2, 4096), hooks);
  ASSERT_TRUE(b.ok()) << b.status();
  sender_ = std::move(a).value();
  receiver_ = std::move(b).value();
  std::vector<uint8_t> src(mixed.ImageBytes());
  std::vector<uint8_t> dst(mixed.ImageBytes(), 0xEE);
  std::mt19937 rng(41);
  for (uint8_t& byte : src) byte = static_cast<uint8_t>(rng());
  std::vector<uint8_t> expected = dst;
  auto sd = sender_->Register(mixed.Regions(reinterpret_cast<uint64_t>(src.data())));
  ASSERT_TRUE(sd.ok()) << sd.status();
  auto rd = receiver_->Register(mixed.Regions(reinterpret_cast<uint64_t>(dst.data())));
  ASSERT_TRUE(rd.ok()) << rd.status();
  auto peer = sender_->Connect(*rd);
  ASSERT_TRUE(peer.ok()) << peer.status();
  const std::vector<std::pair<int32_t, int32_t>> batches = {{0, 2}, {2, 3}, {3, 5}, {1, 4}};
  for (auto [begin, end] : batches) {
    const std::vector<int32_t> src_pages = DistinctPages(9, mixed.pages, rng);
    const std::vector<int32_t> dst_pages = DistinctPages(9, mixed.pages, rng);
    PageWrite w;
    w.src_pages = src_pages;
    w.dst_pages = dst_pages;
    w.num_layers = mixed.num_layers;
    w.layer_begin = begin;
    w.layer_end = end;
    auto id = sender_->PostPages(*peer, w);
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_TRUE(WaitFor(*sender_, *id).ok()) << sender_->Check(*id);
    sender_->Release(*id);
    mixed.Apply(w, src, expected);
    ASSERT_EQ(mixed.Mismatch(expected, dst), "") << "layers [" << begin << ", " << end << ")";
  }
  // The whole layout at once, one page: a chunk holds all eight buffers of their own sizes.
  const std::vector<int32_t> one = {5};
  const std::vector<int32_t> to = {23};
  PageWrite all;
  all.src_pages = one;
  all.dst_pages = to;
  all.num_layers = mixed.num_layers;
  all.layer_begin = 0;
  all.layer_end = mixed.num_layers;
  auto id = sender_->PostPages(*peer, all);
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(WaitFor(*sender_, *id).ok()) << sender_->Check(*id);
  sender_->Release(*id);
  mixed.Apply(all, src, expected);
  EXPECT_EQ(mixed.Mismatch(expected, dst), "");

  // A write naming another layer count, or pages past the smallest buffer, is refused naming it.
  PageWrite wrong = all;
  wrong.num_layers = 4;
  auto refused = sender_->PostPages(*peer, wrong);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("num_layers = 4"), std::string::npos)
      << refused.status();
  const std::vector<int32_t> past = {static_cast<int32_t>(mixed.pages)};
  PageWrite outside = all;
  outside.src_pages = past;
  auto out = sender_->PostPages(*peer, outside);
  EXPECT_EQ(out.status().code(), StatusCode::kOutOfRange) << out.status();
  EXPECT_EQ(mixed.Mismatch(expected, dst), "");
  sender_.reset();
  receiver_.reset();
}

INSTANTIATE_TEST_SUITE_P(Transports, StagedHostProtocol,
                         ::testing::Values(std::string(""), std::string("tcp"),
                                           std::string("shm,self"),
                                           std::string("shm,self+payloads")),
                         testing::TransportsTestName);

}  // namespace
}  // namespace kvt::transfer

#include "backends/ucx/ucx_staged_protocol.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>

namespace kvt::transfer::ucx_staging {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the staging wire format is written in host order, which must be little-endian");

constexpr uint64_t kSaturated = std::numeric_limits<uint64_t>::max();

uint64_t SatAdd(uint64_t a, uint64_t b) { return a > kSaturated - b ? kSaturated : a + b; }
uint64_t SatMul(uint64_t a, uint64_t b) {
  if (a == 0 || b == 0) return 0;
  return a > kSaturated / b ? kSaturated : a * b;
}
uint64_t AlignUp(uint64_t v, uint64_t a) {
  const uint64_t r = v % a;
  return r == 0 ? v : SatAdd(v, a - r);
}

// Little-endian field access at fixed offsets; the callers check sizes first.
template <typename T>
void Put(uint8_t* out, size_t offset, T value) {
  std::memcpy(out + offset, &value, sizeof(T));
}
template <typename T>
T Get(const uint8_t* in, size_t offset) {
  T value;
  std::memcpy(&value, in + offset, sizeof(T));
  return value;
}

// Magic words of the control messages.
constexpr uint32_t kNoticeMagic = 0x4e54564b;    // "KVTN"
constexpr uint32_t kHelloMagic = 0x4854564b;     // "KVTH"
constexpr uint32_t kHelloAckMagic = 0x4154564b;  // "KVTA"
constexpr uint32_t kAckMagic = 0x4b54564b;       // "KVTK"
constexpr uint32_t kByeMagic = 0x4254564b;       // "KVTB"
constexpr uint32_t kTrailerMagic = 0x5554564b;   // "KVTU"
constexpr uint32_t kRunsMagic = 0x5254564b;      // "KVTR"
constexpr uint32_t kSlotMagic = 0x5354564b;      // "KVTS"

Status CheckMessage(std::span<const uint8_t> bytes, size_t size, uint32_t magic, const char* what) {
  if (bytes.size() != size) {
    return DataLoss(std::string(what) + " of " + std::to_string(bytes.size()) +
                    " bytes; expected " + std::to_string(size));
  }
  const uint32_t got = Get<uint32_t>(bytes.data(), 0);
  if (got != magic) {
    return DataLoss(std::string(what) + " has magic " + std::to_string(got) + "; expected " +
                    std::to_string(magic));
  }
  return OkStatus();
}

StatusCode CodeFromWire(uint32_t raw) {
  if (raw > static_cast<uint32_t>(StatusCode::kInProgress)) return StatusCode::kInternal;
  return static_cast<StatusCode>(raw);
}

}  // namespace

// ---- chunk plan -------------------------------------------------------------------------------

PayloadLayout LayoutPayload(int64_t pages, std::span<const PageUnit> units,
                            std::span<const uint64_t> page_bytes) {
  PayloadLayout layout;
  const uint64_t p = static_cast<uint64_t>(std::max<int64_t>(pages, 0));
  const uint64_t prefix = SatAdd(SatAdd(kChunkHeaderBytes, SatMul(4, p)),
                                 SatMul(16, static_cast<uint64_t>(units.size())));
  uint64_t offset = AlignUp(prefix, kPayloadAlign);
  layout.data_offset = offset;
  if (units.empty()) {
    uint64_t per_page = 0;  // one page of every buffer, each its own page bytes
    for (uint64_t bytes : page_bytes) per_page = SatAdd(per_page, bytes);
    layout.units.push_back(ChunkUnit{0, 0, 0, /*whole_page=*/true, offset});
    layout.payload_bytes = SatAdd(offset, SatMul(p, per_page));
    return layout;
  }
  const uint64_t buffers = static_cast<uint64_t>(page_bytes.size());
  layout.units.reserve(units.size());
  for (size_t u = 0; u < units.size(); ++u) {
    if (u > 0) offset = AlignUp(offset, kPayloadAlign);
    layout.units.push_back(ChunkUnit{units[u].src_offset, units[u].dst_offset, units[u].bytes,
                                     /*whole_page=*/false, offset});
    offset = SatAdd(offset, SatMul(p, SatMul(buffers, units[u].bytes)));
  }
  layout.payload_bytes = offset;
  return layout;
}

uint64_t PayloadBytes(int64_t pages, std::span<const PageUnit> units,
                      std::span<const uint64_t> page_bytes) {
  return LayoutPayload(pages, units, page_bytes).payload_bytes;
}

std::vector<uint64_t> ChunkPageBytes(const LayerTable& table, std::span<const uint64_t> item_len,
                                     int32_t begin, int32_t end) {
  std::vector<uint64_t> bytes;
  const std::span<const uint32_t> buffers = table.Buffers(begin, end);
  bytes.reserve(buffers.size());
  for (uint32_t b : buffers) bytes.push_back(item_len[b]);
  return bytes;
}

Chunk ChunkPlan::Get(uint32_t index) const {
  const int64_t layer_group = index / page_groups;
  const int64_t page_group = index % page_groups;
  Chunk chunk;
  chunk.layer_begin = layer_begin + static_cast<int32_t>(layer_group * layers_per_chunk);
  chunk.layer_end = std::min(layer_end, chunk.layer_begin + layers_per_chunk);
  chunk.page_begin = page_group * pages_per_chunk;
  chunk.page_end = std::min(num_pages, chunk.page_begin + pages_per_chunk);
  return chunk;
}

StatusOr<ChunkPlan> PlanChunks(int32_t layer_begin, int32_t layer_end, int64_t num_pages,
                               std::span<const PageUnit> units, const LayerTable& table,
                               std::span<const uint64_t> item_len, uint64_t slot_bytes) {
  if (layer_begin < 0 || layer_end <= layer_begin || layer_end > table.num_layers()) {
    return InvalidArgument("staged write: layer range [" + std::to_string(layer_begin) + ", " +
                           std::to_string(layer_end) + ") is empty or outside the pool's " +
                           std::to_string(table.num_layers()) +
                           " transfer layers; pass a non-empty range inside [0, " +
                           std::to_string(table.num_layers()) + "]");
  }
  if (item_len.size() != table.num_buffers()) {
    return InvalidArgument("staged write: " + std::to_string(item_len.size()) +
                           " page sizes for a pool of " + std::to_string(table.num_buffers()) +
                           " buffers; pass one per registered buffer");
  }
  if (num_pages < 0) {
    return InvalidArgument("staged write: " + std::to_string(num_pages) +
                           " pages; pass a page list of 0 or more pages");
  }
  if (units.size() > kMaxUnits) {
    return InvalidArgument("staged write: " + std::to_string(units.size()) +
                           " units per page; give at most " + std::to_string(kMaxUnits) +
                           " (none: whole pages)");
  }
  for (size_t u = 0; u < units.size(); ++u) {
    if (units[u].bytes == 0) {
      return InvalidArgument("staged write: unit " + std::to_string(u) +
                             " has 0 bytes; give every unit at least one byte");
    }
  }
  const int32_t layers = layer_end - layer_begin;
  // What a window of layers weighs in a payload: the sum of its buffers' page bytes (whole
  // pages) or its buffer count (units, the same bytes for every buffer). The payload grows with
  // the weight, so the heaviest window of g layers bounds every chunk of at most g layers.
  std::vector<uint64_t> prefix(static_cast<size_t>(layers) + 1, 0);
  for (int32_t l = layer_begin; l < layer_end; ++l) {
    uint64_t weight = 0;
    for (uint32_t b : table.Buffers(l, l + 1)) weight += units.empty() ? item_len[b] : 1;
    prefix[static_cast<size_t>(l - layer_begin) + 1] =
        prefix[static_cast<size_t>(l - layer_begin)] + weight;
  }
  auto heaviest = [&](int32_t g) {
    int32_t best = layer_begin;
    uint64_t best_weight = 0;
    for (int32_t s = 0; s + g <= layers; ++s) {
      const uint64_t w = prefix[static_cast<size_t>(s + g)] - prefix[static_cast<size_t>(s)];
      if (w > best_weight || s == 0) {
        best_weight = w;
        best = layer_begin + s;
      }
    }
    return best;
  };
  auto payload = [&](int32_t first, int32_t g, int64_t p) {
    return PayloadBytes(p, units, ChunkPageBytes(table, item_len, first, first + g));
  };
  auto fits = [&](int32_t g, int64_t p) { return payload(heaviest(g), g, p) <= slot_bytes; };
  if (!fits(1, 1)) {
    const int32_t layer = heaviest(1);
    return InvalidArgument("a staging slot of " + std::to_string(slot_bytes) +
                           " bytes cannot hold one page of transfer layer " +
                           std::to_string(layer) + " (" + std::to_string(payload(layer, 1, 1)) +
                           " bytes of its " +
                           std::to_string(table.Buffers(layer, layer + 1).size()) +
                           " buffers with the chunk header); raise ucx staging_slot_bytes");
  }
  ChunkPlan plan;
  plan.layer_begin = layer_begin;
  plan.layer_end = layer_end;
  plan.num_pages = num_pages;
  if (num_pages == 0) {
    plan.layers_per_chunk = layers;
    plan.pages_per_chunk = 1;
    plan.layer_groups = 1;
    plan.page_groups = 0;
    return plan;
  }
  int32_t g = 1;
  int64_t p = 1;
  if (fits(layers, 1)) {
    g = layers;
    int64_t lo = 1, hi = std::min(num_pages, kMaxChunkPages);  // fits(g, lo) holds
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      if (fits(g, mid)) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    p = lo;
  } else {
    int32_t lo = 1, hi = layers;  // fits(lo, 1) holds
    while (lo < hi) {
      const int32_t mid = lo + (hi - lo + 1) / 2;
      if (fits(mid, 1)) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    g = lo;
  }
  // Balance: the same number of groups, each as even as possible (never larger than found).
  plan.page_groups = (num_pages + p - 1) / p;
  plan.pages_per_chunk = (num_pages + plan.page_groups - 1) / plan.page_groups;
  plan.layer_groups = (layers + g - 1) / g;
  plan.layers_per_chunk = (layers + plan.layer_groups - 1) / plan.layer_groups;
  if (static_cast<uint64_t>(plan.layer_groups) * static_cast<uint64_t>(plan.page_groups) >
      std::numeric_limits<uint32_t>::max()) {
    return InvalidArgument("staged write of " + std::to_string(num_pages) + " pages x " +
                           std::to_string(layers) + " layers needs more than 2^32 chunks");
  }
  return plan;
}

// ---- chunk wire format ------------------------------------------------------------------------
//
// Header fields: 0 magic u32, 4 version u16, 6 num_units u16, 8 sender, 16 link, 24 write,
// 32 chunk u32, 36 chunk_count u32, 40 num_layers i32, 44 layer_begin i32, 48 layer_end i32,
// 52 num_pages u32, 56 payload_bytes u64, 64 num_buffers u32, 68 reserved u32 (zero).

Status EncodeChunkPrefix(const ChunkHeader& h, std::span<const int32_t> dst_pages,
                         std::span<const PageUnit> units, std::span<const uint64_t> page_bytes,
                         std::span<uint8_t> payload) {
  if (h.num_pages != dst_pages.size() || h.num_units != units.size() ||
      h.num_buffers != page_bytes.size() || page_bytes.empty() || units.size() > kMaxUnits ||
      dst_pages.empty() || dst_pages.size() > static_cast<size_t>(kMaxChunkPages)) {
    return InvalidArgument("chunk header names " + std::to_string(h.num_pages) + " pages, " +
                           std::to_string(h.num_units) + " units and " +
                           std::to_string(h.num_buffers) + " buffers but " +
                           std::to_string(dst_pages.size()) + ", " + std::to_string(units.size()) +
                           " and " + std::to_string(page_bytes.size()) + " were given (1.." +
                           std::to_string(kMaxChunkPages) + " pages, 0.." +
                           std::to_string(kMaxUnits) + " units, 1 or more buffers)");
  }
  const PayloadLayout layout =
      LayoutPayload(static_cast<int64_t>(dst_pages.size()), units, page_bytes);
  if (h.payload_bytes != layout.payload_bytes) {
    return InvalidArgument("chunk header says " + std::to_string(h.payload_bytes) +
                           " payload bytes; the layout needs " +
                           std::to_string(layout.payload_bytes));
  }
  if (payload.size() < layout.data_offset) {
    return InvalidArgument("chunk prefix of " + std::to_string(layout.data_offset) +
                           " bytes does not fit " + std::to_string(payload.size()));
  }
  uint8_t* out = payload.data();
  std::memset(out, 0, layout.data_offset);
  Put<uint32_t>(out, 0, kChunkMagic);
  Put<uint16_t>(out, 4, kWireVersion);
  Put<uint16_t>(out, 6, static_cast<uint16_t>(h.num_units));
  Put<uint64_t>(out, 8, h.sender);
  Put<uint64_t>(out, 16, h.link);
  Put<uint64_t>(out, 24, h.write);
  Put<uint32_t>(out, 32, h.chunk);
  Put<uint32_t>(out, 36, h.chunk_count);
  Put<int32_t>(out, 40, h.num_layers);
  Put<int32_t>(out, 44, h.layer_begin);
  Put<int32_t>(out, 48, h.layer_end);
  Put<uint32_t>(out, 52, h.num_pages);
  Put<uint64_t>(out, 56, h.payload_bytes);
  Put<uint32_t>(out, 64, h.num_buffers);
  if (!dst_pages.empty()) {
    std::memcpy(out + kChunkHeaderBytes, dst_pages.data(), dst_pages.size() * sizeof(int32_t));
  }
  const size_t units_at = kChunkHeaderBytes + dst_pages.size() * sizeof(int32_t);
  for (size_t u = 0; u < units.size(); ++u) {
    Put<uint64_t>(out, units_at + 16 * u, units[u].dst_offset);
    Put<uint64_t>(out, units_at + 16 * u + 8, units[u].bytes);
  }
  return OkStatus();
}

uint64_t ChunkPrefixBytes(std::span<const uint8_t> header) {
  const uint64_t units = std::min<uint64_t>(Get<uint16_t>(header.data(), 6), kMaxUnits);
  const uint64_t pages =
      std::min<uint64_t>(Get<uint32_t>(header.data(), 52), static_cast<uint64_t>(kMaxChunkPages));
  return kChunkHeaderBytes + pages * sizeof(int32_t) + 16 * units;
}

StatusOr<DecodedChunk> DecodeChunk(std::span<const uint8_t> payload, const ChunkLimits& limits) {
  return DecodeChunkPrefix(payload, payload.size(), limits);
}

StatusOr<DecodedChunk> DecodeChunkPrefix(std::span<const uint8_t> payload, uint64_t payload_bytes,
                                         const ChunkLimits& limits) {
  if (payload.size() < kChunkHeaderBytes) {
    return DataLoss("chunk payload of " + std::to_string(payload.size()) +
                    " bytes is shorter than its header (" + std::to_string(kChunkHeaderBytes) +
                    "); the sender speaks another staging protocol");
  }
  const uint8_t* in = payload.data();
  if (Get<uint32_t>(in, 0) != kChunkMagic) {
    return DataLoss("chunk payload has magic " + std::to_string(Get<uint32_t>(in, 0)) +
                    "; expected " + std::to_string(kChunkMagic));
  }
  if (Get<uint16_t>(in, 4) != kWireVersion) {
    return DataLoss("chunk wire version " + std::to_string(Get<uint16_t>(in, 4)) +
                    "; this build speaks " + std::to_string(kWireVersion) +
                    ": run the same kvt version on both sides");
  }
  DecodedChunk chunk;
  ChunkHeader& h = chunk.header;
  h.num_units = Get<uint16_t>(in, 6);
  h.sender = Get<uint64_t>(in, 8);
  h.link = Get<uint64_t>(in, 16);
  h.write = Get<uint64_t>(in, 24);
  h.chunk = Get<uint32_t>(in, 32);
  h.chunk_count = Get<uint32_t>(in, 36);
  h.num_layers = Get<int32_t>(in, 40);
  h.layer_begin = Get<int32_t>(in, 44);
  h.layer_end = Get<int32_t>(in, 48);
  h.num_pages = Get<uint32_t>(in, 52);
  h.payload_bytes = Get<uint64_t>(in, 56);
  h.num_buffers = Get<uint32_t>(in, 64);
  if (Get<uint32_t>(in, 68) != 0) {
    return DataLoss("chunk header reserved field is " + std::to_string(Get<uint32_t>(in, 68)) +
                    "; expected 0");
  }
  if (h.chunk >= h.chunk_count) {
    return DataLoss("chunk header chunk = " + std::to_string(h.chunk) + " of chunk_count = " +
                    std::to_string(h.chunk_count) + "; expected chunk < chunk_count");
  }
  if (h.num_units > kMaxUnits) {
    return DataLoss("chunk header num_units = " + std::to_string(h.num_units) +
                    "; allowed 0 (whole pages) to " + std::to_string(kMaxUnits));
  }
  if (h.num_pages == 0 || h.num_pages > static_cast<uint64_t>(kMaxChunkPages)) {
    return DataLoss("chunk header num_pages = " + std::to_string(h.num_pages) + "; allowed 1.." +
                    std::to_string(kMaxChunkPages));
  }
  const int32_t pool_layers = limits.layers.num_layers();
  if (h.num_layers != pool_layers) {
    return OutOfRange("chunk header num_layers = " + std::to_string(h.num_layers) +
                      " but this pool has " + std::to_string(pool_layers) +
                      " transfer layers; both sides must register the same layout");
  }
  if (h.layer_begin < 0 || h.layer_end <= h.layer_begin || h.layer_end > pool_layers) {
    return OutOfRange("chunk header layer range [" + std::to_string(h.layer_begin) + ", " +
                      std::to_string(h.layer_end) + ") is not a non-empty range inside [0, " +
                      std::to_string(pool_layers) + "]");
  }
  const std::span<const uint32_t> buffers = limits.layers.Buffers(h.layer_begin, h.layer_end);
  if (h.num_buffers != buffers.size()) {
    return OutOfRange("chunk header num_buffers = " + std::to_string(h.num_buffers) +
                      " but layers [" + std::to_string(h.layer_begin) + ", " +
                      std::to_string(h.layer_end) + ") hold " + std::to_string(buffers.size()) +
                      " buffers here; both sides must register the same layout");
  }
  const size_t units_at = kChunkHeaderBytes + size_t{h.num_pages} * sizeof(int32_t);
  const size_t prefix = units_at + 16 * size_t{h.num_units};
  if (payload.size() < prefix) {
    return DataLoss("chunk payload of " + std::to_string(payload.size()) +
                    " bytes ends inside its page and unit lists (" + std::to_string(prefix) + ")");
  }
  chunk.dst_pages.resize(h.num_pages);
  std::memcpy(chunk.dst_pages.data(), in + kChunkHeaderBytes,
              size_t{h.num_pages} * sizeof(int32_t));
  std::vector<uint64_t> page_bytes;
  page_bytes.reserve(buffers.size());
  uint64_t pool_pages = std::numeric_limits<uint64_t>::max();
  for (uint32_t b : buffers) {
    const uint64_t item = limits.item_len[b];
    page_bytes.push_back(item);
    pool_pages = std::min(pool_pages, item == 0 ? 0 : limits.buffer_len[b] / item);
  }
  std::vector<PageUnit> units(h.num_units);
  for (size_t u = 0; u < units.size(); ++u) {
    units[u].dst_offset = Get<uint64_t>(in, units_at + 16 * u);
    units[u].bytes = Get<uint64_t>(in, units_at + 16 * u + 8);
    if (units[u].bytes == 0) {
      return DataLoss("chunk unit " + std::to_string(u) + " has 0 bytes");
    }
    for (size_t i = 0; i < buffers.size(); ++i) {
      if (units[u].dst_offset > page_bytes[i] ||
          units[u].bytes > page_bytes[i] - units[u].dst_offset) {
        return OutOfRange("chunk unit " + std::to_string(u) + " of " +
                          std::to_string(units[u].bytes) + " bytes at offset " +
                          std::to_string(units[u].dst_offset) + " does not fit a page of buffer " +
                          std::to_string(buffers[i]) + " (" + std::to_string(page_bytes[i]) +
                          " bytes)");
      }
    }
  }
  for (size_t i = 0; i < chunk.dst_pages.size(); ++i) {
    const int32_t p = chunk.dst_pages[i];
    if (p < 1 || static_cast<uint64_t>(p) >= pool_pages) {
      return OutOfRange("chunk page " + std::to_string(p) + " at position " + std::to_string(i) +
                        " is outside [1, " + std::to_string(pool_pages) +
                        ") of the pages every buffer of layers [" + std::to_string(h.layer_begin) +
                        ", " + std::to_string(h.layer_end) + ") holds");
    }
  }
  chunk.layout = LayoutPayload(h.num_pages, units, page_bytes);
  if (h.payload_bytes != chunk.layout.payload_bytes || payload_bytes != h.payload_bytes) {
    return DataLoss("chunk header payload_bytes = " + std::to_string(h.payload_bytes) +
                    ", its layout over this pool's page bytes " +
                    std::to_string(chunk.layout.payload_bytes) + ", and " +
                    std::to_string(payload_bytes) + " bytes arrived; all three must agree");
  }
  return chunk;
}

// ---- control messages -------------------------------------------------------------------------

std::vector<uint8_t> Encode(const ChunkNotice& m) {
  std::vector<uint8_t> out(kChunkNoticeBytes, 0);
  Put<uint32_t>(out.data(), 0, kNoticeMagic);
  Put<uint64_t>(out.data(), 8, m.sender);
  Put<uint64_t>(out.data(), 16, m.link);
  Put<uint64_t>(out.data(), 24, m.write);
  Put<uint32_t>(out.data(), 4, m.chunk);
  Put<uint64_t>(out.data(), 32, m.token);
  return out;
}

StatusOr<ChunkNotice> DecodeChunkNotice(std::span<const uint8_t> bytes) {
  KVT_RETURN_IF_ERROR(CheckMessage(bytes, kChunkNoticeBytes, kNoticeMagic, "chunk notice"));
  ChunkNotice m;
  m.chunk = Get<uint32_t>(bytes.data(), 4);
  m.sender = Get<uint64_t>(bytes.data(), 8);
  m.link = Get<uint64_t>(bytes.data(), 16);
  m.write = Get<uint64_t>(bytes.data(), 24);
  m.token = Get<uint64_t>(bytes.data(), 32);
  return m;
}

std::vector<uint8_t> Encode(const SlotNotice& m) {
  std::vector<uint8_t> out(kSlotNoticeBytes, 0);
  Put<uint32_t>(out.data(), 0, kSlotMagic);
  Put<uint32_t>(out.data(), 4, m.notice.chunk);
  Put<uint64_t>(out.data(), 8, m.notice.sender);
  Put<uint64_t>(out.data(), 16, m.notice.link);
  Put<uint64_t>(out.data(), 24, m.notice.write);
  Put<uint32_t>(out.data(), 32, m.slot);
  Put<uint64_t>(out.data(), 40, m.payload_bytes);
  Put<uint64_t>(out.data(), 48, m.notice.token);
  return out;
}

StatusOr<SlotNotice> DecodeSlotNotice(std::span<const uint8_t> bytes) {
  KVT_RETURN_IF_ERROR(CheckMessage(bytes, kSlotNoticeBytes, kSlotMagic, "slot notice"));
  if (Get<uint32_t>(bytes.data(), 36) != 0) {
    return DataLoss("slot notice reserved field is " +
                    std::to_string(Get<uint32_t>(bytes.data(), 36)) + "; expected 0");
  }
  SlotNotice m;
  m.notice.chunk = Get<uint32_t>(bytes.data(), 4);
  m.notice.sender = Get<uint64_t>(bytes.data(), 8);
  m.notice.link = Get<uint64_t>(bytes.data(), 16);
  m.notice.write = Get<uint64_t>(bytes.data(), 24);
  m.slot = Get<uint32_t>(bytes.data(), 32);
  m.payload_bytes = Get<uint64_t>(bytes.data(), 40);
  m.notice.token = Get<uint64_t>(bytes.data(), 48);
  return m;
}

std::vector<uint8_t> Encode(const Hello& m) {
  std::vector<uint8_t> out(kHelloBytes, 0);
  Put<uint32_t>(out.data(), 0, kHelloMagic);
  Put<uint16_t>(out.data(), 4, kWireVersion);
  Put<uint16_t>(out.data(), 6, static_cast<uint16_t>(m.mode));
  Put<uint64_t>(out.data(), 8, m.sender);
  Put<uint64_t>(out.data(), 16, m.link);
  Put<uint64_t>(out.data(), 24, m.slots_base);
  Put<uint64_t>(out.data(), 32, m.slot_bytes);
  Put<uint32_t>(out.data(), 40, m.slots);
  Put<uint32_t>(out.data(), 44, m.key_bytes);
  Put<uint64_t>(out.data(), 48, m.token);
  return out;
}

StatusOr<Hello> DecodeHello(std::span<const uint8_t> bytes) {
  KVT_RETURN_IF_ERROR(CheckMessage(bytes, kHelloBytes, kHelloMagic, "staging hello"));
  if (Get<uint16_t>(bytes.data(), 4) != kWireVersion) {
    return DataLoss("staging hello of wire version " +
                    std::to_string(Get<uint16_t>(bytes.data(), 4)) + "; this build speaks " +
                    std::to_string(kWireVersion));
  }
  const uint16_t mode = Get<uint16_t>(bytes.data(), 6);
  if (mode > static_cast<uint16_t>(LinkMode::kRuns)) {
    return DataLoss("staging hello names link mode " + std::to_string(mode) +
                    "; expected 0 (staged chunks) or 1 (copy runs)");
  }
  Hello m;
  m.sender = Get<uint64_t>(bytes.data(), 8);
  m.link = Get<uint64_t>(bytes.data(), 16);
  m.mode = static_cast<LinkMode>(mode);
  m.slots_base = Get<uint64_t>(bytes.data(), 24);
  m.slot_bytes = Get<uint64_t>(bytes.data(), 32);
  m.slots = Get<uint32_t>(bytes.data(), 40);
  m.key_bytes = Get<uint32_t>(bytes.data(), 44);
  m.token = Get<uint64_t>(bytes.data(), 48);
  if (m.token == 0) {
    return DataLoss("staging hello of sender " + std::to_string(m.sender) + " link " +
                    std::to_string(m.link) +
                    " carries link token 0; a sender draws a random "
                    "non-zero token for every link");
  }
  if (m.slots > kMaxOfferedSlots || m.key_bytes > kMaxKeyBytes ||
      (m.slots == 0) != (m.key_bytes == 0)) {
    return DataLoss("staging hello offers " + std::to_string(m.slots) + " slots with a key of " +
                    std::to_string(m.key_bytes) + " bytes; expected both 0, or at most " +
                    std::to_string(kMaxOfferedSlots) + " slots and a key of 1.." +
                    std::to_string(kMaxKeyBytes) + " bytes");
  }
  if (m.slots != 0 &&
      (m.slot_bytes < kMinSlotBytes ||
       m.slot_bytes > std::numeric_limits<uint64_t>::max() / m.slots ||
       m.slots_base > std::numeric_limits<uint64_t>::max() - m.slot_bytes * m.slots)) {
    return DataLoss("staging hello offers " + std::to_string(m.slots) + " slots of " +
                    std::to_string(m.slot_bytes) + " bytes at " + std::to_string(m.slots_base) +
                    "; slots must be at least " + std::to_string(kMinSlotBytes) +
                    " bytes and end inside the address space");
  }
  return m;
}

std::vector<uint8_t> Encode(const HelloAck& m) {
  std::vector<uint8_t> out(kHelloAckBytes, 0);
  Put<uint32_t>(out.data(), 0, kHelloAckMagic);
  Put<uint32_t>(out.data(), 4, static_cast<uint32_t>(m.code));
  Put<uint64_t>(out.data(), 8, m.receiver);
  Put<uint64_t>(out.data(), 16, m.link);
  Put<uint32_t>(out.data(), 24, m.slots);
  Put<uint32_t>(out.data(), 28, m.in_place ? 1 : 0);
  Put<uint64_t>(out.data(), 32, m.slot_bytes);
  Put<uint64_t>(out.data(), 40, m.token);
  return out;
}

StatusOr<HelloAck> DecodeHelloAck(std::span<const uint8_t> bytes) {
  KVT_RETURN_IF_ERROR(CheckMessage(bytes, kHelloAckBytes, kHelloAckMagic, "staging hello ack"));
  HelloAck m;
  m.code = CodeFromWire(Get<uint32_t>(bytes.data(), 4));
  m.receiver = Get<uint64_t>(bytes.data(), 8);
  m.link = Get<uint64_t>(bytes.data(), 16);
  m.slots = Get<uint32_t>(bytes.data(), 24);
  const uint32_t flags = Get<uint32_t>(bytes.data(), 28);
  if (flags > 1) {
    return DataLoss("staging hello ack has flags " + std::to_string(flags) +
                    "; expected 0 or 1 (reads the slots in place)");
  }
  m.in_place = flags == 1;
  m.slot_bytes = Get<uint64_t>(bytes.data(), 32);
  m.token = Get<uint64_t>(bytes.data(), 40);
  return m;
}

std::vector<uint8_t> Encode(const ChunkAck& m) {
  std::vector<uint8_t> out(kChunkAckBytes, 0);
  Put<uint32_t>(out.data(), 0, kAckMagic);
  Put<uint32_t>(out.data(), 4, static_cast<uint32_t>(m.code));
  Put<uint64_t>(out.data(), 8, m.link);
  Put<uint64_t>(out.data(), 16, m.write);
  Put<uint32_t>(out.data(), 24, m.chunk);
  Put<uint64_t>(out.data(), 32, m.token);
  return out;
}

StatusOr<ChunkAck> DecodeChunkAck(std::span<const uint8_t> bytes) {
  KVT_RETURN_IF_ERROR(CheckMessage(bytes, kChunkAckBytes, kAckMagic, "chunk ack"));
  ChunkAck m;
  m.code = CodeFromWire(Get<uint32_t>(bytes.data(), 4));
  m.link = Get<uint64_t>(bytes.data(), 8);
  m.write = Get<uint64_t>(bytes.data(), 16);
  m.chunk = Get<uint32_t>(bytes.data(), 24);
  if (const uint32_t reserved = Get<uint32_t>(bytes.data(), 28); reserved != 0) {
    return DataLoss("chunk ack reserved field is " + std::to_string(reserved) + "; expected 0");
  }
  m.token = Get<uint64_t>(bytes.data(), 32);
  return m;
}

std::vector<uint8_t> Encode(const Bye& m) {
  std::vector<uint8_t> out(kByeBytes, 0);
  Put<uint32_t>(out.data(), 0, kByeMagic);
  Put<uint64_t>(out.data(), 8, m.sender);
  Put<uint64_t>(out.data(), 16, m.link);
  Put<uint64_t>(out.data(), 24, m.token);
  return out;
}

StatusOr<Bye> DecodeBye(std::span<const uint8_t> bytes) {
  KVT_RETURN_IF_ERROR(CheckMessage(bytes, kByeBytes, kByeMagic, "staging bye"));
  return Bye{Get<uint64_t>(bytes.data(), 8), Get<uint64_t>(bytes.data(), 16),
             Get<uint64_t>(bytes.data(), 24)};
}

// ---- copy runs as active messages ------------------------------------------------------------

StatusOr<std::vector<uint8_t>> EncodeRuns(const RunsHeader& h,
                                          std::span<const RunSegment> segments) {
  if (h.num_segments != segments.size() || segments.size() > kMaxRunSegments) {
    return InvalidArgument("a run message of " + std::to_string(segments.size()) +
                           " segments with num_segments " + std::to_string(h.num_segments) +
                           "; they must agree and be at most " + std::to_string(kMaxRunSegments));
  }
  std::vector<uint8_t> out(RunsHeaderSize(segments.size()), 0);
  Put<uint32_t>(out.data(), 0, kRunsMagic);
  Put<uint16_t>(out.data(), 4, kWireVersion);
  Put<uint64_t>(out.data(), 8, h.sender);
  Put<uint64_t>(out.data(), 16, h.link);
  Put<uint64_t>(out.data(), 24, h.write);
  Put<uint32_t>(out.data(), 32, h.message);
  Put<uint32_t>(out.data(), 36, h.num_segments);
  Put<uint64_t>(out.data(), 40, h.token);
  for (size_t i = 0; i < segments.size(); ++i) {
    uint8_t* seg = out.data() + RunsHeaderSize(i);
    Put<uint32_t>(seg, 0, segments[i].buffer);
    Put<uint64_t>(seg, 8, segments[i].offset);
    Put<uint64_t>(seg, 16, segments[i].bytes);
  }
  return out;
}

std::optional<ChunkNotice> RunsNotice(std::span<const uint8_t> header) {
  if (header.size() < kRunsHeaderBytes) return std::nullopt;
  ChunkNotice notice;
  notice.sender = Get<uint64_t>(header.data(), 8);
  notice.link = Get<uint64_t>(header.data(), 16);
  notice.write = Get<uint64_t>(header.data(), 24);
  notice.chunk = Get<uint32_t>(header.data(), 32);
  notice.token = Get<uint64_t>(header.data(), 40);
  return notice;
}

StatusOr<DecodedRuns> DecodeRuns(std::span<const uint8_t> bytes,
                                 std::span<const uint64_t> buffer_len, uint64_t data_bytes) {
  if (bytes.size() < kRunsHeaderBytes) {
    return DataLoss("run message header of " + std::to_string(bytes.size()) +
                    " bytes; expected at least " + std::to_string(kRunsHeaderBytes));
  }
  const uint32_t magic = Get<uint32_t>(bytes.data(), 0);
  if (magic != kRunsMagic) {
    return DataLoss("run message header has magic " + std::to_string(magic) + "; expected " +
                    std::to_string(kRunsMagic));
  }
  if (const uint16_t version = Get<uint16_t>(bytes.data(), 4); version != kWireVersion) {
    return DataLoss("run message of wire version " + std::to_string(version) +
                    "; this build speaks " + std::to_string(kWireVersion));
  }
  if (const uint16_t reserved = Get<uint16_t>(bytes.data(), 6); reserved != 0) {
    return DataLoss("run message header has reserved bytes " + std::to_string(reserved) +
                    "; expected 0");
  }
  DecodedRuns runs;
  RunsHeader& h = runs.header;
  h.sender = Get<uint64_t>(bytes.data(), 8);
  h.link = Get<uint64_t>(bytes.data(), 16);
  h.write = Get<uint64_t>(bytes.data(), 24);
  h.message = Get<uint32_t>(bytes.data(), 32);
  h.num_segments = Get<uint32_t>(bytes.data(), 36);
  h.token = Get<uint64_t>(bytes.data(), 40);
  if (h.num_segments == 0 || h.num_segments > kMaxRunSegments) {
    return DataLoss("run message names " + std::to_string(h.num_segments) +
                    " segments; expected 1 to " + std::to_string(kMaxRunSegments));
  }
  if (bytes.size() != RunsHeaderSize(h.num_segments)) {
    return DataLoss("run message header of " + std::to_string(bytes.size()) + " bytes for " +
                    std::to_string(h.num_segments) + " segments; expected " +
                    std::to_string(RunsHeaderSize(h.num_segments)));
  }
  runs.segments.resize(h.num_segments);
  uint64_t total = 0;
  for (uint32_t i = 0; i < h.num_segments; ++i) {
    const uint8_t* seg = bytes.data() + RunsHeaderSize(i);
    RunSegment& s = runs.segments[i];
    s.buffer = Get<uint32_t>(seg, 0);
    s.offset = Get<uint64_t>(seg, 8);
    s.bytes = Get<uint64_t>(seg, 16);
    if (const uint32_t reserved = Get<uint32_t>(seg, 4); reserved != 0) {
      return DataLoss("run segment " + std::to_string(i) + " has reserved bytes " +
                      std::to_string(reserved) + "; expected 0");
    }
    if (s.bytes == 0) return DataLoss("run segment " + std::to_string(i) + " has 0 bytes");
    if (s.buffer >= buffer_len.size()) {
      return OutOfRange("run segment " + std::to_string(i) + " names buffer " +
                        std::to_string(s.buffer) + "; this side registered " +
                        std::to_string(buffer_len.size()));
    }
    const uint64_t len = buffer_len[s.buffer];
    if (s.offset > len || s.bytes > len - s.offset) {
      return OutOfRange("run segment " + std::to_string(i) + " of " + std::to_string(s.bytes) +
                        " bytes at offset " + std::to_string(s.offset) + " does not fit buffer " +
                        std::to_string(s.buffer) + " (" + std::to_string(len) + " bytes)");
    }
    total = SatAdd(total, s.bytes);
  }
  if (total != data_bytes) {
    return DataLoss("run message segments hold " + std::to_string(total) + " bytes but " +
                    std::to_string(data_bytes) + " arrived");
  }
  return runs;
}

// ---- descriptor trailer -----------------------------------------------------------------------
// 0 magic u32, 4 version u16, 6 flags u16 (bit 0: staged, bit 1: copy runs as messages),
// 8 instance, 16 slots u32, 20 runs_address_bytes u32, 24 slot_bytes.

std::string AppendTrailer(std::string_view worker_address, AddressTrailer t,
                          std::string_view runs_address) {
  std::string out(worker_address);
  out.append(runs_address);
  t.runs_address_bytes = static_cast<uint32_t>(runs_address.size());
  uint8_t bytes[kTrailerBytes] = {};
  Put<uint32_t>(bytes, 0, kTrailerMagic);
  Put<uint16_t>(bytes, 4, kWireVersion);
  Put<uint16_t>(bytes, 6,
                static_cast<uint16_t>((t.staged ? 1 : 0) | (t.runs_address_bytes > 0 ? 2 : 0)));
  Put<uint64_t>(bytes, 8, t.instance);
  Put<uint32_t>(bytes, 16, t.slots);
  Put<uint32_t>(bytes, 20, t.runs_address_bytes);
  Put<uint64_t>(bytes, 24, t.slot_bytes);
  out.append(reinterpret_cast<const char*>(bytes), kTrailerBytes);
  return out;
}

SplitAddress SplitPeerAddress(std::string_view address) {
  SplitAddress split;
  split.worker_address = address;
  if (address.size() <= kTrailerBytes) return split;
  const auto* t = reinterpret_cast<const uint8_t*>(address.data() + address.size() - kTrailerBytes);
  if (Get<uint32_t>(t, 0) != kTrailerMagic || Get<uint16_t>(t, 4) != kWireVersion) return split;
  AddressTrailer trailer;
  const uint16_t flags = Get<uint16_t>(t, 6);
  trailer.staged = (flags & 1) != 0;
  trailer.instance = Get<uint64_t>(t, 8);
  trailer.slots = Get<uint32_t>(t, 16);
  trailer.runs_address_bytes = Get<uint32_t>(t, 20);
  trailer.slot_bytes = Get<uint64_t>(t, 24);
  const size_t rest = address.size() - kTrailerBytes;
  // A runs address that does not fit (or a flag without one) leaves it out: the worker address
  // check then refuses what remains.
  if ((flags & 2) == 0 || trailer.runs_address_bytes >= rest) trailer.runs_address_bytes = 0;
  split.worker_address = address.substr(0, rest - trailer.runs_address_bytes);
  split.runs_address =
      address.substr(rest - trailer.runs_address_bytes, trailer.runs_address_bytes);
  split.trailer = trailer;
  return split;
}

// ---- credits ----------------------------------------------------------------------------------

bool CreditWindow::Acquire(uint64_t write, uint32_t chunk) {
  if (available() == 0) return false;
  return held_.insert({write, chunk}).second;
}

bool CreditWindow::Release(uint64_t write, uint32_t chunk) {
  return held_.erase({write, chunk}) != 0;
}

uint32_t CreditWindow::ReleaseWrite(uint64_t write) {
  auto begin = held_.lower_bound({write, 0});
  auto end = held_.upper_bound({write, std::numeric_limits<uint32_t>::max()});
  const uint32_t n = static_cast<uint32_t>(std::distance(begin, end));
  held_.erase(begin, end);
  return n;
}

uint32_t CreditWindow::HeldBy(uint64_t write) const {
  auto begin = held_.lower_bound({write, 0});
  auto end = held_.upper_bound({write, std::numeric_limits<uint32_t>::max()});
  return static_cast<uint32_t>(std::distance(begin, end));
}

}  // namespace kvt::transfer::ucx_staging

#include "backends/nccl/nccl_protocol.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <limits>

#include "backends/common/host_identity.h"

namespace kvt::transfer::nccl {
namespace {

constexpr char kHeaderMagic[4] = {'K', 'V', 'N', 'H'};
constexpr char kAckMagic[4] = {'K', 'V', 'N', 'A'};
// 2: buffers by transfer layer with their own page bytes, num_buffers, whole-page chunks (1
// addressed K l and V L + l of one page size).
constexpr uint16_t kWireVersion = 2;
constexpr size_t kAckMessageOffset = 34;

std::string Num(uint64_t v) { return std::to_string(v); }
std::string Num(int64_t v) { return std::to_string(v); }
std::string Num(int32_t v) { return std::to_string(v); }
std::string Num(uint32_t v) { return std::to_string(v); }

template <typename T>
void Put(std::span<uint8_t> out, size_t at, T value) {
  static_assert(std::is_integral_v<T>);
  using U = std::make_unsigned_t<T>;
  const U v = static_cast<U>(value);
  for (size_t i = 0; i < sizeof(T); ++i) out[at + i] = static_cast<uint8_t>((v >> (8 * i)) & 0xFF);
}

template <typename T>
T Get(std::span<const uint8_t> in, size_t at) {
  static_assert(std::is_integral_v<T>);
  using U = std::make_unsigned_t<T>;
  U v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<U>(static_cast<U>(in[at + i]) << (8 * i));
  return static_cast<T>(v);
}

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i]))) {
      return false;
    }
  }
  return true;
}

// a * b, or false on overflow.
bool MulOk(uint64_t a, uint64_t b, uint64_t& out) {
  if (a != 0 && b > std::numeric_limits<uint64_t>::max() / a) return false;
  out = a * b;
  return true;
}

bool AddOk(uint64_t a, uint64_t b, uint64_t& out) {
  if (b > std::numeric_limits<uint64_t>::max() - a) return false;
  out = a + b;
  return true;
}

// Splits `count` items into the fewest groups of at most `limit`, evenly sized.
uint64_t EvenGroupSize(uint64_t count, uint64_t limit) {
  const uint64_t groups = (count + limit - 1) / limit;
  return (count + groups - 1) / groups;
}

}  // namespace

// ---- Process addresses ----------------------------------------------------------------------

std::string EncodeAddress(const ProcessAddress& a) {
  return std::string(kAddressPrefix) + " boot=" + a.boot_id + " pid=" + Num(a.pid) +
         " dev=" + Num(a.device) + " pci=" + a.pci_bus_id;
}

StatusOr<ProcessAddress> DecodeAddress(std::string_view text) {
  static constexpr TextRecordFormat kFormat = {
      .prefix = kAddressPrefix,
      .what = "nccl address",
      .not_one = "not an nccl address",
      .use_instead = "the peer must use the nccl backend",
  };
  KVT_ASSIGN_OR_RETURN(const TextRecordFields fields, ParseTextRecord(text, kFormat));
  ProcessAddress a;
  bool have_boot = false, have_pid = false, have_dev = false, have_pci = false;
  for (const auto& [name, value] : fields) {
    bool ok = !value.empty();
    if (name == "boot") {
      a.boot_id = std::string(value);
      have_boot = true;
    } else if (name == "pid") {
      ok = ok && ParseNumber(value, a.pid, 10);
      have_pid = true;
    } else if (name == "dev") {
      ok = ok && ParseNumber(value, a.device, 10) && a.device >= 0;
      have_dev = true;
    } else if (name == "pci") {
      a.pci_bus_id = std::string(value);
      have_pci = true;
    }
    if (!ok) {
      return InvalidArgument("nccl address field '" + ShownText(name) + "=" + ShownText(value) +
                             "' has a malformed value in '" + ShownText(text) + "'");
    }
  }
  const char* missing = !have_boot  ? "boot"
                        : !have_pid ? "pid"
                        : !have_dev ? "dev"
                        : !have_pci ? "pci"
                                    : nullptr;
  if (missing != nullptr) {
    return InvalidArgument(std::string("nccl address lacks the '") + missing + "=' field: '" +
                           ShownText(text) + "'");
  }
  return a;
}

Status CheckPeerPlacement(const ProcessAddress& local, const ProcessAddress& peer) {
  if (local.boot_id != peer.boot_id) return OkStatus();  // another host: its own GPUs
  if (!EqualsIgnoreCase(local.pci_bus_id, peer.pci_bus_id)) return OkStatus();
  return FailedPrecondition("the peer (pid " + Num(peer.pid) + ", device " + Num(peer.device) +
                            ") uses GPU " + peer.pci_bus_id + ", the same GPU as this side (pid " +
                            Num(local.pid) + ", device " + Num(local.device) +
                            "): nccl needs one GPU per rank; use cuda_ipc on one GPU");
}

const std::string& ThisBootId() {
  static const std::string boot_id = ReadBootId("nccl");
  return boot_id;
}

// ---- Pair token -----------------------------------------------------------------------------

std::string EncodeToken(const PairToken& token) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string id;
  id.reserve(2 * kUniqueIdBytes);
  for (char c : token.unique_id) {
    const auto b = static_cast<uint8_t>(c);
    id.push_back(kDigits[b >> 4]);
    id.push_back(kDigits[b & 0xF]);
  }
  return std::string(kTokenPrefix) + " slot=" + Num(token.slot_bytes) +
         " tick=" + Num(token.idle_tick_ms) + " nonce=" + HexDigits(token.nonce) + " id=" + id;
}

StatusOr<PairToken> DecodeToken(std::string_view text) {
  static constexpr TextRecordFormat kFormat = {
      .prefix = kTokenPrefix,
      .what = "nccl pair token",
      .not_one = "not an nccl pair token",
      .use_instead = "the peer must use the nccl backend",
  };
  KVT_ASSIGN_OR_RETURN(const TextRecordFields fields, ParseTextRecord(text, kFormat));
  PairToken token;
  bool have_slot = false, have_tick = false, have_nonce = false, have_id = false;
  for (const auto& [name, value] : fields) {
    if (name == "slot") {
      if (!ParseNumber(value, token.slot_bytes, 10)) {
        return InvalidArgument("nccl pair token: slot '" + ShownText(value) + "' is not a number");
      }
      have_slot = true;
    } else if (name == "tick") {
      if (!ParseNumber(value, token.idle_tick_ms, 10)) {
        return InvalidArgument("nccl pair token: tick '" + ShownText(value) + "' is not a number");
      }
      have_tick = true;
    } else if (name == "nonce") {
      if (!ParseNumber(value, token.nonce, 16)) {
        return InvalidArgument("nccl pair token: nonce '" + ShownText(value) + "' is not hex");
      }
      have_nonce = true;
    } else if (name == "id") {
      if (value.size() != 2 * kUniqueIdBytes) {
        return InvalidArgument("nccl pair token: the communicator id has " + Num(value.size()) +
                               " hex digits, expected " + Num(2 * kUniqueIdBytes) +
                               " (truncated or corrupted hello-ack)");
      }
      for (size_t i = 0; i < kUniqueIdBytes; ++i) {
        uint8_t byte = 0;
        if (!ParseNumber(value.substr(2 * i, 2), byte, 16)) {
          return InvalidArgument("nccl pair token: the communicator id has a non-hex digit at " +
                                 Num(2 * i));
        }
        token.unique_id[i] = static_cast<char>(byte);
      }
      have_id = true;
    }
  }
  const char* missing = !have_slot    ? "slot"
                        : !have_tick  ? "tick"
                        : !have_nonce ? "nonce"
                        : !have_id    ? "id"
                                      : nullptr;
  if (missing != nullptr) {
    return InvalidArgument(std::string("nccl pair token lacks the '") + missing + "=' field");
  }
  if (token.slot_bytes < kMinSlotBytes || token.slot_bytes > kMaxSlotBytes) {
    return InvalidArgument("nccl pair token asks for " + Num(token.slot_bytes) +
                           "-byte staging slots; they must be in [" + Num(kMinSlotBytes) + ", " +
                           Num(kMaxSlotBytes) + "]");
  }
  return token;
}

// ---- Chunk planning -------------------------------------------------------------------------

StatusOr<std::vector<ChunkSpec>> PlanChunks(const ChunkPlanInput& in) {
  if (in.layers == nullptr || in.item_len.size() != in.layers->num_buffers()) {
    return InvalidArgument(
        "nccl chunk plan: " + Num(uint64_t{in.item_len.size()}) + " page sizes for a pool of " +
        Num(uint64_t{in.layers == nullptr ? 0 : in.layers->num_buffers()}) +
        " buffers; pass the registration's layer table and one page size per buffer");
  }
  if (in.unit_bytes.size() > kMaxUnits) {
    return InvalidArgument("a page write names " + Num(uint64_t{in.unit_bytes.size()}) +
                           " units of a page; the nccl backend moves at most " + Num(kMaxUnits) +
                           " (none: whole pages)");
  }
  uint64_t unit_sum = 0;
  for (size_t u = 0; u < in.unit_bytes.size(); ++u) {
    if (in.unit_bytes[u] == 0) {
      return InvalidArgument("unit " + Num(uint64_t{u}) +
                             " of the page write has 0 bytes; give every unit at least one byte");
    }
    if (!AddOk(unit_sum, in.unit_bytes[u], unit_sum)) {
      return InvalidArgument("the page write's units overflow 64 bits");
    }
  }
  if (in.num_pages < 0 || in.layer_begin < 0 || in.layer_end < in.layer_begin ||
      in.layer_end > in.layers->num_layers()) {
    return InvalidArgument("page write of " + Num(in.num_pages) + " pages over layers [" +
                           Num(in.layer_begin) + ", " + Num(in.layer_end) + ") of a pool of " +
                           Num(in.layers->num_layers()) +
                           " transfer layers; pass 0 or more pages and a range inside [0, " +
                           Num(in.layers->num_layers()) + "]");
  }
  if (in.max_pages == 0) return InvalidArgument("max_pages per chunk is 0; pass at least 1");
  std::vector<ChunkSpec> chunks;
  if (in.num_pages == 0 || in.layer_begin == in.layer_end) return chunks;

  // What one page of each layer weighs in a payload: its buffers' page bytes (whole pages) or
  // the unit bytes once per buffer. Saturating: a weight beyond any slot is refused below.
  const size_t layers = static_cast<size_t>(in.layer_end - in.layer_begin);
  std::vector<uint64_t> weight(layers, 0);
  for (size_t i = 0; i < layers; ++i) {
    const int32_t l = in.layer_begin + static_cast<int32_t>(i);
    const std::vector<uint64_t> page_bytes = ChunkPageBytes(*in.layers, in.item_len, l, l + 1);
    weight[i] = ChunkPayloadBytes(page_bytes, in.unit_bytes, 1);
    if (weight[i] > in.payload_capacity) {
      return InvalidArgument("one page of transfer layer " + Num(l) + " (" +
                             Num(uint64_t{page_bytes.size()}) + " buffers, " + Num(weight[i]) +
                             " bytes) does not fit a staging slot's " + Num(in.payload_capacity) +
                             " payload bytes; raise the nccl slot size to at least " +
                             Num(weight[i] > kMaxSlotBytes ? weight[i] : weight[i] + kHeaderBytes) +
                             " bytes (at most " + Num(kMaxSlotBytes) + "), or pass units");
    }
  }
  const uint64_t heaviest = *std::max_element(weight.begin(), weight.end());
  const uint64_t pages = static_cast<uint64_t>(in.num_pages);
  if (pages <= std::min<uint64_t>(in.payload_capacity / heaviest, in.max_pages)) {
    // Whole layers per chunk: the most g whose heaviest window of g layers fits with every page
    // (the payload grows with the window's weight), then as many layers per chunk, evenly.
    std::vector<uint64_t> prefix(layers + 1, 0);
    for (size_t i = 0; i < layers; ++i) prefix[i + 1] = prefix[i] + weight[i];
    auto fits = [&](size_t g) {
      for (size_t s = 0; s + g <= layers; ++s) {
        uint64_t bytes = 0;
        if (!MulOk(prefix[s + g] - prefix[s], pages, bytes) || bytes > in.payload_capacity) {
          return false;
        }
      }
      return true;
    };
    size_t lo = 1, hi = layers;  // fits(lo) holds; find the largest g that fits
    while (lo < hi) {
      const size_t mid = lo + (hi - lo + 1) / 2;
      if (fits(mid)) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const uint64_t per_chunk = EvenGroupSize(layers, lo);
    for (uint64_t l = 0; l < layers; l += per_chunk) {
      const uint64_t n = std::min<uint64_t>(per_chunk, layers - l);
      chunks.push_back(ChunkSpec{in.layer_begin + static_cast<int32_t>(l),
                                 in.layer_begin + static_cast<int32_t>(l + n), 0, in.num_pages,
                                 (prefix[l + n] - prefix[l]) * pages});
    }
    return chunks;
  }
  for (size_t i = 0; i < layers; ++i) {
    const int32_t l = in.layer_begin + static_cast<int32_t>(i);
    const uint64_t page_limit = std::min<uint64_t>(in.payload_capacity / weight[i], in.max_pages);
    const uint64_t per_chunk = EvenGroupSize(pages, page_limit);
    for (uint64_t p = 0; p < pages; p += per_chunk) {
      const uint64_t n = std::min(per_chunk, pages - p);
      chunks.push_back(
          ChunkSpec{l, l + 1, static_cast<int64_t>(p), static_cast<int64_t>(p + n), n * weight[i]});
    }
  }
  return chunks;
}

std::vector<uint64_t> ChunkPageBytes(const LayerTable& table, std::span<const uint64_t> item_len,
                                     int32_t begin, int32_t end) {
  std::vector<uint64_t> bytes;
  const std::span<const uint32_t> buffers = table.Buffers(begin, end);
  bytes.reserve(buffers.size());
  for (uint32_t b : buffers) bytes.push_back(item_len[b]);
  return bytes;
}

uint64_t ChunkPayloadBytes(std::span<const uint64_t> page_bytes,
                           std::span<const uint64_t> unit_bytes, uint64_t num_pages) {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  uint64_t per_page = 0;
  if (unit_bytes.empty()) {
    for (uint64_t bytes : page_bytes) {
      if (!AddOk(per_page, bytes, per_page)) return kMax;
    }
  } else {
    uint64_t unit_sum = 0;
    for (uint64_t bytes : unit_bytes) {
      if (!AddOk(unit_sum, bytes, unit_sum)) return kMax;
    }
    if (!MulOk(unit_sum, page_bytes.size(), per_page)) return kMax;
  }
  uint64_t total = 0;
  return MulOk(per_page, num_pages, total) ? total : kMax;
}

uint64_t UnitPayloadOffset(std::span<const uint64_t> unit_bytes, size_t unit, int64_t num_buffers,
                           int64_t num_pages) {
  uint64_t offset = 0;
  for (size_t u = 0; u < unit && u < unit_bytes.size(); ++u) {
    offset += static_cast<uint64_t>(num_buffers) * static_cast<uint64_t>(num_pages) * unit_bytes[u];
  }
  return offset;
}

std::vector<kernels::PackArgs> ChunkStagingArgs(const uint64_t* bases,
                                                std::span<const uint64_t> page_bytes,
                                                const int32_t* pages, int64_t num_pages,
                                                std::span<const UnitSpan> units, uint8_t* payload) {
  // Whole pages are one unit of each buffer's own page bytes.
  const bool whole_pages = units.empty();
  const UnitSpan whole{0, 0};
  const std::span<const UnitSpan> spans =
      whole_pages ? std::span<const UnitSpan>(&whole, 1) : units;
  std::vector<kernels::PackArgs> launches;
  uint64_t offset = 0;
  for (const UnitSpan& unit : spans) {
    for (size_t i = 0; i < page_bytes.size();) {
      size_t j = i + 1;
      while (j < page_bytes.size() && page_bytes[j] == page_bytes[i]) ++j;
      const uint64_t bytes = whole_pages ? page_bytes[i] : unit.bytes;
      kernels::PackArgs args;
      args.bases = bases + i;
      args.num_buffers = static_cast<int32_t>(j - i);
      args.pages = pages;
      args.num_pages = num_pages;
      args.page_stride = static_cast<int64_t>(page_bytes[i]);
      args.offset = static_cast<int64_t>(unit.offset);
      args.bytes = static_cast<int64_t>(bytes);
      args.staging = payload + offset;
      launches.push_back(args);
      offset += static_cast<uint64_t>(j - i) * static_cast<uint64_t>(num_pages) * bytes;
      i = j;
    }
  }
  return launches;
}

// ---- Chunk header ---------------------------------------------------------------------------
//
// Fields (little-endian): 0 magic, 4 version u16, 6 kind u16, 8 step u64; kChunk only: 16 write
// u64, 24 chunk_index u32, 28 chunk_count u32, 32 num_layers i32, 36 layer_begin i32,
// 40 layer_end i32, 44 num_units u32, 48 num_pages u32, 52 num_buffers u32, 56 payload_bytes u64,
// 64 whole_pages u32 (0 or 1), [68, kUnitsOffset) reserved (zero), the units at kUnitsOffset
// (offset u64, bytes u64), the destination pages at kPagesOffset (int32).

void EncodeChunkHeader(const ChunkHeader& h, std::span<uint8_t> out) {
  std::fill(out.begin(), out.begin() + kHeaderBytes, uint8_t{0});
  std::memcpy(out.data(), kHeaderMagic, sizeof(kHeaderMagic));
  Put<uint16_t>(out, 4, kWireVersion);
  Put<uint16_t>(out, 6, static_cast<uint16_t>(h.kind));
  Put<uint64_t>(out, 8, h.step);
  if (h.kind != HeaderKind::kChunk) return;
  Put<uint64_t>(out, 16, h.write_id);
  Put<uint32_t>(out, 24, h.chunk_index);
  Put<uint32_t>(out, 28, h.chunk_count);
  Put<int32_t>(out, 32, h.num_layers);
  Put<int32_t>(out, 36, h.layer_begin);
  Put<int32_t>(out, 40, h.layer_end);
  Put<uint32_t>(out, 44, static_cast<uint32_t>(h.units.size()));
  Put<uint32_t>(out, 48, static_cast<uint32_t>(h.dst_pages.size()));
  Put<uint32_t>(out, 52, h.num_buffers);
  Put<uint64_t>(out, 56, h.payload_bytes);
  Put<uint32_t>(out, 64, h.whole_pages ? 1u : 0u);
  for (size_t u = 0; u < h.units.size() && u < kMaxUnits; ++u) {
    Put<uint64_t>(out, kUnitsOffset + 16 * u, h.units[u].offset);
    Put<uint64_t>(out, kUnitsOffset + 16 * u + 8, h.units[u].bytes);
  }
  for (size_t i = 0; i < h.dst_pages.size() && i < kMaxChunkPages; ++i) {
    Put<int32_t>(out, kPagesOffset + 4 * i, h.dst_pages[i]);
  }
}

StatusOr<ChunkHeader> DecodeChunkHeader(std::span<const uint8_t> in, uint64_t expected_step,
                                        uint64_t payload_capacity) {
  const std::string where = "nccl chunk header of step " + Num(expected_step);
  if (in.size() < kHeaderBytes) {
    return DataLoss(where + " has " + Num(uint64_t{in.size()}) + " bytes, expected " +
                    Num(kHeaderBytes));
  }
  if (std::memcmp(in.data(), kHeaderMagic, sizeof(kHeaderMagic)) != 0) {
    return DataLoss(where + " lacks the 'KVNH' magic: the peers are out of step or not both kvt");
  }
  const uint16_t version = Get<uint16_t>(in, 4);
  if (version != kWireVersion) {
    return DataLoss(where + " is version " + Num(uint32_t{version}) + ", this build speaks " +
                    Num(uint32_t{kWireVersion}) + "; run the same kvt version on both sides");
  }
  ChunkHeader h;
  const uint16_t kind = Get<uint16_t>(in, 6);
  if (kind > static_cast<uint16_t>(HeaderKind::kClose)) {
    return DataLoss(where + " has unknown kind " + Num(uint32_t{kind}));
  }
  h.kind = static_cast<HeaderKind>(kind);
  h.step = Get<uint64_t>(in, 8);
  if (h.step != expected_step) {
    return DataLoss(where + " says it is step " + Num(h.step) +
                    ": the two ranks disagree about the step sequence");
  }
  if (h.kind != HeaderKind::kChunk) return h;

  h.write_id = Get<uint64_t>(in, 16);
  h.chunk_index = Get<uint32_t>(in, 24);
  h.chunk_count = Get<uint32_t>(in, 28);
  h.num_layers = Get<int32_t>(in, 32);
  h.layer_begin = Get<int32_t>(in, 36);
  h.layer_end = Get<int32_t>(in, 40);
  const uint32_t num_units = Get<uint32_t>(in, 44);
  const uint32_t num_pages = Get<uint32_t>(in, 48);
  h.num_buffers = Get<uint32_t>(in, 52);
  h.payload_bytes = Get<uint64_t>(in, 56);
  const uint32_t whole_pages = Get<uint32_t>(in, 64);
  const std::string chunk = where + " (write " + Num(h.write_id) + ", chunk " + Num(h.chunk_index) +
                            " of " + Num(h.chunk_count) + ")";
  if (h.chunk_index >= h.chunk_count) return DataLoss(chunk + ": chunk index out of range");
  for (uint64_t at = 68; at < kUnitsOffset; at += 4) {
    if (Get<uint32_t>(in, at) != 0) {
      return DataLoss(chunk + ": reserved bytes at " + Num(at) + " hold " +
                      Num(Get<uint32_t>(in, at)) + "; expected 0");
    }
  }
  if (whole_pages > 1) {
    return DataLoss(chunk + ": whole_pages = " + Num(whole_pages) + "; expected 0 or 1");
  }
  h.whole_pages = whole_pages == 1;
  if (h.whole_pages ? num_units != 0 : (num_units == 0 || num_units > kMaxUnits)) {
    return DataLoss(chunk + " names num_units = " + Num(num_units) +
                    " with whole_pages = " + Num(whole_pages) +
                    "; a whole-page chunk names 0 units, others 1 to " + Num(kMaxUnits));
  }
  if (num_pages == 0 || num_pages > kMaxChunkPages) {
    return DataLoss(chunk + " names num_pages = " + Num(num_pages) + "; 1 to " +
                    Num(kMaxChunkPages) + " are allowed");
  }
  if (h.num_layers <= 0 || h.layer_begin < 0 || h.layer_end <= h.layer_begin ||
      h.layer_end > h.num_layers) {
    return DataLoss(chunk + " has layers [" + Num(h.layer_begin) + ", " + Num(h.layer_end) +
                    ") of " + Num(h.num_layers));
  }
  // Every transfer layer holds at least one buffer.
  if (h.num_buffers < static_cast<uint32_t>(h.layer_end - h.layer_begin)) {
    return DataLoss(chunk + " names num_buffers = " + Num(h.num_buffers) + " for layers [" +
                    Num(h.layer_begin) + ", " + Num(h.layer_end) + "), fewer than one per layer");
  }
  h.units.resize(num_units);
  std::vector<uint64_t> unit_bytes(num_units);
  uint64_t unit_sum = 0;
  for (uint32_t u = 0; u < num_units; ++u) {
    h.units[u].offset = Get<uint64_t>(in, kUnitsOffset + 16 * u);
    h.units[u].bytes = Get<uint64_t>(in, kUnitsOffset + 16 * u + 8);
    unit_bytes[u] = h.units[u].bytes;
    if (h.units[u].bytes == 0 || !AddOk(unit_sum, h.units[u].bytes, unit_sum)) {
      return DataLoss(chunk + ": unit " + Num(u) + " has " + Num(h.units[u].bytes) + " bytes");
    }
  }
  h.dst_pages.resize(num_pages);
  for (uint32_t i = 0; i < num_pages; ++i) h.dst_pages[i] = Get<int32_t>(in, kPagesOffset + 4 * i);
  if (h.whole_pages) {
    // pages x the buffers' page bytes: a positive multiple of the page count.
    if (h.payload_bytes == 0 || h.payload_bytes % num_pages != 0) {
      return DataLoss(chunk + " declares payload_bytes = " + Num(h.payload_bytes) +
                      ", not a positive multiple of its " + Num(num_pages) + " whole pages");
    }
  } else {
    uint64_t expected = 0;
    if (!MulOk(unit_sum, h.num_buffers, expected) || !MulOk(expected, num_pages, expected) ||
        expected != h.payload_bytes) {
      return DataLoss(chunk + " declares payload_bytes = " + Num(h.payload_bytes) +
                      " but its units, buffers and pages describe a different amount");
    }
  }
  if (h.payload_bytes > payload_capacity) {
    return DataLoss(chunk + " carries " + Num(h.payload_bytes) +
                    " payload bytes; this side's slots hold " + Num(payload_capacity));
  }
  return h;
}

Status CheckChunkFits(const ChunkHeader& h, const ReceiverLayout& layout) {
  const std::string chunk = "chunk " + Num(h.chunk_index) + " of write " + Num(h.write_id);
  const int32_t pool_layers = layout.layers.num_layers();
  if (h.num_layers != pool_layers) {
    return InvalidArgument(chunk + " comes from a pool of " + Num(h.num_layers) +
                           " transfer layers, this side registered " + Num(pool_layers) +
                           "; both sides must register the same layout");
  }
  if (layout.item_len.size() != layout.layers.num_buffers() ||
      layout.buffer_len.size() != layout.layers.num_buffers()) {
    return FailedPrecondition("this side's layout has " + Num(uint64_t{layout.item_len.size()}) +
                              " page sizes and " + Num(uint64_t{layout.buffer_len.size()}) +
                              " lengths for " + Num(uint64_t{layout.layers.num_buffers()}) +
                              " buffers");
  }
  if (h.layer_begin < 0 || h.layer_end <= h.layer_begin || h.layer_end > pool_layers) {
    return OutOfRange(chunk + " names layers [" + Num(h.layer_begin) + ", " + Num(h.layer_end) +
                      ") outside this side's " + Num(pool_layers));
  }
  const std::span<const uint32_t> buffers = layout.layers.Buffers(h.layer_begin, h.layer_end);
  if (h.num_buffers != buffers.size()) {
    return InvalidArgument(chunk + " carries num_buffers = " + Num(h.num_buffers) +
                           " for layers [" + Num(h.layer_begin) + ", " + Num(h.layer_end) +
                           "), which hold " + Num(uint64_t{buffers.size()}) +
                           " buffers here; both sides must register the same layout");
  }
  const std::vector<uint64_t> page_bytes =
      ChunkPageBytes(layout.layers, layout.item_len, h.layer_begin, h.layer_end);
  uint64_t unit_end = 0;  // the bytes of a page the chunk writes end here (whole pages: per buffer)
  for (size_t u = 0; u < h.units.size(); ++u) {
    const UnitSpan& unit = h.units[u];
    for (size_t i = 0; i < buffers.size(); ++i) {
      if (unit.bytes > page_bytes[i] || unit.offset > page_bytes[i] - unit.bytes) {
        return OutOfRange(chunk + ": unit " + Num(uint64_t{u}) + " writes [" + Num(unit.offset) +
                          ", +" + Num(unit.bytes) + ") of a page, but this side's buffer " +
                          Num(buffers[i]) + " has " + Num(page_bytes[i]) + "-byte pages");
      }
    }
    unit_end = std::max(unit_end, unit.offset + unit.bytes);
  }
  if (h.whole_pages) {
    const uint64_t expected =
        ChunkPayloadBytes(page_bytes, {}, static_cast<uint64_t>(h.dst_pages.size()));
    if (expected != h.payload_bytes) {
      return InvalidArgument(
          chunk + " carries " + Num(h.payload_bytes) + " bytes of " +
          Num(uint64_t{h.dst_pages.size()}) + " whole pages, but this side's buffers of layers [" +
          Num(h.layer_begin) + ", " + Num(h.layer_end) + ") take " + Num(expected) +
          ": the page sizes differ; pass units to move part of each page");
    }
  }
  // Page p is in range when p * page bytes + (unit_end, or the page bytes) <= the buffer's
  // length, for every buffer of the chunk.
  uint64_t last_page = std::numeric_limits<uint64_t>::max();
  size_t limiting = 0;
  bool any_page = true;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const uint64_t item = page_bytes[i];
    const uint64_t end = h.whole_pages ? item : unit_end;
    const uint64_t len = layout.buffer_len[buffers[i]];
    if (item == 0 || len < end) {
      any_page = false;
      limiting = i;
      break;
    }
    const uint64_t last = (len - end) / item;
    if (last < last_page) {
      last_page = last;
      limiting = i;
    }
  }
  for (size_t i = 0; i < h.dst_pages.size(); ++i) {
    const int32_t p = h.dst_pages[i];
    if (p < 0 || !any_page || static_cast<uint64_t>(p) > last_page) {
      const uint32_t b = buffers[limiting];
      return OutOfRange(chunk + ": destination page " + Num(p) + " (entry " + Num(uint64_t{i}) +
                        ") lies outside this side's buffer " + Num(b) + " (" +
                        Num(layout.buffer_len[b]) + " bytes, " + Num(layout.item_len[b]) +
                        " per page)");
    }
  }
  return OkStatus();
}

// ---- Acknowledgement ------------------------------------------------------------------------

void EncodeAck(const Ack& ack, std::span<uint8_t> out) {
  std::fill(out.begin(), out.begin() + kAckBytes, uint8_t{0});
  std::memcpy(out.data(), kAckMagic, sizeof(kAckMagic));
  Put<uint16_t>(out, 4, kWireVersion);
  Put<uint64_t>(out, 8, ack.step);
  Put<uint32_t>(out, 16, static_cast<uint32_t>(ack.code));
  Put<uint32_t>(out, 20, ack.chunk_index);
  Put<uint64_t>(out, 24, ack.write_id);
  const size_t length = std::min(ack.message.size(), kAckBytes - kAckMessageOffset);
  Put<uint16_t>(out, 32, static_cast<uint16_t>(length));
  std::memcpy(out.data() + kAckMessageOffset, ack.message.data(), length);
}

StatusOr<Ack> DecodeAck(std::span<const uint8_t> in, uint64_t expected_step) {
  const std::string where = "nccl ack of step " + Num(expected_step);
  if (in.size() < kAckBytes) {
    return DataLoss(where + " has " + Num(in.size()) + " bytes, expected " + Num(kAckBytes));
  }
  if (std::memcmp(in.data(), kAckMagic, sizeof(kAckMagic)) != 0 ||
      Get<uint16_t>(in, 4) != kWireVersion) {
    return DataLoss(where + " lacks the 'KVNA' magic or has another version");
  }
  Ack ack;
  ack.step = Get<uint64_t>(in, 8);
  if (ack.step != expected_step) {
    return DataLoss(where + " says it is step " + Num(ack.step) +
                    ": the two ranks disagree about the step sequence");
  }
  const uint32_t code = Get<uint32_t>(in, 16);
  if (code > static_cast<uint32_t>(StatusCode::kInProgress)) {
    return DataLoss(where + " carries unknown status code " + Num(code));
  }
  ack.code = static_cast<StatusCode>(code);
  ack.chunk_index = Get<uint32_t>(in, 20);
  ack.write_id = Get<uint64_t>(in, 24);
  const size_t length = Get<uint16_t>(in, 32);
  if (length > kAckBytes - kAckMessageOffset) {
    return DataLoss(where + " declares a " + Num(length) + "-byte message");
  }
  ack.message.assign(reinterpret_cast<const char*>(in.data()) + kAckMessageOffset, length);
  return ack;
}

}  // namespace kvt::transfer::nccl

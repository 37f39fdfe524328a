// The backends' own wire formats, which a connected peer controls: CUDA IPC addresses and region
// keys, NCCL addresses, pair tokens, chunk headers and acks, the staged UCX chunks and active
// message headers, the UCX address trailer, UCX's own packed worker addresses and memory keys
// (checked before UCX sees them, ucx_peer_check.h), and the text records the addresses are built
// on.
//
// Input: byte 0 picks the decoder (modulo the count below); the rest is what it decodes.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "backends/common/host_identity.h"
#include "backends/common/layer_table.h"
#include "backends/cuda_ipc/cuda_ipc_codec.h"
#include "backends/nccl/nccl_protocol.h"
#include "backends/ucx/ucx_peer_check.h"
#include "backends/ucx/ucx_staged_protocol.h"
#include "fuzz_common.h"

using namespace kvt;
using namespace kvt::transfer;

namespace {

// The receiving pool of the chunk decoders: 4 layers of 64 pages (and the dummy page).
constexpr int32_t kLayers = 4;
constexpr uint64_t kPages = 65;

enum Decoder : uint8_t {
  kCudaIpcAddress,
  kCudaIpcRegionKey,
  kNcclAddress,
  kNcclToken,
  kNcclChunkHeader,
  kNcclAck,
  kUcxChunk,
  kUcxMessages,
  kUcxAddressTrailer,
  kTextRecord,
  kUcxWorkerAddress,
  kUcxPackedKey,
  kDecoderCount,
};

// The staged receiver's pool: K/V of layers 0..3 (buffers 0..7) and a latent group of layers
// 4 and 5 with 256-byte pages (buffers 8, 9), every buffer kPages pages.
ucx_staging::ChunkLimits UcxLimits() {
  std::vector<int32_t> layers = {0, 1, 2, 3, 0, 1, 2, 3, kLayers, kLayers + 1};
  ucx_staging::ChunkLimits limits;
  limits.layers = LayerTable::FromLayers(layers).value();
  for (int32_t layer : layers) {
    const uint64_t item = layer < kLayers ? fuzz::kLocalItemLen : 256;
    limits.item_len.push_back(item);
    limits.buffer_len.push_back(kPages * item);
  }
  return limits;
}

void DecodeUcxChunk(std::span<const uint8_t> bytes) {
  static const ucx_staging::ChunkLimits limits = UcxLimits();
  StatusOr<ucx_staging::DecodedChunk> chunk = ucx_staging::DecodeChunk(bytes, limits);
  if (!chunk.ok()) return;
  // What the receiver then copies out of the payload into its pool must lie inside both.
  const ucx_staging::ChunkHeader& h = chunk->header;
  KVT_FUZZ_CHECK(h.layer_begin >= 0 && h.layer_begin < h.layer_end &&
                 h.layer_end <= limits.layers.num_layers());
  const std::span<const uint32_t> buffers = limits.layers.Buffers(h.layer_begin, h.layer_end);
  KVT_FUZZ_CHECK(buffers.size() == h.num_buffers);
  for (int32_t page : chunk->dst_pages) {
    KVT_FUZZ_CHECK(page >= 1 && static_cast<uint64_t>(page) < kPages);
  }
  for (const ucx_staging::ChunkUnit& unit : chunk->layout.units) {
    uint64_t end = unit.payload_offset;
    for (uint32_t b : buffers) {
      const uint64_t bytes = unit.whole_page ? limits.item_len[b] : unit.bytes;
      KVT_FUZZ_CHECK(unit.whole_page || unit.dst_offset + unit.bytes <= limits.item_len[b]);
      end += bytes * h.num_pages;
    }
    KVT_FUZZ_CHECK(end <= bytes.size());
  }
  KVT_FUZZ_CHECK(h.payload_bytes == bytes.size());
}

// A hello: one that decodes carries a link token; an offer of slots that decodes must end inside
// the address space and carry a key.
void DecodeUcxHello(std::span<const uint8_t> bytes) {
  StatusOr<ucx_staging::Hello> hello = ucx_staging::DecodeHello(bytes);
  if (!hello.ok()) return;
  KVT_FUZZ_CHECK(hello->token != 0);
  if (hello->slots == 0) return;
  KVT_FUZZ_CHECK(hello->key_bytes >= 1 && hello->key_bytes <= ucx_staging::kMaxKeyBytes);
  KVT_FUZZ_CHECK(hello->slots <= ucx_staging::kMaxOfferedSlots);
  KVT_FUZZ_CHECK(hello->slot_bytes >= ucx_staging::kMinSlotBytes);
  KVT_FUZZ_CHECK(hello->slot_bytes <= ~uint64_t{0} / hello->slots);
  KVT_FUZZ_CHECK(hello->slots_base <= ~uint64_t{0} - hello->slot_bytes * hello->slots);
}

// A chunk read in place: its prefix decodes only to what the payload size says, and the prefix
// the receiver copies is bounded by the caps whatever the header claims.
void DecodeUcxChunkPrefix(std::span<const uint8_t> bytes) {
  if (bytes.size() < ucx_staging::kChunkHeaderBytes) return;
  const uint64_t prefix = ucx_staging::ChunkPrefixBytes(bytes);
  KVT_FUZZ_CHECK(prefix >= ucx_staging::kChunkHeaderBytes &&
                 prefix <= ucx_staging::kChunkHeaderBytes + ucx_staging::kMaxChunkPages * 4 +
                               16 * ucx_staging::kMaxUnits);
  static const ucx_staging::ChunkLimits limits = UcxLimits();
  const auto head = bytes.first(std::min<uint64_t>(prefix, bytes.size()));
  StatusOr<ucx_staging::DecodedChunk> chunk =
      ucx_staging::DecodeChunkPrefix(head, bytes.size(), limits);
  if (!chunk.ok()) return;
  KVT_FUZZ_CHECK(chunk->header.payload_bytes == bytes.size());
  KVT_FUZZ_CHECK(chunk->layout.data_offset >= prefix);
}

// A run message's AM header against a receiver of three buffers; the first 8 bytes are the
// data length that arrived with it. Every accepted segment lies inside its buffer and the
// segments hold exactly the data; whom to answer (RunsNotice) is read from any header long
// enough, and agrees with a header that decodes.
void DecodeRunMessage(std::span<const uint8_t> bytes) {
  static const std::vector<uint64_t> kBufferLen = {4096, 1 << 20, 100};
  if (bytes.size() < 8) return;
  uint64_t data = 0;
  std::memcpy(&data, bytes.data(), 8);
  const std::optional<ucx_staging::ChunkNotice> notice = ucx_staging::RunsNotice(bytes.subspan(8));
  KVT_FUZZ_CHECK(notice.has_value() == (bytes.size() - 8 >= ucx_staging::kRunsHeaderBytes));
  StatusOr<ucx_staging::DecodedRuns> runs =
      ucx_staging::DecodeRuns(bytes.subspan(8), kBufferLen, data);
  if (!runs.ok()) return;
  KVT_FUZZ_CHECK(notice.has_value() && notice->sender == runs->header.sender &&
                 notice->link == runs->header.link && notice->write == runs->header.write &&
                 notice->chunk == runs->header.message && notice->token == runs->header.token);
  uint64_t total = 0;
  for (const ucx_staging::RunSegment& s : runs->segments) {
    KVT_FUZZ_CHECK(s.buffer < kBufferLen.size() && s.bytes > 0 &&
                   s.offset + s.bytes <= kBufferLen[s.buffer]);
    total += s.bytes;
  }
  KVT_FUZZ_CHECK(total == data && runs->segments.size() == runs->header.num_segments);
}

// The nccl receiver's pool: the staged receiver's (UcxLimits), K/V of layers 0..3 and a latent
// group of layers 4 and 5 with 256-byte pages.
nccl::ReceiverLayout NcclLayout() {
  ucx_staging::ChunkLimits limits = UcxLimits();
  nccl::ReceiverLayout layout;
  layout.layers = std::move(limits.layers);
  layout.item_len = std::move(limits.item_len);
  layout.buffer_len = std::move(limits.buffer_len);
  return layout;
}

void DecodeNcclChunkHeader(std::span<const uint8_t> bytes) {
  constexpr uint64_t kCapacity = 1 << 20;
  static const nccl::ReceiverLayout layout = NcclLayout();
  StatusOr<nccl::ChunkHeader> header =
      nccl::DecodeChunkHeader(bytes, /*expected_step=*/1, kCapacity);
  if (!header.ok()) return;
  KVT_FUZZ_CHECK(header->payload_bytes <= kCapacity);
  if (header->kind != nccl::HeaderKind::kChunk) return;
  KVT_FUZZ_CHECK(header->whole_pages == header->units.empty());
  if (!nccl::CheckChunkFits(*header, layout).ok()) return;
  // What the receiver then unpacks must lie inside the payload it received (exactly filling
  // it) and inside every buffer of its pool.
  const nccl::ChunkHeader& h = *header;
  KVT_FUZZ_CHECK(h.layer_begin >= 0 && h.layer_begin < h.layer_end &&
                 h.layer_end <= layout.layers.num_layers());
  const std::span<const uint32_t> buffers = layout.layers.Buffers(h.layer_begin, h.layer_end);
  KVT_FUZZ_CHECK(buffers.size() == h.num_buffers);
  const std::vector<uint64_t> page_bytes =
      nccl::ChunkPageBytes(layout.layers, layout.item_len, h.layer_begin, h.layer_end);
  const std::vector<uint64_t> bases(page_bytes.size(), 0);
  std::vector<uint8_t> payload(h.payload_bytes);
  uint64_t end = 0;
  for (const kernels::PackArgs& args :
       nccl::ChunkStagingArgs(bases.data(), page_bytes, h.dst_pages.data(),
                              static_cast<int64_t>(h.dst_pages.size()), h.units, payload.data())) {
    KVT_FUZZ_CHECK(args.offset >= 0 && args.bytes > 0 &&
                   args.offset + args.bytes <= args.page_stride);
    end = std::max(
        end, static_cast<uint64_t>(static_cast<uint8_t*>(args.staging) - payload.data()) +
                 static_cast<uint64_t>(args.num_buffers) * static_cast<uint64_t>(args.num_pages) *
                     static_cast<uint64_t>(args.bytes));
    for (int32_t i = 0; i < args.num_buffers; ++i) {
      const uint32_t b = buffers[static_cast<size_t>(args.bases - bases.data()) + i];
      for (int32_t page : h.dst_pages) {
        KVT_FUZZ_CHECK(page >= 0 && static_cast<uint64_t>(page) * layout.item_len[b] +
                                            static_cast<uint64_t>(args.offset + args.bytes) <=
                                        layout.buffer_len[b]);
      }
    }
  }
  KVT_FUZZ_CHECK(end == h.payload_bytes);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const auto decoder = static_cast<Decoder>(data[0] % kDecoderCount);
  const std::span<const uint8_t> bytes(data + 1, size - 1);
  const std::string_view text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  switch (decoder) {
    case kCudaIpcAddress:
      (void)cuda_ipc::DecodeAddress(text);
      break;
    case kCudaIpcRegionKey: {
      // The buffer length the key must cover comes first (8 bytes, little-endian).
      if (bytes.size() < 8) return 0;
      uint64_t region_length = 0;
      for (int i = 7; i >= 0; --i) region_length = (region_length << 8) | bytes[i];
      StatusOr<cuda_ipc::RegionKey> key = cuda_ipc::DecodeRegionKey(text.substr(8), region_length);
      if (key.ok()) {
        KVT_FUZZ_CHECK(key->offset <= key->allocation_bytes &&
                       region_length <= key->allocation_bytes - key->offset);
        KVT_FUZZ_CHECK(key->allocation < key->allocations);
      }
      break;
    }
    case kNcclAddress:
      (void)nccl::DecodeAddress(text);
      break;
    case kNcclToken: {
      StatusOr<nccl::PairToken> token = nccl::DecodeToken(text);
      if (token.ok()) KVT_FUZZ_CHECK(token->slot_bytes > 0);
      break;
    }
    case kNcclChunkHeader:
      DecodeNcclChunkHeader(bytes);
      break;
    case kNcclAck:
      (void)nccl::DecodeAck(bytes, /*expected_step=*/1);
      break;
    case kUcxChunk:
      DecodeUcxChunk(bytes);
      DecodeUcxChunkPrefix(bytes);
      break;
    case kUcxMessages:
      (void)ucx_staging::DecodeChunkNotice(bytes);
      (void)ucx_staging::DecodeSlotNotice(bytes);
      DecodeUcxHello(bytes);
      (void)ucx_staging::DecodeHelloAck(bytes);
      (void)ucx_staging::DecodeChunkAck(bytes);
      (void)ucx_staging::DecodeBye(bytes);
      DecodeRunMessage(bytes);
      break;
    case kUcxAddressTrailer: {
      const ucx_staging::SplitAddress split = ucx_staging::SplitPeerAddress(text);
      KVT_FUZZ_CHECK(split.worker_address.size() + split.runs_address.size() <= text.size());
      break;
    }
    case kTextRecord: {
      static constexpr TextRecordFormat kFormat = {.prefix = "fuzz/1",
                                                   .what = "fuzz record",
                                                   .not_one = "not a fuzz record",
                                                   .use_instead = "send a fuzz record"};
      StatusOr<TextRecordFields> fields = ParseTextRecord(text, kFormat);
      if (fields.ok()) {
        for (const auto& [name, value] : *fields) KVT_FUZZ_CHECK(!name.empty());
      }
      break;
    }
    case kUcxWorkerAddress:
      (void)ucx_check::CheckWorkerAddress(bytes);
      break;
    case kUcxPackedKey:
      (void)ucx_check::CheckPackedRkey(bytes);
      break;
    case kDecoderCount:
      break;
  }
  return 0;
}

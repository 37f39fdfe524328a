// The nccl backend's wire formats and pure planning functions, kept apart from NCCL and the CUDA
// runtime so that a machine without a GPU tests them:
//  - the tunables and protocol constants, in one place;
//  - the process address published in the hello (which host, process and GPU a side runs on),
//    and the check that two ranks of a pair sit on different GPUs;
//  - the pair token the sending side hands the receiving side (the ncclUniqueId of the pair's
//    communicator and the staging slot size both sides must use);
//  - the chunk planner: how a page write is cut into chunks that each fit one staging slot, and
//    the pack/unpack launches of a chunk (the same on both sides, so the layouts agree);
//  - the chunk header (the self-describing part of every step) and the acknowledgement.
//
// The protocol (one two-rank communicator per (prefill, decode) pair; rank 0 sends, rank 1
// receives). Both ranks issue the same sequence of steps n = 0, 1, 2, ..., each one NCCL group:
//   rank 0: ncclSend(slot[n % kRing], kHeaderBytes + payload(n)); ncclRecv(ack[n % kRing])
//   rank 1: ncclRecv(slot[n % kRing], kHeaderBytes + payload(n)); ncclSend(ack[n % kRing])
// The first kHeaderBytes of a step are a ChunkHeader; a kChunk header of step n announces the
// chunk that step n + kLookahead carries (its size, layers, units and destination pages), so the
// receiver, which reads each header to host once its step completed, knows the exact size of the
// receive to post kLookahead steps ahead (NCCL requires equal counts on both sides). Sizes and
// order therefore match on both ranks by construction, and each group moves data both ways, so
// neither rank ever waits on an operation the other has queued behind a blocked one.
// The receiver unpacks step n's payload on its own stream once step n completed and makes step
// n + kAckLag wait (on the GPU) for that unpack; so when step n + kAckLag completes on the
// sender, step n's bytes are in the receiver's pool: that is the acknowledgement. The ack
// message itself carries the receiver's verdict on the chunk of its own step (a chunk that does
// not fit the receiver's pool is received and dropped, and its write fails with the reason).
//
// Pure functions on plain values: thread-safe.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "backends/common/layer_table.h"
#include "kvt/common/status.h"
#include "kvt/kernels/kernels.h"

namespace kvt::transfer::nccl {

// ---- Tunables and protocol constants --------------------------------------------------------

// Run-time tunables of one backend (defaults suit H100/H200 over NVLink). Both sides of a pair
// use the sending side's slot size (it travels in the token).
struct NcclTuning {
  // Bytes of one staging slot: a step's header plus its payload. Each side of a pair holds
  // kRing slots on its GPU. Larger slots amortise the per-step cost (one NCCL group, a few
  // copies); one page of each layer (every buffer of it) must fit one slot.
  uint64_t slot_bytes = uint64_t{8} << 20;
  // A communicator must be up this long after Connect / Accept; writes posted before wait for
  // it and fail after it.
  std::chrono::milliseconds connect_timeout{60000};
  // The sending side fails the pair (and aborts the communicator) when a step it posted has not
  // completed for this long: the receiver is gone or wedged.
  std::chrono::milliseconds stall_timeout{30000};
  // A graceful Disconnect waits this long for writes in flight (and, on the receiving side, for
  // the sender's close) before it aborts.
  std::chrono::milliseconds drain_timeout{10000};
  // While it has nothing to send, the sending side still runs a header-only step this often.
  // The receiver always has its next receives posted (it cannot know when data comes), and a
  // posted NCCL receive is a kernel that waits on the GPU; any device-wide synchronisation in
  // the receiving process (cudaDeviceSynchronize, cudaFree) waits for it too. Idle steps bound
  // that wait to about kLookahead ticks, and let the receiver notice a vanished sender.
  // Zero turns idle steps off (the receiver's posted receives then wait until the next write).
  std::chrono::milliseconds idle_tick{2};
  // The receiving side gives up on a sender (aborts the pair) when no step completed for this
  // long; only with idle_tick > 0.
  std::chrono::milliseconds receiver_silence_timeout{30000};
};

// A header announces the payload of the step this many steps later.
inline constexpr uint64_t kLookahead = 2;
// Step n's completion on the sender acknowledges the unpack of step n - kAckLag's payload.
inline constexpr uint64_t kAckLag = 2;
// Staging slots, header buffers and acknowledgement buffers per side.
inline constexpr uint64_t kRing = kLookahead + kAckLag;
// Steps the sender may have in flight (its slot for step n + kLookahead was last used by step
// n + kLookahead - kRing, which must have completed before the sender announces into it).
inline constexpr uint64_t kSenderWindow = kRing - kLookahead;

inline constexpr uint64_t kHeaderBytes = 16384;
inline constexpr uint64_t kAckBytes = 256;
inline constexpr uint32_t kMaxUnits = 64;
inline constexpr uint64_t kUnitsOffset = 128;
inline constexpr uint64_t kPagesOffset = kUnitsOffset + uint64_t{kMaxUnits} * 16;
inline constexpr uint32_t kMaxChunkPages = static_cast<uint32_t>((kHeaderBytes - kPagesOffset) / 4);
inline constexpr uint64_t kMinSlotBytes = kHeaderBytes + 4096;
inline constexpr uint64_t kMaxSlotBytes = uint64_t{1} << 32;
static_assert(kPagesOffset % 16 == 0, "the page table in a header must stay aligned");

// ---- Process addresses ----------------------------------------------------------------------

// Text, one line: "nccl/1 boot=<id> pid=<n> dev=<n> pci=<bus id>".
inline constexpr std::string_view kAddressPrefix = "nccl/1";

struct ProcessAddress {
  std::string boot_id;  // /proc/sys/kernel/random/boot_id (or "host:<name>" without it)
  uint64_t pid = 0;
  int32_t device = -1;     // the publisher's device ordinal, in its own numbering
  std::string pci_bus_id;  // the publisher's GPU, in numbering every process of a host shares

  friend bool operator==(const ProcessAddress&, const ProcessAddress&) = default;
};

std::string EncodeAddress(const ProcessAddress& address);

// A missing or malformed field, or another version, is InvalidArgument. Unknown fields are
// ignored (later versions may add some).
StatusOr<ProcessAddress> DecodeAddress(std::string_view text);

// OK when the two sides may be the two ranks of one communicator: FailedPrecondition when they
// are the same GPU of the same host (NCCL cannot put two ranks on one device).
Status CheckPeerPlacement(const ProcessAddress& local, const ProcessAddress& peer);

// This host's boot id, read once.
const std::string& ThisBootId();

// ---- Pair token -----------------------------------------------------------------------------

// sizeof(ncclUniqueId); the backend checks the two agree at compile time.
inline constexpr size_t kUniqueIdBytes = 128;

// Text, one line: "nccl-token/1 slot=<bytes> tick=<ms> nonce=<hex> id=<256 hex digits>".
inline constexpr std::string_view kTokenPrefix = "nccl-token/1";

struct PairToken {
  std::array<char, kUniqueIdBytes> unique_id{};  // the ncclUniqueId of the pair's communicator
  uint64_t slot_bytes = 0;                       // staging slot size both sides use
  uint64_t idle_tick_ms = 0;  // the sender's idle tick (0: none): the receiver's silence clock
  uint64_t nonce = 0;         // random per pair; names the pair in logs

  friend bool operator==(const PairToken&, const PairToken&) = default;
};

std::string EncodeToken(const PairToken& token);

// Any malformation (prefix, version, missing field, id length or digits, slot size outside
// [kMinSlotBytes, kMaxSlotBytes]) is InvalidArgument saying which.
StatusOr<PairToken> DecodeToken(std::string_view text);

// ---- Chunk planning -------------------------------------------------------------------------

// A page write moves, for every layer l in [layer_begin, layer_end), every buffer of that layer
// (LayerTable order: layers ascending, registration order within a layer; buffers may differ in
// page bytes), every page i in [0, num_pages) of the write's page lists, and either every unit
// (a byte range of a page, the same for every buffer) or, without units, each buffer's whole
// page (its own page bytes). A chunk is a layer range times a page range; its payload holds the
// chunk's buffers in LayerTable order:
//   units:       unit-major, then buffer, then page:
//                payload + UnitPayloadOffset(u) + (b * num_chunk_pages + i) * unit_bytes[u]
//   whole pages: buffer-major, each buffer num_chunk_pages x its own page bytes
// which is the pack kernel's buffer-major staging layout within every launch.
struct ChunkPlanInput {
  int64_t num_pages = 0;
  int32_t layer_begin = 0;
  int32_t layer_end = 0;
  const LayerTable* layers = nullptr;    // the sender's buffers by transfer layer
  std::span<const uint64_t> item_len;    // page bytes of each buffer, by buffer index
  std::span<const uint64_t> unit_bytes;  // bytes of each unit of one page; empty: whole pages
  uint64_t payload_capacity = 0;         // slot bytes minus kHeaderBytes
  uint32_t max_pages = kMaxChunkPages;   // pages one header can name
};

struct ChunkSpec {
  int32_t layer_begin = 0;
  int32_t layer_end = 0;
  int64_t page_begin = 0;  // index into the write's page lists
  int64_t page_end = 0;
  uint64_t payload_bytes = 0;

  friend bool operator==(const ChunkSpec&, const ChunkSpec&) = default;
};

// Cuts a write into chunks, layers outermost: whole layers (all pages) per chunk while the
// heaviest layer fits a slot with every page (as many layers per chunk as the heaviest window of
// that many layers allows, evenly spread), else each layer's pages split into the fewest, evenly
// sized page ranges that fit with that layer's own buffers. Every (buffer, page, unit) of the
// write lies in exactly one chunk, and each chunk's payload is at most payload_capacity. An
// empty write (no pages or no layers) has no chunks. One page of some layer larger than a slot
// (naming the layer and its bytes), a missing or mismatched table, a layer range outside it, a
// zero-byte unit or more than kMaxUnits units are InvalidArgument naming the values.
StatusOr<std::vector<ChunkSpec>> PlanChunks(const ChunkPlanInput& input);

// The page bytes of the buffers of layers [begin, end) in LayerTable order, from every buffer's
// page bytes by index; the range must pass table.CheckRange.
std::vector<uint64_t> ChunkPageBytes(const LayerTable& table, std::span<const uint64_t> item_len,
                                     int32_t begin, int32_t end);

// Payload bytes of a chunk of `num_pages` pages of buffers whose page bytes (in LayerTable
// order) are `page_bytes`, with these units (empty: whole pages). Saturates at UINT64_MAX.
uint64_t ChunkPayloadBytes(std::span<const uint64_t> page_bytes,
                           std::span<const uint64_t> unit_bytes, uint64_t num_pages);

// Byte offset of unit u's block inside a chunk of `num_buffers` buffers and `num_pages` pages.
uint64_t UnitPayloadOffset(std::span<const uint64_t> unit_bytes, size_t unit, int64_t num_buffers,
                           int64_t num_pages);

// The part of a unit one side needs: where in its page the bytes are (the sender's source
// offset, the receiver's destination offset) and how many.
struct UnitSpan {
  uint64_t offset = 0;
  uint64_t bytes = 0;

  friend bool operator==(const UnitSpan&, const UnitSpan&) = default;
};

// The pack (sending side) or unpack (receiving side) launches of one chunk: one per (unit, run
// of consecutive buffers of equal page bytes), or per run for whole pages (`units` empty). The
// chunk's buffers are bases[0, page_bytes.size()) (the slice of a LayerTable-ordered address
// table that holds the chunk's layers) with page_bytes their page bytes, its pages
// `pages[0, num_pages)`, and the payload is laid out as ChunkPlanInput says. `bases` and `pages`
// must be where the kernel runs (device or host); `page_bytes` is read here.
std::vector<kernels::PackArgs> ChunkStagingArgs(const uint64_t* bases,
                                                std::span<const uint64_t> page_bytes,
                                                const int32_t* pages, int64_t num_pages,
                                                std::span<const UnitSpan> units, uint8_t* payload);

// ---- Chunk header ---------------------------------------------------------------------------

enum class HeaderKind : uint16_t {
  kIdle = 0,   // announces nothing (step n + kLookahead carries no payload)
  kChunk = 1,  // announces the chunk that step n + kLookahead carries
  kClose = 2,  // the sender closes the pair: the receiver posts no step beyond what it has
};

struct ChunkHeader {
  HeaderKind kind = HeaderKind::kIdle;
  uint64_t step = 0;  // the step that carries this header
  // kChunk only: the chunk carried by step + kLookahead.
  uint64_t write_id = 0;
  uint32_t chunk_index = 0;
  uint32_t chunk_count = 0;
  int32_t num_layers = 0;  // L of the sender's pool (the receiver's must match)
  int32_t layer_begin = 0;
  int32_t layer_end = 0;
  uint32_t num_buffers = 0;        // buffers of layers [layer_begin, layer_end) at the sender
  bool whole_pages = false;        // every buffer's whole page (its own page bytes); no units
  std::vector<UnitSpan> units;     // destination offset and bytes of each unit
  std::vector<int32_t> dst_pages;  // the chunk's destination pages, in payload order
  uint64_t payload_bytes = 0;      // units: units x buffers x pages; whole pages: the sender's

  friend bool operator==(const ChunkHeader&, const ChunkHeader&) = default;
};

// Writes the header into `out` (kHeaderBytes, little-endian, unused bytes zero). The caller
// guarantees the counts fit (the planner does): at most kMaxUnits units and kMaxChunkPages pages.
void EncodeChunkHeader(const ChunkHeader& header, std::span<uint8_t> out);

// Decodes a header the receiver got in step `expected_step`: magic, version, kind, step,
// reserved bytes zero, unit, page and buffer counts, the whole-page marker (set exactly when no
// units are named), and a payload size that fits payload_capacity and, for units, matches the
// description. Any failure is DataLoss naming the field and its value (the peers disagree about
// the protocol: the pair cannot continue). A whole-page chunk's size depends on the buffers'
// page bytes, which only CheckChunkFits knows.
StatusOr<ChunkHeader> DecodeChunkHeader(std::span<const uint8_t> bytes, uint64_t expected_step,
                                        uint64_t payload_capacity);

// The receiver's pool as a chunk must fit it: its layer table and, by buffer index, each
// buffer's page bytes and length (one entry per buffer of the table).
struct ReceiverLayout {
  LayerTable layers;
  std::vector<uint64_t> item_len;
  std::vector<uint64_t> buffer_len;
};

// OK when a decoded kChunk header fits the receiver's pool: same layer count, layer range inside
// it holding num_buffers buffers here, every unit inside the page of every buffer of the chunk,
// a whole-page chunk's payload equal to its pages of this side's buffers (the page bytes agree),
// every destination page inside every buffer of the chunk. OutOfRange / InvalidArgument naming
// the value otherwise (the chunk is then received and dropped and its write fails; the pair
// continues, since the receive's size came from the header).
Status CheckChunkFits(const ChunkHeader& header, const ReceiverLayout& layout);

// ---- Acknowledgement ------------------------------------------------------------------------

// The receiver's verdict on the payload of the step that carries the ack.
struct Ack {
  uint64_t step = 0;
  StatusCode code = StatusCode::kOk;  // kOk: accepted (or no payload)
  uint64_t write_id = 0;              // when code != kOk: the refused chunk
  uint32_t chunk_index = 0;
  std::string message;  // truncated to fit kAckBytes

  friend bool operator==(const Ack&, const Ack&) = default;
};

void EncodeAck(const Ack& ack, std::span<uint8_t> out);

// DataLoss when the bytes are not an ack of `expected_step`.
StatusOr<Ack> DecodeAck(std::span<const uint8_t> bytes, uint64_t expected_step);

}  // namespace kvt::transfer::nccl

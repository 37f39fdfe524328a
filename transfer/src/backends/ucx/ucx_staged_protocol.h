// The pure parts of the ucx backend's staged path for CUDA pools: how a page write is cut into
// chunks that fit a bounce slot, the self-describing wire format of a chunk and of the small
// control messages, the descriptor trailer that announces a side's staging area, and the
// credit window that bounds the chunks a sender has outstanding at one receiver.
//
// Staging moves a page write (backend.h PageWrite) as a sequence of chunks. A chunk is a
// rectangle of the write: layers [layer_begin, layer_end) of the layer batch times pages
// [page_begin, page_end) of the page list, for every unit of every page of every buffer of
// those layers (LayerTable order: layers ascending, registration order within a layer; buffers
// may differ in page bytes). Its payload is
//
//   [0, 72)                   ChunkHeader (fields below, little-endian)
//   [72, 72 + 4 * pages)      destination page ids, int32
//   [.., + 16 * units)        units: destination offset in the page (u64), bytes (u64); none
//                             for a whole-page chunk
//   data_offset (256-aligned) one segment per unit (one for whole pages), each 256-aligned,
//                             buffer-major within: the chunk's buffers in layer order, each
//                             `pages * bytes` long, bytes the unit's or (whole pages) the
//                             buffer's own page bytes
//
// so a receiver needs nothing but the payload and its own pool (whose buffers, layers and page
// bytes the engines checked equal to the sender's) to scatter it, and refuses a payload whose
// header does not describe exactly its bytes or names pages outside its pool.
//
// Pure functions and plain values, no UCX or CUDA calls: thread-safe. CreditWindow is a value;
// its owner serialises access.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "backends/common/layer_table.h"
#include "kvt/common/status.h"
#include "kvt/transfer/plan.h"

namespace kvt::transfer::ucx_staging {

inline constexpr uint32_t kChunkMagic = 0x4354564b;  // "KVTC"
// 2: buffers by transfer layer with their own page bytes (1 addressed K l and V L + l).
// 3: hellos name their mode (staged chunks or copy runs); the trailer may announce a worker for
// copy runs sent as active messages.
// 4: hellos offer the sender's slots for reading in place (SlotNotice instead of a payload).
// 5: every control message and run header carries its link's token (see "link tokens" below).
inline constexpr uint16_t kWireVersion = 5;
inline constexpr uint64_t kChunkHeaderBytes = 72;
inline constexpr uint64_t kPayloadAlign = 256;
// Caps that keep per-chunk metadata bounded (device index buffers are sized from them).
inline constexpr int64_t kMaxChunkPages = 16384;
inline constexpr size_t kMaxUnits = 1024;
// Smallest slot accepted (header, a few pages and their data).
inline constexpr uint64_t kMinSlotBytes = 4096;

// ---- chunk plan -------------------------------------------------------------------------------

// One unit of every page as it sits in a chunk payload.
struct ChunkUnit {
  uint64_t src_offset = 0;      // in the source page (sender only)
  uint64_t dst_offset = 0;      // in the destination page
  uint64_t bytes = 0;           // per (buffer, page); 0 with whole_page
  bool whole_page = false;      // every buffer's whole page (its own page bytes)
  uint64_t payload_offset = 0;  // of this unit's segment: the chunk's buffers one after another
};

// Where each unit's segment starts in the payload of a chunk of `pages` pages of buffers whose
// page bytes (in layer order) are `page_bytes`, with these units (empty: whole pages), and
// where the data begins. Sizes saturate at UINT64_MAX instead of overflowing.
struct PayloadLayout {
  uint64_t data_offset = 0;
  uint64_t payload_bytes = 0;
  std::vector<ChunkUnit> units;
};
PayloadLayout LayoutPayload(int64_t pages, std::span<const PageUnit> units,
                            std::span<const uint64_t> page_bytes);
uint64_t PayloadBytes(int64_t pages, std::span<const PageUnit> units,
                      std::span<const uint64_t> page_bytes);

// The page bytes of the buffers of layers [begin, end) in layer order, from every buffer's page
// bytes by index; the range must pass table.CheckRange.
std::vector<uint64_t> ChunkPageBytes(const LayerTable& table, std::span<const uint64_t> item_len,
                                     int32_t begin, int32_t end);

struct Chunk {
  int32_t layer_begin = 0;  // absolute layer ids
  int32_t layer_end = 0;
  int64_t page_begin = 0;  // positions in the write's page lists
  int64_t page_end = 0;
};

// How a write is cut: at most layers_per_chunk layers x pages_per_chunk pages a chunk, layer
// groups outermost. Sizes are balanced (a 100-page write with room for 90 becomes 50 + 50).
struct ChunkPlan {
  int32_t layer_begin = 0;
  int32_t layer_end = 0;
  int64_t num_pages = 0;
  int32_t layers_per_chunk = 0;
  int64_t pages_per_chunk = 0;
  int32_t layer_groups = 0;
  int64_t page_groups = 0;

  uint32_t count() const { return static_cast<uint32_t>(layer_groups * page_groups); }
  // Precondition: index < count().
  Chunk Get(uint32_t index) const;
};

// Plans the chunks of a write of `num_pages` pages over layers [layer_begin, layer_end) of
// `table`, whose buffers have `item_len` page bytes (by buffer index), with these units
// (empty: whole pages), so that every payload fits `slot_bytes`: any layers_per_chunk
// consecutive layers of the range, with their own buffers and page bytes, fit with
// pages_per_chunk pages. InvalidArgument when one page of some layer does not fit (naming the
// layer and the bytes), or when the arguments are malformed (a range outside the table, a
// table and item_len of different buffer counts, more than kMaxUnits units, an empty unit, ...).
StatusOr<ChunkPlan> PlanChunks(int32_t layer_begin, int32_t layer_end, int64_t num_pages,
                               std::span<const PageUnit> units, const LayerTable& table,
                               std::span<const uint64_t> item_len, uint64_t slot_bytes);

// ---- chunk wire format ------------------------------------------------------------------------

struct ChunkHeader {
  uint64_t sender = 0;  // the sending backend's instance id
  uint64_t link = 0;    // the sender's id of this connection (its PeerId)
  uint64_t write = 0;
  uint32_t chunk = 0;
  uint32_t chunk_count = 0;
  int32_t num_layers = 0;  // transfer layers of the sender's pool (the receiver's must match)
  int32_t layer_begin = 0;
  int32_t layer_end = 0;
  uint32_t num_pages = 0;
  uint32_t num_units = 0;    // 0: whole pages
  uint32_t num_buffers = 0;  // buffers of layers [layer_begin, layer_end) at the sender
  uint64_t payload_bytes = 0;

  friend bool operator==(const ChunkHeader&, const ChunkHeader&) = default;
};

// Writes the header, the destination pages and the units (empty: whole pages) into the front
// of `payload` (which must hold at least the layout's data_offset bytes); `page_bytes` are the
// chunk's buffers' page bytes in layer order. header.num_pages/num_units/num_buffers/
// payload_bytes must agree with the spans and the layout; InvalidArgument otherwise.
Status EncodeChunkPrefix(const ChunkHeader& header, std::span<const int32_t> dst_pages,
                         std::span<const PageUnit> units, std::span<const uint64_t> page_bytes,
                         std::span<uint8_t> payload);

// What the receiver's pool allows: its layer table and, by buffer index, each buffer's page
// bytes and length (item_len and buffer_len hold one entry per buffer of the table).
struct ChunkLimits {
  LayerTable layers;
  std::vector<uint64_t> item_len;
  std::vector<uint64_t> buffer_len;
};

struct DecodedChunk {
  ChunkHeader header;
  uint64_t pages_offset = kChunkHeaderBytes;  // where the int32 page ids sit in the payload
  std::vector<int32_t> dst_pages;
  PayloadLayout layout;  // units carry dst_offset, bytes and payload_offset (src_offset 0)
};

// Parses and checks a received payload: magic, version, reserved bytes zero, counts within the
// caps, the pool's layer count, a layer range inside it holding num_buffers buffers here, pages
// in [1, pages of every buffer of the chunk), units inside every such buffer's page, and a
// payload_bytes that equals both the layout (from this pool's page bytes) and payload.size().
// DataLoss for a payload that does not describe itself consistently, OutOfRange for layers,
// buffers, pages or units outside the pool; each names the field and its value.
StatusOr<DecodedChunk> DecodeChunk(std::span<const uint8_t> payload, const ChunkLimits& limits);
// The same for a payload of `payload_bytes` of which only `prefix` (the header, page ids and
// units; longer is fine) is at hand: a payload read in place from the sender's slot, whose
// prefix the receiver copied out to check and to use, so that the sender cannot change it
// after the check.
StatusOr<DecodedChunk> DecodeChunkPrefix(std::span<const uint8_t> prefix, uint64_t payload_bytes,
                                         const ChunkLimits& limits);
// Bytes of a payload's prefix (header, page ids, units) from the header's counts, the counts
// capped at kMaxChunkPages and kMaxUnits; at least kChunkHeaderBytes. `header` holds at least
// kChunkHeaderBytes.
uint64_t ChunkPrefixBytes(std::span<const uint8_t> header);

// ---- control messages (UCX active-message headers) --------------------------------------------
//
// Link tokens. A sender draws a random 64-bit token for each link (connection) it opens and
// sends it in the link's hello; from then on every message on the link carries it both ways:
// chunk and slot notices, run headers and byes (sender -> receiver), hello acks and chunk acks
// (receiver -> sender, which echo the token of the message they answer). A receiver takes a
// message only on a link opened by a hello with that token, and a sender counts an ack only when
// it carries its link's token, so that a third party that can reach either worker but does not
// see the link's traffic can neither complete, fail nor free another sender's chunks, nor write,
// close or redirect another sender's link: its messages name sender ids and links it can guess
// (small, sequential) but not a token.

// Active-message ids on the staging worker (small: UCX sizes a table by the largest id).
inline constexpr unsigned kAmChunk = 20;
inline constexpr unsigned kAmHello = 21;
inline constexpr unsigned kAmHelloAck = 22;
inline constexpr unsigned kAmChunkAck = 23;
inline constexpr unsigned kAmBye = 24;
inline constexpr unsigned kAmRuns = 25;
inline constexpr unsigned kAmSlotChunk = 26;

// The AM header of a chunk: lets the receiver attribute a payload before it has landed.
struct ChunkNotice {
  uint64_t sender = 0;
  uint64_t link = 0;
  uint64_t write = 0;
  uint32_t chunk = 0;
  uint64_t token = 0;  // the link's
  friend bool operator==(const ChunkNotice&, const ChunkNotice&) = default;
};
inline constexpr size_t kChunkNoticeBytes = 40;

// What a connection carries: staged chunks of a CUDA pool, or copy runs of host memory.
enum class LinkMode : uint16_t { kStaged = 0, kRuns = 1 };

// Sender -> receiver when a connection is made; the AM data is the sender's worker address
// followed by key_bytes of packed remote key (ucp_rkey_pack) of its send slots when it offers
// them (slots > 0): `slots` slots of `slot_bytes` from slots_base in its address space, which a
// receiver that maps them (the same host) reads chunks from in place.
struct Hello {
  uint64_t sender = 0;
  uint64_t link = 0;
  LinkMode mode = LinkMode::kStaged;
  uint64_t slots_base = 0;
  uint64_t slot_bytes = 0;
  uint32_t slots = 0;
  uint32_t key_bytes = 0;
  uint64_t token = 0;  // the link's, never 0 (DecodeHello refuses 0)
  friend bool operator==(const Hello&, const Hello&) = default;
};
inline constexpr size_t kHelloBytes = 56;
// Caps on an offer: slots and key bytes.
inline constexpr uint32_t kMaxOfferedSlots = 1024;
inline constexpr uint32_t kMaxKeyBytes = 4096;

// Receiver -> sender: accepted (code kOk) with the receiver's slots, or refused with a reason
// (the AM data). in_place: the receiver reads this sender's chunks from its offered slots
// (the sender sends SlotNotices and keeps a slot until the chunk's ack).
struct HelloAck {
  uint64_t receiver = 0;
  uint64_t link = 0;
  StatusCode code = StatusCode::kOk;
  uint32_t slots = 0;
  uint64_t slot_bytes = 0;
  bool in_place = false;
  uint64_t token = 0;  // the hello's
  friend bool operator==(const HelloAck&, const HelloAck&) = default;
};
inline constexpr size_t kHelloAckBytes = 48;

// Receiver -> sender once a chunk's bytes are in its pool (kOk) or it failed; the AM data is
// the error message.
struct ChunkAck {
  uint64_t link = 0;
  uint64_t write = 0;
  uint32_t chunk = 0;
  StatusCode code = StatusCode::kOk;
  uint64_t token = 0;  // the answered message's
  friend bool operator==(const ChunkAck&, const ChunkAck&) = default;
};
inline constexpr size_t kChunkAckBytes = 40;

// Sender -> receiver on a graceful disconnect: forget this link.
struct Bye {
  uint64_t sender = 0;
  uint64_t link = 0;
  uint64_t token = 0;  // the link's
  friend bool operator==(const Bye&, const Bye&) = default;
};
inline constexpr size_t kByeBytes = 32;

// Sender -> receiver on an in-place link: chunk `notice` is gathered in the sender's offered
// slot `slot`, payload_bytes long; the AM data is the payload's prefix (ChunkPrefixBytes of it:
// header, page ids, units), which the receiver checks and uses instead of reading the slot's.
struct SlotNotice {
  ChunkNotice notice;
  uint32_t slot = 0;
  uint64_t payload_bytes = 0;
  friend bool operator==(const SlotNotice&, const SlotNotice&) = default;
};
inline constexpr size_t kSlotNoticeBytes = 56;

std::vector<uint8_t> Encode(const ChunkNotice& m);
std::vector<uint8_t> Encode(const SlotNotice& m);
std::vector<uint8_t> Encode(const Hello& m);
std::vector<uint8_t> Encode(const HelloAck& m);
std::vector<uint8_t> Encode(const ChunkAck& m);
std::vector<uint8_t> Encode(const Bye& m);
// Each decoder refuses (DataLoss) a buffer of the wrong size or with the wrong magic.
StatusOr<ChunkNotice> DecodeChunkNotice(std::span<const uint8_t> bytes);
StatusOr<SlotNotice> DecodeSlotNotice(std::span<const uint8_t> bytes);
StatusOr<Hello> DecodeHello(std::span<const uint8_t> bytes);
StatusOr<HelloAck> DecodeHelloAck(std::span<const uint8_t> bytes);
StatusOr<ChunkAck> DecodeChunkAck(std::span<const uint8_t> bytes);
StatusOr<Bye> DecodeBye(std::span<const uint8_t> bytes);

// ---- copy runs as active messages ------------------------------------------------------------
//
// Where UCX has no native RMA to a peer (tcp emulates puts over its messages), the ucx backend
// moves a write's copy runs as active messages on the staging worker instead: each message's
// AM header is a RunsHeader followed by num_segments RunSegments (the destination of each
// piece, in the receiver's buffers), and its AM data is the pieces' bytes back to back in
// segment order, sent from the source runs as an IOV (no gather copy). The receiver checks
// every segment against its own buffers before a byte moves, copies eager data into place
// (rendezvous data it receives into a buffer of its own first, then copies) and acknowledges
// each message with a ChunkAck (chunk = message index) once its bytes are in place.
//
//   RunsHeader (48 bytes): 0 magic u32, 4 version u16, 6 reserved u16, 8 sender, 16 link,
//                          24 write, 32 message u32, 36 num_segments u32, 40 token
//   RunSegment (24 bytes): 0 buffer u32, 4 reserved u32, 8 offset u64, 16 bytes u64

struct RunsHeader {
  uint64_t sender = 0;
  uint64_t link = 0;
  uint64_t write = 0;
  uint32_t message = 0;
  uint32_t num_segments = 0;
  uint64_t token = 0;  // the link's
  friend bool operator==(const RunsHeader&, const RunsHeader&) = default;
};
struct RunSegment {
  uint32_t buffer = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  friend bool operator==(const RunSegment&, const RunSegment&) = default;
};
inline constexpr size_t kRunsHeaderBytes = 48;
inline constexpr size_t kRunSegmentBytes = 24;
// Data bytes of one run message at most (the largest UcxOptions::am_message_bytes): a receiver
// refuses a longer rendezvous message rather than allocate what a sender declares.
inline constexpr uint64_t kMaxRunMessageBytes = uint64_t{64} << 20;
// Segments per message (bounds the header a receiver parses).
inline constexpr uint32_t kMaxRunSegments = 4096;
// The AM header bytes of a message of `segments` segments.
constexpr size_t RunsHeaderSize(size_t segments) {
  return kRunsHeaderBytes + segments * kRunSegmentBytes;
}

// header.num_segments must equal segments.size() (at most kMaxRunSegments); InvalidArgument
// otherwise.
StatusOr<std::vector<uint8_t>> EncodeRuns(const RunsHeader& header,
                                          std::span<const RunSegment> segments);

struct DecodedRuns {
  RunsHeader header;
  std::vector<RunSegment> segments;
};
// Parses and checks a message's AM header against the receiver's buffers (their lengths, by
// index) and the bytes that came with it: DataLoss for a header that does not describe itself
// (size, magic, version, reserved bytes, a segment of 0 bytes, segment bytes that do not sum
// to `data_bytes`), OutOfRange for a segment outside the buffers; each names the field and
// its value.
StatusOr<DecodedRuns> DecodeRuns(std::span<const uint8_t> header,
                                 std::span<const uint64_t> buffer_len, uint64_t data_bytes);
// Whom to answer about a run message whose header may not decode: its sender, link, write,
// message (as chunk) and token, read from the fixed part; nullopt when even that is short.
std::optional<ChunkNotice> RunsNotice(std::span<const uint8_t> header);

// ---- descriptor trailer -----------------------------------------------------------------------

// Appended to PeerDescriptor.address after the UCX worker address (and, when it announces one,
// the worker address for copy runs): who this backend is, whether (and how much) it stages
// CUDA pools, and whether it takes copy runs as active messages.
struct AddressTrailer {
  uint64_t instance = 0;
  bool staged = false;
  uint32_t slots = 0;
  uint64_t slot_bytes = 0;
  // Bytes of the staging worker's address between the worker address and the trailer, when
  // this side takes copy runs as active messages there; 0 when it does not.
  uint32_t runs_address_bytes = 0;
  friend bool operator==(const AddressTrailer&, const AddressTrailer&) = default;
};
inline constexpr size_t kTrailerBytes = 32;

// `runs_address` (the staging worker's address) is appended before the trailer when not empty,
// and the trailer's runs_address_bytes set to its size.
std::string AppendTrailer(std::string_view worker_address, AddressTrailer trailer,
                          std::string_view runs_address = {});

struct SplitAddress {
  std::string_view worker_address;
  std::string_view runs_address;          // empty: the peer takes no copy runs as messages
  std::optional<AddressTrailer> trailer;  // absent: a peer that appends none
};
SplitAddress SplitPeerAddress(std::string_view address);

// ---- credits ----------------------------------------------------------------------------------

// The chunks a sender has outstanding at one receiver (gathering, sent, or awaiting their ack),
// never more than the receiver's slot count. A credit is taken per (write, chunk) and given back
// exactly once, so a duplicated or forged ack cannot inflate the window.
class CreditWindow {
 public:
  explicit CreditWindow(uint32_t limit = 0) : limit_(limit) {}

  uint32_t limit() const { return limit_; }
  uint32_t outstanding() const { return static_cast<uint32_t>(held_.size()); }
  uint32_t available() const { return limit_ > outstanding() ? limit_ - outstanding() : 0; }
  // Lowering the limit below what is outstanding only stops new acquisitions.
  void SetLimit(uint32_t limit) { limit_ = limit; }

  // Takes a credit for the chunk; false when none is available or the chunk already holds one.
  bool Acquire(uint64_t write, uint32_t chunk);
  // Returns the chunk's credit; false when it held none (unknown or duplicate ack).
  bool Release(uint64_t write, uint32_t chunk);
  // Returns every credit of the write; how many there were.
  uint32_t ReleaseWrite(uint64_t write);
  bool Holds(uint64_t write, uint32_t chunk) const { return held_.count({write, chunk}) != 0; }
  uint32_t HeldBy(uint64_t write) const;
  void Clear() { held_.clear(); }

 private:
  uint32_t limit_;
  std::set<std::pair<uint64_t, uint32_t>> held_;
};

}  // namespace kvt::transfer::ucx_staging

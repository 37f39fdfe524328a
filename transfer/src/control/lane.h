// Lane (private to the control plane): the shared-memory path of a control connection between
// two processes of one host. One segment holds two single-producer single-consumer byte rings,
// one per direction; a connection that has switched to its lane writes its frames into the
// outgoing ring instead of the socket and reads the incoming ring with the same frame decoder,
// so a control message costs a copy into shared memory and a load on the other side instead of
// a send and a receive system call and a reactor pass (docs/performance.md has the figures).
//
// The socket stays: it carries the handshake, the lane's setup, doorbells for a reader that
// sleeps, and its close ends the connection as before. See docs/protocol.md, "Lanes".
//
// Hand-written because no Debian-packaged library offers an interprocess byte ring whose
// indices are treated as untrusted: Boost.Interprocess's message_queue takes a process-shared
// mutex a dead or hostile peer can leave locked, and both sides here validate every index the
// other side writes (a peer that corrupts them fails its own connection, nothing more).
//
// Thread contract: one writer (under the connection's write mutex) and one reader (the
// connection's strand) per direction; Sleep/Wake are the reader's, TakeDoorbell the writer's.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "kvt/common/status.h"

namespace kvt::control::internal {

struct LaneRing;  // one direction's shared indices and bytes (lane.cc)

// Ring size per direction (BusyPollOptions::lane_ring_bytes): a TransferRequest of 8192 pages
// is 32 KiB; bytes that do not fit wait in the connection's queue, in order, and stream through.
inline constexpr uint32_t kDefaultLaneRingBytes = 256u << 10;
inline constexpr uint32_t kMinLaneRingBytes = 4u << 10;
inline constexpr uint32_t kMaxLaneRingBytes = 64u << 20;
inline constexpr size_t kLaneNonceBytes = 16;

// Whether `n` is a ring size lanes take: a power of two in [kMinLaneRingBytes, kMaxLaneRingBytes].
inline bool ValidLaneRingBytes(uint32_t n) {
  return n >= kMinLaneRingBytes && n <= kMaxLaneRingBytes && (n & (n - 1)) == 0;
}

class Lane {
 public:
  // The connecting side: creates a segment (POSIX shared memory, mode 0600, a random name) with
  // rings of `ring_bytes` (a power of two in [kMinLaneRingBytes, kMaxLaneRingBytes]).
  static StatusOr<std::unique_ptr<Lane>> Create(uint32_t ring_bytes);
  // The accepting side: opens the segment `name` offered with `nonce` and `ring_bytes`, checks
  // that it is the one offered (its size, magic and nonce: a segment of another host or
  // namespace is not found) and removes its name. FailedPrecondition names what did not match.
  static StatusOr<std::unique_ptr<Lane>> Open(const std::string& name, std::string_view nonce,
                                              uint32_t ring_bytes);
  ~Lane();

  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;

  const std::string& name() const { return name_; }
  const std::string& nonce() const { return nonce_; }
  uint32_t ring_bytes() const { return ring_bytes_; }
  // Removes the segment's name (the creator, once the peer opened it or declined; idempotent).
  void Unlink();

  // Writer: copies as much of `data` as fits; how much. DataLoss when the reader's index is
  // impossible (the peer corrupted the segment).
  StatusOr<size_t> Write(std::string_view data);
  // Writer, after a Write: whether the reader sleeps, in which case the writer must ring the
  // doorbell on the socket. Clears the reader's flag: one doorbell per sleep (the reader reads
  // everything that waits when it wakes, and marks itself asleep again before it next blocks).
  bool TakeDoorbell();

  // Reader: copies up to `capacity` received bytes to `out`; how many (0: none). DataLoss when
  // the writer's index is impossible.
  StatusOr<size_t> Read(char* out, size_t capacity);
  // Reader: whether bytes are waiting.
  bool Readable() const;
  // Reader, before it blocks: marks it asleep, then returns whether bytes arrived meanwhile (in
  // which case it must not block; Wake() either way after).
  bool Sleep();
  void Wake();

 private:
  Lane(std::string name, std::string nonce, uint32_t ring_bytes, void* base, size_t size,
       bool creator);

  std::string name_;
  std::string nonce_;
  uint32_t ring_bytes_;
  void* base_;
  size_t size_;
  bool creator_;
  bool unlinked_ = false;
  LaneRing* out_;      // the ring this side writes
  LaneRing* in_;       // the ring this side reads
  uint64_t tail_ = 0;  // what this side wrote (its own count: the shared copy is only published)
  uint64_t head_ = 0;  // what this side read
  void* tsan_out_ = nullptr;  // ThreadSanitizer builds: see lane.cc
  void* tsan_in_ = nullptr;
};

}  // namespace kvt::control::internal

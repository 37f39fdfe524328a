#include "control/lane.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <openssl/rand.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <new>

#include "kvt/common/log.h"
#include "tsan_annotations.h"

namespace kvt::control::internal {
namespace {

// ThreadSanitizer sees the two ends of a lane in one process (tests) as two mappings at
// different addresses, so the release/acquire on a ring's index orders nothing for it and every
// frame's payload looks racy. Both ends also report the hand-over on one address of this process
// chosen from the segment's nonce and the direction.
char tsan_sync[4096];
void* TsanSync(std::string_view nonce, int direction) {
  size_t h = std::hash<std::string_view>{}(nonce);
  return &tsan_sync[(h * 2 + static_cast<size_t>(direction)) % sizeof(tsan_sync)];
}

constexpr uint64_t kMagic = 0x656e616c2d74766bULL;  // "kvt-lane", little-endian
constexpr uint32_t kVersion = 1;
constexpr char kNamePrefix[] = "/kvt-lane-";
constexpr size_t kNameHexBytes = 16;  // random bytes in a name (32 hex digits)

struct Header {
  uint64_t magic;
  uint32_t version;
  uint32_t ring_bytes;
  char nonce[kLaneNonceBytes];
};
constexpr size_t kHeaderBytes = 64;
static_assert(sizeof(Header) <= kHeaderBytes);

std::string Hex(std::string_view bytes) {
  std::string out;
  for (unsigned char c : bytes) out += fmt::format("{:02x}", c);
  return out;
}

bool ValidName(const std::string& name) {
  const size_t prefix = sizeof(kNamePrefix) - 1;
  if (name.size() != prefix + 2 * kNameHexBytes || name.compare(0, prefix, kNamePrefix) != 0) {
    return false;
  }
  for (size_t i = prefix; i < name.size(); ++i) {
    const char c = name[i];
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// A name lives from the creator's shm_open until the peer opens it (one round trip) or the
// creator is told no: a lane file older than this was left by a process that died in that
// window. Removing a younger one by mistake would only make its offer be declined.
constexpr auto kStaleLaneAge = std::chrono::seconds(60);

// Removes this user's lane files older than kStaleLaneAge from /dev/shm (where glibc keeps POSIX
// shared memory); best effort.
void RemoveStaleLanes() {
  std::error_code ec;
  std::filesystem::directory_iterator it("/dev/shm", ec);
  const uid_t uid = ::geteuid();
  const time_t now = ::time(nullptr);
  for (; !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    std::string name(1, '/');  // shm_unlink's form of the file name
    name += it->path().filename().native();
    if (!ValidName(name)) continue;
    struct stat st {};
    if (::stat(it->path().c_str(), &st) != 0 || st.st_uid != uid) continue;
    if (now - st.st_mtime < kStaleLaneAge.count()) continue;
    if (::shm_unlink(name.c_str()) == 0) {
      KVT_LOG_INFO("ctl",
                   "removed {}: a control lane left by a process that died before its "
                   "peer opened it",
                   name);
    }
  }
}

}  // namespace

// One direction. The indices count bytes since the lane began (never wrap in practice: 2^64).
struct LaneRing {
  alignas(64) std::atomic<uint64_t> head;      // bytes the reader consumed
  alignas(64) std::atomic<uint64_t> tail;      // bytes the writer published
  alignas(64) std::atomic<uint32_t> sleeping;  // the reader blocks (wants a doorbell)
  alignas(64) char data[1];                    // ring_bytes of them
};
static_assert(std::atomic<uint64_t>::is_always_lock_free);
constexpr size_t kRingHeaderBytes = offsetof(LaneRing, data);

namespace {
// Allocates every page of the segment `fd` (closed here) and maps it. Allocated now, not on first
// touch: a full /dev/shm (a container's is often 64 MiB), or a segment left sparse, must fail
// here, not raise SIGBUS on a later store into the ring. MAP_FAILED with *err set on failure.
void* AllocateAndMap(int fd, size_t size, int* err) {
  void* base = MAP_FAILED;
  *err = ::posix_fallocate(fd, 0, static_cast<off_t>(size));
  if (*err == 0) {
    base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) *err = errno;
  }
  ::close(fd);
  return base;
}

size_t SegmentBytes(uint32_t ring_bytes) {
  return kHeaderBytes + 2 * (kRingHeaderBytes + static_cast<size_t>(ring_bytes));
}
}  // namespace

Lane::Lane(std::string name, std::string nonce, uint32_t ring_bytes, void* base, size_t size,
           bool creator)
    : name_(std::move(name)),
      nonce_(std::move(nonce)),
      ring_bytes_(ring_bytes),
      base_(base),
      size_(size),
      creator_(creator) {
  char* first = static_cast<char*>(base) + kHeaderBytes;
  auto* a = reinterpret_cast<LaneRing*>(first);  // creator -> opener
  auto* b = reinterpret_cast<LaneRing*>(first + kRingHeaderBytes + ring_bytes);
  out_ = creator ? a : b;
  in_ = creator ? b : a;
  tsan_out_ = TsanSync(nonce_, creator ? 0 : 1);
  tsan_in_ = TsanSync(nonce_, creator ? 1 : 0);
}

Lane::~Lane() {
  if (creator_) Unlink();
  ::munmap(base_, size_);
}

void Lane::Unlink() {
  if (unlinked_) return;
  unlinked_ = true;
  ::shm_unlink(name_.c_str());  // ENOENT: the peer removed it already
}

StatusOr<std::unique_ptr<Lane>> Lane::Create(uint32_t ring_bytes) {
  if (!ValidLaneRingBytes(ring_bytes)) {
    return InvalidArgument(fmt::format("lane ring_bytes = {}: must be a power of two in [{}, {}]",
                                       ring_bytes, kMinLaneRingBytes, kMaxLaneRingBytes));
  }
  std::string random(kNameHexBytes + kLaneNonceBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(random.data()),
                 static_cast<int>(random.size())) != 1) {
    return Internal("OpenSSL RAND_bytes failed: no randomness for a lane name");
  }
  RemoveStaleLanes();
  std::string name = kNamePrefix + Hex(std::string_view(random).substr(0, kNameHexBytes));
  std::string nonce = random.substr(kNameHexBytes);
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    return Unavailable(
        fmt::format("shm_open({}) for a control lane: {}; the connection keeps "
                    "its socket (is /dev/shm mounted and writable?)",
                    name, std::strerror(errno)));
  }
  const size_t size = SegmentBytes(ring_bytes);
  int err = 0;
  void* base = AllocateAndMap(fd, size, &err);
  if (base == MAP_FAILED) {
    ::shm_unlink(name.c_str());
    return Unavailable(fmt::format(
        "allocating or mapping the control lane {} ({} bytes): {}; the connection keeps its "
        "socket (is /dev/shm full? `df /dev/shm`)",
        name, size, std::strerror(err)));
  }
  // A fresh segment reads as zeros: both rings empty, nobody asleep.
  auto* header = new (base) Header{};
  header->magic = kMagic;
  header->version = kVersion;
  header->ring_bytes = ring_bytes;
  std::memcpy(header->nonce, nonce.data(), kLaneNonceBytes);
  return std::unique_ptr<Lane>(
      new Lane(std::move(name), std::move(nonce), ring_bytes, base, size, /*creator=*/true));
}

StatusOr<std::unique_ptr<Lane>> Lane::Open(const std::string& name, std::string_view nonce,
                                           uint32_t ring_bytes) {
  if (!ValidName(name)) {
    return InvalidArgument(
        fmt::format("lane name '{}' is not {}<32 hex digits>", name, kNamePrefix));
  }
  if (nonce.size() != kLaneNonceBytes || !ValidLaneRingBytes(ring_bytes)) {
    return InvalidArgument(fmt::format(
        "lane offer with a {}-byte nonce and ring_bytes = {}: want {} bytes and a power of two "
        "in [{}, {}]",
        nonce.size(), ring_bytes, kLaneNonceBytes, kMinLaneRingBytes, kMaxLaneRingBytes));
  }
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    return FailedPrecondition(
        fmt::format("lane {} cannot be opened here ({}): the peer is on another host or in another "
                    "shared-memory namespace, or runs as another user",
                    name, std::strerror(errno)));
  }
  const size_t size = SegmentBytes(ring_bytes);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != size) {
    ::close(fd);
    return FailedPrecondition(fmt::format("lane {} is {} bytes, not the {} its offer implies", name,
                                          static_cast<long long>(st.st_size), size));
  }
  // Lanes are private to one user, as Create makes them (0600). A segment another user owns, or
  // that others may open, could be truncated under our mapping, and a store into it would then
  // kill this process with SIGBUS.
  if (st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
    ::close(fd);
    return FailedPrecondition(fmt::format(
        "lane {} belongs to uid {} with mode {:04o}; lanes are private to one user (uid {}, mode "
        "0600): the peer runs as another user or the segment was altered, so the connection "
        "keeps its socket; run both ends as one user to use a lane",
        name, static_cast<unsigned>(st.st_uid), static_cast<unsigned>(st.st_mode & 07777),
        static_cast<unsigned>(::geteuid())));
  }
  int err = 0;
  void* base = AllocateAndMap(fd, size, &err);
  if (base == MAP_FAILED) {
    return Unavailable(
        fmt::format("allocating or mapping the control lane {}: {}; the connection keeps its "
                    "socket (is /dev/shm full? `df /dev/shm`)",
                    name, std::strerror(err)));
  }
  Header header;
  std::memcpy(&header, base, sizeof(header));
  if (header.magic != kMagic || header.version != kVersion || header.ring_bytes != ring_bytes ||
      std::memcmp(header.nonce, nonce.data(), kLaneNonceBytes) != 0) {
    ::munmap(base, size);
    return FailedPrecondition(fmt::format(
        "lane {} is not the segment offered (magic {:#x}, version {}, ring_bytes {}, nonce "
        "{}match)",
        name, header.magic, header.version, header.ring_bytes,
        std::memcmp(header.nonce, nonce.data(), kLaneNonceBytes) == 0 ? "" : "does not "));
  }
  auto lane = std::unique_ptr<Lane>(
      new Lane(name, std::string(nonce), ring_bytes, base, size, /*creator=*/false));
  // Nobody else may open it now; the creator removes the name too (whichever comes first).
  ::shm_unlink(name.c_str());
  lane->unlinked_ = true;
  return lane;
}

StatusOr<size_t> Lane::Write(std::string_view data) {
  const uint64_t head = out_->head.load(std::memory_order_acquire);
  const uint64_t used = tail_ - head;
  if (head > tail_ || used > ring_bytes_) {
    return DataLoss(fmt::format(
        "control lane {}: the reader's index {} is impossible (written {}, ring {} bytes): the "
        "peer corrupted the shared segment",
        name_, head, tail_, ring_bytes_));
  }
  const size_t n = std::min<size_t>(ring_bytes_ - used, data.size());
  const size_t mask = ring_bytes_ - 1;
  const size_t at = static_cast<size_t>(tail_) & mask;
  const size_t first = std::min(n, ring_bytes_ - at);
  std::memcpy(out_->data + at, data.data(), first);
  std::memcpy(out_->data, data.data() + first, n - first);
  tail_ += n;
  transfer::internal::TsanRelease(tsan_out_);
  out_->tail.store(tail_, std::memory_order_release);
  return n;
}

bool Lane::TakeDoorbell() {
  // Pairs with the fence in Sleep(): either the reader sees the bytes just published, or this
  // sees its flag (or both).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (out_->sleeping.load(std::memory_order_relaxed) == 0) return false;
  return out_->sleeping.exchange(0, std::memory_order_relaxed) != 0;
}

StatusOr<size_t> Lane::Read(char* out, size_t capacity) {
  const uint64_t tail = in_->tail.load(std::memory_order_acquire);
  transfer::internal::TsanAcquire(tsan_in_);
  const uint64_t avail = tail - head_;
  if (tail < head_ || avail > ring_bytes_) {
    return DataLoss(fmt::format(
        "control lane {}: the writer's index {} is impossible (read {}, ring {} bytes): the "
        "peer corrupted the shared segment",
        name_, tail, head_, ring_bytes_));
  }
  const size_t n = std::min<size_t>(avail, capacity);
  const size_t mask = ring_bytes_ - 1;
  const size_t at = static_cast<size_t>(head_) & mask;
  const size_t first = std::min(n, ring_bytes_ - at);
  std::memcpy(out, in_->data + at, first);
  std::memcpy(out + first, in_->data, n - first);
  head_ += n;
  in_->head.store(head_, std::memory_order_release);
  return n;
}

bool Lane::Readable() const { return in_->tail.load(std::memory_order_acquire) != head_; }

bool Lane::Sleep() {
  in_->sleeping.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return Readable();
}

void Lane::Wake() { in_->sleeping.store(0, std::memory_order_relaxed); }

}  // namespace kvt::control::internal

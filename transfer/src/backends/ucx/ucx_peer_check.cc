#include "backends/ucx/ucx_peer_check.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>

#include "kvt/common/hex.h"

namespace kvt::transfer::ucx_check {
namespace {

// ---- UCX 1.13's packed worker address (src/ucp/wireup/address.c) ------------------------------

// The header's low 4 bits: UCP_OBJECT_VERSION_V1 (0) or UCP_OBJECT_VERSION_V2 (1).
constexpr uint8_t kAddressV1 = 0;
constexpr uint8_t kAddressV2 = 1;
// Header flags (v1: the header's high 4 bits; v2: the second byte).
constexpr uint8_t kHeaderDebugInfo = 1u << 0;  // a worker name follows the uuid
constexpr uint8_t kHeaderWorkerUuid = 1u << 1;
constexpr uint8_t kHeaderClientId = 1u << 2;
constexpr uint8_t kHeaderAmOnly = 1u << 3;
constexpr uint8_t kHeaderKnownFlags =
    kHeaderDebugInfo | kHeaderWorkerUuid | kHeaderClientId | kHeaderAmOnly;
// UCP_NULL_RESOURCE where the first device would start: an address with no transports.
constexpr uint8_t kNullResource = 0xff;
// The memory domain byte: EMPTY_DEV, then (v1) ALLOC and REG flags and a 5-bit index, or (v2) a
// 7-bit index whose all-ones value means "the index is in the next byte".
constexpr uint8_t kMdEmptyDevice = 0x80;
constexpr uint8_t kMdIndexMaskV1 = 0x1f;
constexpr uint8_t kMdIndexMaskV2 = 0x7f;
// The device address length byte: LAST, NUM_PATHS, SYS_DEVICE flags and a 5-bit length.
constexpr uint8_t kFlagLast = 0x80;
constexpr uint8_t kDeviceNumPaths = 0x40;
constexpr uint8_t kDeviceSysDevice = 0x20;
constexpr uint8_t kDeviceLengthMask = 0x1f;
// The interface address length byte: LAST, HAS_EP_ADDR flags and a 6-bit length; the same mask
// takes the lane index out of an endpoint address's lane byte.
constexpr uint8_t kIfaceHasEpAddress = 0x40;
constexpr uint8_t kIfaceLengthMask = 0x3f;
// Per interface, non-unified mode: ucp_address_packed_iface_attr_t (v1: overhead, bandwidth and
// latency overhead as floats, then 32 bits of priority and flags) or
// ucp_address_v2_packed_iface_attr_t (v2: 3 fp8 values, priority, segment size, flags).
constexpr size_t kIfaceAttrBytesV1 = 16;
constexpr size_t kIfaceAttrBytesV2 = 8;
// UCX's bounds: UCP_MAX_RESOURCES interfaces in all, UCP_MAX_LANES endpoint addresses per
// interface, memory domain indices below UCP_MD_INDEX_BITS (they index 64-bit maps).
constexpr int kMaxInterfaces = 128;
constexpr int kMaxLanes = 6;
constexpr unsigned kMaxMdIndex = 63;

constexpr char kAddressAdvice[] =
    "; the peer runs a UCX whose address format this side does not know (it checks the format of "
    "UCX 1.13) or is not a kvt agent";

// Reads the address front to back; every read is bounded by what is left.
class Reader {
 public:
  explicit Reader(std::span<const uint8_t> bytes) : bytes_(bytes) {}
  size_t remaining() const { return bytes_.size() - pos_; }
  size_t position() const { return pos_; }
  bool Take(size_t n, std::span<const uint8_t>* out = nullptr) {
    if (n > remaining()) return false;
    if (out != nullptr) *out = bytes_.subspan(pos_, n);
    pos_ += n;
    return true;
  }
  bool Byte(uint8_t* value) {
    if (remaining() < 1) return false;
    *value = bytes_[pos_++];
    return true;
  }
  uint8_t Peek() const { return bytes_[pos_]; }

 private:
  std::span<const uint8_t> bytes_;
  size_t pos_ = 0;
};

Status Malformed(const std::string& what) {
  return InvalidArgument("the peer's UCX worker address is malformed: " + what + kAddressAdvice);
}

std::string Short(const std::string& what, size_t needed, size_t remaining) {
  return what + " needs " + std::to_string(needed) + " bytes but " + std::to_string(remaining) +
         " remain";
}

// A length or index packed in the bits of `mask` of a byte; in v2 the all-ones value of the mask
// means the value is the next byte (ucp_address_unpack_byte_extended).
bool Extended(Reader& r, uint8_t first, uint8_t mask, uint8_t version, uint8_t* value) {
  *value = first & mask;
  if (version != kAddressV1 && *value == mask) return r.Byte(value);
  return true;
}

float LoadFloat(std::span<const uint8_t> bytes, size_t offset) {
  float value;
  std::memcpy(&value, bytes.data() + offset, sizeof(value));
  return value;
}

// One interface record of device `device`: transport name checksum, attributes, address, and the
// endpoint addresses it may carry. Sets *last from the record's LAST flag.
Status CheckInterface(Reader& r, uint8_t version, int device, int iface, bool* last) {
  const std::string name = "interface record " + std::to_string(iface) + " (device record " +
                           std::to_string(device) + ")";
  if (!r.Take(2)) return Malformed(Short(name + "'s transport checksum", 2, r.remaining()));
  const size_t attr_bytes = version == kAddressV1 ? kIfaceAttrBytesV1 : kIfaceAttrBytesV2;
  std::span<const uint8_t> attr;
  if (!r.Take(attr_bytes, &attr)) {
    return Malformed(Short(name + "'s attributes", attr_bytes, r.remaining()));
  }
  if (version == kAddressV1) {
    for (size_t offset : {size_t{0}, size_t{4}, size_t{8}}) {
      if (!std::isfinite(LoadFloat(attr, offset))) {
        return Malformed(name + " has a performance attribute that is not a finite number");
      }
    }
    if (LoadFloat(attr, 4) == 0.0f) return Malformed(name + " claims a bandwidth of 0");
  }
  uint8_t length_byte = 0;
  if (!r.Byte(&length_byte)) return Malformed(Short(name + "'s address length", 1, 0));
  *last = (length_byte & kFlagLast) != 0;
  const bool has_endpoints = (length_byte & kIfaceHasEpAddress) != 0;
  uint8_t length = 0;
  if (!Extended(r, length_byte, kIfaceLengthMask, version, &length)) {
    return Malformed(Short(name + "'s extended address length", 1, 0));
  }
  if (!r.Take(length)) {
    return Malformed(name + " claims " + std::to_string(length) + " bytes of address but " +
                     std::to_string(r.remaining()) + " remain");
  }
  if (!has_endpoints) return OkStatus();
  for (int ep = 0;; ++ep) {
    if (ep == kMaxLanes) {
      return Malformed(name + " carries more than " + std::to_string(kMaxLanes) +
                       " endpoint addresses");
    }
    const std::string ep_name = name + "'s endpoint address " + std::to_string(ep);
    uint8_t ep_length = 0;
    if (!r.Byte(&ep_length)) return Malformed(Short(ep_name + "'s length", 1, 0));
    if (!r.Take(ep_length)) {
      return Malformed(ep_name + " claims " + std::to_string(ep_length) + " bytes but " +
                       std::to_string(r.remaining()) + " remain");
    }
    uint8_t lane = 0;
    if (!r.Byte(&lane)) return Malformed(Short(ep_name + "'s lane", 1, 0));
    if ((lane & kIfaceHasEpAddress) != 0 || (lane & kIfaceLengthMask) >= kMaxLanes) {
      return Malformed(ep_name + " names lane byte " + Hex(lane) + " (lanes are below " +
                       std::to_string(kMaxLanes) + ")");
    }
    if ((lane & kFlagLast) != 0) return OkStatus();
  }
}

// ---- ucp_rkey_pack's format (src/ucp/core/ucp_rkey.c) ------------------------------------------

// UCS_MEMORY_TYPE_LAST in UCX 1.13 (host, cuda, cuda-managed, rocm, rocm-managed).
constexpr uint8_t kMemoryTypes = 5;

Status BadKey(const std::string& what) {
  return InvalidArgument("the peer's UCX memory key is malformed: " + what +
                         "; the peer runs a UCX whose key format this side does not know (it "
                         "checks the format of UCX 1.13) or is not a kvt agent");
}

// ---- /proc/self/maps
// -----------------------------------------------------------------------------

std::string RangeText(uint64_t begin, uint64_t length) {
  std::string text(1, '[');
  text += Hex(begin);
  text += ", ";
  text += Hex(begin + length);
  text += ')';
  return text;
}

std::string MappingText(const Mapping& m) {
  std::string text =
      RangeText(m.begin, m.end - m.begin) + " " + (m.writable ? "w" : "-") + (m.shared ? "s" : "p");
  text += m.path.empty() ? std::string(" anonymous") : " " + m.path;
  return text;
}

// Whether this process can read the byte at `address`. Where an access would fault (unmapped,
// or a shared mapping past its file's end, which raises SIGBUS), the kernel's own copy from it
// fails with EFAULT instead of raising the signal: process_vm_readv on this process, or, where a
// seccomp policy refuses that call, a write of the byte into a pipe.
bool Readable(uint64_t address) {
  uint8_t byte = 0;
  iovec local{&byte, 1};
  iovec remote{reinterpret_cast<void*>(address), 1};
  if (process_vm_readv(getpid(), &local, 1, &remote, 1, 0) == 1) return true;
  if (errno == EFAULT) return false;
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return false;
  const bool readable = write(fds[1], reinterpret_cast<const void*>(address), 1) == 1;
  close(fds[0]);
  close(fds[1]);
  return readable;
}

}  // namespace

Status CheckWorkerAddress(std::span<const uint8_t> address) {
  Reader r(address);
  uint8_t header = 0;
  if (!r.Byte(&header)) return Malformed("it is empty");
  const uint8_t version = header & 0x0f;
  uint8_t flags = 0;
  if (version == kAddressV1) {
    flags = header >> 4;
  } else if (version == kAddressV2) {
    if ((header >> 4) != 0) {
      return Malformed("its v2 header byte " + Hex(header) + " has bits set above the version");
    }
    if (!r.Byte(&flags)) return Malformed(Short("its v2 header", 2, 1));
    if ((flags & ~kHeaderKnownFlags) != 0) {
      return Malformed("its header has unknown flags " + Hex(flags & ~kHeaderKnownFlags));
    }
  } else {
    return Malformed("its header names format version " + std::to_string(version) +
                     " (UCX 1.13 knows 0 for v1 and 1 for v2)");
  }
  // UCX reads a worker uuid from every v1 address it connects to, and from v2 ones that say so.
  if (version == kAddressV1 || (flags & kHeaderWorkerUuid) != 0) {
    if (!r.Take(8)) return Malformed(Short("its worker uuid", 8, r.remaining()));
  }
  if ((flags & kHeaderClientId) != 0 && !r.Take(8)) {
    return Malformed(Short("its client id", 8, r.remaining()));
  }
  if ((flags & kHeaderDebugInfo) != 0) {
    uint8_t name_length = 0;
    if (!r.Byte(&name_length)) return Malformed(Short("its worker name's length", 1, 0));
    if (!r.Take(name_length)) {
      return Malformed("its worker name claims " + std::to_string(name_length) + " bytes but " +
                       std::to_string(r.remaining()) + " remain");
    }
  }
  if (r.remaining() == 0) return Malformed("it ends before its first device record");
  if (r.Peek() == kNullResource) {
    return Malformed("it lists no transports (UCX found none the peer could be reached by)");
  }
  int interfaces = 0;
  for (int device = 0;; ++device) {
    const std::string name = "device record " + std::to_string(device);
    uint8_t md_byte = 0;
    if (!r.Byte(&md_byte)) return Malformed(Short(name, 2, 0));
    const bool empty = (md_byte & kMdEmptyDevice) != 0;
    uint8_t md_index = 0;
    if (!Extended(r, md_byte, version == kAddressV1 ? kMdIndexMaskV1 : kMdIndexMaskV2, version,
                  &md_index)) {
      return Malformed(Short(name + "'s extended memory domain index", 1, 0));
    }
    if (md_index > kMaxMdIndex) {
      return Malformed(name + " names memory domain " + std::to_string(md_index) +
                       " (UCX has at most " + std::to_string(kMaxMdIndex + 1) + ")");
    }
    uint8_t length_byte = 0;
    if (!r.Byte(&length_byte)) return Malformed(Short(name + "'s address length", 1, 0));
    const bool last_device = (length_byte & kFlagLast) != 0;
    uint8_t length = 0;
    if (!Extended(r, length_byte, kDeviceLengthMask, version, &length)) {
      return Malformed(Short(name + "'s extended address length", 1, 0));
    }
    if ((length_byte & kDeviceNumPaths) != 0) {
      uint8_t paths = 0;
      if (!r.Byte(&paths)) return Malformed(Short(name + "'s path count", 1, 0));
      if (paths == 0) return Malformed(name + " claims 0 network paths");
    }
    if ((length_byte & kDeviceSysDevice) != 0 && !r.Take(1)) {
      return Malformed(Short(name + "'s system device", 1, 0));
    }
    if (!r.Take(length)) {
      return Malformed(name + " claims " + std::to_string(length) + " bytes of address but " +
                       std::to_string(r.remaining()) + " remain");
    }
    for (bool last_iface = empty; !last_iface;) {
      if (interfaces == kMaxInterfaces) {
        return Malformed("it lists more than " + std::to_string(kMaxInterfaces) + " interfaces");
      }
      KVT_RETURN_IF_ERROR(CheckInterface(r, version, device, interfaces++, &last_iface));
    }
    if (last_device) break;
  }
  if (r.remaining() != 0) {
    return Malformed(std::to_string(r.remaining()) +
                     " bytes follow its last device record (it ends at byte " +
                     std::to_string(r.position()) + " of " + std::to_string(address.size()) + ")");
  }
  return OkStatus();
}

Status CheckPackedRkey(std::span<const uint8_t> key) {
  Reader r(key);
  std::span<const uint8_t> map_bytes;
  if (!r.Take(8, &map_bytes)) return BadKey(Short("its memory domain map", 8, key.size()));
  uint64_t md_map = 0;
  for (int i = 7; i >= 0; --i) md_map = (md_map << 8) | map_bytes[i];  // UCX packs it native (LE)
  // (No domain at all is a key UCX packs for memory no domain of its could register.)
  uint8_t memory_type = 0;
  if (!r.Byte(&memory_type)) return BadKey(Short("its memory type", 1, 0));
  if (memory_type >= kMemoryTypes) {
    return BadKey("it names memory type " + std::to_string(memory_type) + " (UCX 1.13 knows " +
                  std::to_string(kMemoryTypes) + ")");
  }
  for (unsigned md = 0; md < 64; ++md) {
    if ((md_map & (uint64_t{1} << md)) == 0) continue;
    const std::string name = "the key of memory domain " + std::to_string(md);
    uint8_t size = 0;
    if (!r.Byte(&size)) return BadKey(Short(name + "'s size", 1, 0));
    if (!r.Take(size)) {
      return BadKey(name + " claims " + std::to_string(size) + " bytes but " +
                    std::to_string(r.remaining()) + " remain");
    }
  }
  if (r.remaining() != 0) {
    return BadKey(std::to_string(r.remaining()) + " bytes follow its last memory domain's key");
  }
  return OkStatus();
}

std::vector<Mapping> ParseMaps(std::string_view text) {
  std::vector<Mapping> maps;
  std::istringstream lines{std::string(text)};
  std::string line;
  while (std::getline(lines, line)) {
    Mapping m;
    unsigned long long begin = 0, end = 0, offset = 0, inode = 0;
    unsigned major = 0, minor = 0;
    char perms[5] = {};
    int path_at = 0;
    if (std::sscanf(line.c_str(), "%llx-%llx %4s %llx %x:%x %llu %n", &begin, &end, perms, &offset,
                    &major, &minor, &inode, &path_at) < 7) {
      continue;
    }
    m.begin = begin;
    m.end = end;
    m.writable = perms[1] == 'w';
    m.shared = perms[3] == 's';
    m.offset = offset;
    m.device = (uint64_t{major} << 32) | minor;
    m.inode = inode;
    if (path_at > 0 && static_cast<size_t>(path_at) <= line.size()) m.path = line.substr(path_at);
    if (m.end > m.begin) maps.push_back(std::move(m));
  }
  return maps;
}

StatusOr<std::vector<Mapping>> ReadSelfMaps() {
  std::ifstream in("/proc/self/maps");
  if (!in) {
    return FailedPrecondition(std::string("cannot read /proc/self/maps (") + std::strerror(errno) +
                              "): mount /proc, or set ucx direct_shm off");
  }
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return ParseMaps(text);
}

std::vector<Mapping> NewMappings(std::span<const Mapping> before, std::span<const Mapping> after) {
  std::vector<Mapping> made;
  for (const Mapping& m : after) {
    bool old = false;
    for (const Mapping& b : before) {
      if (b.begin == m.begin && b.end == m.end && b.inode == m.inode && b.device == m.device &&
          b.offset == m.offset) {
        old = true;
        break;
      }
    }
    if (!old) made.push_back(m);
  }
  return made;
}

Status CheckMappedForWrite(size_t index, uint64_t claimed_base, uint64_t length, uint64_t first,
                           std::span<const Mapping> maps, std::span<const Range> own) {
  const std::string claim = "the peer's buffer " + std::to_string(index) + " (claimed as " +
                            RangeText(claimed_base, length) + ", " + std::to_string(length) +
                            " bytes)";
  const std::string advice =
      "; the peer describes memory its key does not map: it is not a kvt agent, or its "
      "registration changed without a new hello";
  if (length == 0 || first + length < first) {
    return InvalidArgument(claim + " maps here to " + Hex(first) + ", a range that wraps" + advice);
  }
  const uint64_t end = first + length;
  // The mappings that hold the range, in order: one shared file, writable, without a gap.
  const Mapping* start = nullptr;
  for (const Mapping& m : maps) {
    if (first >= m.begin && first < m.end) start = &m;
  }
  if (start == nullptr) {
    return InvalidArgument(claim + " maps here to " + RangeText(first, length) +
                           ", whose first byte lies in no mapping made here for the peer's keys" +
                           advice);
  }
  const auto refuse = [&](const Mapping& m, const std::string& why) {
    return InvalidArgument(claim + " maps here to " + RangeText(first, length) + ", but " + why +
                           " (mapped there: " + MappingText(m) + ")" + advice);
  };
  if (!start->shared || start->inode == 0 || !start->writable) {
    return refuse(*start, "that is not writable shared memory");
  }
  const Mapping* last = start;
  while (last->end < end) {
    const Mapping* next = last + 1;
    if (next == maps.data() + maps.size() || next->begin != last->end || !next->shared ||
        !next->writable || next->inode != start->inode || next->device != start->device ||
        next->offset != last->offset + (last->end - last->begin)) {
      return refuse(*start, "the mapping of that shared memory ends at " + Hex(last->end));
    }
    last = next;
  }
  for (size_t i = 0; i < own.size(); ++i) {
    if (first < own[i].begin + own[i].length && own[i].begin < end) {
      return refuse(*start, "that overlaps this side's own buffer " + std::to_string(i));
    }
  }
  // The file must hold the last byte (then it holds every byte before it): past the file's end
  // a store raises SIGBUS. The path names the file where it still exists; a segment UCX has
  // unlinked is probed instead.
  const uint64_t needed = last->offset + (end - 1 - last->begin) + 1;
  struct stat st {};
  if (!start->path.empty() && start->path[0] == '/' && stat(start->path.c_str(), &st) == 0 &&
      st.st_ino == start->inode && S_ISREG(st.st_mode) &&
      static_cast<uint64_t>(st.st_size) < needed) {
    return refuse(*start, "the file holds " + std::to_string(st.st_size) +
                              " bytes and the range "
                              "needs " +
                              std::to_string(needed));
  }
  if (!Readable(end - 1)) {
    return refuse(*start, "its last byte cannot be accessed (past the end of the shared file)");
  }
  return OkStatus();
}

}  // namespace kvt::transfer::ucx_check

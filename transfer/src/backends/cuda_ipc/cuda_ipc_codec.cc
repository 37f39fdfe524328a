#include "backends/cuda_ipc/cuda_ipc_codec.h"

#include <unistd.h>

#include <cstring>
#include <map>

#include "backends/common/host_identity.h"
#include "kvt/common/random.h"

namespace kvt::transfer::cuda_ipc {
namespace {

constexpr char kKeyMagic[4] = {'K', 'V', 'C', 'I'};

void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

uint64_t GetLittleEndian(std::string_view in, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) {
    v |= static_cast<uint64_t>(static_cast<uint8_t>(in[at + i])) << (8 * i);
  }
  return v;
}

// Where the fields after the 8-byte head sit.
constexpr size_t kIndexAt = 8;
constexpr size_t kCountAt = 12;
constexpr size_t kHandleAt = 16;
constexpr size_t kOffsetAt = kHandleAt + kIpcHandleBytes;
constexpr size_t kAllocationBytesAt = kOffsetAt + 8;
static_assert(kAllocationBytesAt + 8 == kKeyBytes);

std::string Num(uint64_t v) { return std::to_string(v); }

}  // namespace

std::string EncodeRegionKey(const RegionKey& key) {
  std::string out;
  out.reserve(kKeyBytes);
  out.append(kKeyMagic, sizeof(kKeyMagic));
  out.push_back(static_cast<char>(kKeyVersion));
  out.push_back(static_cast<char>(kIpcHandleBytes));
  out.push_back('\0');
  out.push_back('\0');
  PutU32(out, key.allocation);
  PutU32(out, key.allocations);
  out.append(key.handle.data(), key.handle.size());
  PutU64(out, key.offset);
  PutU64(out, key.allocation_bytes);
  return out;
}

StatusOr<RegionKey> DecodeRegionKey(std::string_view bytes, uint64_t region_length) {
  if (bytes.size() < 5 || std::memcmp(bytes.data(), kKeyMagic, sizeof(kKeyMagic)) != 0) {
    return InvalidArgument("not a cuda_ipc buffer key (" + std::to_string(bytes.size()) +
                           " bytes without the 'KVCI' magic); the peer must publish its buffers "
                           "with the cuda_ipc backend");
  }
  const uint8_t version = static_cast<uint8_t>(bytes[4]);
  if (version != kKeyVersion) {
    return InvalidArgument("cuda_ipc buffer key version " + std::to_string(version) +
                           ", this build reads version " + std::to_string(kKeyVersion) +
                           "; run the same kvt version on both sides");
  }
  if (bytes.size() != kKeyBytes) {
    return InvalidArgument("cuda_ipc buffer key of " + std::to_string(bytes.size()) +
                           " bytes; version " + std::to_string(kKeyVersion) + " keys are " +
                           std::to_string(kKeyBytes) + " bytes (truncated or corrupted hello)");
  }
  const uint8_t handle_bytes = static_cast<uint8_t>(bytes[5]);
  if (handle_bytes != kIpcHandleBytes || bytes[6] != '\0' || bytes[7] != '\0') {
    return InvalidArgument("cuda_ipc buffer key carries a " + std::to_string(handle_bytes) +
                           "-byte IPC handle (expected " + std::to_string(kIpcHandleBytes) +
                           ", reserved bytes zero); the key is corrupted");
  }
  RegionKey key;
  key.allocation = static_cast<uint32_t>(GetLittleEndian(bytes, kIndexAt, 4));
  key.allocations = static_cast<uint32_t>(GetLittleEndian(bytes, kCountAt, 4));
  std::memcpy(key.handle.data(), bytes.data() + kHandleAt, kIpcHandleBytes);
  key.offset = GetLittleEndian(bytes, kOffsetAt, 8);
  key.allocation_bytes = GetLittleEndian(bytes, kAllocationBytesAt, 8);
  if (key.allocation >= key.allocations) {
    return InvalidArgument("cuda_ipc buffer key names allocation index " + Num(key.allocation) +
                           ", out of range for the " + Num(key.allocations) +
                           " allocations the key says the peer published; corrupted key");
  }
  if (key.allocation_bytes == 0) {
    return InvalidArgument("cuda_ipc buffer key names an allocation of 0 bytes; corrupted key");
  }
  if (region_length > key.allocation_bytes || key.offset > key.allocation_bytes - region_length) {
    return InvalidArgument("cuda_ipc buffer key places the buffer at [" + Num(key.offset) + ", +" +
                           Num(region_length) + ") inside its allocation " + Num(key.allocation) +
                           " of " + Num(key.allocation_bytes) +
                           " bytes, past its end; the peer's descriptor is inconsistent");
  }
  return key;
}

StatusOr<PeerKeys> DecodePeerKeys(std::span<const RemoteRegion> regions) {
  PeerKeys keys;
  std::vector<size_t> first_buffer;  // per allocation index: the first buffer naming it
  std::map<IpcHandleBytes, uint32_t> index_of_handle;
  for (size_t i = 0; i < regions.size(); ++i) {
    StatusOr<RegionKey> key = DecodeRegionKey(regions[i].key, regions[i].length);
    if (!key.ok()) return key.status().WithContext("the peer's buffer " + Num(i));
    if (i == 0) {
      // Each allocation holds at least one buffer, so there are no more allocations than buffers.
      if (key->allocations > regions.size()) {
        return InvalidArgument("the peer's buffer 0 says its " + Num(regions.size()) +
                               " buffers lie in " + Num(key->allocations) +
                               " allocations, more than there are buffers; corrupted descriptor");
      }
      keys.allocations.resize(key->allocations);
      first_buffer.assign(key->allocations, regions.size());
    } else if (key->allocations != keys.allocations.size()) {
      return InvalidArgument("the peer's buffer " + Num(i) + " says its buffers lie in " +
                             Num(key->allocations) + " allocations, buffer 0 says " +
                             Num(keys.allocations.size()) + "; the peer's descriptor is corrupted");
    }
    const PeerAllocation allocation{key->handle, key->allocation_bytes};
    const size_t first = first_buffer[key->allocation];
    if (first == regions.size()) {
      const auto [named, fresh] = index_of_handle.emplace(key->handle, key->allocation);
      if (!fresh) {
        return InvalidArgument("the peer's buffers " + Num(first_buffer[named->second]) + " and " +
                               Num(i) + " name one IPC handle under two allocation indices (" +
                               Num(named->second) + " and " + Num(key->allocation) +
                               "); the peer's descriptor is corrupted");
      }
      first_buffer[key->allocation] = i;
      keys.allocations[key->allocation] = allocation;
    } else if (!(keys.allocations[key->allocation] == allocation)) {
      return InvalidArgument(
          "the peer's buffers " + Num(first) + " and " + Num(i) + " both lie in allocation " +
          Num(key->allocation) + " but carry different handles or sizes (" +
          Num(keys.allocations[key->allocation].bytes) + " and " + Num(key->allocation_bytes) +
          " bytes); the peer's descriptor is corrupted");
    }
    keys.allocation_of.push_back(key->allocation);
    keys.offsets.push_back(key->offset);
  }
  for (size_t a = 0; a < first_buffer.size(); ++a) {
    if (first_buffer[a] == regions.size()) {
      return InvalidArgument("the peer's descriptor counts " + Num(first_buffer.size()) +
                             " allocations but no buffer lies in allocation " + Num(a) +
                             "; the peer's descriptor is corrupted");
    }
  }
  return keys;
}

std::string EncodeAddress(const ProcessAddress& a) {
  std::string out(kAddressPrefix);
  out += " boot=" + a.boot_id;
  out += " pid=" + std::to_string(a.pid);
  out += " proc=" + HexDigits(a.process);
  out += " dev=" + std::to_string(a.device);
  out += " pci=" + a.pci_bus_id;
  out += " inst=" + HexDigits(a.instance);
  return out;
}

StatusOr<ProcessAddress> DecodeAddress(std::string_view text) {
  static constexpr TextRecordFormat kFormat = {
      .prefix = kAddressPrefix,
      .what = "cuda_ipc address",
      .not_one = "not a cuda_ipc address",
      .use_instead = "the peer must publish with the cuda_ipc backend",
  };
  KVT_ASSIGN_OR_RETURN(const TextRecordFields fields, ParseTextRecord(text, kFormat));
  ProcessAddress a;
  bool have_boot = false, have_pid = false, have_proc = false, have_dev = false, have_pci = false,
       have_inst = false;
  for (const auto& [name, value] : fields) {
    bool ok = !value.empty();
    if (name == "boot") {
      a.boot_id = std::string(value);
      have_boot = true;
    } else if (name == "pid") {
      ok = ok && ParseNumber(value, a.pid, 10);
      have_pid = true;
    } else if (name == "proc") {
      ok = ok && ParseNumber(value, a.process, 16);
      have_proc = true;
    } else if (name == "dev") {
      ok = ok && ParseNumber(value, a.device, 10) && a.device >= 0;
      have_dev = true;
    } else if (name == "pci") {
      a.pci_bus_id = std::string(value);
      have_pci = true;
    } else if (name == "inst") {
      ok = ok && ParseNumber(value, a.instance, 16);
      have_inst = true;
    }
    if (!ok) {
      return InvalidArgument("cuda_ipc address field '" + ShownText(name) + "=" + ShownText(value) +
                             "' has a malformed value in '" + ShownText(text) + "'");
    }
  }
  const char* missing = !have_boot   ? "boot"
                        : !have_pid  ? "pid"
                        : !have_proc ? "proc"
                        : !have_dev  ? "dev"
                        : !have_pci  ? "pci"
                        : !have_inst ? "inst"
                                     : nullptr;
  if (missing != nullptr) {
    return InvalidArgument(std::string("cuda_ipc address lacks the '") + missing + "=' field: '" +
                           ShownText(text) + "'");
  }
  return a;
}

bool SameHost(const ProcessAddress& a, const ProcessAddress& b) { return a.boot_id == b.boot_id; }

bool SameProcess(const ProcessAddress& a, const ProcessAddress& b) {
  return SameHost(a, b) && a.pid == b.pid && a.process == b.process;
}

const std::string& ThisBootId() {
  static const std::string boot_id = ReadBootId("ipc");
  return boot_id;
}

uint64_t ThisProcessToken() {
  static const uint64_t token = [] { return RandomU64() ^ static_cast<uint64_t>(getpid()); }();
  return token;
}

}  // namespace kvt::transfer::cuda_ipc

// Checks of what a ucx peer sends before any of it reaches UCX: its packed worker address, its
// packed remote keys, and (for peers whose buffers UCX maps into this process) that each buffer
// the peer describes lies inside memory this process really has mapped for it.
//
// Why hand-written: UCX takes a peer's worker address (ucp_ep_create) and packed key
// (ucp_ep_rkey_unpack) as bare pointers without a length, and has no call that validates either;
// its parsers trust every length byte and abort the process (ucs_assert) on an address version
// they do not know. So the formats of UCX 1.13 (src/ucp/wireup/address.c, version v1 and v2,
// non-unified mode; src/ucp/core/ucp_rkey.c) are walked here, every length bounded by the bytes
// the peer sent, and anything else (unknown version or flags, records running past the end,
// trailing bytes) is refused. UCX's own addresses and keys pass (tested on tcp, shared memory and
// UCX's default transports); a UCX whose format differs fails the backend's check of its own
// address at start-up instead of refusing every peer.
//
// Thread safety: pure functions, except CheckMappedForWrite, which reads /proc/self/maps and
// probes this process's memory; call from any thread.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvt/common/status.h"

namespace kvt::transfer::ucx_check {

// OK for a worker address in UCX 1.13's packed format, as ucp_worker_get_address produces it
// (with at least one device); InvalidArgument naming the record that is wrong, otherwise.
Status CheckWorkerAddress(std::span<const uint8_t> address);

// OK for a key in the format ucp_rkey_pack produces (memory domain map, memory type, one sized
// transport key per domain, nothing after); InvalidArgument naming what is wrong, otherwise.
Status CheckPackedRkey(std::span<const uint8_t> key);

// Bytes of zeros appended to a copy of a peer's key before ucp_ep_rkey_unpack: a transport's
// key unpacker reads its own fixed-size struct whatever size the peer wrote, so a short key
// would otherwise be read past its end.
inline constexpr size_t kRkeyUnpackPadding = 256;

// One line of /proc/<pid>/maps.
struct Mapping {
  uint64_t begin = 0;
  uint64_t end = 0;  // exclusive
  bool writable = false;
  bool shared = false;
  uint64_t offset = 0;  // in the mapped file
  uint64_t device = 0;  // major << 32 | minor
  uint64_t inode = 0;   // 0: not file-backed
  std::string path;     // may end in " (deleted)"
};

// Parses /proc/<pid>/maps text; lines it cannot read are skipped.
std::vector<Mapping> ParseMaps(std::string_view text);

// Checks that the local range [first, first + length) that UCX maps a peer's buffer `index` to
// (claimed by the peer as [claimed_base, claimed_base + length)) lies inside `maps` (the
// mappings made for the peer's keys: NewMappings), in mappings of one shared file, writable, with
// no gap, that the file covers every byte of it (a shared mapping past its file's end raises
// SIGBUS on access), and that it overlaps none of `own` (this backend's registered buffers).
// InvalidArgument naming the buffer, the claim and what is mapped there, otherwise.
struct Range {
  uint64_t begin = 0;
  uint64_t length = 0;
};
Status CheckMappedForWrite(size_t index, uint64_t claimed_base, uint64_t length, uint64_t first,
                           std::span<const Mapping> maps, std::span<const Range> own);

// This process's /proc/self/maps, parsed (read it once to check many buffers).
StatusOr<std::vector<Mapping>> ReadSelfMaps();

// The mappings of `after` that `before` does not have (same range, file and offset): those made
// in between, e.g. by ucp_ep_rkey_unpack attaching a peer's shared memory.
std::vector<Mapping> NewMappings(std::span<const Mapping> before, std::span<const Mapping> after);

}  // namespace kvt::transfer::ucx_check

// The cuda_ipc backend's two wire formats, both carried in the hello:
//  - the key of each published buffer (RemoteRegion::key): which of the publisher's distinct
//    CUDA allocations holds the buffer (an index, with the count, so that a receiver opens each
//    allocation once), that allocation's CUDA IPC handle and size, and where the buffer starts in
//    it. Serving engines hand out sub-ranges of large allocations (PyTorch's caching allocator),
//    and an IPC handle names a whole allocation, never a sub-range;
//  - the address (PeerDescriptor::address): which host, process and GPU published the buffers,
//    so that a connecting side knows whether it may open the handles (same host, other process),
//    must use the addresses as they are (same process: CUDA refuses to open its own handles) or
//    cannot reach the peer at all (another host).
// Both are versioned and validated on decode; nothing here calls CUDA, so a machine without a
// GPU tests them. Pure functions on plain values: thread-safe.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvt/common/status.h"
#include "kvt/transfer/backend.h"

namespace kvt::transfer::cuda_ipc {

// sizeof(cudaIpcMemHandle_t); the backend checks the two agree at compile time.
inline constexpr size_t kIpcHandleBytes = 64;
using IpcHandleBytes = std::array<char, kIpcHandleBytes>;

// ---- Buffer keys --------------------------------------------------------------------------

// Binary, little-endian: magic "KVCI" | version u8 | handle length u8 | 2 zero bytes |
// allocation index u32 | allocation count u32 | handle | offset u64 | allocation bytes u64.
// Every key carries its allocation's handle and size, so each key is checked on its own; keys of
// one descriptor must agree on them (DecodePeerKeys).
inline constexpr uint8_t kKeyVersion = 2;
inline constexpr size_t kKeyBytes = 4 + 1 + 1 + 2 + 4 + 4 + kIpcHandleBytes + 8 + 8;

struct RegionKey {
  uint32_t allocation = 0;        // index of the allocation holding the buffer, < allocations
  uint32_t allocations = 0;       // distinct allocations holding the publisher's buffers
  IpcHandleBytes handle{};        // cudaIpcMemHandle_t of that whole allocation
  uint64_t offset = 0;            // the buffer's base minus the allocation's base
  uint64_t allocation_bytes = 0;  // size of the allocation the handle names

  friend bool operator==(const RegionKey&, const RegionKey&) = default;
};

std::string EncodeRegionKey(const RegionKey& key);

// Decodes a key and checks it against the buffer it describes: the buffer's
// [offset, offset + region_length) must lie inside the allocation, and the allocation index
// inside the count. Any malformation (length, magic, version, handle size, index, range) is
// InvalidArgument saying which, with the values.
StatusOr<RegionKey> DecodeRegionKey(std::string_view bytes, uint64_t region_length);

// The allocations a peer's buffers lie in, as its descriptor's keys name them.
struct PeerAllocation {
  IpcHandleBytes handle{};
  uint64_t bytes = 0;

  friend bool operator==(const PeerAllocation&, const PeerAllocation&) = default;
};
struct PeerKeys {
  std::vector<PeerAllocation> allocations;  // by allocation index
  std::vector<uint32_t> allocation_of;      // per buffer: its allocation's index
  std::vector<uint64_t> offsets;            // per buffer: its offset in that allocation
};

// Decodes every buffer's key (DecodeRegionKey) and checks they describe one consistent set of
// allocations: the same count in every key; keys naming one index carry the same handle and
// size; different indices carry different handles (opening one allocation twice fails); every
// index in [0, count) is named by some buffer. Errors name the buffer and the values.
StatusOr<PeerKeys> DecodePeerKeys(std::span<const RemoteRegion> regions);

// ---- Process addresses --------------------------------------------------------------------

// Text, one line: "cuda_ipc/1 boot=<id> pid=<n> proc=<hex> dev=<n> pci=<bus id> inst=<hex>".
inline constexpr std::string_view kAddressPrefix = "cuda_ipc/1";

struct ProcessAddress {
  std::string boot_id;  // /proc/sys/kernel/random/boot_id (or "host:<name>" without it)
  uint64_t pid = 0;
  uint64_t process = 0;    // random per process: tells processes of equal pid apart
                           // (pid namespaces of containers on one host)
  int32_t device = -1;     // the publisher's device ordinal, in its own numbering
  std::string pci_bus_id;  // the publisher's GPU, in numbering every process shares
  uint64_t instance = 0;   // random per backend instance

  friend bool operator==(const ProcessAddress&, const ProcessAddress&) = default;
};

std::string EncodeAddress(const ProcessAddress& address);

// Decodes an address; a missing or malformed field, or another version, is InvalidArgument.
// Fields this version does not know are ignored (later versions may add some).
StatusOr<ProcessAddress> DecodeAddress(std::string_view text);

// Same host: the same kernel boot (CUDA IPC works between processes of one host only).
bool SameHost(const ProcessAddress& a, const ProcessAddress& b);
// Same process: same host, pid and per-process token.
bool SameProcess(const ProcessAddress& a, const ProcessAddress& b);

// This process's identity: boot id (read once), pid and a random per-process token.
const std::string& ThisBootId();
uint64_t ThisProcessToken();

}  // namespace kvt::transfer::cuda_ipc

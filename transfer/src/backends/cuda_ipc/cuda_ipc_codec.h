// The cuda_ipc backend's two wire formats, both carried in the hello:
//  - the key of each published buffer (RemoteRegion::key): the CUDA IPC handle of the cudaMalloc
//    allocation holding the buffer, where the buffer starts inside it and how large it is;
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
#include <string>
#include <string_view>

#include "kvt/common/status.h"

namespace kvt::transfer::cuda_ipc {

// sizeof(cudaIpcMemHandle_t); the backend checks the two agree at compile time.
inline constexpr size_t kIpcHandleBytes = 64;
using IpcHandleBytes = std::array<char, kIpcHandleBytes>;

// ---- Buffer keys --------------------------------------------------------------------------

// Binary, little-endian: magic "KVCI" | version u8 | handle length u8 | 2 zero bytes |
// handle | offset u64 | allocation bytes u64.
inline constexpr uint8_t kKeyVersion = 1;
inline constexpr size_t kKeyBytes = 4 + 1 + 1 + 2 + kIpcHandleBytes + 8 + 8;

struct RegionKey {
  IpcHandleBytes handle{};        // cudaIpcMemHandle_t of the whole allocation
  uint64_t offset = 0;            // the buffer's base minus the allocation's base
  uint64_t allocation_bytes = 0;  // size of the allocation the handle names

  friend bool operator==(const RegionKey&, const RegionKey&) = default;
};

std::string EncodeRegionKey(const RegionKey& key);

// Decodes a key and checks it against the buffer it describes: the buffer's
// [offset, offset + region_length) must lie inside the allocation. Any malformation
// (length, magic, version, handle size, range) is InvalidArgument saying which.
StatusOr<RegionKey> DecodeRegionKey(std::string_view bytes, uint64_t region_length);

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

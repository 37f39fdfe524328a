// Options of the ucx backend (UCX RMA puts within and across hosts; CUDA pools registered
// directly when the UCX build handles CUDA memory, else staged through pinned bounce buffers).
//
// Plain values; CreateBackend (backends.h) validates them and names the option, the value and
// the allowed range of any it refuses.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <string_view>

#include "kvt/common/status.h"

namespace kvt::transfer {

// How the ucx backend moves CUDA pools.
enum class UcxCudaMode {
  // Registers device memory directly when the UCX build handles CUDA memory, stages otherwise.
  kAuto,
  // Always stages through pinned host bounce buffers (the gather/scatter kernels).
  kStaged,
  // Refuses CUDA pools unless UCX handles CUDA memory.
  kDirect,
};

// "auto", "staged", "direct".
std::string_view UcxCudaModeName(UcxCudaMode mode);
// The mode a name spells; InvalidArgument naming the allowed names otherwise.
StatusOr<UcxCudaMode> ParseUcxCudaMode(std::string_view name);

// How the ucx backend writes host memory a peer has not mapped into this process.
enum class UcxHostPath {
  // Active messages where UCX has no native RMA to the peer (it emulates puts over messages,
  // as its tcp transport does), puts otherwise. Peers whose memory UCX maps here (shared
  // memory) are written with plain copies either way.
  kAuto,
  // One UCX put per run, then a flush.
  kPut,
  // Active messages to every peer not mapped here (the peer must not use kPut).
  kActiveMessages,
};

// "auto", "put", "am".
std::string_view UcxHostPathName(UcxHostPath path);
// The path a name spells; InvalidArgument naming the allowed names otherwise.
StatusOr<UcxHostPath> ParseUcxHostPath(std::string_view name);

struct UcxOptions {
  // UCX transports to allow (UCX_TLS syntax, e.g. "shm,self" or "tcp"); empty = UCX's default
  // choice (or the UCX_TLS environment variable when set).
  std::string transports{};
  // The progress thread spins this long without work before it sleeps on the worker's event fd;
  // longer spins trade a CPU core for lower latency. It yields its core every 10 µs while it
  // spins, so that it delays a thread with work on a machine of few cores by no more. 0..1 s.
  std::chrono::microseconds spin{200};
  // When UCX maps a peer's buffers into this process (shared memory on the same host,
  // ucp_rkey_ptr), write them with plain copies instead of one UCX put per run.
  bool direct_shm = true;
  // Writes of at most this many bytes are copied (peer mapped here) or posted as UCX puts
  // (network) on the posting thread; larger ones on the backend's copy threads or its poster
  // thread, so that posting (often the control plane's thread, or the model's in LayersReady)
  // never waits for a bulk copy or send.
  size_t direct_inline_bytes = size_t{256} << 10;
  // Direct copies: threads that copy a large write, each a slice of its runs (1..64, or 0 for
  // half the machine's cores, at least 2 and at most 8; a write gets at most one slice per MiB).
  int copy_threads = 0;
  // CUDA pools: see UcxCudaMode.
  UcxCudaMode cuda_mode = UcxCudaMode::kAuto;
  // Staging: bounce slots per side (1..4096) and bytes per slot (4 KiB..4 GiB); memory is
  // bounded by both, and a sender holds a credit per receiver slot. A staged pool pins
  // 2 x slots x slot_bytes of host memory (send and receive slots) and as much device memory (a
  // device twin of each slot: the gather packs there before a copy engine moves the data to the
  // host slot, the scatter unpacks from there); 256 MiB of each by default. Slots of 16 MiB keep
  // the fixed cost of each chunk (kernel launches, a message, an ack) small beside its copies.
  int staging_slots = 8;
  size_t staging_slot_bytes = size_t{16} << 20;
  // Staging between processes of one host: a receiver reads a sender's bounce slots in place
  // (mapped through UCX's shared memory and page-locked) and copies them to its device from
  // there, instead of receiving them into its own slots first (a host-to-host copy by one
  // thread). Off: chunks always travel as payloads. Both sides must allow it.
  bool staging_in_place = true;
  // Host memory: see UcxHostPath. Any but kPut gives the backend a second UCP context and
  // worker (active messages only), which peers that send active messages connect to.
  UcxHostPath host_path = UcxHostPath::kAuto;
  // Active messages: data bytes per message (4 KiB..64 MiB; a longer run is cut), and whether
  // they go eagerly (the receiver copies each once, from UCX's buffer: the fastest over tcp) or
  // by rendezvous (the receiver takes the bytes straight into its pages, a handshake each).
  size_t am_message_bytes = size_t{1} << 20;
  bool am_rendezvous = false;
};

}  // namespace kvt::transfer

// Options of kvt's control plane (TCP connections carrying framed kvt.v1.Envelope messages):
//   ConnectionLimits      the bounds every control connection (server or client side) runs under
//   ValidationLimits      bounds on the fields of received messages
//   BusyPollOptions       how an endpoint's io threads wait for frames
//   ControlServerOptions  a control server's address, authentication and limits (what
//                         EngineOptions::server and RegistryServerOptions::server carry)
//
// Thread safety: plain values (BusyPollOptions::hint is called from io threads).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace kvt::control {

// 16 MiB: a Hello of a 4096-layer pool with 16 backends fits with room to spare; anything
// bigger is a bug or an attack.
inline constexpr uint32_t kDefaultMaxFrameBytes = 16u << 20;

// 8 KiB: the largest frame a peer needs before authentication is an auth_response (client id
// of at most 128 bytes, a 32-byte MAC and a 32-byte nonce: under 300 bytes) or, toward a client,
// an Error whose reason is at most ValidationLimits::max_message_bytes (4096 bytes).
inline constexpr uint32_t kDefaultMaxHandshakeFrameBytes = 8u << 10;
// Smallest max_handshake_frame_bytes accepted: an auth_response with the longest client id.
inline constexpr uint32_t kMinHandshakeFrameBytes = 1024;

// Whether a frame sent on a connection is held to ConnectionLimits' queue bounds.
enum class QueueLimit {
  kEnforced,  // refused (ResourceExhausted) past max_queued_frames / max_queued_bytes
  // Queued past them: for the few frames whose loss would turn a finished request into a
  // failure or hold its pages (a room's TransferDone, an abort and its acknowledgement). The
  // sender bounds how many it sends this way (one or two per room it owns).
  kExempt,
};

struct ConnectionLimits {
  // Largest Envelope accepted or sent, in bytes (the length prefix excluded). Checked against
  // the length prefix before any buffer is allocated.
  uint32_t max_frame_bytes = kDefaultMaxFrameBytes;
  // Frames and bytes queued for sending on one connection; Send answers ResourceExhausted
  // beyond either (a slow peer cannot make us buffer without bound).
  // A frame the protocol cannot do without (QueueLimit::kExempt) is queued past them.
  size_t max_queued_frames = 4096;
  size_t max_queued_bytes = 64u << 20;
  // Largest frame accepted before authentication is done (a server with a cluster token waiting
  // for the auth_response; a client waiting for the server's challenge and verdict). Checked
  // against the length prefix like max_frame_bytes (the smaller of the two applies), so an
  // unauthenticated peer cannot make us buffer more than this.
  uint32_t max_handshake_frame_bytes = kDefaultMaxHandshakeFrameBytes;
  // Time from TCP connect until authentication is done or, on a server without a cluster token,
  // until the peer's first complete frame has arrived. Counted from the connect: bytes that do
  // not complete the handshake do not extend it. Must be > 0.
  std::chrono::milliseconds handshake_timeout{5000};
  // Once a frame's first byte has arrived, the rest must arrive within this long, or the
  // connection is closed (DeadlineExceeded): a peer that trickles bytes cannot hold a
  // connection (and a partial frame's buffer) open by keeping the idle timer fed. Long enough
  // for a max_frame_bytes Hello over a slow link. Must be > 0.
  std::chrono::milliseconds frame_timeout{30000};
  // A connection that receives nothing for this long is closed (DeadlineExceeded). 0 = never.
  // Peers keep quiet connections alive with heartbeat_interval.
  std::chrono::milliseconds idle_timeout{60000};
  // Send a Heartbeat this often (the peer answers it, which keeps both idle timers fed).
  // 0 = never.
  std::chrono::milliseconds heartbeat_interval{0};
  // After a fatal error, how long queued frames (the Error frame) may take to drain before the
  // socket is closed regardless.
  std::chrono::milliseconds close_linger{1000};
};

// How a control endpoint's io threads wait (ControlClientOptions / ControlServerOptions).
// With `window` 0 (the default) they block in the reactor (epoll) between frames. Otherwise,
// once a handler has run (a frame, a timer, or a Wake() of the endpoint), they poll their
// sockets without sleeping for as long as `hint` returns true and then until `window` has
// passed with nothing to do: a CPU core per io thread while polling, for frames handled within
// microseconds of their arrival. An owner whose hint turns true while the thread sleeps calls
// Wake(). A server polls only with one io thread (ControlServer refuses more). Polling trades a
// core for the tens of microseconds a thread woken from epoll after an idle spell costs. A
// polling thread yields its core (sched_yield) every 10 µs, so that on a machine with fewer cores
// than busy threads the threads that have work (the caller waiting for a done, the peer's io
// thread) run within microseconds instead of after the scheduler's time slice.
struct BusyPollOptions {
  std::chrono::microseconds window{0};
  // Called often from the io threads, without locks: must be cheap and thread-safe (e.g. an
  // atomic load). True while the owner expects frames (requests in flight).
  std::function<bool()> hint;
  // With a window: a connection whose two ends both poll and share a host (the same POSIX
  // shared-memory namespace, the same user) moves its frames through a shared-memory lane
  // instead of the socket, once its Hello is answered (docs/protocol.md, "Lanes"): a copy and
  // a load per message instead of two system calls and a reactor pass. The socket still carries
  // the setup, a doorbell when the reader sleeps, and the connection's end. false: never.
  bool lanes = true;
  // Bytes per direction of a lane (a power of two in [4 KiB, 64 MiB]); larger frames stream
  // through it.
  uint32_t lane_ring_bytes = 256u << 10;
};

// Bounds for fields whose size a peer chooses. The defaults match the comments in the .proto
// files; tests may lower them.
struct ValidationLimits {
  size_t max_name_bytes = 128;         // agent / client / server names, host ids
  size_t max_room_id_bytes = 256;      // room ids
  size_t max_address_bytes = 256;      // "host:port"
  size_t max_message_bytes = 4096;     // free text (error messages, reasons)
  size_t max_backend_name_bytes = 32;  // "ucx", "cuda_ipc", ...
  size_t max_blob_bytes = 64u << 10;   // rkeys, IPC handles, worker addresses
  size_t max_backends = 16;            // keys per buffer, endpoints per peer
  uint32_t max_layers = 4096;
  uint32_t max_page_size = 65536;
  uint32_t max_heads = 65536;
  uint32_t max_head_dim = 65536;
  uint32_t max_tp_size = 65536;
  size_t max_pages_per_request = 1u << 20;
  size_t max_slices = 4096;
  uint32_t max_deadline_ms = 3600 * 1000;
  size_t max_agents_per_reply = 4096;
};

struct ControlServerOptions {
  // IP address to listen on ("127.0.0.1", "::1", "0.0.0.0", or "localhost").
  std::string bind_address = "127.0.0.1";
  uint16_t port = 0;  // 0: the kernel picks one; read it back with port()
  // Our name in AuthChallenge (and in the mutual-auth proof).
  std::string server_id = "kvt";
  // Shared secret (>= 16 bytes); empty: no authentication (loopback only, see below). Callers
  // usually fill it from ClusterTokenFromEnv().
  std::string cluster_token;
  // Lets a server without a token listen on a non-loopback address. Anyone who can reach the
  // port can then drive transfers into the pool: for isolated test networks only.
  bool allow_remote_without_token = false;
  // Open connections. A connection beyond this closes the oldest one still waiting for its
  // auth_response (so a flood that never authenticates cannot keep clients out); when there is
  // none it gets Error(RESOURCE_EXHAUSTED) and is closed.
  size_t max_connections = 256;
  size_t num_threads = 1;  // io threads; 1..64 (1 with busy polling)
  ConnectionLimits limits;
  ValidationLimits validation;
  BusyPollOptions busy_poll;  // how the io thread(s) wait for frames (above)
};

// The cluster token from KVT_CLUSTER_TOKEN, or an empty string when unset.
std::string ClusterTokenFromEnv();

}  // namespace kvt::control

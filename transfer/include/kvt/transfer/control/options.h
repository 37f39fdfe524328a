// ConnectionLimits: the bounds every control connection (server or client side) runs under.
// BusyPollOptions: how an endpoint's io threads wait for frames.
//
// Thread safety: plain values (BusyPollOptions::hint is called from io threads).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>

namespace kvt::control {

// 16 MiB: a Hello of a 4096-layer pool with 16 backends fits with room to spare; anything
// bigger is a bug or an attack.
inline constexpr uint32_t kDefaultMaxFrameBytes = 16u << 20;

struct ConnectionLimits {
  // Largest Envelope accepted or sent, in bytes (the length prefix excluded). Checked against
  // the length prefix before any buffer is allocated.
  uint32_t max_frame_bytes = kDefaultMaxFrameBytes;
  // Frames and bytes queued for sending on one connection; Send answers ResourceExhausted
  // beyond either (a slow peer cannot make us buffer without bound).
  size_t max_queued_frames = 4096;
  size_t max_queued_bytes = 64u << 20;
  // Time from TCP connect until authentication (or the unauthenticated greeting) is done.
  std::chrono::milliseconds handshake_timeout{5000};
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
// Wake(). A server polls only with one io thread (ControlServer refuses more). A thread woken from
// epoll after milliseconds of idling costs 30-120 µs on a server (measured on the device
// machine: docs/transfer-bench.md), mostly its core's sleep state.
struct BusyPollOptions {
  std::chrono::microseconds window{0};
  // Called often from the io threads, without locks: must be cheap and thread-safe (e.g. an
  // atomic load). True while the owner expects frames (requests in flight).
  std::function<bool()> hint;
};

}  // namespace kvt::control

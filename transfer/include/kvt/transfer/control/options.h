// ConnectionLimits: the bounds every control connection (server or client side) runs under.
//
// Thread safety: a plain value.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

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

}  // namespace kvt::control

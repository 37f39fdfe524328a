// Bounds how often one source of log lines writes: at most `burst` lines per `period`; the lines
// it held back meanwhile are counted, and the next line let through says how many. For warnings
// a peer can cause once per message (every message of a fenced sender is refused with a
// warning), which would otherwise flood the log and cost a formatted line per message.
// Hand-written: spdlog (the logging library) has no rate limit of its own. WarnLimited
// (kvt/common/log.h) writes a warning through one.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace kvt {

class LogLimiter {
 public:
  using Clock = std::chrono::steady_clock;

  LogLimiter(uint32_t burst, std::chrono::milliseconds period) : burst_(burst), period_(period) {}

  // Whether a line may be written at `now`. When it may, `*held_back` is the number of lines
  // held back since the last one let through (0: none). Thread-safe.
  bool Admit(Clock::time_point now, uint64_t* held_back);
  bool Admit(uint64_t* held_back) { return Admit(Clock::now(), held_back); }

  // " (N more like it held back)" for a line let through after N were held back; empty for 0.
  static std::string HeldBack(uint64_t held_back);

 private:
  const uint32_t burst_;
  const std::chrono::milliseconds period_;
  std::mutex mu_;
  Clock::time_point window_start_{};  // guarded by mu_
  uint32_t in_window_ = 0;            // guarded by mu_: lines let through in this window
  uint64_t held_back_ = 0;            // guarded by mu_: since the last line let through
};

}  // namespace kvt

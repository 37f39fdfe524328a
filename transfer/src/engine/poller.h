// The engine's poller thread: it runs the side's PollPass (deadlines, write completions,
// retention) and sleeps until the next thing can happen: a deadline, a kick (a user call, a
// control message, a backend's completion notice), or a safety poll. It watches a device write
// without sleeping only while that write's copy can actually run (its producer's event has
// completed), so a write gated on a forward pass costs no CPU while it waits.
#pragma once

#include <atomic>
#include <thread>

#include "engine/request_table.h"

namespace kvt::transfer::engine {

class Poller {
 public:
  Poller(EngineContext& ctx, EngineSide& side) : ctx_(ctx), side_(side) {}
  ~Poller() { Stop(); }
  Poller(const Poller&) = delete;
  Poller& operator=(const Poller&) = delete;

  void Start();
  // Stops and joins the thread; no PollPass runs after it returns.
  void Stop();

 private:
  void Loop();

  EngineContext& ctx_;
  EngineSide& side_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace kvt::transfer::engine

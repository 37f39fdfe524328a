// Pacing of the library's busy loops (the control io threads, the engine's poller, the UCX
// progress thread), private to the transfer library.
#pragma once

#include <chrono>
#include <thread>

namespace kvt::control::internal {

// One CPU pause in a spin loop (a yield where there is no pause instruction).
inline void SpinPause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// A busy loop's wait between two empty passes: a CPU pause, and a yield of the core (sched_yield)
// once every kYieldEvery. A loop that only paused held its core until the scheduler preempted it:
// with more busy threads than cores (two engines polling on a small machine) a thread with work
// (the caller waiting for a done, the peer's io thread) waited for a time slice, which put up to
// 1 ms on a one-page request's tail. Yielding on every pass instead cost the common case a system
// call between a frame's arrival and its pickup. Not thread-safe: one per loop.
class SpinPacer {
 public:
  static constexpr std::chrono::microseconds kYieldEvery{10};

  void Wait() {
    const auto now = std::chrono::steady_clock::now();
    if (now - last_yield_ < kYieldEvery) {
      SpinPause();
      return;
    }
    std::this_thread::yield();
    last_yield_ = std::chrono::steady_clock::now();
  }

 private:
  std::chrono::steady_clock::time_point last_yield_ = std::chrono::steady_clock::now();
};

}  // namespace kvt::control::internal

// Options of the loopback backend (in-process copies between engines of one process, host
// memory only: for tests).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>

namespace kvt::transfer {

struct LoopbackOptions {
  // A posted write completes (its bytes are copied) only once this much time has passed, so
  // tests can abort or time out writes in flight. 0 copies at post time. At least 0.
  std::chrono::microseconds delay{0};
  // Report page_writes and take PostPages (CPU gather/scatter), so the engine's page path runs
  // without a GPU.
  bool page_writes = false;
  // Release of a write still in flight does not cancel it: it waits out the delay and performs
  // the copy, as a network card that already took the data would. Tests use it to see bytes
  // that land after the engine let go of a write.
  bool release_completes_in_flight = false;
  // Called on the caller's thread at the start of every Disconnect, with the peer id (tests
  // block in it to model a slow teardown). Must not call into the backend.
  std::function<void(uint64_t peer)> before_disconnect;
};

}  // namespace kvt::transfer

// Options of the loopback backend (in-process copies between engines of one process, host
// memory only: for tests).
#pragma once

#include <chrono>

namespace kvt::transfer {

struct LoopbackOptions {
  // A posted write completes (its bytes are copied) only once this much time has passed, so
  // tests can abort or time out writes in flight. 0 copies at post time. At least 0.
  std::chrono::microseconds delay{0};
  // Report page_writes and take PostPages (CPU gather/scatter), so the engine's page path runs
  // without a GPU.
  bool page_writes = false;
};

}  // namespace kvt::transfer

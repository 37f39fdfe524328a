#include "io_loop.h"

#include <fmt/format.h>

#include <chrono>
#include <exception>
#include <thread>

#include "kvt/common/log.h"

namespace kvt::control::internal {
namespace {

using Clock = std::chrono::steady_clock;

// Returns when `io` is stopped (or out of work).
void Loop(boost::asio::io_context& io, const BusyPollOptions& busy) {
  if (busy.window.count() <= 0) {
    io.run();
    return;
  }
  auto expecting = [&busy] { return busy.hint && busy.hint(); };
  while (!io.stopped()) {
    // Sleep in the reactor until something happens, unless frames are expected...
    if (!expecting() && io.run_one() == 0) return;
    // ...then poll without sleeping while handlers keep coming or frames are expected, and for
    // `window` after the last of either.
    auto last = Clock::now();
    SpinPacer pacer;
    while (true) {
      if (io.poll() > 0) {
        last = Clock::now();
        continue;
      }
      if (io.stopped()) return;
      if (expecting()) {
        last = Clock::now();
      } else if (Clock::now() - last >= busy.window) {
        break;
      }
      pacer.Wait();
    }
  }
}

}  // namespace

Status CheckBusyPoll(const BusyPollOptions& busy) {
  if (busy.window.count() >= 0) return OkStatus();
  return InvalidArgument(
      fmt::format("busy_poll.window = {} us: must be >= 0 (0: no polling)", busy.window.count()));
}

void RunIoLoop(boost::asio::io_context& io, const BusyPollOptions& busy, const char* who) {
  while (true) {
    try {
      Loop(io, busy);
      return;
    } catch (const std::exception& e) {
      KVT_LOG_ERROR("ctl", "exception escaped a {} io handler: {}", who, e.what());
    } catch (...) {
      KVT_LOG_ERROR("ctl", "non-standard exception escaped a {} io handler", who);
    }
  }
}

}  // namespace kvt::control::internal

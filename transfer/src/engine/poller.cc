#include "engine/poller.h"

#include <sys/prctl.h>

#include "control/spin.h"

namespace kvt::transfer::engine {
namespace {

// Between two completion checks of a spinning poller: Check takes the backend's lock, which
// posting threads need too.
constexpr auto kDeviceSpinGap = std::chrono::microseconds(4);

}  // namespace

void Poller::Start() {
  thread_ = std::thread([this] { Loop(); });
}

void Poller::Stop() {
  stopping_.store(true);
  ctx_.wakeup.Kick();
  if (thread_.joinable()) thread_.join();
}

void Poller::Loop() {
  // Short sleeps while writes are in flight: without this the kernel rounds each one up by the
  // default 50 µs timer slack.
  (void)prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  while (!stopping_.load()) {
    const EngineSide::PollResult pass = side_.PollPass(Clock::now());
    if (stopping_.load()) break;
    if (pass.spin_write != 0 && ctx_.options.device_spin.count() > 0) {
      // The write's copy runs on the GPU now: watch it for a while (a CPU core for completion
      // seen within microseconds; waking from the notifier costs tens of µs), then run the pass
      // again. A kick (new work, a completion notice) ends the spin early.
      const auto until = std::min(Clock::now() + ctx_.options.device_spin, pass.next);
      control::internal::SpinPacer pacer;
      while (!ctx_.wakeup.pending() && Clock::now() < until &&
             ctx_.backend->Check(pass.spin_write).code() == StatusCode::kInProgress) {
        const auto next = Clock::now() + kDeviceSpinGap;
        while (Clock::now() < next) pacer.Wait();
      }
      (void)ctx_.wakeup.Consume();
      continue;
    }
    // Writes in flight that nobody watches now: the backend's notice wakes the poller when the
    // oldest completes (a write posted after this kicks the poller itself).
    if (ctx_.notified) ctx_.backend->ArmCompletionNotice();
    ctx_.wakeup.WaitUntil(pass.next);
  }
}

}  // namespace kvt::transfer::engine

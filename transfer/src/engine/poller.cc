#include "engine/poller.h"

#include <sys/prctl.h>

#include "control/spin.h"

namespace kvt::transfer::engine {
namespace {

// Between two completion checks of a spinning poller: Check takes the backend's lock, which
// posting threads need too.
constexpr auto kDeviceSpinGap = std::chrono::microseconds(4);
// With completion hints (a load each), Check runs this rarely: a write the hint does not cover,
// or one that failed, is still seen.
constexpr auto kHintedCheckGap = std::chrono::microseconds(50);

// Whether the write watched is still running; `next_check` paces the Check calls when the
// backend gives hints (`hinted`).
bool StillRunning(const EngineContext& ctx, bool hinted, WriteId write,
                  Clock::time_point& next_check) {
  if (hinted) {
    if (ctx.backend->CompletedHint(write)) return false;
    const auto now = Clock::now();
    if (now < next_check) return true;
    next_check = now + kHintedCheckGap;
  }
  return ctx.backend->Check(write).code() == StatusCode::kInProgress;
}

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
      Clock::time_point next_check = Clock::now() + kHintedCheckGap;
      // Asked per watch: a backend may stop giving hints (cuda_ipc, when a signal of its word
      // fails), and the watch then goes back to Check every few microseconds.
      const bool hinted = ctx_.hinted && ctx_.backend->Capabilities().completion_hints;
      while (!ctx_.wakeup.pending() && Clock::now() < until &&
             StillRunning(ctx_, hinted, pass.spin_write, next_check)) {
        if (hinted) {
          pacer.Wait();
          continue;
        }
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

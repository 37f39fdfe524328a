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
  // When the poller last watched a device write (none yet: long ago, so it starts cold).
  Clock::time_point last_watch = Clock::time_point::min();
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
      last_watch = Clock::now();
      continue;
    }
    // Writes in flight that nobody watches now: the backend's notice wakes the poller when the
    // oldest completes (a write posted after this kicks the poller itself).
    if (ctx_.notified) ctx_.backend->ArmCompletionNotice();
    // A busy-polling engine that just watched a device write keeps its poller hot for the
    // control plane's polling window: the next write's kick is then seen at once, where waking
    // a sleeping poller costs microseconds that the GPU's copy of a small write does not hide.
    // The pass runs again at the window's end, so a room that came meanwhile is looked at.
    const Clock::time_point hot_until = last_watch + ctx_.options.control_busy_poll;
    if (ctx_.options.control_busy_poll.count() > 0 && Clock::now() < hot_until) {
      ctx_.poller_hot_spins.fetch_add(1, std::memory_order_relaxed);
      ctx_.wakeup.SpinUntil(std::min(hot_until, pass.next));
      continue;
    }
    ctx_.wakeup.WaitUntil(pass.next);
  }
}

}  // namespace kvt::transfer::engine

#include "kvt/common/log_limiter.h"

namespace kvt {

bool LogLimiter::Admit(Clock::time_point now, uint64_t* held_back) {
  std::lock_guard<std::mutex> lock(mu_);
  if (in_window_ == 0 || now - window_start_ >= period_) {
    window_start_ = now;
    in_window_ = 0;
  }
  if (in_window_ >= burst_) {
    ++held_back_;
    return false;
  }
  ++in_window_;
  *held_back = held_back_;
  held_back_ = 0;
  return true;
}

std::string LogLimiter::HeldBack(uint64_t held_back) {
  if (held_back == 0) return {};
  return " (" + std::to_string(held_back) + " more like it held back)";
}

}  // namespace kvt

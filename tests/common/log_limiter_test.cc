// LogLimiter: a burst per period goes through, what follows in the period is held back and
// counted, and the next line let through says how many.
#include "kvt/common/log_limiter.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace kvt {
namespace {

using namespace std::chrono_literals;

TEST(LogLimiterTest, ABurstPerPeriodGoesThroughAndTheRestIsCounted) {
  LogLimiter limiter(3, 1000ms);
  const LogLimiter::Clock::time_point t0{};
  uint64_t held = 99;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(limiter.Admit(t0 + std::chrono::milliseconds(i), &held));
    EXPECT_EQ(held, 0u);
  }
  held = 99;
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(limiter.Admit(t0 + 10ms, &held));
  EXPECT_EQ(held, 99u) << "a line held back reports nothing";
  EXPECT_FALSE(limiter.Admit(t0 + 999ms, &held));
  // A new period: the first line names the six held back, the next ones none.
  ASSERT_TRUE(limiter.Admit(t0 + 1000ms, &held));
  EXPECT_EQ(held, 6u);
  ASSERT_TRUE(limiter.Admit(t0 + 1001ms, &held));
  EXPECT_EQ(held, 0u);
  EXPECT_EQ(LogLimiter::HeldBack(6), " (6 more like it held back)");
  EXPECT_EQ(LogLimiter::HeldBack(0), "");
}

TEST(LogLimiterTest, AQuietSourceIsNeverHeldBack) {
  LogLimiter limiter(1, 100ms);
  const LogLimiter::Clock::time_point t0{};
  uint64_t held = 0;
  for (int i = 0; i < 10; ++i) {
    EXPECT_TRUE(limiter.Admit(t0 + i * 100ms, &held)) << i;
    EXPECT_EQ(held, 0u);
  }
}

TEST(LogLimiterTest, ThreadsTogetherGetNoMoreThanTheBurstAndEveryLineIsCounted) {
  LogLimiter limiter(10, std::chrono::hours(1));
  std::atomic<uint64_t> admitted{0}, reported{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 1000; ++i) {
        uint64_t held = 0;
        if (limiter.Admit(&held)) {
          admitted.fetch_add(1);
          reported.fetch_add(held);
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(admitted.load(), 10u);
  EXPECT_EQ(reported.load(), 0u) << "the burst came first, before anything was held back";
  // Within the hour nothing more goes through; after it, the first line names every line held
  // back, this one included.
  uint64_t held = 0;
  EXPECT_FALSE(limiter.Admit(&held));
  ASSERT_TRUE(limiter.Admit(LogLimiter::Clock::now() + std::chrono::hours(2), &held));
  EXPECT_EQ(held, 4 * 1000 - 10 + 1u);
}

}  // namespace
}  // namespace kvt

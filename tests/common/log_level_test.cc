// Log level names: every level spdlog knows is accepted, anything else is refused naming the
// value and the allowed names; the environment check does the same for KVT_LOG_LEVEL.
#include "kvt/common/log_level.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

namespace kvt {
namespace {

using ::testing::HasSubstr;

TEST(LogLevelTest, KnownNamesParse) {
  EXPECT_EQ(*ParseLogLevel("trace"), spdlog::level::trace);
  EXPECT_EQ(*ParseLogLevel("debug"), spdlog::level::debug);
  EXPECT_EQ(*ParseLogLevel("info"), spdlog::level::info);
  EXPECT_EQ(*ParseLogLevel("warn"), spdlog::level::warn);
  EXPECT_EQ(*ParseLogLevel("error"), spdlog::level::err);
  EXPECT_EQ(*ParseLogLevel("critical"), spdlog::level::critical);
  EXPECT_EQ(*ParseLogLevel("off"), spdlog::level::off);
}

TEST(LogLevelTest, UnknownNamesAreRefusedWithTheAllowedOnes) {
  for (const char* name : {"verbose", "INFO", "", "of"}) {
    auto level = ParseLogLevel(name);
    ASSERT_FALSE(level.ok()) << name;
    EXPECT_EQ(level.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(level.status().message(), HasSubstr("'" + std::string(name) + "'"));
    EXPECT_THAT(level.status().message(), HasSubstr("trace, debug, info, warn, error"));
  }
}

TEST(LogLevelTest, EnvironmentCheckNamesTheVariable) {
  const char* saved = getenv("KVT_LOG_LEVEL");
  const std::string keep = saved != nullptr ? saved : "";
  setenv("KVT_LOG_LEVEL", "chatty", 1);
  const Status refused = CheckLogLevelEnv();
  setenv("KVT_LOG_LEVEL", "debug", 1);
  const Status accepted = CheckLogLevelEnv();
  unsetenv("KVT_LOG_LEVEL");
  const Status unset = CheckLogLevelEnv();
  if (saved != nullptr) setenv("KVT_LOG_LEVEL", keep.c_str(), 1);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("KVT_LOG_LEVEL='chatty'"));
  EXPECT_THAT(refused.message(), HasSubstr("warn"));
  EXPECT_TRUE(accepted.ok()) << accepted;
  EXPECT_TRUE(unset.ok()) << unset;
}

}  // namespace
}  // namespace kvt

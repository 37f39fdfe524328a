#include "kvt/common/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <mutex>
#include <string>

#include "kvt/common/env.h"

namespace kvt {
namespace env {

std::optional<std::string> Get(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

}  // namespace env

namespace {

spdlog::level::level_enum LevelFromEnv() {
  static const spdlog::level::level_enum level = [] {
    auto value = env::Get(env::kLogLevel);
    if (!value) return spdlog::level::info;
    auto parsed = spdlog::level::from_str(*value);
    // from_str answers "off" for names it does not know; only "off" itself should mean off.
    if (parsed == spdlog::level::off && *value != "off") return spdlog::level::info;
    return parsed;
  }();
  return level;
}

}  // namespace

std::shared_ptr<spdlog::logger> Logger(std::string_view tag) {
  static std::mutex mutex;  // guards creation; spdlog's registry is itself thread-safe
  std::string name = "kvt." + std::string(tag);
  if (auto existing = spdlog::get(name)) return existing;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto existing = spdlog::get(name)) return existing;
  auto logger = spdlog::stderr_color_mt(name);
  logger->set_level(LevelFromEnv());
  logger->set_pattern("[%H:%M:%S.%e] [%n] [%^%l%$] %v");
  return logger;
}

}  // namespace kvt

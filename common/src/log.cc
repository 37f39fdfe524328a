#include "kvt/common/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <mutex>
#include <string>

#include "kvt/common/env.h"
#include "kvt/common/log_level.h"

namespace kvt {
namespace env {

std::optional<std::string> Get(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

}  // namespace env

namespace {

constexpr char kLevelNames[] = "trace, debug, info, warn, error, critical, off";

spdlog::level::level_enum LevelFromEnv() {
  static const spdlog::level::level_enum level = [] {
    auto value = env::Get(env::kLogLevel);
    if (!value) return spdlog::level::info;
    StatusOr<spdlog::level::level_enum> parsed = ParseLogLevel(*value);
    return parsed.ok() ? *parsed : spdlog::level::info;
  }();
  return level;
}

}  // namespace

StatusOr<spdlog::level::level_enum> ParseLogLevel(std::string_view name) {
  // spdlog's from_str answers "off" for names it does not know: only "off" itself means off.
  const spdlog::level::level_enum parsed = spdlog::level::from_str(std::string(name));
  if (parsed != spdlog::level::off || name == "off") return parsed;
  // Appended piece by piece: GCC 12 warns falsely (-Wrestrict) on "'" + std::string(...).
  std::string message = "'";
  message += name;
  message += "' is not a log level; use one of ";
  message += kLevelNames;
  return InvalidArgument(std::move(message));
}

Status CheckLogLevelEnv() {
  auto value = env::Get(env::kLogLevel);
  if (!value) return OkStatus();
  StatusOr<spdlog::level::level_enum> parsed = ParseLogLevel(*value);
  if (parsed.ok()) return OkStatus();
  return InvalidArgument(std::string(env::kLogLevel) + "='" + *value +
                         "' is not a log level; use one of " + kLevelNames +
                         " (or unset it for info)");
}

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

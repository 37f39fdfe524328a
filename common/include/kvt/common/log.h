// Logging through spdlog with one logger per component tag ("pool", "kern", "xfer", "ucx",
// "ipc", "nccl", "ctl", "tool"). Loggers are created on first use and are thread-safe.
// The level comes from KVT_LOG_LEVEL (trace, debug, info, warn, error, critical, off; default
// info), read once (see kvt/common/env.h). A value that names no level leaves the library at
// info; programs refuse it first (CheckLogLevelEnv, kvt/common/log_level.h).
#pragma once

#include <spdlog/spdlog.h>

#include <memory>
#include <string_view>
#include <utility>

#include "kvt/common/log_limiter.h"

namespace kvt {

// The logger for a component tag. Never null.
std::shared_ptr<spdlog::logger> Logger(std::string_view tag);

// A warning of component `tag` (as KVT_LOG_WARN) when `limiter` admits one, saying how many
// lines it held back before; nothing (not even the formatting) when it does not.
template <typename... Args>
void WarnLimited(LogLimiter& limiter, std::string_view tag, fmt::format_string<Args...> format,
                 Args&&... args) {
  uint64_t held_back = 0;
  if (!limiter.Admit(&held_back)) return;
  Logger(tag)->warn("{}{}", fmt::format(format, std::forward<Args>(args)...),
                    LogLimiter::HeldBack(held_back));
}

}  // namespace kvt

#define KVT_LOG_TRACE(tag, ...) ::kvt::Logger(tag)->trace(__VA_ARGS__)
#define KVT_LOG_DEBUG(tag, ...) ::kvt::Logger(tag)->debug(__VA_ARGS__)
#define KVT_LOG_INFO(tag, ...) ::kvt::Logger(tag)->info(__VA_ARGS__)
#define KVT_LOG_WARN(tag, ...) ::kvt::Logger(tag)->warn(__VA_ARGS__)
#define KVT_LOG_ERROR(tag, ...) ::kvt::Logger(tag)->error(__VA_ARGS__)

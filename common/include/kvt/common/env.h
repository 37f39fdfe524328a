// Every KVT_ environment variable kvt reads, declared in one place. These are operational
// overrides only; configuration belongs in each component's Options struct.
#pragma once

#include <optional>
#include <string>

namespace kvt::env {

// KVT_LOG_LEVEL: trace | debug | info | warn | error | off (default info).
inline constexpr const char* kLogLevel = "KVT_LOG_LEVEL";

// The value of an environment variable, or nullopt when unset or empty.
std::optional<std::string> Get(const char* name);

}  // namespace kvt::env

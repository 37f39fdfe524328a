// Every KVT_ environment variable kvt reads, declared in one place. These are operational
// overrides only; configuration belongs in each component's Options struct.
#pragma once

#include <optional>
#include <string>

namespace kvt::env {

// KVT_LOG_LEVEL: trace | debug | info | warn | error | critical | off (default info); other
// values are refused by the programs (CheckLogLevelEnv in kvt/common/log_level.h).
inline constexpr const char* kLogLevel = "KVT_LOG_LEVEL";

// KVT_CLUSTER_TOKEN: the shared secret control connections authenticate with (HMAC-SHA256
// challenge-response; at least 16 bytes). Unset: servers listen on loopback only unless their
// options explicitly allow another address.
inline constexpr const char* kClusterToken = "KVT_CLUSTER_TOKEN";

// The value of an environment variable, or nullopt when unset or empty.
std::optional<std::string> Get(const char* name);

}  // namespace kvt::env

// Log level names: how KVT_LOG_LEVEL is read, and the check programs run at start so that a
// misspelt level is refused instead of silently logging at info.
//
// Thread safety: pure functions (CheckLogLevelEnv reads the environment).
#pragma once

#include <spdlog/common.h>

#include <string_view>

#include "kvt/common/status.h"

namespace kvt {

// The level `name` spells (trace, debug, info, warn or warning, error or err, critical, off);
// InvalidArgument naming the value and the allowed ones otherwise.
StatusOr<spdlog::level::level_enum> ParseLogLevel(std::string_view name);

// OK when KVT_LOG_LEVEL is unset, empty or names a level; otherwise InvalidArgument, e.g.
// "KVT_LOG_LEVEL='verbose' is not a log level; use one of trace, debug, info, warn, error,
// critical, off (or unset it for info)".
Status CheckLogLevelEnv();

}  // namespace kvt

// What kvt sees on this machine: CUDA devices, NCCL and UCX (version, transports, memory
// types). Every probe reports failure as data ("none and why"), never aborts.
#pragma once

#include <nlohmann/json.hpp>

namespace kvt::tools {

nlohmann::json CollectSystemInfo();

// The human-readable report of CollectSystemInfo().
void PrintSystemInfo(const nlohmann::json& info);

}  // namespace kvt::tools

// The backend registry: the backends this build has, and creating one by name or from its typed
// options.
//
//   auto backend = CreateBackend(UcxOptions{.transports = "tcp"});
//   EngineOptions options;  options.backend = LoopbackOptions{.page_writes = true};
//   KVT_ASSIGN_OR_RETURN(BackendConfig config, DefaultBackendConfig(flag_value));
//
// Each backend owns its options struct (kvt/transfer/backends/<name>_options.h); a BackendConfig
// holds exactly one of them, so the alternative picks the backend. Callers that want full
// control create the backend themselves and hand it to TransferEngine::Create.
//
// Thread safety: every function may be called from any thread.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "kvt/common/status.h"
#include "kvt/pool/host_allocator.h"
#include "kvt/transfer/backend.h"
#include "kvt/transfer/backends/cuda_ipc_options.h"
#include "kvt/transfer/backends/loopback_options.h"
#include "kvt/transfer/backends/nccl_options.h"
#include "kvt/transfer/backends/ucx_options.h"

namespace kvt::transfer {

// Which backend to create, with its options.
using BackendConfig = std::variant<UcxOptions, CudaIpcOptions, NcclOptions, LoopbackOptions>;

// One registered backend.
struct BackendInfo {
  std::string_view name;  // "ucx", "cuda_ipc", "nccl", "loopback"
  std::string_view description;
  // What the backend can do where the machine has what it needs (a CUDA device, a UCX built
  // with CUDA support, ...); an instance's Backend::Capabilities() says what it does there.
  BackendCapabilities capabilities;
};

// The registered backends, in priority order.
std::span<const BackendInfo> RegisteredBackends();

// Their names, in priority order.
std::vector<std::string> BackendNames();

// The name of the backend a config creates.
std::string_view BackendName(const BackendConfig& config);

// The named backend with default options. Unknown names -> InvalidArgument listing the known
// ones.
StatusOr<BackendConfig> DefaultBackendConfig(std::string_view name);

// A new backend instance. Options out of range -> InvalidArgument naming the option, its value
// and the allowed range; Unavailable when the machine lacks what the backend needs (a CUDA
// device, NCCL, a UCX transport).
StatusOr<std::unique_ptr<Backend>> CreateBackend(const BackendConfig& config);

// The named backend with default options (DefaultBackendConfig, then CreateBackend).
StatusOr<std::unique_ptr<Backend>> CreateBackend(std::string_view name);

// An allocator for host pools (PoolOptions::host_allocator) that takes memory from `backend`,
// keeping the backend alive until the last block is freed; null when the backend has no host
// allocator of its own (then pools use ordinary memory).
std::shared_ptr<pool::HostAllocator> BackendHostAllocator(std::shared_ptr<Backend> backend);

}  // namespace kvt::transfer

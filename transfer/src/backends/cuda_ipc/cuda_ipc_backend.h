// The cuda_ipc backend: writes CUDA pools straight into the pools of peers on the same host —
// another process through CUDA IPC (NVLink or PCIe peer-to-peer), or another backend of this
// process through the addresses themselves — with one page-copy kernel launch per write on a
// private non-blocking stream. Host pools are not its business (ucx, loopback).
//
// Buffers may be sub-ranges of larger cudaMalloc allocations (as serving engines' caching
// allocators hand them out): each allocation is exported once and opened once per process.
// Memory without a legacy CUDA IPC handle (cuMemCreate/cuMemMap, cudaMallocAsync pools) is
// refused at Register.
//
// Thread safety: every method may be called from any thread (one mutex per backend); the
// process-wide cache of opened IPC mappings has its own mutex, always taken after a backend's.
#pragma once

#include <cstddef>
#include <memory>

#include "kvt/common/status.h"
#include "kvt/transfer/backend.h"
#include "kvt/transfer/backends/cuda_ipc_options.h"

namespace kvt::transfer {

// Unavailable (naming the reason) when this process has no usable CUDA device or the driver
// lacks what the backend needs.
StatusOr<std::unique_ptr<Backend>> CreateCudaIpcBackend(const CudaIpcOptions& options);

// Peer allocations this process holds open through cudaIpcOpenMemHandle, over all cuda_ipc
// backends: each is opened once, shared by every peer connection naming it, and closed when the
// last such connection goes. For tests of that cache.
size_t CudaIpcOpenMappingsForTest();

}  // namespace kvt::transfer

// The nccl backend: moves CUDA pools between GPUs with NCCL point-to-point operations, one
// two-rank communicator per (prefill, decode) pair. The sending side packs each layer batch's
// pages into staging slots (the pack kernel), sends them with ncclSend inside a group, and the
// receiving side, which takes part in every transfer (two-sided), unpacks them into its pool
// (the scatter kernel). Works within a host (NVLink, PCIe) and across hosts (NCCL's network
// transports), one GPU per rank; CUDA memory only.
//
// Pairing (two-sided): the sending side's Connect(peer descriptor) creates a fresh ncclUniqueId
// and starts rank 0 in the background; ConnectToken hands the id (and the staging slot size) to
// the receiving side in the hello-ack, whose Accept starts rank 1 in the background. Writes
// posted before the communicator is up wait for it (NcclTuning::connect_timeout).
//
// NCCL is loaded at run time (libnccl.so.2, see nccl_api.h); NCCL_NVLS_ENABLE is set to 0.
//
// Thread safety: every method may be called from any thread (one mutex per backend, then one
// per pair); each pair runs its own progress thread.
#pragma once

#include <memory>

#include "backends/nccl/nccl_protocol.h"
#include "kvt/common/status.h"
#include "kvt/transfer/backend.h"
#include "kvt/transfer/backends/nccl_options.h"

namespace kvt::transfer {

// Unavailable (naming the reason) when this process has no usable CUDA device or NCCL cannot
// be loaded; InvalidArgument naming the option, its value and the allowed range for options out
// of range.
StatusOr<std::unique_ptr<Backend>> CreateNcclBackend(const NcclOptions& options);

// The same with every tunable (tests; NcclOptions sets the public ones).
StatusOr<std::unique_ptr<Backend>> CreateNcclBackendWithTuning(const nccl::NcclTuning& tuning);

}  // namespace kvt::transfer

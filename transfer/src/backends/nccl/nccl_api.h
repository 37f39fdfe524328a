// NCCL, loaded at run time: kvt links no NCCL library, so a build or a process without NCCL keeps
// every other backend, and the nccl backend reports Unavailable with the reason. nccl.h supplies
// the types only.
//
// Before the library is loaded (and so before the first NCCL call of the process, as long as
// nothing else in the process used NCCL first) NCCL_NVLS_ENABLE is set to 0: NVLink SHARP
// buffers are large and only serve collectives, which kvt never runs.
//
// Thread safety: LoadNccl may be called from any thread; the table it returns is immutable and
// lives until the process exits (the library is never unloaded: NCCL keeps threads).
#pragma once

#include <nccl.h>

#include <memory>
#include <string>
#include <string_view>

#include "kvt/common/status.h"

namespace kvt::transfer::nccl {

// The oldest NCCL the backend runs on: non-blocking communicators with ncclCommFinalize and
// ncclGetLastError, and size-tolerant ncclConfig_t parsing.
inline constexpr int kMinNcclVersion = 21900;  // 2.19.0

// The entry points the backend uses, resolved with dlsym.
struct NcclApi {
  std::string library;  // what was loaded ("libnccl.so.2")
  int version = 0;      // ncclGetVersion: major * 10000 + minor * 100 + patch

  ncclResult_t (*GetVersion)(int*) = nullptr;
  ncclResult_t (*GetUniqueId)(ncclUniqueId*) = nullptr;
  ncclResult_t (*CommInitRankConfig)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*) = nullptr;
  ncclResult_t (*CommFinalize)(ncclComm_t) = nullptr;
  ncclResult_t (*CommDestroy)(ncclComm_t) = nullptr;
  ncclResult_t (*CommAbort)(ncclComm_t) = nullptr;
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*) = nullptr;
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t,
                       cudaStream_t) = nullptr;
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*GroupStart)() = nullptr;
  ncclResult_t (*GroupEnd)() = nullptr;
  const char* (*GetErrorString)(ncclResult_t) = nullptr;
  const char* (*GetLastError)(ncclComm_t) = nullptr;

  // "<what>: <ncclGetErrorString> (<ncclGetLastError>)" as Unavailable for remote and system
  // errors (the peer or the link went away), Internal otherwise.
  Status ToStatus(ncclResult_t result, ncclComm_t comm, std::string_view what) const;

  // "2.28.9".
  std::string VersionString() const;
};

// The process-wide NCCL, loaded from "libnccl.so.2" on first use. Unavailable when the library
// cannot be loaded ("nccl backend: libnccl.so.2 not found: <dlerror>; install NCCL or pick
// cuda_ipc/ucx"), lacks an entry point, or is older than kMinNcclVersion. The first call's
// answer is kept.
StatusOr<const NcclApi*> LoadNccl();

// Loads `soname` without caching (tests; LoadNccl uses it once). Also sets NCCL_NVLS_ENABLE=0.
// The library is never unloaded.
StatusOr<std::unique_ptr<NcclApi>> LoadNcclLibrary(const std::string& soname);

// Sets NCCL_NVLS_ENABLE=0 in this process's environment (overwriting any other value, which is
// logged). Idempotent.
void DisableNvls();

}  // namespace kvt::transfer::nccl

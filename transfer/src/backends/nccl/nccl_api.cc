#include "backends/nccl/nccl_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>

#include "kvt/common/log.h"

namespace kvt::transfer::nccl {
namespace {

constexpr const char* kNvlsVariable = "NCCL_NVLS_ENABLE";

template <typename Fn>
Status Resolve(void* handle, const std::string& soname, const char* symbol, Fn& out) {
  dlerror();
  void* address = dlsym(handle, symbol);
  if (address == nullptr) {
    const char* error = dlerror();
    return Unavailable("nccl backend: " + soname + " lacks " + symbol + " (" +
                       (error != nullptr ? error : "null symbol") +
                       "); install NCCL >= 2.19 or pick cuda_ipc/ucx");
  }
  out = reinterpret_cast<Fn>(address);
  return OkStatus();
}

}  // namespace

void DisableNvls() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* raw = std::getenv(kNvlsVariable);
    const std::optional<std::string> before =
        raw != nullptr ? std::optional<std::string>(raw) : std::nullopt;
    setenv(kNvlsVariable, "0", /*overwrite=*/1);
    if (!before) {
      KVT_LOG_INFO("nccl", "set {}=0 for this process (kvt runs no collectives)", kNvlsVariable);
    } else if (*before != "0") {
      KVT_LOG_WARN("nccl", "{} was '{}'; set it to 0 for this process (kvt runs no collectives)",
                   kNvlsVariable, *before);
    }
  });
  // Someone may have changed it since; the rule is "0 in every process".
  const char* now = std::getenv(kNvlsVariable);
  if (now == nullptr || std::string(now) != "0") {
    KVT_LOG_WARN("nccl", "{} was changed to '{}'; set it back to 0", kNvlsVariable,
                 now == nullptr ? "" : now);
    setenv(kNvlsVariable, "0", 1);
  }
}

Status NcclApi::ToStatus(ncclResult_t result, ncclComm_t comm, std::string_view what) const {
  if (result == ncclSuccess) return OkStatus();
  std::string message = std::string(what) + ": " +
                        (GetErrorString != nullptr ? GetErrorString(result) : "NCCL error") +
                        " (ncclResult " + std::to_string(static_cast<int>(result)) + ")";
  const char* last = GetLastError != nullptr ? GetLastError(comm) : nullptr;
  if (last != nullptr && last[0] != '\0') message += ": " + std::string(last);
  if (result == ncclRemoteError || result == ncclSystemError) return Unavailable(message);
  if (result == ncclInvalidArgument || result == ncclInvalidUsage) return InvalidArgument(message);
  return Internal(message);
}

std::string NcclApi::VersionString() const {
  return std::to_string(version / 10000) + "." + std::to_string(version / 100 % 100) + "." +
         std::to_string(version % 100);
}

StatusOr<std::unique_ptr<NcclApi>> LoadNcclLibrary(const std::string& soname) {
  DisableNvls();
  void* handle = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* error = dlerror();
    return Unavailable("nccl backend: " + soname +
                       " not found: " + (error != nullptr ? error : "dlopen failed") +
                       "; install NCCL or pick cuda_ipc/ucx");
  }
  // From here on the handle is deliberately never closed: NCCL starts threads and registers
  // atexit handlers, so unloading it is unsafe.
  auto api = std::make_unique<NcclApi>();
  api->library = soname;
  KVT_RETURN_IF_ERROR(Resolve(handle, soname, "ncclGetVersion", api->GetVersion));
  KVT_RETURN_IF_ERROR(Resolve(handle, soname, "ncclGetUniqueId", api->GetUniqueId));
  KVT_RETURN_IF_ERROR(Resolve(handle, soname, "ncclCommInitRankConfig", api->CommInitRankConfig));
  KVT_RETURN_IF_ERROR(Resolve(handle, soname, "ncclCommFinalize", api->CommFinalize));
  KVT_RETURN_IF_ERROR(Resolve(handle, soname, "ncclCommDestroy", api->CommDestroy));
  KVT_RETURN_IF_ERROR(Resolve(handle, soname, "ncclCommAbort", api->CommAbort));
  KVT_RETURN_IF_ERROR(Resolve(handle, soname, "ncclCommGetAsyncError", api->CommGetAsyncError));
  KVT_RETURN_IF_ERROR(Resolve(handle, soname, "ncclSend", api->Send));
  KVT_RETURN_IF_ERROR(Resolve(handle, soname, "ncclRecv", api->Recv));
  KVT_RETURN_IF_ERROR(Resolve(handle, soname, "ncclGroupStart", api->GroupStart));
  KVT_RETURN_IF_ERROR(Resolve(handle, soname, "ncclGroupEnd", api->GroupEnd));
  KVT_RETURN_IF_ERROR(Resolve(handle, soname, "ncclGetErrorString", api->GetErrorString));
  KVT_RETURN_IF_ERROR(Resolve(handle, soname, "ncclGetLastError", api->GetLastError));
  const ncclResult_t result = api->GetVersion(&api->version);
  if (result != ncclSuccess) return api->ToStatus(result, nullptr, "ncclGetVersion");
  if (api->version < kMinNcclVersion) {
    return Unavailable("nccl backend: " + soname + " is NCCL " + api->VersionString() +
                       "; the backend needs 2.19 or newer (non-blocking communicators); "
                       "upgrade NCCL or pick cuda_ipc/ucx");
  }
  return api;
}

StatusOr<const NcclApi*> LoadNccl() {
  static const StatusOr<std::unique_ptr<NcclApi>>* loaded = [] {
    auto* result = new StatusOr<std::unique_ptr<NcclApi>>(LoadNcclLibrary("libnccl.so.2"));
    if (result->ok()) {
      KVT_LOG_INFO("nccl", "loaded {} (NCCL {}; built against headers {}.{}.{})",
                   (**result)->library, (**result)->VersionString(), NCCL_MAJOR, NCCL_MINOR,
                   NCCL_PATCH);
    } else {
      KVT_LOG_INFO("nccl", "{}", result->status().message());
    }
    return result;
  }();
  if (!loaded->ok()) return loaded->status();
  return static_cast<const NcclApi*>(loaded->value().get());
}

}  // namespace kvt::transfer::nccl

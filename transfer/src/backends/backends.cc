#include "kvt/transfer/backends.h"

#include "backends/loopback/loopback_backend.h"
#include "backends/ucx/ucx_backend.h"

namespace kvt::transfer {

std::vector<std::string> BackendNames() { return {"ucx", "loopback"}; }

StatusOr<std::unique_ptr<Backend>> CreateBackend(std::string_view name,
                                                 const BackendOptions& options) {
  if (name == "ucx") return CreateUcxBackend(options);
  if (name == "loopback") return CreateLoopbackBackend(options);
  std::string known;
  for (const std::string& n : BackendNames()) known += (known.empty() ? "" : ", ") + n;
  return InvalidArgument("unknown backend '" + std::string(name) + "'; this build has " + known);
}

}  // namespace kvt::transfer

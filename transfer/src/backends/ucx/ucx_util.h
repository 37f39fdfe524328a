// UCX helpers that both of the ucx backend's paths (the RMA path in ucx_backend.cc and the staged
// path in ucx_staged_transport.cc, each on a UCP context of its own) use.
//
// Thread safety: pure functions; call from any thread.
#pragma once

#include <ucp/api/ucp.h>

#include <string>

#include "kvt/common/status.h"

namespace kvt::transfer {

// Status for a UCX status code, "<what>: <ucs_status_string>", with kvt's retry meaning.
Status UcsStatus(ucs_status_t status, const std::string& what);

// UCX's configuration from the environment, with `transports` (UCX_TLS syntax; empty: UCX's
// choice) and kvt's tcp tuning (64 KiB send / 256 KiB receive segments, 4 MiB socket buffers,
// where the environment does not set them). The caller releases it (ucp_config_release).
// InvalidArgument for a transport list UCX refuses.
StatusOr<ucp_config_t*> ReadUcpConfig(const std::string& transports);

}  // namespace kvt::transfer

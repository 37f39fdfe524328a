// UCX helpers that both of the ucx backend's paths (the RMA path in ucx_backend.cc and the staged
// path in ucx_staged_transport.cc, each on a UCP context of its own) use.
//
// Thread safety: pure functions; call from any thread.
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstdint>
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

// Where the `length` (> 0) bytes at the peer's address `base` lie in this process, when UCX maps
// them here (shared memory: ucp_rkey_ptr of the first and the last byte) as one range; *local is
// set on UCS_OK. UCS_ERR_UNREACHABLE when the first byte is not mapped here (the peer is reached
// over the network), UCS_ERR_OUT_OF_RANGE when the last byte is not mapped or the two ends are not
// one range (an address the key does not cover), else ucp_rkey_ptr's own error.
ucs_status_t RkeyPtrRange(ucp_rkey_h rkey, uint64_t base, uint64_t length, uint8_t** local);

// Progresses `worker` until it has done nothing for `quiet` in a row, or for at most `bound`:
// call before ucp_worker_destroy. UCX 1.13's tcp transport aborts the process there
// (ucp_ep_purge_lanes: "got REP message") when a wireup reply is still queued on an endpoint UCX
// made for a peer's connection, which a worker torn down right after a peer connected has; UCX
// has no call that waits for those replies, so the worker is given the time to send them.
void DrainWorker(ucp_worker_h worker, std::chrono::milliseconds quiet,
                 std::chrono::milliseconds bound);

}  // namespace kvt::transfer

#pragma once

#include <atomic>
#include <memory>

#include "kvt/common/status.h"
#include "kvt/transfer/backend.h"
#include "kvt/transfer/backends/ucx_options.h"

namespace kvt::transfer {

// UCX backend: one UCP context and worker, a progress thread, pool buffers registered once with
// ucp_mem_map, rkeys in the descriptor, ucp_put_nbx per run and an endpoint flush before a
// write counts as complete; writes above UcxOptions::direct_inline_bytes are posted by
// the backend's poster thread in batches (the caller never sends a large write itself). When UCX
// maps a peer's buffers into this process (shared memory, ucp_rkey_ptr), writes are plain copies
// instead: small ones on the posting thread, larger ones on the backend's copy threads
// (UcxOptions::copy_threads). Flush and copy completions call the completion notifier.
//
// CUDA pools: registered directly when this UCX handles CUDA memory (ucp_context_query memory
// types; UcxOptions::cuda_mode auto or direct); otherwise ("auto" or "staged") staged through
// pinned host bounce buffers by the gather/scatter kernels (ucx_staged_transport.h), taking page
// writes. InvalidArgument naming the option, its value and the allowed range for options out of
// range.
StatusOr<std::unique_ptr<Backend>> CreateUcxBackend(const UcxOptions& options);

// Internal knobs for tests of the staged protocol on machines without a GPU.
struct UcxTestHooks {
  // Host pools take the staged path too, packed and unpacked by the CPU reference kernels.
  bool stage_host_memory = false;
  // Each staged gather and scatter reports completion only this long after it started, so that
  // tests can hold chunks in flight.
  int host_copy_delay_us = 0;
  // Direct copies (peers mapped into this process) start only this long after the copy thread
  // took them, so that tests can release or disconnect with a copy in flight.
  int direct_copy_delay_us = 0;
  // Network writes above UcxOptions::direct_inline_bytes start being posted only this long after
  // the poster thread took them, so that tests can release or disconnect before any of it is sent.
  int post_delay_us = 0;
  // The poster pauses this long after each batch of a write (1 MiB of puts) but its last, so
  // that tests can cancel a write part-way.
  int post_batch_pause_us = 0;
  // Bytes of puts the poster posts per batch (0: the backend's 1 MiB), so that tests can cut
  // runs into pieces on small buffers.
  int post_batch_bytes = 0;
  // The copy-run message sent this many-th (from 1) fails as if UCX refused to send it; 0: none.
  uint64_t fail_run_send_at = 0;
  // Receiving, this side sends each ack of a copy-run message or a staged chunk (landed or
  // refused) only this long after it was due, so that tests can hold a sender's writes
  // unacknowledged.
  int ack_delay_us = 0;
  // Receiving, this side starts taking each rendezvous copy-run message and each staged chunk
  // only this long after it arrived, so that tests can hold a sender's messages queued (a
  // hostile sender's past its window).
  int receive_delay_us = 0;
  // How long a Release waits for the acks of the write's messages in flight; 0: the backend's
  // 10 s.
  int release_bound_ms = 0;
  // While it reads true, this backend's progress thread does not progress its worker, so that
  // tests can hold a peer's writes to it (a put's flush waits for the target's progress over
  // tcp) as an unresponsive peer would.
  std::shared_ptr<std::atomic<bool>> hold_progress;
};
StatusOr<std::unique_ptr<Backend>> CreateUcxBackendForTest(const UcxOptions& options,
                                                           const UcxTestHooks& hooks);

// How writes to a connected peer of a ucx backend move: "copy" (the peer's buffers are mapped
// here), "put", "am" (copy runs as active messages), "staged" or "staged-in-place" (the
// receiver reads our bounce slots in place; known once the link's hello is acknowledged,
// "staged" before). NotFound for an unknown peer,
// InvalidArgument for a backend that is not ucx.
StatusOr<std::string> UcxPeerPath(Backend& backend, PeerId peer);

// Receiving staged chunks: how many senders' bounce slots this ucx backend has mapped for
// reading in place (tests: a sender's slots are let go once none of its links is open).
// InvalidArgument for a backend that is not ucx.
StatusOr<size_t> UcxMappedSenderSlots(Backend& backend);

// The UCX library version string, e.g. "1.13.1".
const char* UcxVersion();

}  // namespace kvt::transfer

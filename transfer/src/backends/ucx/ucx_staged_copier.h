// Copiers move chunk bytes between a pool and the staging slots of the ucx backend's staged
// path: a gather packs a chunk of the local pool into a send slot, a scatter unpacks a received
// payload from a receive slot into the local pool. The CUDA copier runs the pack/unpack kernels
// on streams (one per slot, so that chunks overlap each other and the network); the host copier
// runs the CPU references synchronously and serves host pools in tests of the staged protocol.
//
// Thread contract: not synchronised; the staged transport calls a copier under its owner's
// mutex. A slot's memory must not be touched while its gather or scatter is pending (until
// GatherDone/ScatterDone said true or an error).
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "backends/ucx/ucx_staged_protocol.h"
#include "kvt/common/status.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/transfer/backend.h"

namespace kvt::transfer::ucx_staging {

// The bounce slots: `slots` send slots of `slot_bytes` at send_base and as many receive slots at
// recv_base, host memory the caller owns and keeps alive longer than the copier.
struct SlotMemory {
  uint8_t* send_base = nullptr;
  uint8_t* recv_base = nullptr;
  uint32_t slots = 0;
  uint64_t slot_bytes = 0;
  // True when the memory is already page-locked and mapped for the device (cudaHostAlloc); the
  // CUDA copier then does not register it again.
  bool pinned = false;
};

// One chunk as a copier sees it: transfer layers of the pool (their buffers in LayerTable
// order), the page ids on this side, and where each unit's segment sits in the slot's payload.
struct CopierChunk {
  int32_t layer_begin = 0;
  int32_t layer_end = 0;
  std::span<const int32_t> pages;  // gather: source pages; scatter: destination pages
  std::span<const ChunkUnit> units;
  uint64_t pages_offset = 0;  // scatter: where the page ids sit in the payload
  uint64_t payload_bytes = 0;
  // Scatter of a chunk read in place: the payload's bytes from data_offset on are at
  // data_source + data_offset (a peer's slot mapped here and pinned with PinPeerSlots); the
  // receive slot holds only the prefix before data_offset (checked and owned by this side).
  const uint8_t* data_source = nullptr;
  uint64_t data_offset = 0;
};

class StagingCopier {
 public:
  virtual ~StagingCopier() = default;
  StagingCopier(const StagingCopier&) = delete;
  StagingCopier& operator=(const StagingCopier&) = delete;

  virtual std::string_view Name() const = 0;

  // Captures `ready` now (the producer may re-record it after the post) so that gathers started
  // later wait for the work it marks; `gate` receives what they wait on (empty when ready is
  // null or the copier has waited on the CPU already).
  virtual Status Gate(cudaEvent_t ready, cuda::Event& gate) = 0;

  // Starts packing the chunk's units of the source pages into send slot `slot` (its payload
  // from the layout's offsets; the caller wrote the prefix), after `gate` when not null.
  virtual Status StartGather(uint32_t slot, const CopierChunk& chunk, cudaEvent_t gate) = 0;
  virtual StatusOr<bool> GatherDone(uint32_t slot) = 0;

  // Starts unpacking receive slot `slot` (payload_bytes landed there) into the pool.
  virtual Status StartScatter(uint32_t slot, const CopierChunk& chunk) = 0;
  virtual StatusOr<bool> ScatterDone(uint32_t slot) = 0;

  // Asks the copier to call notify(arg) once after each gather or scatter started from now on
  // has completed (GatherDone / ScatterDone would say true), on a thread of its own choosing (a
  // CUDA callback thread for the CUDA copier): the owner can then sleep instead of polling.
  // notify must be cheap, must not call CUDA, and must stay callable until the copier is
  // destroyed (destruction waits for pending calls). Returns false when the copier cannot do
  // this; its completions are then seen only by polling.
  virtual bool NotifyCompletions(void (*notify)(void*), void* arg) { return false; }

  // Makes a peer's slots mapped here at [base, base + bytes) readable by scatters at full speed
  // (page-locked for DMA); UnpinPeerSlots undoes it once no scatter reads them. The host copier
  // needs neither.
  virtual Status PinPeerSlots(void* base, size_t bytes) { return OkStatus(); }
  virtual void UnpinPeerSlots(void* base) {}

 protected:
  StagingCopier() = default;
};

// CUDA pools on `device`: `regions` are the pool's buffers with their transfer layers (a valid
// LayerTable) and page bytes, which may differ between buffers. Sets
// *host_registration_failed when cudaHostRegister refused the slot memory (the caller may retry
// with cudaHostAlloc memory and pinned = true).
StatusOr<std::unique_ptr<StagingCopier>> CreateCudaCopier(int device,
                                                          std::span<const LocalRegion> regions,
                                                          const SlotMemory& slots,
                                                          bool* host_registration_failed);

// Host pools (tests of the staged protocol without a GPU): PackCpu / UnpackCpu at start; a
// gather or scatter reports done `delay` after it started, so tests can hold chunks in flight.
StatusOr<std::unique_ptr<StagingCopier>> CreateHostCopier(std::span<const LocalRegion> regions,
                                                          const SlotMemory& slots,
                                                          std::chrono::microseconds delay);

}  // namespace kvt::transfer::ucx_staging

// A peer's Hello or HelloAck as the engine takes it: protocol version, Validate, the layout
// compatibility check, the descriptor for each backend out of the PeerInfo, and the backend's
// parse of the published address and keys (what Connect reads before it touches UCX, CUDA or
// NCCL).
//
// Input: the serialized kvt.v1.Envelope.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "backends/cuda_ipc/cuda_ipc_codec.h"
#include "backends/nccl/nccl_protocol.h"
#include "backends/ucx/ucx_staged_protocol.h"
#include "control/validate.h"
#include "engine/layout_codec.h"
#include "fuzz_common.h"

using namespace kvt;

namespace {

void ParseBackendParts(const transfer::PeerDescriptor& descriptor) {
  if (descriptor.backend == "ucx") {
    const auto split = transfer::ucx_staging::SplitPeerAddress(descriptor.address);
    KVT_FUZZ_CHECK(split.worker_address.size() <= descriptor.address.size());
  } else if (descriptor.backend == "cuda_ipc") {
    (void)transfer::cuda_ipc::DecodeAddress(descriptor.address);
    StatusOr<transfer::cuda_ipc::PeerKeys> keys =
        transfer::cuda_ipc::DecodePeerKeys(descriptor.regions);
    if (keys.ok()) {
      KVT_FUZZ_CHECK(keys->allocation_of.size() == descriptor.regions.size() &&
                     keys->offsets.size() == descriptor.regions.size());
      for (size_t i = 0; i < descriptor.regions.size(); ++i) {
        // Each buffer names an allocation the peer published, which covers the whole buffer.
        KVT_FUZZ_CHECK(keys->allocation_of[i] < keys->allocations.size());
        const uint64_t bytes = keys->allocations[keys->allocation_of[i]].bytes;
        KVT_FUZZ_CHECK(keys->offsets[i] <= bytes &&
                       descriptor.regions[i].length <= bytes - keys->offsets[i]);
      }
    }
  } else if (descriptor.backend == "nccl") {
    StatusOr<transfer::nccl::ProcessAddress> peer =
        transfer::nccl::DecodeAddress(descriptor.address);
    if (peer.ok()) {
      transfer::nccl::ProcessAddress local;
      local.boot_id = "fuzz-boot";
      local.pid = 1;
      local.device = 0;
      local.pci_bus_id = "0000:01:00.0";
      (void)transfer::nccl::CheckPeerPlacement(local, *peer);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  v1::Envelope envelope;
  if (!envelope.ParseFromArray(data, static_cast<int>(size))) return 0;
  const v1::PeerInfo* peer = nullptr;
  std::string_view our_role;
  std::string_view their_role;
  if (envelope.has_hello()) {
    if (!control::CheckProtocolVersion(envelope.hello().protocol_version()).ok()) return 0;
    peer = &envelope.hello().peer();
    our_role = "prefill";
    their_role = "decode";
  } else if (envelope.has_hello_ack()) {
    peer = &envelope.hello_ack().peer();
    our_role = "decode";
    their_role = "prefill";
  } else {
    return 0;
  }
  if (!control::Validate(envelope).ok()) return 0;
  (void)control::PeerContextFrom(*peer);
  if (!transfer::CheckCompatible(fuzz::LocalLayout(), peer->layout(), our_role, their_role).ok()) {
    return 0;
  }
  for (std::string_view backend : {"ucx", "cuda_ipc", "nccl", "loopback"}) {
    StatusOr<transfer::PeerDescriptor> descriptor =
        transfer::DescriptorFromPeerInfo(*peer, backend);
    if (!descriptor.ok()) continue;
    KVT_FUZZ_CHECK(descriptor->backend == backend);
    KVT_FUZZ_CHECK(descriptor->regions.size() == static_cast<size_t>(peer->buffers_size()));
    ParseBackendParts(*descriptor);
  }
  return 0;
}

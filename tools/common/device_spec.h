// Where a tool's KV pool lives, as the command line names it: "host" or "cuda:N". Parsing is
// pure (no CUDA call); CheckDeviceSpec asks the CUDA runtime whether the device exists and says
// which devices do when it does not.
//
// Thread safety: every function is safe from any thread.
#pragma once

#include <string>

#include "kvt/common/status.h"
#include "kvt/pool/pool_options.h"

namespace kvt::tools {

struct DeviceSpec {
  pool::MemoryKind memory = pool::MemoryKind::kHost;
  int index = 0;  // CUDA device index (kCuda only)

  bool cuda() const { return memory == pool::MemoryKind::kCuda; }
  // "host" or "cuda:N" (what ParseDeviceSpec accepts back).
  std::string ToString() const;
};

// "host", "cuda:N" (N a decimal device index) or "cuda" (cuda:0). InvalidArgument naming the
// text and the accepted forms otherwise. Does not check that the device exists.
StatusOr<DeviceSpec> ParseDeviceSpec(const std::string& text);

// OK for host; for cuda:N OK when this process sees device N. Otherwise FailedPrecondition when
// there is no usable device at all (with the runtime's reason), InvalidArgument when N is out of
// range; both name the devices present and what to pass instead.
Status CheckDeviceSpec(const DeviceSpec& spec);

// "NVIDIA H200" for a present device; empty when the runtime cannot say.
std::string CudaDeviceName(int index);

// "cuda:0 (NVIDIA H200), cuda:1 (NVIDIA H200)", or "none (<reason>)".
std::string DescribeCudaDevices();

// The backend an agent uses when none is named: cuda_ipc for CUDA pools (NVLink / PCIe peer
// copies between processes of one node), ucx for host pools.
std::string DefaultBackendFor(const DeviceSpec& spec);

}  // namespace kvt::tools

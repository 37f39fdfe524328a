#include "device_spec.h"

#include <cuda_runtime_api.h>

#include <cstdlib>

#include "kvt/kernels/cuda_util.h"

namespace kvt::tools {

std::string DeviceSpec::ToString() const {
  return cuda() ? "cuda:" + std::to_string(index) : "host";
}

StatusOr<DeviceSpec> ParseDeviceSpec(const std::string& text) {
  DeviceSpec spec;
  if (text == "host") return spec;
  auto bad = [&text](const std::string& why) {
    return InvalidArgument("device '" + text + "' " + why +
                           "; use 'host' or 'cuda:N' with N a CUDA device index (e.g. cuda:0)");
  };
  if (text == "cuda") {
    spec.memory = pool::MemoryKind::kCuda;
    return spec;
  }
  if (text.rfind("cuda:", 0) != 0) return bad("is not a device name");
  const std::string digits = text.substr(5);
  if (digits.empty() || digits.size() > 4 ||
      digits.find_first_not_of("0123456789") != std::string::npos) {
    return bad("does not end in a device index");
  }
  spec.memory = pool::MemoryKind::kCuda;
  spec.index = std::atoi(digits.c_str());
  return spec;
}

std::string CudaDeviceName(int index) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, index) != cudaSuccess) {
    (void)cudaGetLastError();
    return "";
  }
  return prop.name;
}

std::string DescribeCudaDevices() {
  const cuda::DeviceCountResult devices = cuda::DeviceCount();
  if (devices.count == 0) return "none (" + devices.reason + ")";
  std::string out;
  for (int i = 0; i < devices.count; ++i) {
    if (!out.empty()) out += ", ";
    out += "cuda:" + std::to_string(i);
    const std::string name = CudaDeviceName(i);
    if (!name.empty()) out += " (" + name + ")";
  }
  return out;
}

Status CheckDeviceSpec(const DeviceSpec& spec) {
  if (!spec.cuda()) return OkStatus();
  const cuda::DeviceCountResult devices = cuda::DeviceCount();
  if (devices.count == 0) {
    return FailedPrecondition("device " + spec.ToString() +
                              ": this machine has no usable CUDA device (" + devices.reason +
                              "); use --device host");
  }
  if (spec.index >= devices.count) {
    return InvalidArgument("device " + spec.ToString() + " does not exist; this process sees " +
                           std::to_string(devices.count) +
                           " CUDA device(s): " + DescribeCudaDevices());
  }
  return OkStatus();
}

std::string DefaultBackendFor(const DeviceSpec& spec) { return spec.cuda() ? "cuda_ipc" : "ucx"; }

}  // namespace kvt::tools

// A stand-in for a model layer's GPU time: a one-thread kernel that spins on the GPU's global
// timer for a given duration, so that a simulated forward occupies its stream (later work on
// the stream waits for it) without holding a CPU thread.
//
// Callers wrap the cudaError_t into a Status. Thread safety: reentrant.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "gpu_spin.h"

namespace kvt::tools {

// Enqueues a kernel on `stream` that returns after `nanoseconds` of GPU time, or as soon as
// `*cancel` (device-readable memory, e.g. mapped pinned host memory; may be null) is non-zero.
// Returns the launch error, if any.
inline cudaError_t LaunchSimulatedCompute(uint64_t nanoseconds, const volatile uint32_t* cancel,
                                          cudaStream_t stream) {
  return LaunchGpuSpin(nanoseconds, cancel,
                       GpuSpinShape{.blocks = 1, .threads = 1, .sleep_ns = 2000}, stream);
}

}  // namespace kvt::tools

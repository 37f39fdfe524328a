// A stand-in for GPU compute: a kernel that spins on the GPU's global timer for a given duration,
// so that it occupies its stream (later work on the stream waits for it) and, with more blocks,
// multiprocessor slots, without holding a CPU thread. Used by kvt-agent (a model layer's time)
// and kvt-bench (compute beside a transfer).
//
// Kept free of kvt headers so that nvcc compiles only this; callers wrap the cudaError_t into a
// Status. Thread safety: reentrant.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvt::tools {

struct GpuSpinShape {
  unsigned blocks = 1;
  unsigned threads = 1;  // per block
  // Each warp sleeps this long between looks at the timer: it holds its slot, not the
  // multiprocessor's issue bandwidth.
  unsigned sleep_ns = 2000;
};

// Enqueues a kernel on `stream` that returns after `nanoseconds` of GPU time, or as soon as
// `*cancel` (device-readable memory, e.g. mapped pinned host memory; may be null) is non-zero.
// Returns the launch error, if any.
cudaError_t LaunchGpuSpin(uint64_t nanoseconds, const volatile uint32_t* cancel,
                          const GpuSpinShape& shape, cudaStream_t stream);

}  // namespace kvt::tools

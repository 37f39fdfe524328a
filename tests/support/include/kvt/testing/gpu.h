// Skip checks for tests that need CUDA devices. A test that needs a device starts with one of
// them, so that the gpu-labelled suite passes (skipped, with the reason) on a host without one.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "kvt/kernels/cuda_util.h"

// Skips the test, with the CUDA runtime's reason, when this process sees no CUDA device.
#define KVT_SKIP_WITHOUT_GPU()   \
  if (!::kvt::cuda::HasDevice()) \
  GTEST_SKIP() << "no CUDA device: " << ::kvt::cuda::DeviceCount().reason

// Skips the test when this process sees fewer than `n` CUDA devices; `why` says what needs them.
#define KVT_SKIP_WITHOUT_GPUS(n, why)                                                          \
  if (const ::kvt::cuda::DeviceCountResult kvt_devices_ = ::kvt::cuda::DeviceCount();          \
      kvt_devices_.count < (n))                                                                \
  GTEST_SKIP() << "needs " << (n) << " CUDA devices, found " << kvt_devices_.count             \
               << (kvt_devices_.count == 0 ? " (" + kvt_devices_.reason + ")" : std::string()) \
               << "; " << (why)

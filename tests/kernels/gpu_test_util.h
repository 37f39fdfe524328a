// Helpers for the GPU kernel tests: device mirrors of host byte buffers at chosen
// misalignments; the skip check every test starts with comes from kvt/testing/gpu.h.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kvt/kernels/cuda_util.h"
#include "kvt/testing/gpu.h"
#include "kvt/testing/random.h"
#include "kvt/testing/status.h"

namespace kvt::kernels::testing {

using ::kvt::testing::DistinctIndices;

// A device allocation of `size` usable bytes starting `misalign` bytes past a 256-byte
// boundary, with a host mirror. Upload/Download move the usable bytes.
class DeviceBytes {
 public:
  DeviceBytes() = default;
  Status Init(size_t size, size_t misalign) {
    size_ = size;
    misalign_ = misalign;
    auto buf = cuda::DeviceBuffer::Allocate(size + misalign + 256);
    if (!buf.ok()) return buf.status();
    buf_ = std::move(buf).value();
    host.assign(size, 0);
    return OkStatus();
  }
  uint8_t* dev() const { return buf_.as<uint8_t>() + misalign_; }
  uint64_t addr() const { return reinterpret_cast<uint64_t>(dev()); }
  uint64_t host_addr() { return reinterpret_cast<uint64_t>(host.data()); }
  size_t size() const { return size_; }
  Status Upload() { return cuda::Copy(dev(), host.data(), size_); }
  StatusOr<std::vector<uint8_t>> Download() const {
    std::vector<uint8_t> out(size_);
    Status s = cuda::Copy(out.data(), dev(), size_);
    if (!s.ok()) return s;
    return out;
  }
  void Randomize(std::mt19937& rng) {
    for (auto& b : host) b = static_cast<uint8_t>(rng());
  }

  std::vector<uint8_t> host;

 private:
  cuda::DeviceBuffer buf_;
  size_t size_ = 0;
  size_t misalign_ = 0;
};

// A device copy of a host vector (for base tables and index lists).
template <typename T>
StatusOr<cuda::DeviceBuffer> ToDevice(const std::vector<T>& v) {
  auto buf = cuda::DeviceBuffer::Allocate(std::max<size_t>(v.size() * sizeof(T), 1));
  if (!buf.ok()) return buf.status();
  if (!v.empty()) {
    Status s = cuda::Copy(buf->data(), v.data(), v.size() * sizeof(T));
    if (!s.ok()) return s;
  }
  return buf;
}

}  // namespace kvt::kernels::testing

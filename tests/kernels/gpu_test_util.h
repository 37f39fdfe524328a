// Helpers for the GPU kernel tests: device mirrors of host byte buffers at chosen
// misalignments, and the skip check every test starts with.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kvt/kernels/cuda_util.h"

#define KVT_SKIP_WITHOUT_GPU()   \
  if (!::kvt::cuda::HasDevice()) \
  GTEST_SKIP() << "no CUDA device: " << ::kvt::cuda::DeviceCount().reason

#define KVT_ASSERT_OK(expr)             \
  do {                                  \
    ::kvt::Status kvt_s_ = (expr);      \
    ASSERT_TRUE(kvt_s_.ok()) << kvt_s_; \
  } while (false)

namespace kvt::kernels::testing {

// `n` distinct values from [0, range) in random order.
inline std::vector<int32_t> Distinct(int64_t n, int64_t range, std::mt19937& rng) {
  std::vector<int32_t> all(static_cast<size_t>(range));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<size_t>(n));
  return all;
}

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

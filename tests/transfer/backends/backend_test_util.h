// Helpers for the backend tests (unit and GPU): random pool contents, random page lists, what a
// page write must leave in the destination (computed independently of any backend), byte
// comparison of pool images, registering and connecting two host backends, and waiting for a
// write. Header-only, test-only, no CUDA.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "kvt/common/status.h"
#include "kvt/testing/random.h"
#include "kvt/transfer/backend.h"

namespace kvt::transfer::testing {

using ::kvt::testing::FillRandom;
using ::kvt::testing::RandomBytes;

// `n` distinct pages from [1, range) in random order (page 0 is the dummy page).
inline std::vector<int32_t> DistinctPages(int64_t n, int64_t range, std::mt19937& rng) {
  return ::kvt::testing::DistinctIndices(n, range, rng, /*first=*/1);
}

// Applies a page write to host copies of two pools, as the backend must: for every layer l of
// the write, buffers l (K) and num_layers + l (V), every page pair and every unit (the whole
// page of `page_bytes` when the write has none). `src_page(buffer, page)` and
// `dst_page(buffer, page)` return where a page starts in the host copies.
template <typename SrcPage, typename DstPage>
void ApplyPageWrite(const PageWrite& w, uint64_t page_bytes, SrcPage src_page, DstPage dst_page) {
  const PageUnit whole{0, 0, page_bytes};
  const std::span<const PageUnit> units =
      w.units.empty() ? std::span<const PageUnit>(&whole, 1) : w.units;
  for (int32_t l = w.layer_begin; l < w.layer_end; ++l) {
    for (int32_t b : {l, w.num_layers + l}) {
      for (size_t i = 0; i < w.src_pages.size(); ++i) {
        for (const PageUnit& u : units) {
          std::memcpy(dst_page(b, w.dst_pages[i]) + u.dst_offset,
                      src_page(b, w.src_pages[i]) + u.src_offset, u.bytes);
        }
      }
    }
  }
}

// The same for pools held as one image each: buffer b starts at b * buffer_bytes, page p of it
// p * item further.
inline void ApplyPageWrite(const PageWrite& w, const std::vector<uint8_t>& src,
                           std::vector<uint8_t>& dst, uint64_t buffer_bytes, uint64_t item) {
  ApplyPageWrite(
      w, item, [&](int32_t b, int32_t page) { return src.data() + b * buffer_bytes + page * item; },
      [&](int32_t b, int32_t page) { return dst.data() + b * buffer_bytes + page * item; });
}

// "" when the pool images are equal, else how many bytes differ and where the first is.
inline std::string DescribeMismatch(const std::vector<uint8_t>& want,
                                    const std::vector<uint8_t>& got, uint64_t buffer_bytes,
                                    uint64_t item) {
  if (want.size() != got.size()) {
    return "sizes differ: " + std::to_string(want.size()) + " vs " + std::to_string(got.size());
  }
  const auto [w, g] = std::mismatch(want.begin(), want.end(), got.begin());
  if (w == want.end()) return "";
  const uint64_t at = static_cast<uint64_t>(w - want.begin());
  const uint64_t buffer = at / buffer_bytes;
  const uint64_t page = at % buffer_bytes / item;
  const uint64_t count = static_cast<uint64_t>(std::count_if(
      want.begin(), want.end(), [&, i = size_t{0}](uint8_t v) mutable { return v != got[i++]; }));
  return std::to_string(count) + " bytes differ; first at buffer " + std::to_string(buffer) +
         " page " + std::to_string(page) + " byte " + std::to_string(at % buffer_bytes % item) +
         ": expected " + std::to_string(*w) + ", got " + std::to_string(*g);
}

// Polls Check until the write is no longer InProgress, or DeadlineExceeded after `bound`.
inline Status WaitFor(Backend& backend, WriteId id,
                      std::chrono::seconds bound = std::chrono::seconds(20),
                      std::chrono::microseconds poll = std::chrono::microseconds(50)) {
  const auto give_up = std::chrono::steady_clock::now() + bound;
  while (std::chrono::steady_clock::now() < give_up) {
    Status st = backend.Check(id);
    if (st.code() != StatusCode::kInProgress) return st;
    std::this_thread::sleep_for(poll);
  }
  return DeadlineExceeded("write did not finish in " + std::to_string(bound.count()) + " s");
}

// A layout of mixed structure, as a TransferLayout with a latent group and a draft model
// flattens: a target model's K/V (2 layers, 256-byte pages), a latent group (one buffer per
// layer, 2 layers, 96-byte pages) and a draft model's K/V (1 layer, 512-byte pages). Transfer
// layers 0..4, 4 + 2 + 2 = 8 buffers of layers 0 1 0 1 2 3 4 4, each `pages` pages, held back to
// back in one image per side.
struct MixedLayout {
  std::vector<int32_t> layers = {0, 1, 0, 1, 2, 3, 4, 4};
  std::vector<uint64_t> items = {256, 256, 256, 256, 96, 96, 512, 512};
  int32_t num_layers = 5;
  int64_t pages = 24;

  size_t buffers() const { return layers.size(); }
  uint64_t BufferBytes(size_t b) const { return static_cast<uint64_t>(pages) * items[b]; }
  uint64_t Offset(size_t b) const {
    uint64_t offset = 0;
    for (size_t i = 0; i < b; ++i) offset += BufferBytes(i);
    return offset;
  }
  uint64_t ImageBytes() const { return Offset(buffers()); }
  // The regions of an image at `base`, with their transfer layers.
  std::vector<LocalRegion> Regions(uint64_t base, MemoryKind kind = MemoryKind::kHost,
                                   int32_t device = -1) const {
    std::vector<LocalRegion> regions;
    for (size_t b = 0; b < buffers(); ++b) {
      regions.push_back(
          LocalRegion{base + Offset(b), BufferBytes(b), items[b], kind, device, layers[b]});
    }
    return regions;
  }
  // What the write must leave in `dst`, computed from the definition (every buffer whose layer
  // is in the range, whole pages of its own size), independently of any backend's tables.
  void Apply(const PageWrite& w, const std::vector<uint8_t>& src, std::vector<uint8_t>& dst) const {
    for (size_t b = 0; b < buffers(); ++b) {
      if (layers[b] < w.layer_begin || layers[b] >= w.layer_end) continue;
      for (size_t i = 0; i < w.src_pages.size(); ++i) {
        std::memcpy(dst.data() + Offset(b) + w.dst_pages[i] * items[b],
                    src.data() + Offset(b) + w.src_pages[i] * items[b], items[b]);
      }
    }
  }
  // "" when the images are equal, else how many bytes differ and where the first one is.
  std::string Mismatch(const std::vector<uint8_t>& want, const std::vector<uint8_t>& got) const {
    if (want.size() != got.size()) {
      return "sizes differ: " + std::to_string(want.size()) + " vs " + std::to_string(got.size());
    }
    size_t count = 0;
    std::string first;
    for (size_t i = 0; i < want.size(); ++i) {
      if (want[i] == got[i]) continue;
      if (count++ == 0) {
        size_t b = 0;
        while (b + 1 < buffers() && Offset(b + 1) <= i) ++b;
        const uint64_t in = i - Offset(b);
        first = "buffer " + std::to_string(b) + " (layer " + std::to_string(layers[b]) + ") page " +
                std::to_string(in / items[b]) + " byte " + std::to_string(in % items[b]) +
                ": expected " + std::to_string(want[i]) + ", got " + std::to_string(got[i]);
      }
    }
    if (count == 0) return "";
    return std::to_string(count) + " bytes differ; first at " + first;
  }
};

// Registers host buffers of `buffer_bytes` each (items of `item` bytes) on both sides — the
// sender's at src[b], the receiver's back to back from `dst` — and connects the sender to the
// receiver. Returns the sender's peer id.
inline StatusOr<PeerId> RegisterAndConnect(Backend& sender, Backend& receiver,
                                           const std::vector<const uint8_t*>& src, uint8_t* dst,
                                           uint64_t buffer_bytes, uint64_t item) {
  std::vector<LocalRegion> src_regions, dst_regions;
  for (size_t b = 0; b < src.size(); ++b) {
    src_regions.push_back(
        LocalRegion{reinterpret_cast<uint64_t>(src[b]), buffer_bytes, item, MemoryKind::kHost, -1});
    dst_regions.push_back(LocalRegion{reinterpret_cast<uint64_t>(dst + b * buffer_bytes),
                                      buffer_bytes, item, MemoryKind::kHost, -1});
  }
  KVT_RETURN_IF_ERROR(sender.Register(src_regions).status());
  KVT_ASSIGN_OR_RETURN(PeerDescriptor descriptor, receiver.Register(dst_regions));
  return sender.Connect(descriptor);
}

// Test names for a suite parameterized by UCX transports ("" = UCX's choice): "default",
// "shm_self", "tcp".
inline std::string TransportsTestName(const ::testing::TestParamInfo<std::string>& info) {
  if (info.param.empty()) return std::string("default");
  std::string name = info.param;
  for (char& c : name) {
    if (c == ',' || c == '+') c = '_';
  }
  return name;
}

}  // namespace kvt::transfer::testing

// Engines over CUDA memory the caller owns: every buffer of a layout carved out of ONE large
// cudaMalloc per side (as a framework's caching allocator hands out pieces of big blocks), with
// a draft model of other page bytes or MLA-style latent buffers, moved over the device backends
// (cuda_ipc; ucx staged through host bounce buffers) and checked byte by byte over the whole
// allocation, gaps included. Skips without a CUDA device.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvt/testing/gpu.h"
#include "kvt/transfer/engine.h"
#include "kvt/transfer/layout.h"
#include "layout_test_util.h"

namespace kvt::transfer {
namespace {

using namespace std::chrono_literals;
using testing::GroupSpec;
using testing::PatternByte;



// One cudaMalloc holding every buffer of the layout at 256-byte aligned offsets with gaps.
class CarvedMemory {
 public:
  CarvedMemory(const std::vector<GroupSpec>& groups, uint32_t page_size, uint64_t pages) {
    layout.page_size = page_size;
    layout.device = 0;
    uint64_t offset = 768;  // not the allocation's base
    std::vector<std::pair<uint64_t, uint64_t>> spans;  // offset, bytes
    for (const GroupSpec& g : groups) {
      KvGroup group{g.shape, g.layers, g.heads, g.head_dim, DType::kBF16, {}};
      const uint64_t item = uint64_t{page_size} * g.heads * g.head_dim * 2;
      const uint32_t n = g.layers * (g.shape == KvShape::kKeyValue ? 2 : 1);
      for (uint32_t i = 0; i < n; ++i) {
        spans.emplace_back(offset, item * pages);
        offset += item * pages + 256 * (1 + i % 3);  // gaps of 256..768 bytes
        group.buffers.push_back(BufferInfo{0, item * pages, item});
      }
      layout.groups.push_back(std::move(group));
    }
    bytes_ = offset + 512;
    EXPECT_EQ(cudaMalloc(&base_, bytes_), cudaSuccess);
    EXPECT_EQ(cudaMemset(base_, 0, bytes_), cudaSuccess);
    size_t k = 0;
    for (KvGroup& group : layout.groups) {
      for (BufferInfo& b : group.buffers) b.ptr = reinterpret_cast<uint64_t>(base_) + spans[k++].first;
    }
  }
  ~CarvedMemory() {
    if (base_ != nullptr) cudaFree(base_);
  }
  CarvedMemory(const CarvedMemory&) = delete;
  CarvedMemory& operator=(const CarvedMemory&) = delete;

  // The expected bytes of the whole allocation once `pages` (by position) hold request `seed`.
  void Expect(std::vector<uint8_t>& image, uint64_t seed, const std::vector<int32_t>& pages) const {
    const auto flat = layout.Flatten();
    for (size_t b = 0; b < flat.size(); ++b) {
      const uint64_t item = flat[b].info.item_len;
      const uint64_t at = flat[b].info.ptr - reinterpret_cast<uint64_t>(base_);
      for (size_t i = 0; i < pages.size(); ++i) {
        for (uint64_t k = 0; k < item; ++k) {
          image[at + pages[i] * item + k] = PatternByte(seed, b, i, k);
        }
      }
    }
  }
  // Writes request `seed` into `pages` of the buffers of layers [first, last).
  void Fill(uint64_t seed, const std::vector<int32_t>& pages, int32_t first, int32_t last) {
    const auto flat = layout.Flatten();
    for (size_t b = 0; b < flat.size(); ++b) {
      if (flat[b].layer < first || flat[b].layer >= last) continue;
      const uint64_t item = flat[b].info.item_len;
      std::vector<uint8_t> page(item);
      for (size_t i = 0; i < pages.size(); ++i) {
        for (uint64_t k = 0; k < item; ++k) page[k] = PatternByte(seed, b, i, k);
        ASSERT_EQ(cudaMemcpy(reinterpret_cast<void*>(flat[b].info.ptr + pages[i] * item),
                             page.data(), item, cudaMemcpyHostToDevice),
                  cudaSuccess);
      }
    }
  }
  std::vector<uint8_t> Read() const {
    std::vector<uint8_t> out(bytes_);
    EXPECT_EQ(cudaMemcpy(out.data(), base_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  size_t bytes() const { return bytes_; }

  TransferLayout layout;

 private:
  void* base_ = nullptr;
  size_t bytes_ = 0;
};

class EngineLayoutGpuTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { KVT_SKIP_WITHOUT_GPU(); }

  void Start(const TransferLayout& src, const TransferLayout& dst) {
    EngineOptions p;
    p.name = "prefill-gpu";
    if (GetParam() == "ucx_staged") {
      p.backend = UcxOptions{.cuda_mode = UcxCudaMode::kStaged};
    } else {
      p.backend = *DefaultBackendConfig(GetParam());
    }
    p.default_deadline = 20s;
    auto prefill = TransferEngine::Create(p, src);
    ASSERT_TRUE(prefill.ok()) << prefill.status();
    prefill_ = std::move(prefill).value();
    EngineOptions d = p;
    d.name = "decode-gpu";
    d.prefill = false;
    auto decode = TransferEngine::Create(d, dst);
    ASSERT_TRUE(decode.ok()) << decode.status();
    decode_ = std::move(decode).value();
    auto peer = decode_->ConnectPeer("127.0.0.1", prefill_->port());
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
  }
  void TearDown() override {
    decode_.reset();
    prefill_.reset();
  }

  // Random requests, layer by layer; the whole decode allocation is compared after each.
  void MoveRandomRequests(CarvedMemory& src, CarvedMemory& dst, int requests) {
    std::mt19937 rng(3);
    const int32_t pages = static_cast<int32_t>(src.layout.num_pages());
    std::vector<int32_t> all(pages - 1);
    std::iota(all.begin(), all.end(), 1);
    std::vector<uint8_t> expected(dst.bytes(), 0);
    const int32_t layers = src.layout.num_layers();
    for (int r = 0; r < requests; ++r) {
      const size_t n = 1 + rng() % 9;
      std::shuffle(all.begin(), all.end(), rng);
      std::vector<int32_t> s(all.begin(), all.begin() + n);
      std::shuffle(all.begin(), all.end(), rng);
      std::vector<int32_t> d(all.begin(), all.begin() + n);
      std::string room = "r";  // appended: GCC 12 warns falsely (-Wrestrict) on "r" + ...
      room += std::to_string(r);
      ASSERT_TRUE(decode_->Receive(room, peer_, d).ok());
      ASSERT_TRUE(prefill_->Send(room, s).ok());
      for (int32_t l = 0; l < layers; ++l) {
        src.Fill(100 + r, s, l, l + 1);
        ASSERT_TRUE(prefill_->LayersReady(room, l + 1).ok());
      }
      auto info = decode_->WaitRequest(room, 20s);
      ASSERT_TRUE(info.ok()) << info.status();
      ASSERT_EQ(info->state, RequestState::kSuccess) << room << ": " << info->status;
      dst.Expect(expected, 100 + r, d);
      const std::vector<uint8_t> got = dst.Read();
      size_t bad = 0, first_bad = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        if (got[i] != expected[i] && bad++ == 0) first_bad = i;
      }
      ASSERT_EQ(bad, 0u) << room << ": first differing byte at offset " << first_bad
                         << " of the allocation";
    }
  }

  std::unique_ptr<TransferEngine> prefill_, decode_;
  PeerHandle peer_ = 0;
};

TEST_P(EngineLayoutGpuTest, SubAllocatedTargetAndDraftBuffersMoveByteExact) {
  const std::vector<GroupSpec> groups = {{KvShape::kKeyValue, 3, 4, 64},
                                         {KvShape::kKeyValue, 1, 2, 32}};
  CarvedMemory src(groups, 16, 48), dst(groups, 16, 48);
  Start(src.layout, dst.layout);
  MoveRandomRequests(src, dst, 12);
}

TEST_P(EngineLayoutGpuTest, SubAllocatedLatentBuffersMoveByteExact) {
  const std::vector<GroupSpec> groups = {{KvShape::kLatent, 4, 1, 576}};
  CarvedMemory src(groups, 16, 40), dst(groups, 16, 40);
  Start(src.layout, dst.layout);
  MoveRandomRequests(src, dst, 10);
}

INSTANTIATE_TEST_SUITE_P(DeviceBackends, EngineLayoutGpuTest,
                         ::testing::Values("cuda_ipc", "ucx_staged"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace kvt::transfer

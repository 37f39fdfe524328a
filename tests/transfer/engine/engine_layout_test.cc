// Engines over memory the caller owns, described by TransferLayout: layouts from buffer infos,
// their validation, draft and latent groups, aux slots and chunked prefill, end to end over the
// real control plane on loopback, parameterized over the host backends.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>

#include "engine_test_util.h"
#include "kvt/transfer/engine.h"
#include "kvt/transfer/layout.h"
#include "layout_test_util.h"

namespace kvt::transfer {
namespace {

using namespace std::chrono_literals;
using testing::GroupSpec;
using testing::PatternByte;
using ::testing::HasSubstr;

// Host memory from malloc or from an anonymous mmap, freed at the end of the test.
class HostBlock {
 public:
  enum class Source { kMalloc, kMmap };
  HostBlock(size_t bytes, Source source, uint8_t fill = 0) : bytes_(bytes), source_(source) {
    if (source == Source::kMalloc) {
      ptr_ = std::malloc(bytes);
    } else {
      ptr_ = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (ptr_ == MAP_FAILED) ptr_ = nullptr;
    }
    if (ptr_ != nullptr) std::memset(ptr_, fill, bytes);
  }
  ~HostBlock() {
    if (ptr_ == nullptr) return;
    if (source_ == Source::kMalloc) {
      std::free(ptr_);
    } else {
      munmap(ptr_, bytes_);
    }
  }
  HostBlock(const HostBlock&) = delete;
  HostBlock& operator=(const HostBlock&) = delete;
  uint8_t* data() const { return static_cast<uint8_t*>(ptr_); }
  uint64_t addr() const { return reinterpret_cast<uint64_t>(ptr_); }
  size_t size() const { return bytes_; }

 private:
  size_t bytes_;
  Source source_;
  void* ptr_ = nullptr;
};


// An engine's memory: one block per buffer (so buffers never overlap), the layout over them.
class EngineMemory {
 public:
  EngineMemory(const std::vector<GroupSpec>& groups, uint32_t page_size, uint64_t pages,
               std::vector<uint64_t> aux_slot_bytes = {}, uint64_t aux_slots = 8,
               HostBlock::Source source = HostBlock::Source::kMalloc, uint8_t fill = 0) {
    layout.page_size = page_size;
    for (const GroupSpec& g : groups) {
      KvGroup group;
      group.shape = g.shape;
      group.num_layers = g.layers;
      group.head_num = g.heads;
      group.head_dim = g.head_dim;
      group.dtype = DType::kBF16;
      const uint64_t item = uint64_t{page_size} * g.heads * g.head_dim * 2;
      const uint32_t n = g.layers * (g.shape == KvShape::kKeyValue ? 2 : 1);
      for (uint32_t i = 0; i < n; ++i) {
        blocks.push_back(std::make_unique<HostBlock>(item * pages, source, fill));
        group.buffers.push_back(BufferInfo{blocks.back()->addr(), item * pages, item});
      }
      layout.groups.push_back(std::move(group));
    }
    for (uint64_t bytes : aux_slot_bytes) {
      aux_blocks.push_back(std::make_unique<HostBlock>(bytes * aux_slots, source, fill));
      layout.aux.push_back(BufferInfo{aux_blocks.back()->addr(), bytes * aux_slots, bytes});
    }
  }

  // Buffer i of the flattened layout.
  std::vector<TransferLayout::FlatBuffer> Flat() const { return layout.Flatten(); }

  TransferLayout layout;
  std::vector<std::unique_ptr<HostBlock>> blocks;
  std::vector<std::unique_ptr<HostBlock>> aux_blocks;
};


// Writes the pattern of request `seed` into `pages` of the buffers of layers [first, last).
void FillPages(const EngineMemory& m, uint64_t seed, const std::vector<int32_t>& pages,
               size_t position0 = 0, int32_t first = 0, int32_t last = 1 << 30) {
  const auto flat = m.Flat();
  for (size_t b = 0; b < flat.size(); ++b) {
    if (flat[b].layer < first || flat[b].layer >= last) continue;
    const uint64_t item = flat[b].info.item_len;
    for (size_t i = 0; i < pages.size(); ++i) {
      uint8_t* page = reinterpret_cast<uint8_t*>(flat[b].info.ptr + pages[i] * item);
      for (uint64_t k = 0; k < item; ++k) page[k] = PatternByte(seed, b, position0 + i, k);
    }
  }
}

// Bytes of `pages` that differ from request `seed`'s pattern.
uint64_t PageMismatches(const EngineMemory& m, uint64_t seed, const std::vector<int32_t>& pages,
                        int32_t first = 0, int32_t last = 1 << 30) {
  const auto flat = m.Flat();
  uint64_t bad = 0;
  for (size_t b = 0; b < flat.size(); ++b) {
    if (flat[b].layer < first || flat[b].layer >= last) continue;
    const uint64_t item = flat[b].info.item_len;
    for (size_t i = 0; i < pages.size(); ++i) {
      const uint8_t* page = reinterpret_cast<const uint8_t*>(flat[b].info.ptr + pages[i] * item);
      for (uint64_t k = 0; k < item; ++k) bad += page[k] != PatternByte(seed, b, i, k);
    }
  }
  return bad;
}

// Bytes of pages other than `pages` that are not `fill` (nothing else was written).
uint64_t OtherPagesTouched(const EngineMemory& m, const std::vector<int32_t>& pages,
                           uint8_t fill = 0) {
  const auto flat = m.Flat();
  uint64_t bad = 0;
  for (const auto& f : flat) {
    const uint64_t n = f.info.length / f.info.item_len;
    for (uint64_t p = 0; p < n; ++p) {
      if (std::find(pages.begin(), pages.end(), static_cast<int32_t>(p)) != pages.end()) continue;
      const uint8_t* page = reinterpret_cast<const uint8_t*>(f.info.ptr + p * f.info.item_len);
      for (uint64_t k = 0; k < f.info.item_len; ++k) bad += page[k] != fill;
    }
  }
  return bad;
}

BackendConfig BackendFor(const std::string& param) {
  if (param == "ucx") return UcxOptions{};
  LoopbackOptions loopback;
  loopback.page_writes = param == "loopback_pages";
  return loopback;
}

class EngineLayoutTest : public ::testing::TestWithParam<std::string> {
 protected:
  void Start(const TransferLayout& prefill_layout, const TransferLayout& decode_layout) {
    EngineOptions p;
    p.name = "prefill-0";
    p.prefill = true;
    p.backend = BackendFor(GetParam());
    p.default_deadline = 10s;
    auto prefill = TransferEngine::Create(p, prefill_layout);
    ASSERT_TRUE(prefill.ok()) << prefill.status();
    prefill_ = std::move(prefill).value();
    EngineOptions d = p;
    d.name = "decode-0";
    d.prefill = false;
    auto decode = TransferEngine::Create(d, decode_layout);
    ASSERT_TRUE(decode.ok()) << decode.status();
    decode_ = std::move(decode).value();
    auto peer = decode_->ConnectPeer("127.0.0.1", prefill_->port());
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
  }

  // Sends `pages` of the prefill memory to `dst` of the decode memory in one request, all layers
  // ready at once, and waits for the decode side.
  RequestInfo Move(const std::string& room, const std::vector<int32_t>& src,
                   const std::vector<int32_t>& dst, int64_t src_aux = -1, int64_t dst_aux = -1) {
    ReceiveOptions r;
    r.aux_slot = dst_aux;
    EXPECT_TRUE(decode_->Receive(room, peer_, dst, r).ok());
    SendOptions s;
    s.aux_slot = src_aux;
    EXPECT_TRUE(prefill_->Send(room, src, s).ok());
    EXPECT_TRUE(prefill_->LayersReady(room, prefill_->layout().num_layers()).ok());
    auto info = decode_->WaitRequest(room, 10s);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? *info : RequestInfo{};
  }

  std::unique_ptr<TransferEngine> prefill_;
  std::unique_ptr<TransferEngine> decode_;
  PeerHandle peer_ = 0;
};

// ------------------------------------------------------------------------- layout building --
TEST(TransferLayoutTest, FromBufInfosEqualsThePoolsOwnLayout) {
  auto pool = testing::MakePool(testing::SmallPoolOptions(3, 16, 8));
  ASSERT_TRUE(pool);
  auto from_pool = TransferLayout::FromPool(*pool);
  ASSERT_TRUE(from_pool.ok()) << from_pool.status();
  auto infos = pool->GetContiguousBufInfos();
  ASSERT_TRUE(infos.ok());
  TransferLayout::BufInfoOptions o;
  o.page_size = 16;
  o.dtype = DType::kBF16;
  o.head_num = 2;
  o.head_dim = 64;
  const std::vector<int64_t> unit_lens(infos->data_ptrs.size(), 64 * 2);
  o.unit_lens = unit_lens;
  auto from_infos =
      TransferLayout::FromBufInfos(infos->data_ptrs, infos->data_lens, infos->item_lens, o);
  ASSERT_TRUE(from_infos.ok()) << from_infos.status();
  EXPECT_EQ(from_infos->Describe(), from_pool->Describe());
  ASSERT_EQ(from_infos->num_buffers(), from_pool->num_buffers());
  const auto a = from_infos->Flatten();
  const auto b = from_pool->Flatten();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].info.ptr, b[i].info.ptr) << i;
    EXPECT_EQ(a[i].info.length, b[i].info.length) << i;
    EXPECT_EQ(a[i].info.item_len, b[i].info.item_len) << i;
    EXPECT_EQ(a[i].layer, b[i].layer) << i;
  }
  EXPECT_EQ(from_infos->num_layers(), 3);
  EXPECT_EQ(from_infos->num_pages(), from_pool->num_pages());
}

TEST(TransferLayoutTest, DraftBuffersFollowTheTargetsAndCountAsLaterLayers) {
  EngineMemory target({{KvShape::kKeyValue, 3, 2, 16}}, 4, 4);
  EngineMemory draft({{KvShape::kKeyValue, 1, 4, 32}}, 4, 4);
  std::vector<uint64_t> ptrs;
  std::vector<int64_t> lens, items;
  for (const auto* m : {&target, &draft}) {
    for (const auto& f : m->Flat()) {
      ptrs.push_back(f.info.ptr);
      lens.push_back(static_cast<int64_t>(f.info.length));
      items.push_back(static_cast<int64_t>(f.info.item_len));
    }
  }
  TransferLayout::BufInfoOptions o;
  o.page_size = 4;
  o.head_num = 2;
  o.head_dim = 16;
  o.target_buffers = 6;  // start_idx of the draft model's buffers
  o.draft_head_num = 4;
  o.draft_head_dim = 32;
  auto layout = TransferLayout::FromBufInfos(ptrs, lens, items, o);
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_EQ(layout->groups.size(), 2u);
  EXPECT_EQ(layout->num_layers(), 4);
  const auto flat = layout->Flatten();
  ASSERT_EQ(flat.size(), 8u);
  const std::vector<int32_t> layers = {0, 1, 2, 0, 1, 2, 3, 3};
  for (size_t i = 0; i < flat.size(); ++i) EXPECT_EQ(flat[i].layer, layers[i]) << i;
  EXPECT_EQ(layout->page_bytes(1), 4u * 4 * 32 * 2);
}

// Every validation error names the buffer and the value.
TEST(TransferLayoutTest, ValidationNamesTheBadBufferAndValue) {
  auto expect_error = [](const TransferLayout& layout, const std::string& needle) {
    Status st = layout.Validate();
    EXPECT_FALSE(st.ok()) << "expected an error with '" << needle << "'";
    EXPECT_THAT(st.message(), HasSubstr(needle));
  };
  {
    EngineMemory m({{}}, 4, 4);
    m.layout.groups[0].buffers[1].length -= 8;
    expect_error(m.layout, "buffer 1 (group 0, K of layer 1) is 1016 bytes, not a multiple of its "
                           "item_len 256");
  }
  {
    EngineMemory m({{}}, 4, 4);
    m.layout.groups[0].buffers[2].ptr = m.layout.groups[0].buffers[0].ptr + 128;
    expect_error(m.layout, "overlap");
  }
  {
    EngineMemory m({{}}, 4, 4);
    // Memory this process does not have: mapped, then unmapped.
    void* hole = mmap(nullptr, 1 << 16, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(hole, MAP_FAILED);
    munmap(hole, 1 << 16);
    m.layout.groups[0].buffers[3].ptr = reinterpret_cast<uint64_t>(hole);
    expect_error(m.layout, "buffer 3 (group 0, V of layer 1) [");
    expect_error(m.layout, "is not mapped host memory of this process");
  }
  {
    EngineMemory m({{}}, 4, 4);
    m.layout.device = 0;  // host memory claimed to be CUDA memory
    expect_error(m.layout, "but the layout says CUDA memory of device 0");
  }
  {
    EngineMemory m({{}}, 4, 4);
    m.layout.groups[0].head_dim = 24;  // 48-byte units do not divide 128-byte pages
    expect_error(m.layout, "unit bytes 48 (head_dim 24 x 2 bytes of bf16) do not divide its "
                           "item_len 256");
  }
  {
    EngineMemory m({{}}, 4, 4);
    m.layout.groups[0].head_num = 1;
    expect_error(m.layout, "item_len 256 is not page_size 4 x head_num 1 x unit bytes 32 = 128");
  }
  {
    EngineMemory m({{}}, 4, 4);
    m.layout.groups[0].buffers.pop_back();
    expect_error(m.layout, "group 0 (target) lists 3 buffers; a key_value group of 2 layers has 4");
  }
  {
    EngineMemory m({{}}, 4, 4);
    m.layout.tp_rank = 2;
    m.layout.tp_size = 2;
    expect_error(m.layout, "tp_rank 2 must be below tp_size 2");
  }
  {
    EngineMemory m({{}}, 4, 4);
    m.layout.page_size = 0;
    expect_error(m.layout, "page_size 0");
  }
  {
    EngineMemory m({{}}, 4, 4, {uint64_t{5} << 20, uint64_t{4} << 20}, 1);
    expect_error(m.layout, "one request's aux slots are 9437184 bytes together");
  }
  {
    EngineMemory m({{}}, 4, 4, {64}, 4);
    m.layout.aux[0].length = 100;
    expect_error(m.layout, "aux buffer 0 is 100 bytes, not a multiple of its item_len 64");
  }
  {
    EngineMemory m({{}}, 4, 1);  // only the dummy page
    expect_error(m.layout, "holds 1 page(s)");
  }
  // From buffer infos: lists that disagree, an odd K/V count, wrong unit lengths.
  {
    EngineMemory m({{}}, 4, 4);
    std::vector<uint64_t> ptrs;
    std::vector<int64_t> lens, items;
    for (const auto& f : m.Flat()) {
      ptrs.push_back(f.info.ptr);
      lens.push_back(static_cast<int64_t>(f.info.length));
      items.push_back(static_cast<int64_t>(f.info.item_len));
    }
    TransferLayout::BufInfoOptions o;
    o.page_size = 4;
    o.head_num = 2;
    o.head_dim = 16;
    auto short_lens = std::vector<int64_t>(lens.begin(), lens.end() - 1);
    auto bad = TransferLayout::FromBufInfos(ptrs, short_lens, items, o);
    ASSERT_FALSE(bad.ok());
    EXPECT_THAT(bad.status().message(), HasSubstr("4 pointers, 3 lengths, 4 item lengths"));
    o.target_buffers = 3;
    bad = TransferLayout::FromBufInfos(ptrs, lens, items, o);
    ASSERT_FALSE(bad.ok());
    EXPECT_THAT(bad.status().message(), HasSubstr("buffers [0, 3) are 3, an odd count"));
    o.target_buffers = 0;
    const std::vector<int64_t> units = {32, 32, 64, 32};
    o.unit_lens = units;
    bad = TransferLayout::FromBufInfos(ptrs, lens, items, o);
    ASSERT_FALSE(bad.ok());
    EXPECT_THAT(bad.status().message(),
                HasSubstr("buffer 2: unit length 64 differs from head_dim 16 x 2 bytes of bf16"));
  }
}

// Registration neither zeroes nor writes the caller's memory.
TEST(TransferLayoutTest, RegistrationLeavesTheCallersBytesAlone) {
  EngineMemory m({{}}, 4, 6, {32}, 4, HostBlock::Source::kMmap, 0xA5);
  EngineOptions o;
  o.prefill = false;
  o.backend = UcxOptions{};
  auto engine = TransferEngine::Create(o, m.layout);
  ASSERT_TRUE(engine.ok()) << engine.status();
  for (const auto& block : m.blocks) {
    for (size_t i = 0; i < block->size(); ++i) ASSERT_EQ(block->data()[i], 0xA5) << i;
  }
  for (size_t i = 0; i < m.aux_blocks[0]->size(); ++i) {
    ASSERT_EQ(m.aux_blocks[0]->data()[i], 0xA5);
  }
}

// ---------------------------------------------------------------------------- end to end ----
TEST_P(EngineLayoutTest, MallocAndMmapMemoryMoveByteExact) {
  EngineMemory src({{KvShape::kKeyValue, 3, 2, 16}}, 4, 16, {}, 0, HostBlock::Source::kMalloc);
  EngineMemory dst({{KvShape::kKeyValue, 3, 2, 16}}, 4, 16, {}, 0, HostBlock::Source::kMmap);
  Start(src.layout, dst.layout);
  const std::vector<int32_t> s = {3, 4, 9, 1, 15};
  const std::vector<int32_t> d = {7, 8, 2, 11, 5};
  FillPages(src, 11, s);
  RequestInfo info = Move("r", s, d);
  EXPECT_EQ(info.state, RequestState::kSuccess) << info.status;
  EXPECT_EQ(PageMismatches(dst, 11, d), 0u);
  EXPECT_EQ(OtherPagesTouched(dst, d), 0u);
}

TEST_P(EngineLayoutTest, DraftModelBuffersMoveWithTheRequest) {
  // A target of 2 layers and a draft model of 1 layer with other heads (other page bytes).
  const std::vector<GroupSpec> groups = {{KvShape::kKeyValue, 2, 2, 16},
                                         {KvShape::kKeyValue, 1, 4, 8}};
  EngineMemory src(groups, 4, 12);
  EngineMemory dst(groups, 4, 12);
  Start(src.layout, dst.layout);
  ASSERT_EQ(prefill_->layout().num_layers(), 3);
  const std::vector<int32_t> s = {1, 2, 3, 10};
  const std::vector<int32_t> d = {4, 5, 6, 11};
  FillPages(src, 5, s);
  RequestInfo info = Move("draft", s, d);
  EXPECT_EQ(info.state, RequestState::kSuccess) << info.status;
  EXPECT_EQ(PageMismatches(dst, 5, d), 0u);
  EXPECT_EQ(OtherPagesTouched(dst, d), 0u);
  // Only the draft model's layer.
  FillPages(src, 6, s);
  ReceiveOptions r;
  r.layer_begin = 2;
  ASSERT_TRUE(decode_->Receive("draft-only", peer_, {7, 8, 9, 1}, r).ok());
  ASSERT_TRUE(prefill_->Send("draft-only", s).ok());
  ASSERT_TRUE(prefill_->LayersReady("draft-only", 3).ok());
  auto only = decode_->WaitRequest("draft-only", 10s);
  ASSERT_TRUE(only.ok());
  EXPECT_EQ(only->state, RequestState::kSuccess) << only->status;
  EXPECT_EQ(PageMismatches(dst, 6, {7, 8, 9, 1}, 2, 3), 0u);
  EXPECT_EQ(only->bytes, 4u * (4 * 4 * 8 * 2) * 2);  // pages x page bytes x K and V
}

TEST_P(EngineLayoutTest, LatentLayoutMoves) {
  // MLA-style: one latent buffer per layer (576 elements of one "head"), plus a K/V draft.
  const std::vector<GroupSpec> groups = {{KvShape::kLatent, 3, 1, 576},
                                         {KvShape::kKeyValue, 1, 1, 64}};
  EngineMemory src(groups, 2, 10);
  EngineMemory dst(groups, 2, 10);
  Start(src.layout, dst.layout);
  const std::vector<int32_t> s = {2, 3, 4};
  const std::vector<int32_t> d = {9, 1, 2};
  FillPages(src, 8, s);
  RequestInfo info = Move("mla", s, d);
  EXPECT_EQ(info.state, RequestState::kSuccess) << info.status;
  EXPECT_EQ(PageMismatches(dst, 8, d), 0u);
  EXPECT_EQ(OtherPagesTouched(dst, d), 0u);
}

TEST_P(EngineLayoutTest, AuxBytesArriveBeforeDone) {
  EngineMemory src({{}}, 4, 8, {16, 40}, 4);
  EngineMemory dst({{}}, 4, 8, {16, 40}, 6);
  Start(src.layout, dst.layout);
  // Slot 2 of the prefill side, slot 5 of the decode side.
  for (size_t b = 0; b < 2; ++b) {
    uint8_t* slot = src.aux_blocks[b]->data() + 2 * src.layout.aux[b].item_len;
    for (uint64_t k = 0; k < src.layout.aux[b].item_len; ++k) slot[k] = PatternByte(99, b, 0, k);
  }
  const std::vector<int32_t> pages = {1, 2};
  FillPages(src, 1, pages);
  // The bytes are in place by the time the room is Success (WaitRequest returns then).
  RequestInfo info = Move("aux", pages, {3, 4}, 2, 5);
  ASSERT_EQ(info.state, RequestState::kSuccess) << info.status;
  for (size_t b = 0; b < 2; ++b) {
    const uint64_t item = dst.layout.aux[b].item_len;
    for (uint64_t s = 0; s < 6; ++s) {
      const uint8_t* slot = dst.aux_blocks[b]->data() + s * item;
      for (uint64_t k = 0; k < item; ++k) {
        ASSERT_EQ(slot[k], s == 5 ? PatternByte(99, b, 0, k) : 0) << b << " " << s << " " << k;
      }
    }
  }
  EXPECT_EQ(PageMismatches(dst, 1, {3, 4}), 0u);

  // Asked for aux the prefill side did not name: the room fails with the reason, others go on.
  ReceiveOptions r;
  r.aux_slot = 1;
  ASSERT_TRUE(decode_->Receive("no-aux", peer_, {5}, r).ok());
  ASSERT_TRUE(prefill_->Send("no-aux", {3}).ok());
  ASSERT_TRUE(prefill_->LayersReady("no-aux", 2).ok());
  auto failed = decode_->WaitRequest("no-aux", 10s);
  ASSERT_TRUE(failed.ok());
  EXPECT_EQ(failed->state, RequestState::kFailed);
  EXPECT_THAT(failed->status.message(), HasSubstr("Send named no aux slot"));
  // Bad slots are refused at the call.
  r.aux_slot = 6;
  Status st = decode_->Receive("bad-slot", peer_, {5}, r);
  EXPECT_EQ(st.code(), StatusCode::kOutOfRange);
  EXPECT_THAT(st.message(), HasSubstr("aux slot 6 is outside [0, 6)"));
  SendOptions so;
  so.aux_slot = 4;
  st = prefill_->Send("bad-slot", {1}, so);
  EXPECT_THAT(st.message(), HasSubstr("aux slot 4 is outside [0, 4)"));
  RequestInfo after = Move("after", {6}, {7});
  EXPECT_EQ(after.state, RequestState::kSuccess) << after.status;
}

// A decode side that asks for fewer layers than the forward pass writes (layer 0 of 2) gets its
// pages once that layer is ready, but the aux bytes (made at the end of the forward) only once
// the producer has declared every layer: never the slot's bytes from before.
TEST_P(EngineLayoutTest, AuxBytesWaitForTheWholeForwardWhenFewerLayersAreAsked) {
  EngineMemory src({{}}, 4, 8, {16}, 4);
  EngineMemory dst({{}}, 4, 8, {16}, 4);
  Start(src.layout, dst.layout);
  const std::vector<int32_t> pages = {1, 2};
  FillPages(src, 3, pages);
  ReceiveOptions r;
  r.layer_end = 1;
  r.aux_slot = 3;
  ASSERT_TRUE(decode_->Receive("early-end", peer_, {5, 6}, r).ok());
  SendOptions s;
  s.aux_slot = 1;
  ASSERT_TRUE(prefill_->Send("early-end", pages, s).ok());
  ASSERT_TRUE(prefill_->LayersReady("early-end", 1).ok());
  std::this_thread::sleep_for(200ms);  // the layer's write has long landed
  auto waiting = decode_->GetRequest("early-end");
  ASSERT_TRUE(waiting.ok()) << waiting.status();
  EXPECT_FALSE(IsFinal(waiting->state)) << "done before the aux bytes were written";
  // The end of the forward: the aux slot, then the last layer.
  uint8_t* slot = src.aux_blocks[0]->data() + 1 * src.layout.aux[0].item_len;
  for (uint64_t k = 0; k < src.layout.aux[0].item_len; ++k) slot[k] = PatternByte(7, 0, 0, k);
  ASSERT_TRUE(prefill_->LayersReady("early-end", 2).ok());
  auto info = decode_->WaitRequest("early-end", 10s);
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->state, RequestState::kSuccess) << info->status;
  const uint8_t* got = dst.aux_blocks[0]->data() + 3 * dst.layout.aux[0].item_len;
  for (uint64_t k = 0; k < dst.layout.aux[0].item_len; ++k) {
    ASSERT_EQ(got[k], PatternByte(7, 0, 0, k)) << k;
  }
  EXPECT_EQ(PageMismatches(dst, 3, {5, 6}, 0, 1), 0u);
  // Layer 1 was not asked for: its pages stay as they were (zero).
  for (const auto& f : dst.Flat()) {
    if (f.layer != 1) continue;
    for (int32_t p : {5, 6}) {
      const uint8_t* page = reinterpret_cast<const uint8_t*>(f.info.ptr + p * f.info.item_len);
      for (uint64_t k = 0; k < f.info.item_len; ++k) ASSERT_EQ(page[k], 0) << p << " " << k;
    }
  }
}

TEST_P(EngineLayoutTest, MismatchedLayoutsAreRefusedNamingBothSides) {
  EngineMemory src({{KvShape::kKeyValue, 2, 2, 16}, {KvShape::kKeyValue, 1, 2, 16}}, 4, 4, {16});
  EngineMemory dst({{KvShape::kKeyValue, 2, 2, 16}, {KvShape::kLatent, 1, 1, 64}}, 4, 4, {24});
  EngineOptions p;
  p.name = "prefill-0";
  p.backend = BackendFor(GetParam());
  auto prefill = TransferEngine::Create(p, src.layout);
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  EngineOptions d = p;
  d.name = "decode-0";
  d.prefill = false;
  auto decode = TransferEngine::Create(d, dst.layout);
  ASSERT_TRUE(decode.ok()) << decode.status();
  auto peer = (*decode)->ConnectPeer("127.0.0.1", (*prefill)->port());
  ASSERT_FALSE(peer.ok());
  EXPECT_EQ(peer.status().code(), StatusCode::kFailedPrecondition) << peer.status();
  EXPECT_THAT(peer.status().message(), HasSubstr("group 1 shape"));
  EXPECT_THAT(peer.status().message(), HasSubstr("key_value"));
  EXPECT_THAT(peer.status().message(), HasSubstr("latent"));
  EXPECT_THAT(peer.status().message(), HasSubstr("aux_slot_bytes"));
  EXPECT_THAT(peer.status().message(), HasSubstr("[16]"));
  EXPECT_THAT(peer.status().message(), HasSubstr("[24]"));
}

TEST_P(EngineLayoutTest, ChunkedPrefillMovesLayerByLayer) {
  EngineMemory src({{KvShape::kKeyValue, 3, 2, 16}}, 4, 20);
  EngineMemory dst({{KvShape::kKeyValue, 3, 2, 16}}, 4, 20);
  Start(src.layout, dst.layout);
  const std::vector<std::vector<int32_t>> chunks = {{1, 2, 3}, {7}, {10, 11}, {4, 19}};
  const std::vector<int32_t> d = {5, 6, 8, 9, 12, 13, 14, 15};
  // Two chunks before the decode side's request, two after.
  size_t position = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    if (c == 2) {
      ASSERT_TRUE(decode_->Receive("chunked", peer_, d).ok());
    }
    SendOptions so;
    so.last = c + 1 == chunks.size();
    ASSERT_TRUE(prefill_->Send("chunked", chunks[c], so).ok());
    for (int32_t layer = 0; layer < 3; ++layer) {
      FillPages(src, 21, chunks[c], position, layer, layer + 1);
      ASSERT_TRUE(prefill_->LayersReady("chunked", layer + 1).ok());
    }
    position += chunks[c].size();
    auto mid = decode_->GetRequest("chunked");
    if (c + 1 < chunks.size() && mid.ok()) {
      EXPECT_FALSE(IsFinal(mid->state)) << c;
    }
  }
  auto info = decode_->WaitRequest("chunked", 10s);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state, RequestState::kSuccess) << info->status;
  EXPECT_EQ(PageMismatches(dst, 21, d), 0u);
  EXPECT_EQ(OtherPagesTouched(dst, d), 0u);
  auto prefill_info = prefill_->GetRequest("chunked");
  ASSERT_TRUE(prefill_info.ok());
  EXPECT_EQ(prefill_info->layers_posted, 3);
}

TEST_P(EngineLayoutTest, ChunksAreCheckedAgainstTheDecodeRequest) {
  EngineMemory src({{}}, 4, 12);
  EngineMemory dst({{}}, 4, 12);
  Start(src.layout, dst.layout);
  ASSERT_TRUE(decode_->Receive("over", peer_, {1, 2, 3}).ok());
  SendOptions more;
  more.last = false;
  ASSERT_TRUE(prefill_->Send("over", {4, 5}, more).ok());
  // Next chunk before the previous one is ready.
  Status early = prefill_->Send("over", {6}, more);
  EXPECT_EQ(early.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(early.message(), HasSubstr("chunk 0 is ready up to layer 0 of 2"));
  ASSERT_TRUE(prefill_->LayersReady("over", 2).ok());
  // Once the prefill side knows the decode side's request (it travels on its own)...
  for (int i = 0; i < 1000; ++i) {
    auto seen = prefill_->GetRequest("over");
    ASSERT_TRUE(seen.ok());
    if (seen->request_seen != std::chrono::steady_clock::time_point()) break;
    std::this_thread::sleep_for(5ms);
  }
  // ...a chunk past the decode request's page count: refused naming both counts, nothing changes.
  Status past = prefill_->Send("over", {6, 7}, more);
  EXPECT_EQ(past.code(), StatusCode::kOutOfRange);
  EXPECT_THAT(past.message(), HasSubstr("would make 4 source pages, but the decode side asked "
                                        "for 3"));
  SendOptions last;
  ASSERT_TRUE(prefill_->Send("over", {6}, last).ok());
  ASSERT_TRUE(prefill_->LayersReady("over", 2).ok());
  auto info = decode_->WaitRequest("over", 10s);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state, RequestState::kSuccess) << info->status;

  // Chunks that came first and overrun the request fail the room, naming both counts.
  ASSERT_TRUE(prefill_->Send("early", {1, 2}, more).ok());
  ASSERT_TRUE(prefill_->LayersReady("early", 2).ok());
  ASSERT_TRUE(prefill_->Send("early", {3}, last).ok());
  ASSERT_TRUE(decode_->Receive("early", peer_, {4, 5}).ok());
  auto early_info = decode_->WaitRequest("early", 10s);
  ASSERT_TRUE(early_info.ok());
  EXPECT_EQ(early_info->state, RequestState::kFailed);
  EXPECT_THAT(early_info->status.message(),
              HasSubstr("the decode side asked for 2 pages but the prefill side has 3 in 2 "
                        "chunks"));
  // A last chunk that leaves pages short.
  ASSERT_TRUE(decode_->Receive("short", peer_, {4, 5, 6}).ok());
  ASSERT_TRUE(prefill_->Send("short", {1, 2}).ok());
  auto short_info = decode_->WaitRequest("short", 10s);
  ASSERT_TRUE(short_info.ok());
  EXPECT_EQ(short_info->state, RequestState::kFailed);
  EXPECT_THAT(short_info->status.message(),
              HasSubstr("asked for 3 pages but the prefill side has 2"));
}

// Chunks sent as "more follow" that turn out to hold every page: an empty last Send closes the
// room and its bytes arrive. An empty Send that opens a room or promises more is refused.
TEST_P(EngineLayoutTest, AnEmptyLastChunkClosesAChunkedRoom) {
  EngineMemory src({{}}, 4, 12);
  EngineMemory dst({{}}, 4, 12);
  Start(src.layout, dst.layout);
  SendOptions more;
  more.last = false;
  SendOptions last;
  Status empty = prefill_->Send("closed", {}, last);
  EXPECT_EQ(empty.code(), StatusCode::kInvalidArgument) << empty;
  EXPECT_THAT(empty.message(), HasSubstr("an empty Send may only close a chunked room"));
  empty = prefill_->Send("closed", {}, more);
  EXPECT_EQ(empty.code(), StatusCode::kInvalidArgument) << empty;
  EXPECT_THAT(empty.message(), HasSubstr("may only be the last chunk"));
  const std::vector<int32_t> s = {4, 5, 6}, d = {1, 2, 3};
  FillPages(src, 17, {4, 5}, 0);
  FillPages(src, 17, {6}, 2);
  ASSERT_TRUE(decode_->Receive("closed", peer_, d).ok());
  ASSERT_TRUE(prefill_->Send("closed", {4, 5}, more).ok());
  ASSERT_TRUE(prefill_->LayersReady("closed", 2).ok());
  ASSERT_TRUE(prefill_->Send("closed", {6}, more).ok());
  ASSERT_TRUE(prefill_->LayersReady("closed", 2).ok());
  std::this_thread::sleep_for(50ms);
  auto open = decode_->GetRequest("closed");
  ASSERT_TRUE(open.ok());
  EXPECT_FALSE(IsFinal(open->state)) << "done before the last chunk";
  ASSERT_TRUE(prefill_->Send("closed", {}, last).ok());
  auto info = decode_->WaitRequest("closed", 10s);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state, RequestState::kSuccess) << info->status;
  EXPECT_EQ(PageMismatches(dst, 17, d), 0u);
  // Closed: nothing more, empty or not.
  EXPECT_EQ(prefill_->Send("closed", {}, last).code(), StatusCode::kAlreadyExists);
}

TEST_P(EngineLayoutTest, ARoomAbortedBeforeItsRequestTellsTheDecodeSideWhy) {
  EngineMemory src({{}}, 4, 8);
  EngineMemory dst({{}}, 4, 8);
  Start(src.layout, dst.layout);
  ASSERT_TRUE(prefill_->Send("early-abort", {1, 2}).ok());
  ASSERT_TRUE(prefill_->Abort("early-abort", "the engine preempted it").ok());
  ASSERT_TRUE(decode_->Receive("early-abort", peer_, {3, 4}).ok());
  auto info = decode_->WaitRequest("early-abort", 10s);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state, RequestState::kFailed);
  EXPECT_EQ(info->status.code(), StatusCode::kAborted) << info->status;
  EXPECT_THAT(info->status.message(), HasSubstr("ended on the prefill side before this request "
                                                "arrived: the engine preempted it"));
  EXPECT_TRUE(info->pages_reusable);
}

TEST_P(EngineLayoutTest, RandomRequestsOverAMixedLayoutVerify) {
  const std::vector<GroupSpec> groups = {{KvShape::kKeyValue, 3, 2, 16},
                                         {KvShape::kKeyValue, 1, 1, 32}};
  EngineMemory src(groups, 4, 64, {24}, 16);
  EngineMemory dst(groups, 4, 64, {24}, 16);
  Start(src.layout, dst.layout);
  std::mt19937 rng(7);
  std::vector<int32_t> all(63);
  std::iota(all.begin(), all.end(), 1);
  for (int r = 0; r < 12; ++r) {
    std::shuffle(all.begin(), all.end(), rng);
    const size_t n = 1 + rng() % 12;
    std::vector<int32_t> s(all.begin(), all.begin() + n);
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int32_t> d(all.begin(), all.begin() + n);
    const uint64_t seed = 1000 + r;
    FillPages(src, seed, s);
    // Appended, not "r" + std::to_string(r): GCC 12 warns falsely (-Wrestrict) on that form.
    std::string room = "r";
    room += std::to_string(r);
    RequestInfo info = Move(room, s, d, r % 16, (r * 3) % 16);
    ASSERT_EQ(info.state, RequestState::kSuccess) << room << ": " << info.status;
    ASSERT_EQ(PageMismatches(dst, seed, d), 0u) << room;
  }
}

INSTANTIATE_TEST_SUITE_P(HostBackends, EngineLayoutTest,
                         ::testing::Values("loopback", "loopback_pages", "ucx"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace kvt::transfer

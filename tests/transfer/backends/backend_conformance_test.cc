// One conformance suite, run against every backend that can move host memory in-process.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "backend_test_util.h"
#include "kvt/transfer/backend.h"
#include "kvt/transfer/backends.h"

namespace kvt::transfer {
namespace {

using testing::WaitFor;

constexpr uint64_t kItem = 4096;
constexpr uint64_t kPages = 32;
constexpr int kBuffers = 4;

// A fake pool: kBuffers buffers of kPages pages each.
struct Buffers {
  explicit Buffers(uint8_t fill) {
    for (auto& b : data) b.assign(kItem * kPages, fill);
  }
  std::vector<LocalRegion> Regions() {
    std::vector<LocalRegion> regions;
    for (auto& b : data) {
      regions.push_back(LocalRegion{reinterpret_cast<uint64_t>(b.data()), b.size(), kItem,
                                    MemoryKind::kHost, -1});
    }
    return regions;
  }
  std::vector<std::vector<uint8_t>> data{kBuffers};
};

void Randomize(Buffers& buffers, uint32_t seed) {
  std::mt19937 rng(seed);
  for (auto& b : buffers.data) testing::FillRandom(b, rng);
}

class BackendConformance : public ::testing::TestWithParam<std::string> {
 protected:
  // "name", "name:transports" (UCX_TLS syntax for ucx) or "ucx+variant:transports", where the
  // variant picks the ucx host path: "put", "am" (active messages, eager), "am-rndv" (active
  // messages by rendezvous, cut into messages smaller than a page).
  std::string BackendName() const { return GetParam().substr(0, GetParam().find_first_of(":+")); }
  std::string Variant() const {
    const size_t plus = GetParam().find('+');
    if (plus == std::string::npos) return "";
    return GetParam().substr(plus + 1, GetParam().find(':') - plus - 1);
  }
  BackendConfig Config() const {
    StatusOr<BackendConfig> config = DefaultBackendConfig(BackendName());
    EXPECT_TRUE(config.ok()) << config.status();
    if (!config.ok()) return BackendConfig{};
    if (auto colon = GetParam().find(':'); colon != std::string::npos) {
      std::get<UcxOptions>(*config).transports = GetParam().substr(colon + 1);
    }
    if (!Variant().empty()) {
      UcxOptions& ucx = std::get<UcxOptions>(*config);
      ucx.host_path = Variant() == "put" ? UcxHostPath::kPut : UcxHostPath::kActiveMessages;
      if (Variant() == "am-rndv") {
        ucx.am_rendezvous = true;
        ucx.am_message_bytes = 6000;
      }
    }
    return *config;
  }

  void SetUp() override {
    auto a = CreateBackend(Config());
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = CreateBackend(Config());
    ASSERT_TRUE(b.ok()) << b.status();
    sender_ = std::move(a).value();
    receiver_ = std::move(b).value();
    Randomize(src_, 1);
    auto src_regions = src_.Regions();
    auto dst_regions = dst_.Regions();
    auto sd = sender_->Register(src_regions);
    ASSERT_TRUE(sd.ok()) << sd.status();
    auto rd = receiver_->Register(dst_regions);
    ASSERT_TRUE(rd.ok()) << rd.status();
    EXPECT_EQ(rd->backend, BackendName());
    ASSERT_EQ(rd->regions.size(), static_cast<size_t>(kBuffers));
    receiver_descriptor_ = *rd;
    auto peer = sender_->Connect(receiver_descriptor_);
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
  }

  void TearDown() override {
    sender_.reset();  // the writer goes first, as an agent that finishes before its peer
    receiver_.reset();
  }

  Buffers src_{0};
  Buffers dst_{0xEE};
  std::unique_ptr<Backend> sender_;
  std::unique_ptr<Backend> receiver_;
  PeerDescriptor receiver_descriptor_;
  PeerId peer_ = 0;
};

TEST_P(BackendConformance, ReportsNameAndHostCapability) {
  EXPECT_EQ(sender_->Name(), BackendName());
  EXPECT_TRUE(sender_->Capabilities().host_memory);
}

TEST_P(BackendConformance, WritesRandomRunsByteExact) {
  std::mt19937 rng(7);
  std::vector<CopyRun> runs;
  std::vector<uint64_t> dst_pages(kPages);
  for (uint64_t i = 0; i < kPages; ++i) dst_pages[i] = i;
  std::shuffle(dst_pages.begin() + 1, dst_pages.end(), rng);
  for (uint32_t b = 0; b < kBuffers; ++b) {
    for (uint64_t p = 1; p < 12; ++p) {
      const uint64_t bytes = p % 3 == 0 ? kItem : 1 + rng() % kItem;  // partial units too
      runs.push_back({b, p * kItem, dst_pages[p] * kItem, bytes});
    }
  }
  auto write = sender_->PostWrite(peer_, runs);
  ASSERT_TRUE(write.ok()) << write.status();
  ASSERT_TRUE(WaitFor(*sender_, *write).ok());
  sender_->Release(*write);
  Buffers expected(0xEE);
  for (const CopyRun& r : runs) {
    std::memcpy(expected.data[r.buffer].data() + r.dst_offset,
                src_.data[r.buffer].data() + r.src_offset, r.bytes);
  }
  for (int b = 0; b < kBuffers; ++b) EXPECT_EQ(dst_.data[b], expected.data[b]) << "buffer " << b;
}

TEST_P(BackendConformance, ManyConcurrentWritesFromTwoThreads) {
  auto worker = [&](uint32_t buffer) {
    for (uint64_t p = 1; p < kPages; ++p) {
      CopyRun run{buffer, p * kItem, p * kItem, kItem};
      auto w = sender_->PostWrite(peer_, {&run, 1});
      ASSERT_TRUE(w.ok()) << w.status();
      ASSERT_TRUE(WaitFor(*sender_, *w).ok());
      sender_->Release(*w);
    }
  };
  std::thread t1(worker, 0u), t2(worker, 3u);
  t1.join();
  t2.join();
  for (uint32_t b : {0u, 3u}) {
    EXPECT_TRUE(
        std::equal(dst_.data[b].begin() + kItem, dst_.data[b].end(), src_.data[b].begin() + kItem));
  }
}

TEST_P(BackendConformance, OutOfRangeRunsAreRefusedBeforeAnyByteMoves) {
  std::vector<CopyRun> runs = {{0, kItem, kItem, kItem}, {1, kItem, kPages * kItem, 1}};
  auto write = sender_->PostWrite(peer_, runs);
  ASSERT_FALSE(write.ok());
  EXPECT_EQ(write.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(write.status().message().find("remote buffer 1"), std::string::npos);
  EXPECT_EQ(dst_.data[0][kItem], 0xEE);  // the valid first run did not move either

  CopyRun bad_buffer{kBuffers, 0, 0, 1};
  EXPECT_EQ(sender_->PostWrite(peer_, {&bad_buffer, 1}).status().code(), StatusCode::kOutOfRange);
  CopyRun bad_src{0, kPages * kItem - 1, 0, 2};
  EXPECT_EQ(sender_->PostWrite(peer_, {&bad_src, 1}).status().code(), StatusCode::kOutOfRange);
}

TEST_P(BackendConformance, UnknownIdsAreNotFound) {
  CopyRun run{0, 0, 0, 1};
  EXPECT_EQ(sender_->PostWrite(peer_ + 100, {&run, 1}).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(sender_->Check(12345).code(), StatusCode::kNotFound);
  EXPECT_EQ(sender_->Disconnect(peer_ + 100).code(), StatusCode::kNotFound);
  sender_->Release(12345);  // harmless
}

TEST_P(BackendConformance, DisconnectedPeerRefusesWrites) {
  ASSERT_TRUE(sender_->Disconnect(peer_).ok());
  CopyRun run{0, kItem, kItem, kItem};
  EXPECT_EQ(sender_->PostWrite(peer_, {&run, 1}).status().code(), StatusCode::kNotFound);
  // Reconnecting works.
  auto again = sender_->Connect(receiver_descriptor_);
  ASSERT_TRUE(again.ok()) << again.status();
  auto w = sender_->PostWrite(*again, {&run, 1});
  ASSERT_TRUE(w.ok());
  EXPECT_TRUE(WaitFor(*sender_, *w).ok());
}

TEST_P(BackendConformance, RefusesMismatchedPeers) {
  PeerDescriptor other = receiver_descriptor_;
  other.backend = "carrier-pigeon";
  EXPECT_EQ(sender_->Connect(other).status().code(), StatusCode::kInvalidArgument);
}

// Copy runs name the peer's buffer themselves (CopyRun::dst_buffer), so a peer that published
// another buffer list connects; a run naming a buffer it lacks is refused naming it, and
// nothing moves.
TEST_P(BackendConformance, RunsPairAnyLocalBufferWithAnyPeerBuffer) {
  PeerDescriptor fewer = receiver_descriptor_;
  fewer.regions.pop_back();
  auto peer = sender_->Connect(fewer);
  ASSERT_TRUE(peer.ok()) << peer.status();

  CopyRun crossed{3, 2 * kItem, 5 * kItem, 3 * kItem, 1};  // local buffer 3 -> peer buffer 1
  CopyRun beyond{0, 0, 0, kItem, 3};                       // the peer published 0..2
  std::vector<CopyRun> both = {crossed, beyond};
  auto refused = sender_->PostWrite(*peer, both);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(refused.status().message().find("writes buffer 3 but the peer published only 3"),
            std::string::npos)
      << refused.status();
  EXPECT_EQ(dst_.data[1][5 * kItem], 0xEE);  // the valid run did not move either

  auto w = sender_->PostWrite(*peer, {&crossed, 1});
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(WaitFor(*sender_, *w).ok());
  sender_->Release(*w);
  EXPECT_TRUE(std::equal(src_.data[3].begin() + 2 * kItem, src_.data[3].begin() + 5 * kItem,
                         dst_.data[1].begin() + 5 * kItem));
  EXPECT_EQ(dst_.data[1][5 * kItem - 1], 0xEE);  // bytes around the run untouched
  EXPECT_EQ(dst_.data[1][8 * kItem], 0xEE);
  EXPECT_EQ(dst_.data[3][5 * kItem], 0xEE);  // the same index at the peer untouched
}

TEST_P(BackendConformance, LongRunsAndManySmallRunsInOneWriteByteExact) {
  // Whole buffers (runs longer than an active message), then every page cut into odd pieces
  // (more runs than one message carries), in one write each.
  std::vector<CopyRun> whole;
  for (uint32_t b = 0; b < kBuffers; ++b) whole.push_back({b, 0, 0, kItem * kPages});
  auto w = sender_->PostWrite(peer_, whole);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(WaitFor(*sender_, *w).ok());
  sender_->Release(*w);
  for (int b = 0; b < kBuffers; ++b) EXPECT_EQ(dst_.data[b], src_.data[b]) << "buffer " << b;

  Randomize(src_, 9);
  std::vector<CopyRun> pieces;
  for (uint32_t b = 0; b < kBuffers; ++b) {
    for (uint64_t offset = 0; offset < kItem * kPages; offset += 100) {
      pieces.push_back({b, offset, 0, std::min<uint64_t>(100, kItem * kPages - offset)});
    }
  }
  // Destinations: the pieces reversed within each buffer, so no piece lands where it came from.
  for (CopyRun& r : pieces) r.dst_offset = kItem * kPages - r.src_offset - r.bytes;
  w = sender_->PostWrite(peer_, pieces);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(WaitFor(*sender_, *w).ok());
  sender_->Release(*w);
  for (uint32_t b = 0; b < kBuffers; ++b) {
    for (const CopyRun& r : pieces) {
      if (r.buffer != b) continue;
      ASSERT_EQ(std::memcmp(dst_.data[b].data() + r.dst_offset, src_.data[b].data() + r.src_offset,
                            r.bytes),
                0)
          << "buffer " << b << " piece at " << r.src_offset;
    }
  }
}

TEST_P(BackendConformance, ReleasingWritesInFlightLeavesThePeerUsable) {
  // Writes released at once, some before they complete: no error, and the peer takes the
  // next write whole.
  std::vector<CopyRun> whole;
  for (uint32_t b = 0; b < kBuffers; ++b) whole.push_back({b, 0, 0, kItem * kPages});
  for (int i = 0; i < 8; ++i) {
    auto w = sender_->PostWrite(peer_, whole);
    ASSERT_TRUE(w.ok()) << w.status();
    sender_->Release(*w);
  }
  Randomize(src_, 11);
  auto w = sender_->PostWrite(peer_, whole);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(WaitFor(*sender_, *w).ok());
  sender_->Release(*w);
  for (int b = 0; b < kBuffers; ++b) EXPECT_EQ(dst_.data[b], src_.data[b]) << "buffer " << b;
}

// Addresses nothing is mapped at are refused at registration, naming the buffer and its range,
// and the backend's earlier registration still serves writes. The first page above 0 is never
// mapped (Linux keeps the lowest vm.mmap_min_addr bytes, 64 KiB by default, unmappable), so the
// test cannot race another thread's allocation.
TEST_P(BackendConformance, UnmappedHostMemoryIsRefusedAtRegistration) {
  Buffers other{0};
  std::vector<LocalRegion> regions = other.Regions();
  regions[2].base = 4096;
  auto refused = receiver_->Register(regions);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(refused.status().message(),
              ::testing::AllOf(::testing::HasSubstr("buffer 2"),
                               ::testing::HasSubstr("not mapped host memory of this process")))
      << refused.status();
  Randomize(src_, 9);
  const CopyRun run{1, 0, kItem, 2 * kItem, 1};
  auto w = sender_->PostWrite(peer_, std::span<const CopyRun>(&run, 1));
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(WaitFor(*sender_, *w).ok());
  sender_->Release(*w);
  EXPECT_TRUE(std::equal(dst_.data[1].begin() + kItem, dst_.data[1].begin() + 3 * kItem,
                         src_.data[1].begin()))
      << "the receiver's earlier registration no longer served writes";
}

INSTANTIATE_TEST_SUITE_P(AllHostBackends, BackendConformance,
                         ::testing::Values(std::string("loopback"), std::string("ucx"),
                                           std::string("ucx:tcp"), std::string("ucx:shm,self"),
                                           std::string("ucx+put:tcp"),
                                           std::string("ucx+am:shm,self"),
                                           std::string("ucx+am-rndv:tcp")),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& c : name) {
                             if (!isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return name;
                         });

TEST(UcxBackend, BadTransportListIsRefusedWithAHint) {
  auto b = CreateBackend(UcxOptions{.transports = "no-such-transport"});
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("no-such-transport"), std::string::npos) << b.status();
}

TEST(BackendFactory, UnknownNameListsKnownOnes) {
  auto b = CreateBackend("smoke-signals");
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  for (const std::string& name : BackendNames()) {
    EXPECT_NE(b.status().message().find(name), std::string::npos) << b.status();
  }
  EXPECT_EQ(DefaultBackendConfig("smoke-signals").status().code(), StatusCode::kInvalidArgument);
}

TEST(BackendFactory, TheTableNamesEveryConfigAlternative) {
  const std::vector<std::string> names = BackendNames();
  ASSERT_EQ(names, (std::vector<std::string>{"ucx", "cuda_ipc", "nccl", "loopback"}));
  ASSERT_EQ(RegisteredBackends().size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    EXPECT_EQ(RegisteredBackends()[i].name, names[i]);
    EXPECT_FALSE(RegisteredBackends()[i].description.empty()) << names[i];
    auto config = DefaultBackendConfig(names[i]);
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_EQ(BackendName(*config), names[i]);
  }
  EXPECT_EQ(BackendName(LoopbackOptions{}), "loopback");
  EXPECT_TRUE(RegisteredBackends()[0].capabilities.inter_node);      // ucx
  EXPECT_FALSE(RegisteredBackends()[1].capabilities.host_memory);    // cuda_ipc
  EXPECT_TRUE(RegisteredBackends()[2].capabilities.two_sided);       // nccl
  EXPECT_FALSE(RegisteredBackends()[3].capabilities.inter_process);  // loopback
}

UcxOptions Ucx(void (*set)(UcxOptions&)) {
  UcxOptions options;
  set(options);
  return options;
}

LoopbackOptions Loopback(void (*set)(LoopbackOptions&)) {
  LoopbackOptions options;
  set(options);
  return options;
}

TEST(BackendFactory, OptionsOutOfRangeNameTheOptionTheValueAndTheRange) {
  struct Case {
    BackendConfig config;
    std::vector<std::string> expected;
  };
  const Case cases[] = {
      {Ucx([](UcxOptions& o) { o.copy_threads = 65; }), {"copy_threads is 65", "1..64"}},
      {Ucx([](UcxOptions& o) { o.spin = std::chrono::seconds(2); }),
       {"spin is 2000000 us", "0..1000000"}},
      {Ucx([](UcxOptions& o) { o.staging_slots = 0; }), {"staging_slots is 0", "1 to 4096"}},
      {Ucx([](UcxOptions& o) { o.staging_slot_bytes = 100; }),
       {"staging_slot_bytes is 100", "4096 bytes to 4 GiB"}},
      {Loopback([](LoopbackOptions& o) { o.delay = std::chrono::microseconds(-1); }),
       {"delay is -1 us", "0"}},
  };
  for (const Case& c : cases) {
    auto b = CreateBackend(c.config);
    ASSERT_FALSE(b.ok()) << c.expected[0];
    EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument) << b.status();
    for (const std::string& text : c.expected) {
      EXPECT_NE(b.status().message().find(text), std::string::npos) << b.status();
    }
  }
}

TEST(LoopbackBackend, DelayedWriteCanBeReleasedBeforeItLands) {
  LoopbackOptions options;
  options.delay = std::chrono::milliseconds(200);
  auto a = CreateBackend(options);
  auto b = CreateBackend(options);
  ASSERT_TRUE(a.ok() && b.ok());
  Buffers src(1), dst(2);
  auto sr = src.Regions();
  auto dr = dst.Regions();
  ASSERT_TRUE((*a)->Register(sr).ok());
  auto d = (*b)->Register(dr);
  ASSERT_TRUE(d.ok());
  auto peer = (*a)->Connect(*d);
  ASSERT_TRUE(peer.ok());
  CopyRun run{0, 0, 0, kItem};
  auto w = (*a)->PostWrite(*peer, {&run, 1});
  ASSERT_TRUE(w.ok());
  EXPECT_EQ((*a)->Check(*w).code(), StatusCode::kInProgress);
  (*a)->Release(*w);
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  EXPECT_EQ(dst.data[0][0], 2);  // never landed
}

}  // namespace
}  // namespace kvt::transfer

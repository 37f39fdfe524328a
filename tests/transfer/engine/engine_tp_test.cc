// Tensor-parallel pairing at hello: with equal TP sizes decode rank r takes its shard from prefill
// rank r only; any other pair of ranks is refused by both sides, naming both ranks and sizes.
// Two engines in one process over the loopback backend and the real control plane on loopback.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "engine_test_util.h"
#include "kvt/transfer/engine.h"

namespace kvt::transfer {
namespace {

using namespace std::chrono_literals;
using testing::Fill;
using testing::MakePool;
using testing::Mismatches;
using testing::SmallPoolOptions;

struct Rank {
  uint32_t rank = 0;
  uint32_t size = 1;
};

class EngineTpTest : public ::testing::Test {
 protected:
  void Start(Rank prefill, Rank decode) {
    src_pool_ = MakePool(SmallPoolOptions());
    dst_pool_ = MakePool(SmallPoolOptions());
    ASSERT_TRUE(src_pool_ && dst_pool_);
    EngineOptions p;
    p.name = "prefill-r" + std::to_string(prefill.rank);
    p.prefill = true;
    p.backend = LoopbackOptions{};
    p.default_deadline = 5s;
    p.tp_rank = prefill.rank;
    p.tp_size = prefill.size;
    auto prefill_engine = TransferEngine::Create(p, src_pool_.get());
    ASSERT_TRUE(prefill_engine.ok()) << prefill_engine.status();
    prefill_ = std::move(prefill_engine).value();
    EngineOptions d = p;
    d.name = "decode-r" + std::to_string(decode.rank);
    d.prefill = false;
    d.tp_rank = decode.rank;
    d.tp_size = decode.size;
    auto decode_engine = TransferEngine::Create(d, dst_pool_.get());
    ASSERT_TRUE(decode_engine.ok()) << decode_engine.status();
    decode_ = std::move(decode_engine).value();
  }

  void TearDown() override {
    decode_.reset();
    prefill_.reset();
  }

  std::unique_ptr<pool::KvPool> src_pool_, dst_pool_;
  std::unique_ptr<TransferEngine> prefill_, decode_;
};

TEST_F(EngineTpTest, CrossWiredHelloIsRefusedNamingBothRanks) {
  Start(Rank{0, 2}, Rank{1, 2});
  auto peer = decode_->ConnectPeer("127.0.0.1", prefill_->port());
  ASSERT_FALSE(peer.ok()) << "decode rank 1 was paired with prefill rank 0";
  EXPECT_EQ(peer.status().code(), StatusCode::kFailedPrecondition) << peer.status();
  const std::string& message = peer.status().message();
  EXPECT_NE(message.find("decode tp_rank=1 of tp_size=2"), std::string::npos) << message;
  EXPECT_NE(message.find("prefill tp_rank=0 of tp_size=2"), std::string::npos) << message;
  EXPECT_NE(message.find("decode rank r pairs with prefill rank r"), std::string::npos) << message;
}

TEST_F(EngineTpTest, CrossWiredHelloIsRefusedTheOtherWayToo) {
  Start(Rank{1, 4}, Rank{3, 4});
  auto peer = decode_->ConnectPeer("127.0.0.1", prefill_->port());
  ASSERT_FALSE(peer.ok());
  const std::string& message = peer.status().message();
  EXPECT_NE(message.find("decode tp_rank=3 of tp_size=4"), std::string::npos) << message;
  EXPECT_NE(message.find("prefill tp_rank=1 of tp_size=4"), std::string::npos) << message;
}

// Different TP sizes stay refused as before (head ranges are not implemented), naming both.
TEST_F(EngineTpTest, DifferentTpSizesAreStillRefused) {
  Start(Rank{0, 2}, Rank{0, 1});
  auto peer = decode_->ConnectPeer("127.0.0.1", prefill_->port());
  ASSERT_FALSE(peer.ok());
  const std::string& message = peer.status().message();
  EXPECT_NE(message.find("tp_size"), std::string::npos) << message;
  EXPECT_NE(message.find("decode=1"), std::string::npos) << message;
  EXPECT_NE(message.find("prefill=2"), std::string::npos) << message;
}

TEST_F(EngineTpTest, MatchingRanksMoveTheirShard) {
  Start(Rank{1, 2}, Rank{1, 2});
  auto peer = decode_->ConnectPeer("127.0.0.1", prefill_->port());
  ASSERT_TRUE(peer.ok()) << peer.status();
  const std::vector<int32_t> src = {3, 4, 5}, dst = {7, 2, 9};
  Fill(*src_pool_, 41, src);
  ASSERT_TRUE(decode_->Receive("tp-room", *peer, dst).ok());
  ASSERT_TRUE(prefill_->Send("tp-room", src).ok());
  ASSERT_TRUE(prefill_->LayersReady("tp-room", 4).ok());
  auto info = decode_->WaitRequest("tp-room", 5s);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state, RequestState::kSuccess) << info->status;
  EXPECT_EQ(Mismatches(*dst_pool_, 41, dst), 0u);
}

}  // namespace
}  // namespace kvt::transfer

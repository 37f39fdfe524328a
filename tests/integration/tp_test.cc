// Tensor parallelism through the bootstrap: two prefill ranks and two decode ranks of one model
// (each rank its own kvt-agent process, ranks of a group sharing one registered name). Every
// decode rank must find the prefill rank of its own shard and receive that shard byte-exact;
// the pattern each rank writes and verifies is seeded by the TP rank, so a shard delivered to
// the wrong rank cannot verify.
#include <chrono>
#include <string>
#include <vector>

#include "fixture.h"

namespace kvt::integration {
namespace {

using namespace std::chrono_literals;

using TpTest = ClusterTest;

AgentSpec Ranked(AgentSpec spec, uint32_t rank, uint32_t size) {
  spec.tp_rank = rank;
  spec.tp_size = size;
  return spec;
}

TEST_F(TpTest, EachDecodeRankGetsItsOwnShardByteExact) {
  constexpr uint32_t kRanks = 2;
  KVT_ASSERT_OK_AND_ASSIGN(
      auto agents,
      cluster_->StartAgents(
          {Ranked(Prefill("tp-prefill"), 0, kRanks), Ranked(Prefill("tp-prefill"), 1, kRanks),
           Ranked(Decode("tp-decode"), 0, kRanks), Ranked(Decode("tp-decode"), 1, kRanks)}));
  std::vector<tools::RpcClient> prefill(kRanks), decode(kRanks);
  for (uint32_t r = 0; r < kRanks; ++r) {
    KVT_ASSERT_OK_AND_ASSIGN(prefill[r], ConnectRpc(agents[r]->rpc_port));
    KVT_ASSERT_OK_AND_ASSIGN(decode[r], ConnectRpc(agents[kRanks + r]->rpc_port));
  }

  std::vector<std::string> rooms;
  for (int i = 0; i < 6; ++i) {
    const std::string room = "tp-room-" + std::to_string(i);
    const uint64_t tokens = 40 + 97 * static_cast<uint64_t>(i);
    rooms.push_back(room);
    for (uint32_t r = 0; r < kRanks; ++r) {
      KVT_ASSERT_OK(SubmitAccepted(prefill[r], ForPrefill(room, tokens)));
      KVT_ASSERT_OK(SubmitAccepted(decode[r], ForDecode(room, tokens, "tp-prefill")));
    }
  }

  for (uint32_t r = 0; r < kRanks; ++r) {
    KVT_ASSERT_OK_AND_ASSIGN(auto on_decode, WaitFinal(decode[r], rooms, 20s));
    KVT_ASSERT_OK_AND_ASSIGN(auto on_prefill, WaitFinal(prefill[r], rooms, 20s));
    for (const std::string& room : rooms) {
      const v1::RequestReport& d = on_decode.at(room);
      EXPECT_EQ(d.state(), v1::REQUEST_STATE_SUCCESS) << "decode rank " << r << ": " << Describe(d);
      EXPECT_TRUE(d.verified()) << "decode rank " << r << ": " << Describe(d);
      EXPECT_EQ(d.mismatches(), 0u) << "decode rank " << r << ": " << Describe(d);
      const v1::RequestReport& p = on_prefill.at(room);
      EXPECT_EQ(p.state(), v1::REQUEST_STATE_SUCCESS)
          << "prefill rank " << r << " (its shard was never asked for?): " << Describe(p);
      EXPECT_EQ(p.bytes(), d.bytes())
          << "rank " << r << ": " << Describe(p) << " / " << Describe(d);
    }
  }
}

// A decode rank whose prefill rank has not registered is refused naming the ranks, instead of
// being sent to another rank's shard.
TEST_F(TpTest, MissingPrefillRankIsNamed) {
  KVT_ASSERT_OK_AND_ASSIGN(auto agents,
                           cluster_->StartAgents({Ranked(Prefill("half-prefill"), 0, 2),
                                                  Ranked(Decode("half-decode"), 1, 2)}));
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient decode, ConnectRpc(agents[1]->rpc_port));
  KVT_ASSERT_OK_AND_ASSIGN(v1::SubmitReply reply,
                           Submit(decode, ForDecode("lonely", 100, "half-prefill")));
  EXPECT_EQ(reply.status(), v1::STATUS_CODE_NOT_FOUND) << reply.message();
  EXPECT_NE(reply.message().find("no rank 1"), std::string::npos) << reply.message();
  EXPECT_NE(reply.message().find("0 of 2"), std::string::npos) << reply.message();
}

}  // namespace
}  // namespace kvt::integration

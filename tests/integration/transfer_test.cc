// End-to-end transfers between separate kvt-agent processes: many random requests verified
// byte by byte, aborts from either side mid-transfer, deadline expiry, and a prefill agent killed
// with SIGKILL while its requests are in flight. Host pools over ucx; gpu_transfer_test.cc runs
// the shared scenarios on CUDA pools.
#include <chrono>
#include <map>
#include <thread>

#include "fixture.h"
#include "scenarios.h"

namespace kvt::integration {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

double MsSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

using TransferTest = ClusterTest;

// 200 requests of random sizes, 8 in flight: every one arrives byte-exact, and both agents'
// counters agree with the per-request reports.
TEST_F(TransferTest, RandomRequestsArriveByteExact) {
  ExpectRandomWorkloadByteExact(*cluster_, Prefill("it-prefill"), Decode("it-decode"),
                                RandomWorkload{});
}

// Slow layers (4 x 60 ms) so that an abort 100 ms after submission lands mid-forward.
constexpr int64_t kSlowLayerUs = 60000;

class AbortTest : public ClusterTest, public ::testing::WithParamInterface<std::string> {};

// Aborting a room on one side mid-transfer fails it with ABORTED on both sides; the agents
// then serve the next request normally.
TEST_P(AbortTest, AbortMidTransferFailsBothSidesThenRecovers) {
  const bool from_decode = GetParam() == "decode";
  KVT_ASSERT_OK_AND_ASSIGN(auto agents, cluster_->StartAgents({Prefill("it-prefill", kSlowLayerUs),
                                                               Decode("it-decode")}));
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient prefill, ConnectRpc(agents[0]->rpc_port));
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient decode, ConnectRpc(agents[1]->rpc_port));
  KVT_ASSERT_OK_AND_ASSIGN(const v1::AgentStatsReply decode_before, Stats(decode));

  const SubmitArgs doomed = ForDecode("abort-me", 300, "it-prefill");
  // Decode first: the forward (and so the 240 ms clock) starts only once the decode side's
  // request is in place, however long its first connection to the prefill engine takes.
  KVT_ASSERT_OK(SubmitAccepted(decode, doomed));
  KVT_ASSERT_OK(SubmitAccepted(prefill, ForPrefill(doomed.room, doomed.tokens)));
  std::this_thread::sleep_for(100ms);
  KVT_ASSERT_OK_AND_ASSIGN(auto before, Query(decode, {doomed.room}));
  ASSERT_FALSE(IsFinal(before.at(0)))
      << "the request finished before the abort; the forward is not slow enough: "
      << Describe(before.at(0));

  tools::RpcClient& aborter = from_decode ? decode : prefill;
  const auto abort_at = Clock::now();
  KVT_ASSERT_OK_AND_ASSIGN(v1::SubmitReply abort_reply,
                           AbortRoom(aborter, doomed.room, "integration test abort"));
  EXPECT_EQ(abort_reply.status(), v1::STATUS_CODE_OK) << abort_reply.message();

  KVT_ASSERT_OK_AND_ASSIGN(v1::RequestReport on_decode, WaitFinal(decode, doomed.room, 10s));
  const double decode_ms = MsSince(abort_at);
  KVT_ASSERT_OK_AND_ASSIGN(v1::RequestReport on_prefill, WaitFinal(prefill, doomed.room, 10s));
  EXPECT_EQ(on_decode.state(), v1::REQUEST_STATE_FAILED) << Describe(on_decode);
  EXPECT_EQ(on_decode.status(), v1::STATUS_CODE_ABORTED) << Describe(on_decode);
  EXPECT_FALSE(on_decode.verified()) << Describe(on_decode);
  EXPECT_EQ(on_prefill.state(), v1::REQUEST_STATE_FAILED) << Describe(on_prefill);
  EXPECT_EQ(on_prefill.status(), v1::STATUS_CODE_ABORTED) << Describe(on_prefill);
  // The abort and its acknowledgement are one round trip on loopback; the decode agent may
  // only report the room once the prefill side confirmed its writes stopped.
  EXPECT_LT(decode_ms, 2000) << "the aborted room took " << decode_ms << " ms to become final";
  // The side that did not abort learns why from its peer.
  EXPECT_NE((from_decode ? on_prefill : on_decode).message().find("integration test abort"),
            std::string::npos)
      << Describe(from_decode ? on_prefill : on_decode);

  KVT_ASSERT_OK_AND_ASSIGN(
      v1::RequestReport after,
      RunRequest(prefill, decode, ForDecode("after-abort", 300, "it-prefill")));
  EXPECT_EQ(after.state(), v1::REQUEST_STATE_SUCCESS) << Describe(after);
  EXPECT_TRUE(after.verified()) << Describe(after);
  EXPECT_EQ(after.mismatches(), 0u) << Describe(after);

  KVT_ASSERT_OK_AND_ASSIGN(const v1::AgentStatsReply d, Stats(decode));
  EXPECT_EQ(d.failed(), 1u);
  EXPECT_EQ(d.succeeded(), 1u);
  EXPECT_EQ(d.free_pages(), decode_before.free_pages())
      << "pages of the aborted room were not returned";
}

INSTANTIATE_TEST_SUITE_P(FromEitherSide, AbortTest, ::testing::Values("decode", "prefill"),
                         [](const auto& info) {
                           return "From" +
                                  std::string(info.param == "decode" ? "Decode" : "Prefill");
                         });

using DeadlineTest = ClusterTest;

// A decode request whose data never comes in time fails with DEADLINE_EXCEEDED soon after its
// deadline; the prefill side fails the room too; later requests are unaffected.
TEST_F(DeadlineTest, ExpiredRequestsFailAndLaterOnesSucceed) {
  // 4 layers x 100 ms: a 300 ms deadline cannot be met even when the prefill runs the room.
  KVT_ASSERT_OK_AND_ASSIGN(
      auto agents, cluster_->StartAgents({Prefill("it-prefill", 100000), Decode("it-decode")}));
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient prefill, ConnectRpc(agents[0]->rpc_port));
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient decode, ConnectRpc(agents[1]->rpc_port));

  // 1. Decode only: the prefill agent never runs a forward for the room.
  auto start = Clock::now();
  KVT_ASSERT_OK(SubmitAccepted(decode, ForDecode("orphan", 64, "it-prefill", 300)));
  KVT_ASSERT_OK_AND_ASSIGN(v1::RequestReport orphan, WaitFinal(decode, "orphan", 10s));
  double elapsed_ms = MsSince(start);
  EXPECT_EQ(orphan.state(), v1::REQUEST_STATE_FAILED) << Describe(orphan);
  EXPECT_EQ(orphan.status(), v1::STATUS_CODE_DEADLINE_EXCEEDED) << Describe(orphan);
  EXPECT_GE(elapsed_ms, 250) << "failed before its deadline: " << Describe(orphan);
  EXPECT_LT(elapsed_ms, 3000) << "took " << elapsed_ms << " ms to notice a 300 ms deadline";
  // The prefill agent itself never saw the room (only its engine did): a FAILED, unknown room.
  KVT_ASSERT_OK_AND_ASSIGN(auto orphan_prefill, Query(prefill, {"orphan"}));
  EXPECT_EQ(orphan_prefill.at(0).state(), v1::REQUEST_STATE_FAILED);
  EXPECT_EQ(orphan_prefill.at(0).status(), v1::STATUS_CODE_NOT_FOUND);

  // 2. Both sides know the room; the forward is too slow for the deadline.
  start = Clock::now();
  // Decode first, so the 400 ms forward cannot get a head start on the 300 ms deadline.
  KVT_ASSERT_OK(SubmitAccepted(decode, ForDecode("late", 64, "it-prefill", 300)));
  KVT_ASSERT_OK(SubmitAccepted(prefill, ForPrefill("late", 64)));
  KVT_ASSERT_OK_AND_ASSIGN(v1::RequestReport late, WaitFinal(decode, "late", 10s));
  elapsed_ms = MsSince(start);
  EXPECT_EQ(late.state(), v1::REQUEST_STATE_FAILED) << Describe(late);
  EXPECT_EQ(late.status(), v1::STATUS_CODE_DEADLINE_EXCEEDED) << Describe(late);
  EXPECT_LT(elapsed_ms, 3000) << "took " << elapsed_ms << " ms to notice a 300 ms deadline";
  KVT_ASSERT_OK_AND_ASSIGN(v1::RequestReport late_prefill, WaitFinal(prefill, "late", 10s));
  EXPECT_EQ(late_prefill.state(), v1::REQUEST_STATE_FAILED) << Describe(late_prefill);
  // Its own copy of the deadline or the decode side's abort, whichever came first.
  EXPECT_TRUE(late_prefill.status() == v1::STATUS_CODE_DEADLINE_EXCEEDED ||
              late_prefill.status() == v1::STATUS_CODE_ABORTED)
      << Describe(late_prefill);

  // 3. A request with the default deadline succeeds on the same agents.
  KVT_ASSERT_OK_AND_ASSIGN(v1::RequestReport ok,
                           RunRequest(prefill, decode, ForDecode("in-time", 64, "it-prefill")));
  EXPECT_EQ(ok.state(), v1::REQUEST_STATE_SUCCESS) << Describe(ok);
  EXPECT_TRUE(ok.verified()) << Describe(ok);
}

using PeerDeathTest = ClusterTest;

// SIGKILL one of two prefill agents while both have requests in flight: exactly the dead one's
// requests fail (quickly, not at their deadline), the other's all arrive intact, and the decode
// agent keeps working.
TEST_F(PeerDeathTest, KilledPrefillFailsOnlyItsRequests) {
  // 4 layers x 50 ms: each prefill runs its rooms one after another, 200 ms each.
  ExpectKilledPrefillFailsOnlyItsRequests(*cluster_, Prefill("it-prefill-doomed", 50000),
                                          Prefill("it-prefill-alive", 50000), Decode("it-decode"));
}

}  // namespace
}  // namespace kvt::integration

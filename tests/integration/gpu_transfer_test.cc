// The integration scenarios on CUDA pools: separate kvt-agent processes with --device cuda:0,
// moving pages with cuda_ipc (and with ucx staged through pinned host buffers), the decode side
// verifying every byte on the GPU. Labelled gpu: each test skips, saying why, where this
// process sees no CUDA device.
//
// On another machine: copy integration_gpu_test, kvt-agent and kvt-bootstrap into one folder
// (or keep a build folder's layout, or point KVT_AGENT_BIN / KVT_BOOTSTRAP_BIN at the tools)
// and run the test binary.
#include <chrono>
#include <nlohmann/json.hpp>

#include "fixture.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/testing/gpu.h"
#include "scenarios.h"

namespace kvt::integration {
namespace {

using namespace std::chrono_literals;

class GpuTransferTest : public ClusterTest {
 protected:
  void SetUp() override {
    KVT_SKIP_WITHOUT_GPU();
    ClusterTest::SetUp();
  }

  // `spec` with its pool on cuda:0, moving pages with `backend`.
  static AgentSpec OnGpu(AgentSpec spec, const std::string& backend = "cuda_ipc",
                         const std::string& ucx_cuda_mode = "") {
    spec.device = "cuda:0";
    spec.backend = backend;
    spec.ucx_cuda_mode = ucx_cuda_mode;
    return spec;
  }
};

// Both agents run what they were asked for (their ready files and stats say so), and one
// request crosses.
TEST_F(GpuTransferTest, AgentsRunCudaPoolsWithCudaIpc) {
  KVT_ASSERT_OK_AND_ASSIGN(auto agents, cluster_->StartAgents({OnGpu(Prefill("gpu-prefill")),
                                                               OnGpu(Decode("gpu-decode"))}));
  for (const AgentProcess* agent : agents) {
    const nlohmann::json ready = nlohmann::json::parse(agent->ready_json, nullptr, false);
    ASSERT_FALSE(ready.is_discarded()) << agent->ready_json;
    EXPECT_EQ(ready.value("memory", ""), "cuda:0") << agent->ready_json;
    EXPECT_EQ(ready.value("backend", ""), "cuda_ipc") << agent->ready_json;
    EXPECT_FALSE(ready.value("device_name", "").empty()) << agent->ready_json;
  }
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient prefill, ConnectRpc(agents[0]->rpc_port));
  KVT_ASSERT_OK_AND_ASSIGN(tools::RpcClient decode, ConnectRpc(agents[1]->rpc_port));
  for (tools::RpcClient* rpc : {&prefill, &decode}) {
    KVT_ASSERT_OK_AND_ASSIGN(const v1::AgentStatsReply stats, Stats(*rpc));
    EXPECT_EQ(stats.memory(), "cuda") << stats.name();
    EXPECT_EQ(stats.backend(), "cuda_ipc") << stats.name();
  }
  KVT_ASSERT_OK_AND_ASSIGN(v1::RequestReport report,
                           RunRequest(prefill, decode, ForDecode("one", 777, "gpu-prefill")));
  EXPECT_EQ(report.state(), v1::REQUEST_STATE_SUCCESS) << Describe(report);
  EXPECT_TRUE(report.verified()) << Describe(report);
  EXPECT_EQ(report.bytes(), ExpectedBytes(agents[0]->spec.layout, 777)) << Describe(report);
}

// (a) 200 requests of random sizes, 8 in flight, over cuda_ipc: every one byte-exact (checked
// on the decode GPU), counters and free pages consistent on both sides.
TEST_F(GpuTransferTest, CudaIpcRandomRequestsArriveByteExact) {
  ExpectRandomWorkloadByteExact(*cluster_, OnGpu(Prefill("gpu-prefill")),
                                OnGpu(Decode("gpu-decode")), RandomWorkload{});
}

// (b) Layer by layer: each layer's simulated compute (a 10 ms GPU-side spin) precedes its fill,
// and the agent hands the engine each layer's event at once, so the copies must wait for the
// events on the GPU. Copies that ran ahead of the fills would move unwritten pages and fail
// the byte check. The forwards share one stream, so the workload cannot finish before all of
// their compute has run (which shows the spin really held the stream).
TEST_F(GpuTransferTest, CudaIpcLayerwiseForwardArrivesByteExact) {
  constexpr int64_t kLayerUs = 10000;
  RandomWorkload workload;
  workload.requests = 24;
  workload.concurrency = 8;
  workload.seed = 7;
  double wall_s = 0;
  const AgentSpec prefill = OnGpu(Prefill("gpu-prefill", kLayerUs));
  ExpectRandomWorkloadByteExact(*cluster_, prefill, OnGpu(Decode("gpu-decode")), workload, &wall_s);
  if (HasFatalFailure()) return;
  const double compute_s = workload.requests * prefill.layout.layers * kLayerUs / 1e6;
  // 0.8: the GPU's global timer may tick coarsely (it can shorten a spin by up to one tick).
  EXPECT_GE(wall_s, 0.8 * compute_s)
      << "the workload finished before the simulated compute could have run";
}

// (c) One of two CUDA prefill agents is SIGKILLed mid-transfer: exactly its in-flight requests
// fail (UNAVAILABLE, quickly), the survivor's arrive byte-exact, the decode agent gets every
// page back and keeps working.
TEST_F(GpuTransferTest, CudaIpcKilledPrefillFailsOnlyItsRequests) {
  // 4 layers x 50 ms of GPU time: each prefill runs its rooms one after another, 200 ms each.
  ExpectKilledPrefillFailsOnlyItsRequests(*cluster_, OnGpu(Prefill("gpu-prefill-doomed", 50000)),
                                          OnGpu(Prefill("gpu-prefill-alive", 50000)),
                                          OnGpu(Decode("gpu-decode")));
}

// (d) The random workload over ucx with CUDA pools, staged through pinned host bounce buffers.
TEST_F(GpuTransferTest, UcxStagedRandomRequestsArriveByteExact) {
  const AgentSpec prefill = OnGpu(Prefill("gpu-prefill"), "ucx", "staged");
  const AgentSpec decode = OnGpu(Decode("gpu-decode"), "ucx", "staged");
  ExpectRandomWorkloadByteExact(*cluster_, prefill, decode, RandomWorkload{});
}

}  // namespace
}  // namespace kvt::integration

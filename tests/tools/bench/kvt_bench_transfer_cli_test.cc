// Runs the built `kvt-bench transfer` on tiny host pools over UCX (two processes): with
// --memory external (each side's K/V buffers carved out of one plain allocation, registered
// through TransferLayout::FromBufInfos) and with kvt's own pool, every page size verifies and the
// JSON says which memory was used; a bad --memory is refused naming the value. With --ucx-tls tcp
// the table and the JSON carry the plain-socket ceiling and kvt's ratios to it; without, neither.
// Also `kvt-bench copy`, the same binary's host-copy benchmark, and `kvt-bench control`, its
// control-plane round trips.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "kvt/testing/gpu.h"
#include "kvt/testing/run_tool.h"
#include "tool_util.h"

namespace {

using kvt::testing::RunTool;
using kvt::testing::ToolResult;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kTiny[] =
    "transfer --backend ucx --layers 2 --heads 1 --head-dim 32 --page-tokens 1,16 --tokens 64 "
    "--iters 2 --warmup 1 --latency-requests 5 --inflight 2 --pipelined-requests 4 --pool 1MiB "
    "--verify --timeout 20";

// A binary beside this test (binaries copied into one folder), else where a build folder keeps
// it, else the path baked in.
const std::string& Bench() {
  static const std::string path = [] {
    auto found = kvt::tools::FindTool("kvt-bench",
                                      {"kvt-bench", "../../tools/bench/kvt-bench", KVT_BENCH_PATH});
    return found.ok() ? *found : std::string(KVT_BENCH_PATH);
  }();
  return path;
}

nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
}

class KvtBenchTransferTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/kvt-bench-transfer-cli-" + std::to_string(getpid());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

TEST_P(KvtBenchTransferTest, TinyHostRunVerifiesAndNamesItsMemory) {
  const std::string memory = GetParam();
  const std::string json = dir_ + "/transfer-" + memory + ".json";
  const ToolResult r =
      RunTool(Bench(), std::string(kTiny) + " --memory " + memory + " --json " + json);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("memory " + memory));
  const nlohmann::json j = ReadJson(json);
  ASSERT_FALSE(j.is_discarded()) << "no JSON at " << json;
  EXPECT_EQ(j.value("memory", ""), memory);
  EXPECT_EQ(j["config"].value("memory", ""), memory);
  ASSERT_EQ(j["results"].size(), 2u) << j["results"].dump();
  for (const nlohmann::json& result : j["results"]) {
    EXPECT_FALSE(result.contains("error")) << result.dump();
    EXPECT_EQ(result.value("verified_mismatches", -1), 0) << result.dump();
    EXPECT_GT(result["kvt"].value("gbps_p50_request", 0.0), 0.0) << result.dump();
    // UCX's default transports: no plain-socket ceiling.
    EXPECT_FALSE(result.contains("ceiling_socket")) << result.dump();
    EXPECT_FALSE(result.contains("ratio_kvt_to_socket")) << result.dump();
  }
  EXPECT_THAT(r.out, Not(HasSubstr("kvt/sock")));
}

INSTANTIATE_TEST_SUITE_P(Memory, KvtBenchTransferTest, ::testing::Values("external", "pool"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

TEST(KvtBenchTransferTcp, TcpOnlyAddsThePlainSocketCeiling) {
  const std::string dir =
      ::testing::TempDir() + "/kvt-bench-transfer-tcp-" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  const std::string json = dir + "/transfer-tcp.json";
  const ToolResult r = RunTool(Bench(), std::string(kTiny) + " --ucx-tls tcp --json " + json);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("socket"));
  EXPECT_THAT(r.out, HasSubstr("kvt/sock"));
  EXPECT_THAT(r.out, HasSubstr("pipe/sock"));
  const nlohmann::json j = ReadJson(json);
  std::filesystem::remove_all(dir);
  ASSERT_FALSE(j.is_discarded()) << "no JSON at " << json;
  ASSERT_EQ(j["results"].size(), 2u) << j["results"].dump();
  for (const nlohmann::json& result : j["results"]) {
    EXPECT_FALSE(result.contains("error")) << result.dump();
    EXPECT_EQ(result.value("verified_mismatches", -1), 0) << result.dump();
    ASSERT_TRUE(result.contains("ceiling_socket")) << result.dump();
    EXPECT_GT(result["ceiling_socket"].value("gbps", 0.0), 0.0) << result.dump();
    EXPECT_EQ(result["ceiling_socket"].value("write_bytes", 0), 1 << 20) << result.dump();
    EXPECT_GT(result.value("ratio_kvt_to_socket", 0.0), 0.0) << result.dump();
    EXPECT_GT(result["kvt_pipelined"].value("ratio_to_socket", 0.0), 0.0) << result.dump();
  }
}

TEST(KvtBenchTransferFlags, BadMemoryIsRefusedNamingTheValue) {
  const ToolResult r = RunTool(Bench(), "transfer --memory torch");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("--memory is 'torch'; use pool"));
  EXPECT_THAT(r.err, HasSubstr("external"));
}

// `kvt-bench copy` (the shared-memory path's host copy alone): a tiny run prints a row per run
// size, memory and thread count, its JSON carries the figures and the check passed; bad flags
// are refused naming the value.
TEST(KvtBenchCopy, TinyRunPrintsEveryRowAndWritesItsJson) {
  const std::string dir = ::testing::TempDir() + "/kvt-bench-copy-cli-" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  const std::string json = dir + "/copy.json";
  const ToolResult r = RunTool(Bench(),
                               "copy --run-bytes 2KiB,64KiB --threads 1,2 --memory shared,private "
                               "--bytes 4MiB --pool 16MiB --iters 2 --json " +
                                   json);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("ratio"));
  const nlohmann::json doc = ReadJson(json);
  ASSERT_TRUE(doc.contains("results")) << doc.dump();
  ASSERT_EQ(doc["results"].size(), 8u) << doc.dump();
  for (const auto& row : doc["results"]) {
    EXPECT_GT(row.value("memcpy_gbps", 0.0), 0.0) << row.dump();
    EXPECT_GT(row.value("runs_gbps", 0.0), 0.0) << row.dump();
    EXPECT_EQ(row.value("bytes", 0), 4 << 20) << row.dump();
  }
  std::filesystem::remove_all(dir);
}

TEST(KvtBenchCopy, BadFlagsAreRefusedNamingTheValue) {
  ToolResult r = RunTool(Bench(), "copy --memory numa");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("--memory has 'numa'; give shared, private or huge"));
  r = RunTool(Bench(), "copy --run-bytes 8");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("--run-bytes has 8; give at least 64"));
  r = RunTool(Bench(), "copy --bytes 64MiB --pool 16MiB");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("must hold one run"));
}

// `kvt-bench control` (the control plane alone): a short run times round trips in every mode,
// its JSON holds them; bad flags are refused naming the value.
TEST(KvtBenchControl, ShortRunTimesEveryModeAndWritesItsJson) {
  const std::string dir =
      ::testing::TempDir() + "/kvt-bench-control-cli-" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  const std::string json = dir + "/control.json";
  const ToolResult r =
      RunTool(Bench(), "control --messages 200 --warmup 20 --pages 4 --json " + json);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("socket-poll"));
  const nlohmann::json doc = ReadJson(json);
  ASSERT_TRUE(doc.contains("results")) << doc.dump();
  ASSERT_EQ(doc["results"].size(), 3u) << doc.dump();
  for (const auto& row : doc["results"]) {
    EXPECT_FALSE(row.contains("error")) << row.dump();
    EXPECT_EQ(row.value("round_trips", 0), 200) << row.dump();
    EXPECT_GT(row.value("rtt_us_p50", 0.0), 0.0) << row.dump();
    EXPECT_LE(row.value("rtt_us_p50", 0.0), row.value("rtt_us_p99", 0.0)) << row.dump();
    EXPECT_DOUBLE_EQ(row.value("one_message_us_p50", 0.0), row.value("rtt_us_p50", 0.0) / 2);
  }
  std::filesystem::remove_all(dir);
}

TEST(KvtBenchControl, BadFlagsAreRefusedNamingTheValue) {
  ToolResult r = RunTool(Bench(), "control --modes socket,shm");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("--modes has 'shm'; give socket, socket-poll or lane"));
  r = RunTool(Bench(), "control --messages 5");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("--messages is 5; give 10..10000000"));
  r = RunTool(Bench(), "control --pages 0");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("--pages is 0; give 1..65536"));
}

// `kvt-bench cuda-calls`: bad flags are refused naming the value before any CUDA call; without
// a device it says so and exits 1; with one, a short run prints every figure and its JSON holds
// them, each positive.
TEST(KvtBenchCudaCalls, RefusesBadFlagsAndRunsWhereThereIsADevice) {
  ToolResult r = RunTool(Bench(), "cuda-calls --buffers 0");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("--buffers is 0; give 1..200"));
  r = RunTool(Bench(), "cuda-calls --iters 3");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("--iters is 3; give at least 10"));
  r = RunTool(Bench(), "cuda-calls --page-bytes 8");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("--page-bytes is 8; give 16 B..64 MiB"));

  const std::string dir =
      ::testing::TempDir() + "/kvt-bench-cuda-calls-cli-" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  const std::string json = dir + "/calls.json";
  r = RunTool(Bench(), "cuda-calls --iters 50 --json " + json);
  if (!::kvt::cuda::HasDevice()) {
    EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
    EXPECT_THAT(r.err, HasSubstr("needs a CUDA device"));
    std::filesystem::remove_all(dir);
    GTEST_SKIP() << "no CUDA device: only the refusals were checked";
  }
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("launch -> completion seen"));
  const nlohmann::json doc = ReadJson(json);
  ASSERT_TRUE(doc.contains("results")) << doc.dump();
  for (const char* key : {"launch_call", "record_call", "query_call", "notice_calls",
                          "launch_to_seen", "launch_to_notified"}) {
    ASSERT_TRUE(doc["results"].contains(key)) << key << ": " << doc.dump();
    EXPECT_GT(doc["results"][key].value("inline_p50", 0.0), 0.0) << key;
    EXPECT_GT(doc["results"][key].value("upload_p50", 0.0), 0.0) << key;
  }
  EXPECT_GT(doc["results"]["upload_calls"].value("upload_p50", 0.0), 0.0);
  std::filesystem::remove_all(dir);
}

}  // namespace

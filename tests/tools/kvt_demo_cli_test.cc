// Runs the built kvt-demo end to end on a small layout: it passes, and its JSON says which
// memory and backend the agents used (cuda:0 and cuda_ipc when this machine has a CUDA device,
// host and ucx otherwise); and it refuses contradictory choices before starting anything.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kvt/kernels/cuda_util.h"
#include "run_tool.h"
#include "tool_util.h"

namespace {

using kvt::tools::testing::RunTool;
using kvt::tools::testing::ToolResult;
using ::testing::HasSubstr;

constexpr char kSmall[] =
    "--requests 16 --concurrency 4 --min-tokens 1 --max-tokens 600 --layers 4 --heads 2 "
    "--head-dim 64 --pool-tokens 2048 --timeout-s 60";

// A binary beside this test (binaries copied into one folder), else where a build folder keeps
// it, else the path baked in.
std::string Binary(const std::string& name, const std::string& in_build, const char* built) {
  auto path = kvt::tools::FindTool(name, {name, in_build, built});
  return path.ok() ? *path : std::string(built);
}

const std::string& Demo() {
  static const std::string path = Binary("kvt-demo", "../../tools/demo/kvt-demo", KVT_DEMO_PATH);
  return path;
}

std::string DemoArgs(const std::string& json, const std::string& extra = "") {
  return std::string(kSmall) + " --json " + json + " --agent " +
         Binary("kvt-agent", "../../tools/agent/kvt-agent", KVT_AGENT_PATH) + " --bootstrap " +
         Binary("kvt-bootstrap", "../../tools/bootstrap/kvt-bootstrap", KVT_BOOTSTRAP_PATH) +
         (extra.empty() ? "" : " " + extra);
}

nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
}

class KvtDemoCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/kvt-demo-cli-" + std::to_string(getpid());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

// Without --device / --backend the demo picks by what the machine has, and reports it.
TEST_F(KvtDemoCliTest, PicksMemoryAndBackendByTheMachineAndSaysSo) {
  const std::string json = dir_ + "/demo.json";
  const ToolResult r = RunTool(Demo(), DemoArgs(json));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("PASS"));
  const nlohmann::json j = ReadJson(json);
  ASSERT_FALSE(j.is_discarded()) << "no JSON at " << json;
  EXPECT_EQ(j.value("verified", -1), 16);
  EXPECT_EQ(j.value("device_auto", false), true);
  if (kvt::cuda::HasDevice()) {
    EXPECT_EQ(j.value("memory", ""), "cuda:0");
    EXPECT_EQ(j.value("backend", ""), "cuda_ipc");
    EXPECT_FALSE(j.value("device_name", "").empty());
    EXPECT_THAT(r.out, HasSubstr("memory   cuda:0 ("));
  } else {
    EXPECT_EQ(j.value("memory", ""), "host");
    EXPECT_EQ(j.value("backend", ""), "ucx");
    EXPECT_THAT(r.out, HasSubstr("memory   host"));
    EXPECT_THAT(r.out, HasSubstr("backend  ucx"));
  }
}

// --device host keeps host pools and ucx even where a GPU is present.
TEST_F(KvtDemoCliTest, HostCanBeAskedFor) {
  const std::string json = dir_ + "/host.json";
  const ToolResult r = RunTool(Demo(), DemoArgs(json, "--device host"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const nlohmann::json j = ReadJson(json);
  ASSERT_FALSE(j.is_discarded()) << "no JSON at " << json;
  EXPECT_EQ(j.value("memory", ""), "host");
  EXPECT_EQ(j.value("backend", ""), "ucx");
  EXPECT_EQ(j.value("device_auto", true), false);
  EXPECT_EQ(j.value("verified", -1), 16);
}

TEST_F(KvtDemoCliTest, ContradictoryChoicesAreRefusedUpFront) {
  ToolResult r = RunTool(Demo(), "--device host --backend cuda_ipc");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--backend cuda_ipc"));
  EXPECT_THAT(r.err, HasSubstr("--device cuda:N"));

  r = RunTool(Demo(), "--device tpu:0");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("'tpu:0'"));

  r = RunTool(Demo(), "--device cuda:64");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("cuda:64"));
}

}  // namespace

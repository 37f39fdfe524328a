// Runs the built kvt-demo end to end on a small layout: it passes, and its JSON says which
// memory and backend the agents used (cuda:0 and cuda_ipc when this machine has a CUDA device,
// host and ucx otherwise); it refuses contradictory choices and out-of-range flags before
// starting anything; its working folder lives under $TMPDIR and is gone after a pass or a
// SIGINT/SIGTERM; an agent binary that cannot run is named.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kvt/kernels/cuda_util.h"
#include "kvt/testing/run_tool.h"
#include "tool_util.h"

namespace {

using kvt::testing::RunTool;
using kvt::testing::ToolResult;
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

TEST_F(KvtDemoCliTest, RangeErrorsSayFlagRangeAndValuePlainly) {
  ToolResult r = RunTool(Demo(), "--layers 0");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.out + r.err, HasSubstr("--layers: 0 is not allowed; use an integer in 1..4096"));
  EXPECT_THAT(r.out + r.err, ::testing::Not(::testing::ContainsRegex("[0-9]{20}")));

  r = RunTool(Demo(), "--layer-time-us -1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.out + r.err, HasSubstr("--layer-time-us: -1 is not allowed; use an integer >= 0"));

  r = RunTool(Demo(), "--timeout-s 0");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.out + r.err, HasSubstr("--timeout-s: 0 is not allowed; use an integer in 1..3600"));
}

TEST_F(KvtDemoCliTest, UnknownLogLevelIsRefused) {
  // The bad --device is never reached when the level is checked first, as it must be.
  const ToolResult r = RunTool("KVT_LOG_LEVEL=loud " + Demo(), "--device tpu:0");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("KVT_LOG_LEVEL='loud'"));
  EXPECT_THAT(r.err, HasSubstr("trace, debug, info, warn, error"));
}

// An agent path that cannot run is named as such, not as a raw wait status.
TEST_F(KvtDemoCliTest, AnAgentThatCannotRunIsNamed) {
  const std::string missing = dir_ + "/no-such-kvt-agent";
  const ToolResult r = RunTool(
      "TMPDIR=" + dir_ + " " + Demo(),
      std::string(kSmall) + " --device host --agent " + missing + " --bootstrap " +
          Binary("kvt-bootstrap", "../../tools/bootstrap/kvt-bootstrap", KVT_BOOTSTRAP_PATH));
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("cannot execute " + missing));
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("status 32512")));
}

// kvt-bootstrap refuses a heartbeat count under which entries expire between two refreshes.
TEST_F(KvtDemoCliTest, TheBootstrapRefusesOneMissedHeartbeat) {
  const ToolResult r =
      RunTool(Binary("kvt-bootstrap", "../../tools/bootstrap/kvt-bootstrap", KVT_BOOTSTRAP_PATH),
              "--missed-heartbeats 1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("--missed-heartbeats"));
  EXPECT_THAT(r.err, HasSubstr("2"));
}

// Entries of `dir` whose name starts with "kvt-demo-" (the demo's working folders).
std::vector<std::string> WorkingFolders(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.path().filename().string().rfind("kvt-demo-", 0) == 0) {
      out.push_back(entry.path().string());
    }
  }
  return out;
}

// The working folder goes under $TMPDIR and is removed after a passing run.
TEST_F(KvtDemoCliTest, WorkingFolderUnderTmpdirIsRemovedOnSuccess) {
  const std::string tmp = dir_ + "/tmp";
  std::filesystem::create_directories(tmp);
  const ToolResult r =
      RunTool("TMPDIR=" + tmp + " " + Demo(), DemoArgs(dir_ + "/ok.json", "--device host"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(WorkingFolders(tmp).empty());
}

class KvtDemoSignalTest : public KvtDemoCliTest, public ::testing::WithParamInterface<int> {};

// SIGINT / SIGTERM mid-run: the demo stops its agents, removes its working folder (made under
// $TMPDIR) and exits with 128 + the signal.
TEST_P(KvtDemoSignalTest, SignalRemovesTheWorkingFolder) {
  const int sig = GetParam();
  const std::string tmp = dir_ + "/tmp";
  std::filesystem::create_directories(tmp);
  const char* saved = getenv("TMPDIR");
  const std::string keep = saved != nullptr ? saved : "";
  setenv("TMPDIR", tmp.c_str(), 1);
  auto demo = kvt::tools::ChildProcess::Spawn(
      {Demo(),
       "--requests",
       "100000",
       "--concurrency",
       "2",
       "--min-tokens",
       "16",
       "--max-tokens",
       "64",
       "--layers",
       "2",
       "--heads",
       "2",
       "--head-dim",
       "64",
       "--pool-tokens",
       "1024",
       "--layer-time-us",
       "20000",
       "--timeout-s",
       "600",
       "--device",
       "host",
       "--agent",
       Binary("kvt-agent", "../../tools/agent/kvt-agent", KVT_AGENT_PATH),
       "--bootstrap",
       Binary("kvt-bootstrap", "../../tools/bootstrap/kvt-bootstrap", KVT_BOOTSTRAP_PATH)},
      dir_ + "/demo.log");
  if (saved != nullptr) {
    setenv("TMPDIR", keep.c_str(), 1);
  } else {
    unsetenv("TMPDIR");
  }
  ASSERT_TRUE(demo.ok()) << demo.status();
  // Wait until both agents are up (their ready files are in the working folder).
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  bool running = false;
  while (!running && std::chrono::steady_clock::now() < until && demo->running()) {
    for (const std::string& folder : WorkingFolders(tmp)) {
      running = running || std::filesystem::exists(folder + "/decode.json");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(running) << "the demo did not start its agents under $TMPDIR";
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // requests in flight
  demo->Signal(sig);
  const auto stop_until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (demo->running() && std::chrono::steady_clock::now() < stop_until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_FALSE(demo->running()) << "the demo did not stop on signal " << sig;
  EXPECT_TRUE(WorkingFolders(tmp).empty()) << "the working folder was left behind";
  std::ifstream log(dir_ + "/demo.log");
  std::stringstream text;
  text << log.rdbuf();
  EXPECT_THAT(text.str(), HasSubstr(sig == SIGINT ? "stopped by SIGINT" : "stopped by SIGTERM"));
}

INSTANTIATE_TEST_SUITE_P(Signals, KvtDemoSignalTest, ::testing::Values(SIGINT, SIGTERM),
                         [](const auto& info) {
                           return std::string(info.param == SIGINT ? "SIGINT" : "SIGTERM");
                         });

}  // namespace

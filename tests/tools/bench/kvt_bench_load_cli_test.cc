// Runs the built `kvt-bench load` on a tiny cluster (2 prefill + 2 decode agents, 50 requests in
// flight, 200 requests): it exits 0, its JSON counts every request verified and no failure, and
// names each agent's peak RSS; it refuses contradictory or out-of-range flags before starting
// anything; SIGTERM mid-run stops every agent and removes its working folder.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kvt/testing/run_tool.h"
#include "tool_util.h"

namespace {

using kvt::testing::RunTool;
using kvt::testing::ToolResult;
using ::testing::HasSubstr;

constexpr char kTiny[] =
    "load --prefill 2 --decode 2 --in-flight 50 --requests 200 --layers 4 --heads 1 "
    "--head-dim 32 --median-tokens 256 --max-tokens 2048 --ceiling none --timeout-s 60";

// A binary beside this test (binaries copied into one folder), else where a build folder keeps
// it, else the path baked in.
std::string Binary(const std::string& name, const std::string& in_build, const char* built) {
  auto path = kvt::tools::FindTool(name, {name, in_build, built});
  return path.ok() ? *path : std::string(built);
}

const std::string& Bench() {
  static const std::string path =
      Binary("kvt-bench", "../../tools/bench/kvt-bench", KVT_BENCH_PATH);
  return path;
}

std::string Agents() {
  return " --agent-bin " + Binary("kvt-agent", "../../tools/agent/kvt-agent", KVT_AGENT_PATH) +
         " --bootstrap-bin " +
         Binary("kvt-bootstrap", "../../tools/bootstrap/kvt-bootstrap", KVT_BOOTSTRAP_PATH);
}

nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
}

// Entries of `dir` whose name starts with "kvt-bench-load-" (the command's working folders).
std::vector<std::string> WorkingFolders(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.path().filename().string().rfind("kvt-bench-load-", 0) == 0) {
      out.push_back(entry.path().string());
    }
  }
  return out;
}

class KvtBenchLoadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/kvt-bench-load-cli-" + std::to_string(getpid());
    tmp_ = dir_ + "/tmp";
    std::filesystem::create_directories(tmp_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_, tmp_;
};

TEST_F(KvtBenchLoadTest, TinyClusterPassesWithZeroFailures) {
  const std::string json = dir_ + "/load.json";
  const ToolResult r =
      RunTool("TMPDIR=" + tmp_ + " " + Bench(), std::string(kTiny) + Agents() + " --json " + json);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("PASS"));
  const nlohmann::json j = ReadJson(json);
  ASSERT_FALSE(j.is_discarded()) << "no JSON at " << json;
  EXPECT_EQ(j.value("failures", -1), 0);
  ASSERT_EQ(j["runs"].size(), 1u);
  const nlohmann::json& run = j["runs"][0];
  EXPECT_EQ(run.value("requests", -1), 200);
  EXPECT_EQ(run.value("verified", -1), 200);
  EXPECT_EQ(run.value("failed", -1), 0);
  EXPECT_GT(run.value("requests_per_s", 0.0), 0.0);
  EXPECT_GT(run["latency_ms"].value("p99", 0.0), 0.0);
  ASSERT_EQ(run["agents"].size(), 4u);
  uint64_t decoded = 0;
  for (const nlohmann::json& a : run["agents"]) {
    EXPECT_GT(a.value("peak_rss_kib", 0), 0) << a.dump();
    EXPECT_EQ(a.value("failed", 1), 0) << a.dump();
    EXPECT_EQ(a.value("corrupted", 1), 0) << a.dump();
    if (a.value("role", "") == "decode") decoded += a.value("verified", uint64_t{0});
  }
  EXPECT_EQ(decoded, 200u + 4u) << "the timed requests and one warm-up request per pair";
  EXPECT_GT(j.value("bench_peak_rss_kib", 0), 0);
  EXPECT_TRUE(WorkingFolders(tmp_).empty()) << "a passing run removes its working folder";
}

TEST_F(KvtBenchLoadTest, BadFlagsAreRefusedBeforeAnythingStarts) {
  ToolResult r = RunTool(Bench(), "load --min-tokens 100 --max-tokens 10");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--min-tokens 100 exceeds --max-tokens 10"));

  r = RunTool(Bench(), "load --median-tokens 9000");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--median-tokens 9000 is outside"));

  r = RunTool(Bench(), "load --backend cuda_ipc");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--device cuda:N"));

  r = RunTool(Bench(), "load --pool-tokens 100");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("raise --pool-tokens"));

  r = RunTool(Bench(), "load --in-flight 0");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.out + r.err,
              HasSubstr("--in-flight: 0 is not allowed; use an integer in 1..65536"));

  r = RunTool(Bench(), "load --prefill 65");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.out + r.err, HasSubstr("--prefill: 65 is not allowed; use an integer in 1..64"));

  r = RunTool(Bench(), "load --token-dist zipf");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.out + r.err, HasSubstr("zipf"));

  r = RunTool("TMPDIR=" + tmp_ + " " + Bench(),
              std::string(kTiny) + " --agent-bin " + dir_ + "/no-such-kvt-agent" +
                  Agents().substr(Agents().find(" --bootstrap-bin")));
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("cannot execute " + dir_ + "/no-such-kvt-agent"));
}

// SIGTERM mid-run: every agent is stopped, the working folder is removed, the exit code is
// 128 + 15.
TEST_F(KvtBenchLoadTest, SigtermStopsTheAgentsAndRemovesTheWorkingFolder) {
  const char* saved = getenv("TMPDIR");
  const std::string keep = saved != nullptr ? saved : "";
  setenv("TMPDIR", tmp_.c_str(), 1);
  std::vector<std::string> argv = {Bench()};
  const std::string args = std::string(kTiny) + Agents();
  {
    std::istringstream words(args);
    for (std::string w; words >> w;) argv.push_back(w == "200" ? "1000000" : w);
  }
  auto bench = kvt::tools::ChildProcess::Spawn(argv, dir_ + "/bench.log");
  if (saved != nullptr) {
    setenv("TMPDIR", keep.c_str(), 1);
  } else {
    unsetenv("TMPDIR");
  }
  ASSERT_TRUE(bench.ok()) << bench.status().ToString();
  // Once the last agent has written its ready file, every agent runs.
  std::vector<pid_t> pids;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (pids.size() < 4 && std::chrono::steady_clock::now() < until) {
    pids.clear();
    for (const std::string& folder : WorkingFolders(tmp_)) {
      for (const char* name : {"load-p0", "load-p1", "load-d0", "load-d1"}) {
        const nlohmann::json ready = ReadJson(folder + "/" + name + ".json");
        if (!ready.is_discarded() && ready.contains("pid")) pids.push_back(ready["pid"].get<int>());
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(pids.size(), 4u) << kvt::tools::LogTail(dir_ + "/bench.log", 20);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // requests in flight
  bench->Signal(SIGTERM);
  const int status = bench->Stop(std::chrono::seconds(20));
  ASSERT_TRUE(WIFEXITED(status)) << kvt::tools::DescribeWaitStatus(status);
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM) << kvt::tools::LogTail(dir_ + "/bench.log", 20);
  for (pid_t pid : pids) {
    EXPECT_EQ(kill(pid, 0), -1) << "agent pid " << pid << " still runs";
    EXPECT_EQ(errno, ESRCH);
  }
  EXPECT_TRUE(WorkingFolders(tmp_).empty());
}

}  // namespace

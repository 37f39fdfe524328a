// Runs the built kvt-info and checks its command line: exit codes, JSON keys and values, guard
// messages and bad-value messages.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "kvt/testing/run_tool.h"

namespace {

using nlohmann::json;
using ::testing::HasSubstr;
using Result = kvt::testing::ToolResult;

Result RunInfo(const std::string& args) { return kvt::testing::RunTool(KVT_INFO_PATH, args); }

const char* kBase =
    "layout --layers 2 --heads 2 --head-dim 8 --dtype bf16 --page-size 4 --tokens 16";

json Parse(const Result& r) {
  json j = json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << "not JSON: " << r.out << "\nstderr: " << r.err;
  return j;
}

TEST(KvtInfoCliTest, SystemInfoJson) {
  const Result r = RunInfo("--json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = Parse(r);
  ASSERT_TRUE(j.contains("cuda"));
  EXPECT_TRUE(j["cuda"].contains("count"));
  if (j["cuda"]["count"] == 0) {
    EXPECT_TRUE(j["cuda"]["reason"].is_string());
  }
  EXPECT_TRUE(j["nccl"]["version"].is_string());
  EXPECT_TRUE(j["ucx"]["version"].is_string());
  EXPECT_TRUE(j["ucx"]["transports"].is_array());
}

TEST(KvtInfoCliTest, SystemInfoText) {
  const Result r = RunInfo("");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("CUDA devices:"));
  EXPECT_THAT(r.out, HasSubstr("NCCL:"));
  EXPECT_THAT(r.out, HasSubstr("UCX:"));
}

TEST(KvtInfoCliTest, LayoutJsonTwoLayers) {
  const Result r = RunInfo(std::string(kBase) + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = Parse(r);
  for (const char* key : {"data_lens", "item_lens", "unit_lens", "layerwise_offsets",
                          "k_size_bytes", "v_size_bytes", "state_layers", "slab_index"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["data_lens"], json({640, 640, 640, 640}));
  EXPECT_EQ(j["item_lens"], json({128, 128, 128, 128}));
  EXPECT_EQ(j["unit_lens"], json({16, 16, 16, 16}));
  EXPECT_EQ(j["layerwise_offsets"], json({{0, 2}, {1, 3}}));
  EXPECT_EQ(j["k_size_bytes"], 1280);
  EXPECT_EQ(j["v_size_bytes"], 1280);
  EXPECT_EQ(j["state_layers"], json::array());
  EXPECT_EQ(j["slab_index"], json({nullptr, nullptr}));
}

TEST(KvtInfoCliTest, LayoutTable) {
  const Result r = RunInfo(kBase);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("layer"));
  EXPECT_THAT(r.out, HasSubstr("2 layers x [20, 2, 8] bf16"));
}

TEST(KvtInfoCliTest, HybridSlabAliasesAndCountsOnce) {
  const Result r = RunInfo(
      "layout --layers 4 --heads 2 --head-dim 8 --dtype bf16 --page-size 4 --tokens 16 "
      "--layer-types full_attention,sliding_attention,full_attention,sliding_attention "
      "--sliding-window 128 --hybrid-slab --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = Parse(r);
  EXPECT_EQ(j["slab_index"], json({0, 0, 1, 1}));
  EXPECT_EQ(j["k_size_bytes"], 1280);
  EXPECT_EQ(j["data_lens"].size(), 8u);
}

TEST(KvtInfoCliTest, HybridSlabWithPdIsRefused) {
  const Result r = RunInfo(
      "layout --layers 4 --heads 2 --head-dim 8 --dtype bf16 --page-size 4 --tokens 16 "
      "--layer-types full_attention,sliding_attention,full_attention,sliding_attention "
      "--hybrid-slab --pd --json");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("incompatible with PD disaggregation"));
  EXPECT_THAT(r.err, HasSubstr("clobber the peer's pairing"));
}

const char* kState =
    "layout --layers 4 --heads 2 --head-dim 8 --dtype bf16 --page-size 4 --tokens 16 "
    "--layer-types full_attention,linear_attention,full_attention,linear_attention "
    "--conv-state-shape 4,8 --ssm-state-shape 2,4,8";

TEST(KvtInfoCliTest, StateLayersWithoutPdPrintNullInfos) {
  const Result r = RunInfo(std::string(kState) + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = Parse(r);
  EXPECT_EQ(j["state_layers"], json({1, 3}));
  EXPECT_TRUE(j["data_lens"].is_null());
  EXPECT_TRUE(j["item_lens"].is_null());
  EXPECT_TRUE(j["unit_lens"].is_null());
  EXPECT_EQ(j["layerwise_offsets"].size(), 4u);
  EXPECT_EQ(j["k_size_bytes"], 1280);
  EXPECT_EQ(j["state_slabs"]["ssm_shape"], json({5, 2, 8, 4}));
}

TEST(KvtInfoCliTest, StateLayersWithPdAreRefused) {
  const Result r = RunInfo(std::string(kState) + " --pd --json");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("state layers [1, 3]"));
  EXPECT_THAT(r.err, HasSubstr("no per-layer KV"));
}

TEST(KvtInfoCliTest, PageTooSmallForStateNamesTheFit) {
  const Result r = RunInfo(
      "layout --layers 2 --heads 2 --head-dim 8 --dtype bf16 --page-size 4 --tokens 16 "
      "--layer-types full_attention,linear_attention --conv-state-shape 4,8 "
      "--ssm-state-shape 2,4,16 --ssm-dtype fp32");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("use page_size >= 8"));
}

TEST(KvtInfoCliTest, BadValuesAreNamed) {
  struct Case {
    std::string args;
    std::string message;
  };
  const Case cases[] = {
      {"layout --layers 0 --heads 2 --head-dim 8 --dtype bf16 --page-size 4 --tokens 16",
       "layer_num must be > 0 (got 0)"},
      {"layout --layers 2 --heads 2 --head-dim 8 --dtype bf17 --page-size 4 --tokens 16", "bf17"},
      {"layout --layers 2 --heads 2 --head-dim 8 --dtype bf16 --page-size -4 --tokens 16",
       "page_size must be > 0 (got -4)"},
      {std::string(kBase) + " --layer-types full_attention,mamba", "'mamba'"},
      {std::string(kBase) + " --layer-types full_attention", "layer_types has 1 entries"},
      {std::string(kBase) + " --sliding-window 0", "sliding_window_tokens must be > 0"},
      {"layout --layers 3 --heads 2 --head-dim 8 --dtype bf16 --page-size 4 --tokens 16 "
       "--layer-types full_attention,sliding_attention,full_attention --hybrid-slab",
       "uneven groups"},
  };
  for (const Case& c : cases) {
    const Result r = RunInfo(c.args);
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_THAT(r.err, HasSubstr(c.message)) << c.args;
  }
}

TEST(KvtInfoCliTest, CommandLineErrorsExitTwo) {
  Result r =
      RunInfo("layout --layers two --heads 2 --head-dim 8 --dtype bf16 --page-size 4 --tokens 16");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err + r.out, HasSubstr("two"));
  r = RunInfo("layout --heads 2");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err + r.out, HasSubstr("--layers"));
  r = RunInfo("--help");
  EXPECT_EQ(r.exit_code, 0);
}

}  // namespace

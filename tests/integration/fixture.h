// The gtest side of the integration harness: a fixture that owns a Cluster (bootstrap started
// in SetUp, everything stopped in TearDown, logs printed and kept when a test failed); the
// Status assertions come with it (kvt/testing/status.h).
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <iostream>
#include <memory>
#include <string>

#include "cluster.h"
#include "kvt/testing/status.h"

namespace kvt::integration {

inline constexpr char kClusterTokenEnv[] = "KVT_CLUSTER_TOKEN";

class ClusterTest : public ::testing::Test {
 protected:
  // A fixture that wants authentication returns the token here; every process inherits it
  // from this process's environment (servers and clients read KVT_CLUSTER_TOKEN).
  virtual std::string ClusterToken() const { return ""; }

  void SetUp() override {
    token_ = ClusterToken();
    if (!token_.empty()) {
      setenv(kClusterTokenEnv, token_.c_str(), 1);
    } else {
      // A token leaked in from the caller's shell would change what these tests exercise.
      unsetenv(kClusterTokenEnv);
    }
    auto cluster = Cluster::Create();
    ASSERT_TRUE(cluster.ok()) << cluster.status().ToString();
    cluster_ = std::move(cluster).value();
  }

  void TearDown() override {
    if (cluster_ != nullptr && HasFailure()) {
      cluster_->KeepScratch();
      std::cerr << "logs of the failed test:\n" << cluster_->LogTails() << std::flush;
    }
    cluster_.reset();
    if (!token_.empty()) unsetenv(kClusterTokenEnv);
  }

  static AgentSpec Prefill(const std::string& name, int64_t layer_time_us = 0) {
    AgentSpec spec;
    spec.role = "prefill";
    spec.name = name;
    spec.layer_time_us = layer_time_us;
    return spec;
  }

  static AgentSpec Decode(const std::string& name) {
    AgentSpec spec;
    spec.role = "decode";
    spec.name = name;
    return spec;
  }

  std::unique_ptr<Cluster> cluster_;

 private:
  std::string token_;
};

}  // namespace kvt::integration

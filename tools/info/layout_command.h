// `kvt-info layout`: builds a pool on (unpinned, lazily mapped) host memory from command-line
// flags and prints its layout, as a table or as JSON.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

namespace kvt::tools {

struct LayoutFlags {
  int64_t layers = 0;
  int64_t heads = 0;
  int64_t head_dim = 0;
  std::string dtype = "bf16";
  int64_t page_size = 0;
  int64_t tokens = 0;
  std::string layer_types;
  int64_t sliding_window = 0;
  bool sliding_window_set = false;
  bool hybrid_slab = false;
  bool pd = false;
  std::vector<int64_t> conv_state_shape;
  std::vector<int64_t> ssm_state_shape;
  std::string conv_dtype;
  std::string ssm_dtype;
};

// Registers the subcommand's flags on `sub`.
void AddLayoutFlags(CLI::App* sub, LayoutFlags* flags);

// Runs the subcommand; returns the process exit code (errors go to stderr).
int RunLayout(const LayoutFlags& flags, bool json);

}  // namespace kvt::tools

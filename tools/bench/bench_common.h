// Helpers shared by kvt-bench subcommands: size parsing, medians, timestamps, the command line,
// the machine description, and JSON output. Not thread-safe (single-threaded tool).
#pragma once

#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvt/common/status.h"

namespace kvt::bench {

// "1GiB", "512MiB", "64M", "1e9", "4096" -> bytes. K/M/G are powers of 1000, Ki/Mi/Gi of 1024.
StatusOr<int64_t> ParseBytes(const std::string& text);

// "1,16,64" -> {1, 16, 64}; every value must be > 0.
StatusOr<std::vector<int>> ParseIntList(const std::string& text);

// "a,b,c" -> {"a", "b", "c"} (empty items kept, so that the caller's check names them).
std::vector<std::string> SplitList(const std::string& text);

// A steady-clock duration in milliseconds.
inline double Ms(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

double Median(std::vector<double> values);

// Nearest-rank percentile (p in [0, 1]) of unsorted values; 0 for none.
double Percentile(std::vector<double> values, double p);

// UTC, ISO 8601 to the second.
std::string NowUtc();

void SetCommandLine(int argc, char** argv);
const std::string& CommandLine();

// GPU name, SM count, memory, driver and runtime versions; or {"cpu": true, "reason": ...}.
nlohmann::json DescribeMachine(bool use_gpu);

// Writes `doc` (pretty-printed) to `path`.
Status WriteJson(const std::string& path, const nlohmann::json& doc);

// Bytes per second as GB/s (1e9).
inline double GBps(double bytes, double ms) { return ms > 0 ? bytes / (ms * 1e-3) / 1e9 : 0.0; }

}  // namespace kvt::bench

#include "bench_common.h"

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <fstream>
#include <sstream>

#include "kvt/kernels/cuda_util.h"

namespace kvt::bench {
namespace {

std::string& CommandLineStorage() {
  static std::string command_line;
  return command_line;
}

}  // namespace

StatusOr<int64_t> ParseBytes(const std::string& text) {
  size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(text, &pos);
  } catch (...) {
    return InvalidArgument("not a byte count: '" + text + "' (try 1GiB, 512MiB, 4096)");
  }
  std::string unit = text.substr(pos);
  double scale = 1;
  if (unit.empty() || unit == "B") {
    scale = 1;
  } else if (unit == "K" || unit == "KB") {
    scale = 1e3;
  } else if (unit == "M" || unit == "MB") {
    scale = 1e6;
  } else if (unit == "G" || unit == "GB") {
    scale = 1e9;
  } else if (unit == "Ki" || unit == "KiB") {
    scale = 1024.0;
  } else if (unit == "Mi" || unit == "MiB") {
    scale = 1024.0 * 1024;
  } else if (unit == "Gi" || unit == "GiB") {
    scale = 1024.0 * 1024 * 1024;
  } else {
    return InvalidArgument("unknown byte unit '" + unit + "' in '" + text +
                           "' (use B, K, M, G, KiB, MiB, GiB)");
  }
  const double bytes = value * scale;
  if (!(bytes >= 1) || bytes > 9e18) {
    return InvalidArgument("byte count out of range: '" + text + "'");
  }
  return static_cast<int64_t>(std::llround(bytes));
}

std::vector<std::string> SplitList(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(item);
  return out;
}

StatusOr<std::vector<int>> ParseIntList(const std::string& text) {
  std::vector<int> out;
  for (const std::string& item : SplitList(text)) {
    try {
      size_t pos = 0;
      int v = std::stoi(item, &pos);
      if (pos != item.size() || v <= 0) throw std::invalid_argument(item);
      out.push_back(v);
    } catch (...) {
      return InvalidArgument("not a list of positive integers: '" + text + "'");
    }
  }
  if (out.empty()) return InvalidArgument("empty list: '" + text + "'");
  return out;
}

double Median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(values.size())));
  return values[std::clamp<size_t>(rank, 1, values.size()) - 1];
}

std::string NowUtc() {
  const std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

void SetCommandLine(int argc, char** argv) {
  std::string s;
  for (int i = 0; i < argc; ++i) {
    if (i) s += ' ';
    s += argv[i];
  }
  CommandLineStorage() = s;
}

const std::string& CommandLine() { return CommandLineStorage(); }

nlohmann::json DescribeMachine(bool use_gpu) {
  nlohmann::json m;
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  m["host"] = host;
  m["cpu_threads"] = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  if (!use_gpu) {
    m["gpu"] = nullptr;
    const auto count = cuda::DeviceCount();
    if (count.count == 0) m["no_gpu_reason"] = count.reason;
    return m;
  }
  int device = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) == cudaSuccess &&
      cudaGetDeviceProperties(&prop, device) == cudaSuccess) {
    m["gpu"] = prop.name;
    m["sm_count"] = prop.multiProcessorCount;
    m["memory_bytes"] = static_cast<int64_t>(prop.totalGlobalMem);
    m["l2_bytes"] = prop.l2CacheSize;
    m["compute_capability"] = std::to_string(prop.major) + "." + std::to_string(prop.minor);
  }
  int driver = 0, runtime = 0;
  if (cudaDriverGetVersion(&driver) == cudaSuccess) m["cuda_driver"] = driver;
  if (cudaRuntimeGetVersion(&runtime) == cudaSuccess) m["cuda_runtime"] = runtime;
  return m;
}

Status WriteJson(const std::string& path, const nlohmann::json& doc) {
  std::ofstream out(path);
  if (!out) return InvalidArgument("cannot open '" + path + "' for writing");
  out << doc.dump(2) << "\n";
  if (!out) return Internal("write to '" + path + "' failed");
  return OkStatus();
}

}  // namespace kvt::bench

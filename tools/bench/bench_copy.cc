// `kvt-bench copy`: the host copy that the ucx backend's shared-memory path is made of
// (StreamCopyRuns, by its copy threads, each a slice of a write's runs), alone: no engine, no
// control plane, no UCX. A request's bytes as random, distinct runs of --run-bytes between two
// pools, copied by 1..N threads, against one thread's contiguous memcpy of the same bytes in the
// same run (timed interleaved, one of each per round). It tells what the machine allows for a
// given page size, so that `kvt-bench transfer` figures can be read against it.
//
// Memory: "shared" (MAP_SHARED anonymous memory: shmem, as UCX's shared-memory segments and a
// peer's pool mapped here are), "private" (anonymous, no huge pages) or "huge" (anonymous with
// MADV_HUGEPAGE: transparent huge pages where the kernel grants them; the table says how many
// it did).
#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backends/common/stream_copy.h"
#include "bench_common.h"
#include "commands.h"

namespace kvt::bench {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using transfer::CopyRun;

struct CopyOptions {
  std::string run_bytes = "2KiB,32KiB,128KiB";
  std::string threads = "1,2";
  std::string memory = "shared,huge";
  std::string bytes = "128MiB";
  std::string pool = "1GiB";
  int iters = 7;
  uint32_t seed = 1;
  std::string json_path;
};

// An anonymous mapping, unmapped on destruction.
class Mapping {
 public:
  static StatusOr<Mapping> Create(int64_t bytes, const std::string& memory) {
    const int flags = (memory == "shared" ? MAP_SHARED : MAP_PRIVATE) | MAP_ANONYMOUS;
    void* p = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, flags, -1, 0);
    if (p == MAP_FAILED) {
      return ResourceExhausted(fmt::format("mmap of {} bytes ({}): {}", bytes, memory,
                                           std::strerror(errno)));
    }
    Mapping m;
    m.base_ = static_cast<uint8_t*>(p);
    m.bytes_ = bytes;
    if (memory == "huge") (void)madvise(p, static_cast<size_t>(bytes), MADV_HUGEPAGE);
    return m;
  }
  Mapping() = default;
  Mapping(Mapping&& o) noexcept : base_(std::exchange(o.base_, nullptr)), bytes_(o.bytes_) {}
  Mapping& operator=(Mapping&& o) noexcept {
    std::swap(base_, o.base_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~Mapping() {
    if (base_ != nullptr) munmap(base_, static_cast<size_t>(bytes_));
  }
  uint8_t* get() const { return base_; }

 private:
  uint8_t* base_ = nullptr;
  int64_t bytes_ = 0;
};

// AnonHugePages of this process, KiB (/proc/self/smaps_rollup); -1 when unreadable.
int64_t AnonHugeKiB() {
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen("/proc/self/smaps_rollup", "r"), &std::fclose);
  if (!f) return -1;
  char line[256];
  while (std::fgets(line, sizeof(line), f.get()) != nullptr) {
    long long kib = 0;
    if (std::sscanf(line, "AnonHugePages: %lld kB", &kib) == 1) return kib;
  }
  return -1;
}

Status RunSize(const CopyOptions& o, int64_t run, const std::string& memory,
               const std::vector<int>& threads, int64_t bytes, int64_t pool, std::mt19937& rng,
               json& results) {
  KVT_ASSIGN_OR_RETURN(Mapping src, Mapping::Create(pool, memory));
  KVT_ASSIGN_OR_RETURN(Mapping dst, Mapping::Create(pool, memory));
  std::memset(src.get(), 0x11, static_cast<size_t>(pool));
  std::memset(dst.get(), 0x22, static_cast<size_t>(pool));
  const int64_t huge_kib = AnonHugeKiB();
  const int64_t slots = pool / run;
  const int64_t count = bytes / run;
  std::vector<int64_t> from(static_cast<size_t>(slots)), to(static_cast<size_t>(slots));
  std::iota(from.begin(), from.end(), 0);
  std::iota(to.begin(), to.end(), 0);
  std::shuffle(from.begin(), from.end(), rng);
  std::shuffle(to.begin(), to.end(), rng);
  std::vector<CopyRun> runs(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    runs[i] = CopyRun{0, static_cast<uint64_t>(from[i] * run), static_cast<uint64_t>(to[i] * run),
                      static_cast<uint64_t>(run)};
  }
  const uint8_t* src_bases[1] = {src.get()};
  uint8_t* dst_bases[1] = {dst.get()};
  for (int n : threads) {
    std::vector<double> memcpy_ms, runs_ms;
    for (int i = 0; i < o.iters + 1; ++i) {  // the first round warms up
      auto t0 = Clock::now();
      std::memcpy(dst.get(), src.get(), static_cast<size_t>(count * run));
      const double m = Ms(Clock::now() - t0);
      t0 = Clock::now();
      std::vector<std::thread> workers;
      for (int t = 0; t < n; ++t) {
        workers.emplace_back([&, t] {
          const size_t lo = runs.size() * t / n, hi = runs.size() * (t + 1) / n;
          transfer::StreamCopyRuns(std::span<const CopyRun>(runs.data() + lo, hi - lo), src_bases,
                                   dst_bases);
        });
      }
      for (std::thread& w : workers) w.join();
      const double r = Ms(Clock::now() - t0);
      if (i > 0) {
        memcpy_ms.push_back(m);
        runs_ms.push_back(r);
      }
    }
    // The last copy must have moved the right bytes (both pools hold one value each).
    for (int64_t i = 0; i < count; i += std::max<int64_t>(1, count / 64)) {
      if (dst.get()[runs[i].dst_offset] != 0x11 ||
          dst.get()[runs[i].dst_offset + run - 1] != 0x11) {
        return DataLoss(fmt::format("run {} of {} bytes was not copied", i, run));
      }
    }
    const double moved = static_cast<double>(count * run);
    const double memcpy_gbps = GBps(moved, Median(memcpy_ms));
    const double runs_gbps = GBps(moved, Median(runs_ms));
    const double ratio = memcpy_gbps > 0 ? runs_gbps / memcpy_gbps : 0;
    fmt::print("{:>9} {:>8} {:>8} {:>10} {:>9.2f} {:>9.2f} {:>7.2f}\n", run, memory, n,
               huge_kib < 0 ? std::string("?") : std::to_string(huge_kib / 1024), memcpy_gbps,
               runs_gbps, ratio);
    results.push_back(json{{"run_bytes", run},
                           {"memory", memory},
                           {"threads", n},
                           {"runs", count},
                           {"bytes", count * run},
                           {"anon_huge_mib", huge_kib < 0 ? -1 : huge_kib / 1024},
                           {"memcpy_gbps", memcpy_gbps},
                           {"memcpy_ms_median", Median(memcpy_ms)},
                           {"runs_gbps", runs_gbps},
                           {"runs_ms_median", Median(runs_ms)},
                           {"ratio_runs_to_memcpy", ratio}});
  }
  return OkStatus();
}

Status RunCopy(const CopyOptions& o) {
  KVT_ASSIGN_OR_RETURN(int64_t bytes, ParseBytes(o.bytes));
  KVT_ASSIGN_OR_RETURN(int64_t pool, ParseBytes(o.pool));
  KVT_ASSIGN_OR_RETURN(std::vector<int> threads, ParseIntList(o.threads));
  std::vector<int64_t> run_sizes;
  for (const std::string& item : SplitList(o.run_bytes)) {
    KVT_ASSIGN_OR_RETURN(int64_t r, ParseBytes(item));
    if (r < 64) return InvalidArgument(fmt::format("--run-bytes has {}; give at least 64", r));
    run_sizes.push_back(r);
  }
  const std::vector<std::string> memories = SplitList(o.memory);
  if (run_sizes.empty() || memories.empty()) {
    return InvalidArgument(fmt::format(
        "--run-bytes ('{}') and --memory ('{}') each need at least one value", o.run_bytes,
        o.memory));
  }
  for (const std::string& m : memories) {
    if (m != "shared" && m != "private" && m != "huge") {
      return InvalidArgument(fmt::format(
          "--memory has '{}'; give shared, private or huge (comma-separated)", m));
    }
  }
  for (int n : threads) {
    if (n > 256) return InvalidArgument(fmt::format("--threads has {}; at most 256", n));
  }
  if (o.iters < 1) return InvalidArgument(fmt::format("--iters is {}; give at least 1", o.iters));
  for (int64_t r : run_sizes) {
    if (bytes < r || pool < bytes) {
      return InvalidArgument(fmt::format(
          "--bytes ({}) must hold one run of {} bytes and fit --pool ({})", bytes, r, pool));
    }
  }

  json doc;
  doc["tool"] = "kvt-bench copy";
  doc["date_utc"] = NowUtc();
  doc["command"] = CommandLine();
  doc["machine"] = DescribeMachine(false);
  doc["machine"]["cpu_threads"] = std::thread::hardware_concurrency();
  doc["config"] = json{{"bytes", bytes}, {"pool", pool}, {"iters", o.iters}, {"seed", o.seed}};
  doc["notes"] =
      "runs = StreamCopyRuns (the ucx backend's direct copy) of random, distinct runs between two "
      "pools, the runs cut evenly between the threads; memcpy = one thread, contiguous, the same "
      "bytes, timed interleaved with it. GB/s of the median round (1e9).";
  fmt::print("kvt-bench copy ({}), {} hardware threads, {} MiB per round from pools of {} MiB, "
             "median of {}\n",
             doc["date_utc"].get<std::string>(), std::thread::hardware_concurrency(),
             bytes >> 20, pool >> 20, o.iters);
  fmt::print("{:>9} {:>8} {:>8} {:>10} {:>9} {:>9} {:>7}\n", "run B", "memory", "threads",
             "huge MiB", "memcpy", "runs", "ratio");
  std::mt19937 rng(o.seed);
  json results = json::array();
  for (int64_t r : run_sizes) {
    for (const std::string& m : memories) {
      KVT_RETURN_IF_ERROR(RunSize(o, r, m, threads, bytes, pool, rng, results));
    }
  }
  doc["results"] = results;
  fmt::print(
      "memcpy = one thread, contiguous, the same bytes; runs = the threads copying random runs "
      "(StreamCopyRuns); huge MiB = transparent huge pages the process held.\n");
  if (!o.json_path.empty()) {
    KVT_RETURN_IF_ERROR(WriteJson(o.json_path, doc));
    fmt::print("wrote {}\n", o.json_path);
  }
  return OkStatus();
}

}  // namespace

void AddCopyCommand(CLI::App& app, int& exit_code) {
  auto opts = std::make_shared<CopyOptions>();
  CLI::App* cmd = app.add_subcommand(
      "copy",
      "the host copy of the ucx shared-memory path alone: random runs copied by 1..N threads "
      "(StreamCopyRuns) vs one thread's contiguous memcpy of the same bytes");
  cmd->add_option("--run-bytes", opts->run_bytes, "bytes per run (a page of one buffer), list")
      ->capture_default_str();
  cmd->add_option("--threads", opts->threads, "copy threads, list")->capture_default_str();
  cmd->add_option("--memory", opts->memory, "shared, private or huge, list")
      ->capture_default_str();
  cmd->add_option("--bytes", opts->bytes, "bytes copied per round")->capture_default_str();
  cmd->add_option("--pool", opts->pool, "bytes of each of the two pools the runs lie in")
      ->capture_default_str();
  cmd->add_option("--iters", opts->iters, "timed rounds per figure")->capture_default_str();
  cmd->add_option("--seed", opts->seed, "random run placement")->capture_default_str();
  cmd->add_option("--json", opts->json_path, "write all figures to this JSON file");
  cmd->callback([opts, &exit_code] {
    Status s = RunCopy(*opts);
    if (!s.ok()) {
      fmt::print(stderr, "kvt-bench copy: {}\n", s.ToString());
      exit_code = 1;
    }
  });
}

}  // namespace kvt::bench

// `kvt-bench cuda-calls`: what the CUDA runtime costs a one-page cuda_ipc write, call by call,
// on this card and host: the floor under `kvt-bench transfer`'s one-page latency. Each round
// posts one page-copy kernel the way the cuda_ipc backend does (tables uploaded, or tables in
// the launch's parameters) and times, on the host:
//   - each call alone: the launch, an event record, a query of a completed event, and the
//     stream wait plus host function that a completion notice costs;
//   - the call that enqueues a completion word's signal (cuStreamWriteValue64) behind the kernel;
//   - from the start of the launch call until the completion is seen by a thread that spins on
//     cudaEventQuery (even rounds) or on the completion word's load (odd rounds), and until a
//     host function behind it has run (a notice's wake-up).
// The copy is one page of --buffers buffers of --page-bytes each (a one-page request of a model
// with --buffers / 2 layers), device to device on one GPU. Medians and p90 over --iters rounds.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.h"
#include "bench_gpu.h"
#include "commands.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/kernels/kernels.h"

namespace kvt::bench {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

struct CudaCallsOptions {
  int32_t buffers = 64;
  std::string page_bytes = "2KiB";
  int iters = 2000;
  std::string json_path;
};

double Us(Clock::time_point a, Clock::time_point b) { return Ms(b - a) * 1e3; }

// A CUDA host function: flags that it ran (no CUDA calls allowed here).
void CUDART_CB MarkRan(void* flag) {
  static_cast<std::atomic<bool>*>(flag)->store(true, std::memory_order_release);
}

Status RunCudaCalls(const CudaCallsOptions& o) {
  KVT_ASSIGN_OR_RETURN(const int64_t page_bytes, ParseBytes(o.page_bytes));
  if (o.buffers < 1 || o.buffers > 200) {
    return InvalidArgument(fmt::format(
        "--buffers is {}; give 1..200 (the tables of a one-page write must fit in a launch)",
        o.buffers));
  }
  if (page_bytes < 16 || page_bytes > (64 << 20)) {
    return InvalidArgument(fmt::format("--page-bytes is {}; give 16 B..64 MiB", page_bytes));
  }
  if (o.iters < 10) return InvalidArgument(fmt::format("--iters is {}; give at least 10", o.iters));
  const cuda::DeviceCountResult devices = cuda::DeviceCount();
  if (devices.count <= 0) {
    return FailedPrecondition("kvt-bench cuda-calls times CUDA calls and needs a CUDA device (" +
                              devices.reason + "); run it on a GPU machine");
  }
  BENCH_CUDA(cudaSetDevice(0));

  // Two pools of two pages per buffer; the write copies page 1 of each source buffer into
  // page 0 of the destination buffer.
  const size_t pool_bytes = static_cast<size_t>(o.buffers) * 2 * static_cast<size_t>(page_bytes);
  KVT_ASSIGN_OR_RETURN(cuda::DeviceBuffer src, cuda::DeviceBuffer::Allocate(pool_bytes, 0));
  KVT_ASSIGN_OR_RETURN(cuda::DeviceBuffer dst, cuda::DeviceBuffer::Allocate(pool_bytes, 0));
  // Tables: source bases, destination bases, one source page, one destination page.
  std::vector<uint64_t> tables(2 * static_cast<size_t>(o.buffers) + 1, 0);
  for (int32_t b = 0; b < o.buffers; ++b) {
    const uint64_t offset = static_cast<uint64_t>(b) * 2 * static_cast<uint64_t>(page_bytes);
    tables[b] = reinterpret_cast<uint64_t>(src.data()) + offset;
    tables[o.buffers + b] = reinterpret_cast<uint64_t>(dst.data()) + offset;
  }
  const int32_t pages[2] = {1, 0};
  std::memcpy(&tables[2 * static_cast<size_t>(o.buffers)], pages, sizeof(pages));
  const size_t table_bytes = tables.size() * sizeof(uint64_t);
  KVT_ASSIGN_OR_RETURN(cuda::PinnedBuffer pinned, cuda::PinnedBuffer::Allocate(table_bytes));
  KVT_ASSIGN_OR_RETURN(cuda::DeviceBuffer device_tables,
                       cuda::DeviceBuffer::Allocate(table_bytes, 0));
  const auto args_at = [&](uint64_t base) {
    kernels::PageCopyArgs a;
    a.src_bases = reinterpret_cast<const uint64_t*>(base);
    a.dst_bases = reinterpret_cast<const uint64_t*>(base + o.buffers * sizeof(uint64_t));
    a.src_pages = reinterpret_cast<const int32_t*>(base + 2 * o.buffers * sizeof(uint64_t));
    a.dst_pages = a.src_pages + 1;
    a.num_buffers = o.buffers;
    a.num_pages = 1;
    a.src_page_stride = a.dst_page_stride = page_bytes;
    a.bytes = page_bytes;
    return a;
  };
  const kernels::PageCopyArgs inline_args = args_at(reinterpret_cast<uint64_t>(tables.data()));
  const kernels::PageCopyArgs device_args =
      args_at(reinterpret_cast<uint64_t>(device_tables.data()));

  KVT_ASSIGN_OR_RETURN(cuda::Stream stream, cuda::Stream::Create(0));
  KVT_ASSIGN_OR_RETURN(cuda::Stream copy_stream, cuda::Stream::Create(0));
  KVT_ASSIGN_OR_RETURN(cuda::Stream notify_stream, cuda::Stream::Create(0));
  KVT_ASSIGN_OR_RETURN(cuda::Event staged, cuda::Event::Create(/*timing=*/false));
  KVT_ASSIGN_OR_RETURN(cuda::Event done, cuda::Event::Create(/*timing=*/false));
  // The completion word's rounds, where the device runs stream memory operations.
  StatusOr<cuda::CompletionWord> word = cuda::CompletionWord::Create(0);
  if (!word.ok()) {
    fmt::print("no completion word on this device ({}); its figures are left out\n",
               word.status().ToString());
  }
  uint64_t signals = 0;

  enum Figure {
    kLaunch,
    kUpload,
    kRecord,
    kSignal,
    kQuery,
    kNotice,
    kSeen,
    kWordSeen,
    kNotified,
    kFigures
  };
  const char* names[kFigures] = {"launch call",
                                 "table upload calls (memcpy, record, wait)",
                                 "event record call",
                                 "completion word signal call",
                                 "event query call (completed event)",
                                 "stream wait + host function calls (a notice)",
                                 "launch -> completion seen (spinning query)",
                                 "launch -> completion seen (spinning word load)",
                                 "launch -> host function ran (notice wake-up)"};
  const char* keys[kFigures] = {"launch_call",    "upload_calls",   "record_call",
                                "signal_call",    "query_call",     "notice_calls",
                                "launch_to_seen", "launch_to_word", "launch_to_notified"};
  json results = json::object();
  fmt::print("kvt-bench cuda-calls: one page of {} buffers x {} B, {} rounds, microseconds\n",
             o.buffers, page_bytes, o.iters);
  fmt::print("{:<46} {:>10} {:>10} {:>10} {:>10}\n", "", "inline p50", "inline p90", "upload p50",
             "upload p90");
  std::vector<double> figures[2][kFigures];
  for (int mode = 0; mode < 2; ++mode) {
    const bool inline_tables = mode == 0;
    for (int it = 0; it < o.iters + 20; ++it) {  // the first 20 rounds warm up
      const bool keep = it >= 20;
      const auto t0 = Clock::now();
      if (!inline_tables) {
        std::memcpy(pinned.data(), tables.data(), table_bytes);
        BENCH_CUDA(cudaMemcpyAsync(device_tables.data(), pinned.data(), table_bytes,
                                   cudaMemcpyHostToDevice, copy_stream.get()));
        KVT_RETURN_IF_ERROR(staged.Record(copy_stream.get()));
        BENCH_CUDA(cudaStreamWaitEvent(stream.get(), staged.get(), 0));
      }
      const auto t1 = Clock::now();
      KVT_RETURN_IF_ERROR(inline_tables ? kernels::PageCopyCudaInline(inline_args, tables.data(),
                                                                      tables.size(), stream.get())
                                        : kernels::PageCopyCuda(device_args, stream.get()));
      const auto t2 = Clock::now();
      KVT_RETURN_IF_ERROR(done.Record(stream.get()));
      const auto t3 = Clock::now();
      if (word.ok()) KVT_RETURN_IF_ERROR(word->Signal(stream.get(), ++signals));
      const auto t3s = Clock::now();
      std::atomic<bool> ran{false};
      BENCH_CUDA(cudaStreamWaitEvent(notify_stream.get(), done.get(), 0));
      BENCH_CUDA(cudaLaunchHostFunc(notify_stream.get(), &MarkRan, &ran));
      const auto t4 = Clock::now();
      const bool by_word = word.ok() && it % 2 == 1;
      if (by_word) {
        const auto give_up = Clock::now() + std::chrono::seconds(10);
        while (word->Load() < signals) {
          if (Clock::now() > give_up) {
            return DeadlineExceeded("the completion word did not reach signal " +
                                    std::to_string(signals) + " within 10 s");
          }
        }
      } else {
        cudaError_t q;
        while ((q = cudaEventQuery(done.get())) == cudaErrorNotReady) {
        }
        BENCH_CUDA(q);
      }
      const auto t5 = Clock::now();
      while (!ran.load(std::memory_order_acquire)) std::this_thread::yield();
      const auto t6 = Clock::now();
      BENCH_CUDA(cudaEventQuery(done.get()));
      const auto t7 = Clock::now();
      BENCH_CUDA(cudaStreamSynchronize(notify_stream.get()));
      if (!keep) continue;
      auto& f = figures[mode];
      f[kLaunch].push_back(Us(t1, t2));
      f[kUpload].push_back(Us(t0, t1));
      f[kRecord].push_back(Us(t2, t3));
      f[kQuery].push_back(Us(t6, t7));
      if (word.ok()) f[kSignal].push_back(Us(t3, t3s));
      f[kNotice].push_back(Us(t3s, t4));
      f[by_word ? kWordSeen : kSeen].push_back(Us(t1, t5));
      f[kNotified].push_back(Us(t1, t6));
    }
  }
  for (int k = 0; k < kFigures; ++k) {
    const double values[4] = {Percentile(figures[0][k], 0.5), Percentile(figures[0][k], 0.9),
                              Percentile(figures[1][k], 0.5), Percentile(figures[1][k], 0.9)};
    if (k == kUpload) {
      fmt::print("{:<46} {:>10} {:>10} {:>10.2f} {:>10.2f}\n", names[k], "-", "-", values[2],
                 values[3]);
    } else {
      fmt::print("{:<46} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f}\n", names[k], values[0], values[1],
                 values[2], values[3]);
    }
    results[keys[k]] = json{{"inline_p50", values[0]},
                            {"inline_p90", values[1]},
                            {"upload_p50", values[2]},
                            {"upload_p90", values[3]}};
  }
  fmt::print(
      "inline: tables in the launch's parameters (PageCopyCudaInline); upload: tables copied to "
      "device memory on a side stream first, as for writes too large to pass inline. The launch "
      "-> figures run from the start of the launch call.\n");
  if (!o.json_path.empty()) {
    json doc;
    doc["tool"] = "kvt-bench cuda-calls";
    doc["date_utc"] = NowUtc();
    doc["command"] = CommandLine();
    doc["machine"] = DescribeMachine(true);
    doc["config"] = json{{"buffers", o.buffers}, {"page_bytes", page_bytes}, {"iters", o.iters}};
    doc["unit"] = "us";
    doc["results"] = results;
    KVT_RETURN_IF_ERROR(WriteJson(o.json_path, doc));
    fmt::print("wrote {}\n", o.json_path);
  }
  return OkStatus();
}

}  // namespace

void AddCudaCallsCommand(CLI::App& app, int& exit_code) {
  auto opts = std::make_shared<CudaCallsOptions>();
  CLI::App* cmd = app.add_subcommand(
      "cuda-calls",
      "what the CUDA runtime costs a one-page cuda_ipc write, call by call, and the launch's "
      "latency until its completion is seen: the floor under a one-page request");
  cmd->add_option("--buffers", opts->buffers, "buffers of the write (2 per layer)")
      ->capture_default_str();
  cmd->add_option("--page-bytes", opts->page_bytes, "bytes of one page of one buffer")
      ->capture_default_str();
  cmd->add_option("--iters", opts->iters, "timed rounds per way")->capture_default_str();
  cmd->add_option("--json", opts->json_path, "write all figures to this JSON file");
  cmd->callback([opts, &exit_code] {
    Status s = RunCudaCalls(*opts);
    if (!s.ok()) {
      fmt::print(stderr, "kvt-bench cuda-calls: {}\n", s.ToString());
      exit_code = 1;
    }
  });
}

}  // namespace kvt::bench

// `kvt-bench kernels`: moves the same random (buffer, page) items of a pool-like layout
//   (a) with kvt's one-launch page gather/scatter (PageCopyCuda / PageCopyCpu),
//   (b) as one contiguous copy of the same byte count (the ceiling, measured in the same run),
//   (c) the peers' way: one cudaMemcpyAsync (memcpy on the CPU) per (buffer, page) item,
//   (d) cudaMemcpyBatchAsync over the same items (GPU only),
//   (e) cub::DeviceMemcpy::Batched over all the items (GPU only): NVIDIA's SM batched memcpy,
// and prints GB/s (bytes copied per second) with ratios; --json writes every figure.
// (c) and (d) are timed on an evenly spread subset of the items and scaled by bytes; the
// output says how many items.
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_common.h"
#include "bench_cub.h"
#include "bench_gpu.h"
#include "commands.h"
#include "kvt/common/dtype.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/kernels/kernels.h"
#include "kvt/kernels/tuning.h"

namespace kvt::bench {
namespace {

using nlohmann::json;

struct KernelsOptions {
  std::string json_path;
  std::string page_tokens = "1,16,64";
  int layers = 32;
  int heads = 8;
  int head_dim = 128;
  std::string dtype = "bf16";
  std::string bytes;  // empty: 1GiB on the GPU, 64MiB on the CPU
  int iters = 0;      // 0: 20 on the GPU, 5 on the CPU
  bool cpu = false;
  int64_t peer_items = 4096;
  bool sweep = false;
  double pool_factor = 2.0;
  uint32_t seed = 1;
};

// One page-token size: the layout and the figures measured for it.
struct Layout {
  int page_tokens = 0;
  int64_t item_bytes = 0;
  int32_t num_buffers = 0;
  int64_t num_pages = 0;   // pages moved per buffer
  int64_t pool_pages = 0;  // pages per pool buffer (page 0 is the dummy page, never moved)
  int64_t moved_bytes = 0;
  std::vector<int32_t> src_pages, dst_pages;

  int64_t items() const { return static_cast<int64_t>(num_buffers) * num_pages; }
  int64_t buffer_bytes() const { return pool_pages * item_bytes; }
  int64_t slab_bytes() const { return buffer_bytes() * num_buffers; }
};

Layout MakeLayout(const KernelsOptions& o, int page_tokens, int64_t target_bytes, int64_t elem,
                  std::mt19937& rng) {
  Layout l;
  l.page_tokens = page_tokens;
  l.item_bytes = static_cast<int64_t>(page_tokens) * o.heads * o.head_dim * elem;
  l.num_buffers = 2 * o.layers;
  const int64_t per_page = l.item_bytes * l.num_buffers;
  l.num_pages = std::max<int64_t>(1, (target_bytes + per_page - 1) / per_page);
  l.pool_pages = static_cast<int64_t>(static_cast<double>(l.num_pages) * o.pool_factor) + 2;
  l.moved_bytes = l.num_pages * per_page;
  for (auto* pages : {&l.src_pages, &l.dst_pages}) {
    std::vector<int32_t> all(static_cast<size_t>(l.pool_pages - 1));
    std::iota(all.begin(), all.end(), 1);
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(static_cast<size_t>(l.num_pages));
    *pages = std::move(all);
  }
  return l;
}

// Evenly spread item indices (buffer-major) for the per-item peers.
std::vector<int64_t> PeerSubset(const Layout& l, int64_t limit) {
  return EvenSubset(l.items(), std::min(limit, l.items()));
}

struct Figure {
  double ms = 0;      // median per run of what was timed
  double gbps = 0;    // bytes copied per second
  int64_t items = 0;  // items timed (subset for the peers)
  std::string error;  // set when the method failed
  json ToJson() const {
    json j;
    if (!error.empty()) {
      j["error"] = error;
      return j;
    }
    j["median_ms"] = ms;
    j["gbps"] = gbps;
    if (items > 0) j["items_timed"] = items;
    return j;
  }
  std::string Cell() const { return error.empty() ? fmt::format("{:.1f}", gbps) : "error"; }
};

double Ratio(const Figure& a, const Figure& b) {
  return (a.error.empty() && b.error.empty() && b.gbps > 0) ? a.gbps / b.gbps : 0.0;
}

std::string RatioCell(double r) { return r > 0 ? fmt::format("{:.3f}", r) : "-"; }
std::string RatioCellX(double r) { return r > 0 ? fmt::format("{:.0f}x", r) : "-"; }

// ---- GPU ------------------------------------------------------------------------------------

struct GpuPools {
  cuda::DeviceBuffer src, dst, src_bases, dst_bases, src_pages, dst_pages;
  std::vector<uint64_t> src_base_host, dst_base_host;
};

StatusOr<GpuPools> MakeGpuPools(const Layout& l) {
  GpuPools p;
  KVT_ASSIGN_OR_RETURN(p.src, cuda::DeviceBuffer::Allocate(l.slab_bytes()));
  KVT_ASSIGN_OR_RETURN(p.dst, cuda::DeviceBuffer::Allocate(l.slab_bytes()));
  for (int32_t b = 0; b < l.num_buffers; ++b) {
    p.src_base_host.push_back(reinterpret_cast<uint64_t>(p.src.data()) + b * l.buffer_bytes());
    p.dst_base_host.push_back(reinterpret_cast<uint64_t>(p.dst.data()) + b * l.buffer_bytes());
  }
  auto upload = [](const auto& v) -> StatusOr<cuda::DeviceBuffer> {
    const size_t bytes = v.size() * sizeof(v[0]);
    KVT_ASSIGN_OR_RETURN(cuda::DeviceBuffer d, cuda::DeviceBuffer::Allocate(bytes));
    KVT_RETURN_IF_ERROR(cuda::Copy(d.data(), v.data(), bytes));
    return d;
  };
  KVT_ASSIGN_OR_RETURN(p.src_bases, upload(p.src_base_host));
  KVT_ASSIGN_OR_RETURN(p.dst_bases, upload(p.dst_base_host));
  KVT_ASSIGN_OR_RETURN(p.src_pages, upload(l.src_pages));
  KVT_ASSIGN_OR_RETURN(p.dst_pages, upload(l.dst_pages));
  return p;
}

// Pattern args that view buffer b's moved page i as token i of "layer" b % L, K or V: fill the
// source through src_pages, verify the destination through dst_pages.
kernels::PatternArgs PatternOf(const Layout& l, const uint64_t* bases, const int32_t* pages,
                               int layers) {
  kernels::PatternArgs a;
  a.request = 0xC0FFEE;
  a.k_bases = bases;
  a.v_bases = bases + layers;
  a.num_layers = layers;
  a.pages = pages;
  a.num_tokens = l.num_pages;
  a.page_size = 1;
  a.row_bytes = l.item_bytes;
  return a;
}

kernels::PageCopyArgs CopyArgs(const Layout& l, const uint64_t* src_bases,
                               const uint64_t* dst_bases, const int32_t* src_pages,
                               const int32_t* dst_pages) {
  kernels::PageCopyArgs a;
  a.src_bases = src_bases;
  a.dst_bases = dst_bases;
  a.num_buffers = l.num_buffers;
  a.src_pages = src_pages;
  a.dst_pages = dst_pages;
  a.num_pages = l.num_pages;
  a.src_page_stride = l.item_bytes;
  a.dst_page_stride = l.item_bytes;
  a.bytes = l.item_bytes;
  return a;
}

// Where the sweep's copy reads and writes: the benchmark's random pages, or a contiguous run
// (null index lists over contiguous buffers) on one or both sides. The contiguous layouts
// separate the kernel's own ceiling from the cost of random pages.
enum class SweepLayout { kRandom, kBothContiguous, kSrcContiguous, kDstContiguous };

const char* SweepLayoutName(SweepLayout l) {
  switch (l) {
    case SweepLayout::kBothContiguous:
      return "contiguous";
    case SweepLayout::kSrcContiguous:
      return "src-contig";
    case SweepLayout::kDstContiguous:
      return "dst-contig";
    default:
      return "random";
  }
}

struct SweepEntry {
  kernels::PageCopyTuning tuning;
  SweepLayout layout = SweepLayout::kRandom;
};

// The sweep: the default, one knob changed at a time, the persistent grid, and calibration rows
// on contiguous layouts. Unroll 0 = auto (8 for units of 4 KiB or more, else 4). The default
// runs first and last: the difference is the run's drift.
std::vector<SweepEntry> SweepTunings() {
  struct V {
    int unroll, threads, chunk;
    bool streaming, prefetch, persistent;
    int blocks_per_sm;  // 0: no cap (one-pass), or as many as fit (persistent)
    SweepLayout layout;
  };
  constexpr SweepLayout R = SweepLayout::kRandom;
  constexpr SweepLayout C = SweepLayout::kBothContiguous;
  const V variants[] = {
      {0, 512, 16384, false, false, false, 0, R},  // the default
      {0, 256, 16384, false, false, false, 0, R},  // 256 threads per block
      {0, 512, 8192, false, false, false, 0, R},   // 8 KiB units
      {0, 512, 32768, false, false, false, 0, R},  // 32 KiB units
      {0, 512, 0, false, false, false, 0, R},      // whole items
      {4, 512, 16384, false, false, false, 0, R},  // unroll 4 forced
      {8, 512, 16384, false, false, false, 0, R},  // unroll 8 forced
      {0, 512, 16384, true, false, false, 0, R},   // streaming (.cs) hints
      {0, 512, 16384, false, true, false, 0, R},   // L2 bulk prefetch of each unit's source
      {0, 512, 16384, false, false, false, 2, R},  // grid capped at 2 blocks per SM
      {0, 512, 16384, false, false, true, 0, R},   // persistent grid
      {8, 256, 8192, true, false, true, 0, R},     // persistent, unroll 8, 8 KiB units, .cs
      {0, 512, 16384, false, false, false, 0, C},  // calibration: both sides contiguous
      {0, 512, 16384, false, false, false, 0, SweepLayout::kSrcContiguous},
      {0, 512, 16384, false, false, false, 0, SweepLayout::kDstContiguous},
      {0, 512, 16384, false, false, false, 0, R},  // the default again
  };
  std::vector<SweepEntry> out;
  for (const V& v : variants) {
    SweepEntry e;
    e.tuning = kernels::DefaultPageCopyTuning();
    e.tuning.unroll = v.unroll;
    e.tuning.threads_per_block = v.threads;
    e.tuning.threads_per_item = 32;
    e.tuning.chunk_bytes = v.chunk;
    e.tuning.streaming = v.streaming;
    e.tuning.prefetch_l2 = v.prefetch;
    e.tuning.blocks_per_sm = v.blocks_per_sm;
    e.tuning.persistent = v.persistent;
    e.layout = v.layout;
    out.push_back(e);
  }
  return out;
}

json TuningJson(const kernels::PageCopyTuning& t) {
  return json{{"unroll", t.unroll},
              {"streaming", t.streaming},
              {"threads_per_block", t.threads_per_block},
              {"threads_per_item", t.threads_per_item},
              {"blocks_per_sm", t.blocks_per_sm},
              {"persistent", t.persistent},
              {"page_major", t.page_major},
              {"chunk_bytes", t.chunk_bytes},
              {"min_chunk_bytes", t.min_chunk_bytes},
              {"prefetch_l2", t.prefetch_l2}};
}

// The sweep's short name for a row's grid policy: "1p" (one-pass) or "persist".
std::string VariantCell(const json& row) {
  return row.value("persistent", false) ? "persist" : "1p";
}

Status RunGpuSize(const KernelsOptions& o, const Layout& l, int iters, json& out) {
  KVT_ASSIGN_OR_RETURN(cuda::Stream stream_obj, cuda::Stream::Create());
  cudaStream_t stream = stream_obj.get();
  KVT_ASSIGN_OR_RETURN(GpuPools p, MakeGpuPools(l));
  const auto* d_src_bases = p.src_bases.as<uint64_t>();
  const auto* d_dst_bases = p.dst_bases.as<uint64_t>();
  const auto* d_src_pages = p.src_pages.as<int32_t>();
  const auto* d_dst_pages = p.dst_pages.as<int32_t>();

  // Random (pattern) data in the moved source pages; poison the destination.
  KVT_RETURN_IF_ERROR(
      kernels::FillPatternCuda(PatternOf(l, d_src_bases, d_src_pages, o.layers), stream));
  BENCH_CUDA(cudaMemsetAsync(p.dst.data(), 0xA5, l.slab_bytes(), stream));
  const kernels::PageCopyArgs args =
      CopyArgs(l, d_src_bases, d_dst_bases, d_src_pages, d_dst_pages);

  // Correctness of what we time: one copy, then every destination byte checked.
  KVT_RETURN_IF_ERROR(kernels::PageCopyCuda(args, stream));
  KVT_ASSIGN_OR_RETURN(
      kernels::PatternCheck check,
      kernels::VerifyPatternCuda(PatternOf(l, d_dst_bases, d_dst_pages, o.layers), stream));

  // Every item's copy, buffer-major (item b * num_pages + i): cub's batched memcpy copies them
  // in one launch, like ours; the per-item peers take a subset.
  Figure ours, contig, per_item, batch, cub;
  CopyList all;
  for (int32_t b = 0; b < l.num_buffers; ++b) {
    for (int64_t i = 0; i < l.num_pages; ++i) {
      all.Add(reinterpret_cast<void*>(p.dst_base_host[b] + l.dst_pages[i] * l.item_bytes),
              reinterpret_cast<const void*>(p.src_base_host[b] + l.src_pages[i] * l.item_bytes),
              static_cast<size_t>(l.item_bytes));
    }
  }
  StatusOr<CubBatchedCopy> cub_copy = CubBatchedCopy::Create(all);
  if (!cub_copy.ok()) cub.error = cub_copy.status().ToString();

  // Ours, the ceiling and cub timed interleaved (one of each per round), so that the card's
  // drift over a run (it runs warmer and slower as the run goes on) favours none of them.
  const auto contiguous_copy = [&] {
    return cuda::ToStatus(cudaMemcpyAsync(p.dst.data(), p.src.data(), l.moved_bytes,
                                          cudaMemcpyDeviceToDevice, stream),
                          "cudaMemcpyAsync");
  };
  std::vector<std::function<Status()>> timed = {[&] { return kernels::PageCopyCuda(args, stream); },
                                                contiguous_copy};
  if (cub_copy.ok()) timed.push_back([&] { return cub_copy->Run(stream); });
  KVT_ASSIGN_OR_RETURN(std::vector<double> timed_ms, TimeGpuInterleaved(stream, 3, iters, timed));
  ours.ms = timed_ms[0];
  contig.ms = timed_ms[1];
  ours.gbps = GBps(static_cast<double>(l.moved_bytes), ours.ms);
  contig.gbps = GBps(static_cast<double>(l.moved_bytes), contig.ms);
  // cub's bytes: a poisoned destination, one more copy, every byte checked (null when cub did
  // not run).
  json cub_mismatches = nullptr;
  if (cub_copy.ok()) {
    cub.ms = timed_ms[2];
    cub.gbps = GBps(static_cast<double>(l.moved_bytes), cub.ms);
    BENCH_CUDA(cudaMemsetAsync(p.dst.data(), 0xA5, l.slab_bytes(), stream));
    KVT_RETURN_IF_ERROR(cub_copy->Run(stream));
    KVT_ASSIGN_OR_RETURN(
        kernels::PatternCheck cub_check,
        kernels::VerifyPatternCuda(PatternOf(l, d_dst_bases, d_dst_pages, o.layers), stream));
    cub_mismatches = cub_check.mismatches;
  }

  // The peers' ways on an evenly spread subset of the items (`all` holds item b * num_pages + i
  // at that index).
  const std::vector<int64_t> subset = PeerSubset(l, o.peer_items);
  CopyList list;
  for (int64_t item : subset) list.Add(all.dsts[item], all.srcs[item], all.sizes[item]);
  const double subset_bytes = list.bytes();
  const int peer_iters = std::max(1, std::min(iters, 5));
  per_item.items = batch.items = static_cast<int64_t>(subset.size());
  auto per_item_ms = TimeGpu(stream, 1, peer_iters, [&] { return MemcpyEach(list, stream); });
  if (per_item_ms.ok()) {
    per_item.ms = *per_item_ms;
    per_item.gbps = GBps(subset_bytes, per_item.ms);
  } else {
    per_item.error = per_item_ms.status().ToString();
  }
  auto batch_ms = TimeGpu(stream, 1, peer_iters, [&] { return MemcpyBatch(list, stream); });
  if (batch_ms.ok()) {
    batch.ms = *batch_ms;
    batch.gbps = GBps(subset_bytes, batch.ms);
  } else {
    batch.error = batch_ms.status().ToString();
  }

  json sweep = json::array();
  if (o.sweep) {
    // Contiguous views of the same slabs: buffer b's moved pages are the b-th run of
    // num_pages * item_bytes bytes from the slab's start, index lists null.
    std::vector<uint64_t> src_contig, dst_contig;
    for (int32_t b = 0; b < l.num_buffers; ++b) {
      src_contig.push_back(reinterpret_cast<uint64_t>(p.src.data()) +
                           static_cast<uint64_t>(b) * l.num_pages * l.item_bytes);
      dst_contig.push_back(reinterpret_cast<uint64_t>(p.dst.data()) +
                           static_cast<uint64_t>(b) * l.num_pages * l.item_bytes);
    }
    const size_t table_bytes = src_contig.size() * sizeof(uint64_t);
    KVT_ASSIGN_OR_RETURN(cuda::DeviceBuffer d_src_contig,
                         cuda::DeviceBuffer::Allocate(table_bytes));
    KVT_ASSIGN_OR_RETURN(cuda::DeviceBuffer d_dst_contig,
                         cuda::DeviceBuffer::Allocate(table_bytes));
    KVT_RETURN_IF_ERROR(cuda::Copy(d_src_contig.data(), src_contig.data(), table_bytes));
    KVT_RETURN_IF_ERROR(cuda::Copy(d_dst_contig.data(), dst_contig.data(), table_bytes));
    for (const SweepEntry& e : SweepTunings()) {
      const kernels::PageCopyTuning& t = e.tuning;
      kernels::PageCopyArgs a = args;
      if (e.layout == SweepLayout::kBothContiguous || e.layout == SweepLayout::kSrcContiguous) {
        a.src_bases = d_src_contig.as<uint64_t>();
        a.src_pages = nullptr;
      }
      if (e.layout == SweepLayout::kBothContiguous || e.layout == SweepLayout::kDstContiguous) {
        a.dst_bases = d_dst_contig.as<uint64_t>();
        a.dst_pages = nullptr;
      }
      // Each row against its own interleaved contiguous copy (the card drifts over a sweep).
      const auto row_copy = [&] { return kernels::PageCopyCudaTuned(a, t, stream); };
      auto ms = TimeGpuInterleaved(stream, 2, iters, {row_copy, contiguous_copy});
      // On the random layout the copies land on the verified destination pages (the variants
      // are experiments): after the timed runs, which the contiguous copy interleaves, the
      // destination is poisoned, copied once more with the row's tuning and checked byte-wise.
      const bool verify = e.layout == SweepLayout::kRandom;
      if (verify && ms.ok()) {
        BENCH_CUDA(cudaMemsetAsync(p.dst.data(), 0xA5, l.slab_bytes(), stream));
        if (Status copied = row_copy(); !copied.ok()) ms = copied;
      }
      json row = TuningJson(t);
      row["layout"] = SweepLayoutName(e.layout);
      row["effective_unroll"] = kernels::EffectiveUnroll(t, l.item_bytes);
      if (ms.ok()) {
        const double row_contig_gbps = GBps(static_cast<double>(l.moved_bytes), (*ms)[1]);
        row["median_ms"] = (*ms)[0];
        row["gbps"] = GBps(static_cast<double>(l.moved_bytes), (*ms)[0]);
        row["contiguous_gbps"] = row_contig_gbps;
        row["ratio_to_contiguous"] =
            row_contig_gbps > 0 ? row["gbps"].get<double>() / row_contig_gbps : 0;
        if (verify) {
          auto row_check =
              kernels::VerifyPatternCuda(PatternOf(l, d_dst_bases, d_dst_pages, o.layers), stream);
          if (row_check.ok()) {
            row["verified_mismatches"] = row_check->mismatches;
          } else {
            row["error"] = row_check.status().ToString();
          }
        }
      } else {
        row["error"] = ms.status().ToString();
      }
      sweep.push_back(row);
    }
  }

  out = json{{"page_tokens", l.page_tokens},
             {"item_bytes", l.item_bytes},
             {"buffers", l.num_buffers},
             {"pages_moved_per_buffer", l.num_pages},
             {"pool_pages_per_buffer", l.pool_pages},
             {"items", l.items()},
             {"bytes_moved", l.moved_bytes},
             {"verified_mismatches", check.mismatches},
             {"ours_page_copy_cuda", ours.ToJson()},
             {"contiguous_memcpy_d2d", contig.ToJson()},
             {"memcpy_async_per_item", per_item.ToJson()},
             {"memcpy_batch_async", batch.ToJson()},
             {"cub_device_memcpy_batched", cub.ToJson()},
             {"cub_verified_mismatches", cub_mismatches},
             {"ratio_ours_to_contiguous", Ratio(ours, contig)},
             {"ratio_ours_to_per_item", Ratio(ours, per_item)},
             {"ratio_ours_to_batch", Ratio(ours, batch)},
             {"ratio_ours_to_cub", Ratio(ours, cub)},
             {"ratio_cub_to_contiguous", Ratio(cub, contig)},
             {"tuning", TuningJson(kernels::DefaultPageCopyTuning())},
             {"effective_unroll",
              kernels::EffectiveUnroll(kernels::DefaultPageCopyTuning(), l.item_bytes)},
             {"sweep", sweep}};
  const bool cub_bad = cub_mismatches.is_number() && cub_mismatches.get<uint64_t>() != 0;
  const bool all_ok = check.mismatches == 0 && !cub_bad;
  fmt::print("{:>6} {:>9} {:>8} {:>9} {:>11} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8}\n",
             l.page_tokens, l.item_bytes, l.items(), ours.Cell(), contig.Cell(),
             RatioCell(Ratio(ours, contig)), per_item.Cell(), batch.Cell(), cub.Cell(),
             RatioCellX(Ratio(ours, per_item)), RatioCellX(Ratio(ours, batch)),
             RatioCell(Ratio(ours, cub)), all_ok ? "ok" : "MISMATCH");
  if (o.sweep) {
    for (const auto& row : sweep) {
      const std::string head = fmt::format(
          "         sweep {:<9} u{} s{} t{:<4} g{:<3} c{:<5} b{} pf{} {:<10}", VariantCell(row),
          row["unroll"].get<int>(), row["streaming"].get<bool>() ? 1 : 0,
          row["threads_per_block"].get<int>(), row["threads_per_item"].get<int>(),
          row["chunk_bytes"].get<int>(), row["blocks_per_sm"].get<int>(),
          row["prefetch_l2"].get<bool>() ? 1 : 0, row["layout"].get<std::string>());
      if (row.contains("error")) {
        fmt::print("{}: {}\n", head, row["error"].get<std::string>());
        continue;
      }
      std::string check_cell;
      if (row.contains("verified_mismatches")) {
        const uint64_t bad = row["verified_mismatches"].get<uint64_t>();
        check_cell = bad == 0 ? "  ok" : fmt::format("  MISMATCH ({} bytes)", bad);
      }
      fmt::print("{}: {:8.1f} GB/s  {:.3f} of contiguous{}\n", head, row["gbps"].get<double>(),
                 row["ratio_to_contiguous"].get<double>(), check_cell);
    }
  }
  if (!batch.error.empty()) fmt::print("         cudaMemcpyBatchAsync: {}\n", batch.error);
  if (!cub.error.empty()) fmt::print("         cub::DeviceMemcpy::Batched: {}\n", cub.error);
  if (cub_bad) {
    return DataLoss(fmt::format("cub::DeviceMemcpy::Batched of {}-token pages left {} wrong bytes",
                                l.page_tokens, cub_mismatches.get<uint64_t>()));
  }
  if (check.mismatches != 0) {
    return DataLoss(fmt::format(
        "page copy of {}-token pages left {} wrong bytes (first at "
        "layer {} kv {} page {} byte {})",
        l.page_tokens, check.mismatches, check.layer, check.kv, check.token, check.byte));
  }
  return OkStatus();
}

// ---- CPU ------------------------------------------------------------------------------------

struct AlignedFree {
  void operator()(uint8_t* p) const { std::free(p); }
};
using HostSlab = std::unique_ptr<uint8_t, AlignedFree>;

HostSlab AllocHost(int64_t bytes) {
  const size_t rounded = (static_cast<size_t>(bytes) + 4095) & ~size_t{4095};
  return HostSlab(static_cast<uint8_t*>(std::aligned_alloc(4096, rounded)));
}

double TimeCpu(int warmup, int iters, const std::function<void()>& op) {
  for (int i = 0; i < warmup; ++i) op();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    op();
    const auto t1 = std::chrono::steady_clock::now();
    ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  return Median(ms);
}

Status RunCpuSize(const KernelsOptions& o, const Layout& l, int iters, json& out) {
  HostSlab src = AllocHost(l.slab_bytes()), dst = AllocHost(l.slab_bytes());
  if (!src || !dst) {
    return ResourceExhausted(
        fmt::format("cannot allocate 2 x {} bytes of host memory; use a "
                    "smaller --bytes",
                    l.slab_bytes()));
  }
  std::vector<uint64_t> src_bases, dst_bases;
  for (int32_t b = 0; b < l.num_buffers; ++b) {
    src_bases.push_back(reinterpret_cast<uint64_t>(src.get()) + b * l.buffer_bytes());
    dst_bases.push_back(reinterpret_cast<uint64_t>(dst.get()) + b * l.buffer_bytes());
  }
  KVT_RETURN_IF_ERROR(
      kernels::FillPatternCpu(PatternOf(l, src_bases.data(), l.src_pages.data(), o.layers)));
  std::memset(dst.get(), 0xA5, static_cast<size_t>(l.slab_bytes()));
  const kernels::PageCopyArgs args =
      CopyArgs(l, src_bases.data(), dst_bases.data(), l.src_pages.data(), l.dst_pages.data());
  KVT_RETURN_IF_ERROR(kernels::PageCopyCpu(args));
  KVT_ASSIGN_OR_RETURN(
      kernels::PatternCheck check,
      kernels::VerifyPatternCpu(PatternOf(l, dst_bases.data(), l.dst_pages.data(), o.layers)));

  Figure ours, contig, per_item;
  Status copy_status;
  ours.ms = TimeCpu(1, iters, [&] { copy_status = kernels::PageCopyCpu(args); });
  KVT_RETURN_IF_ERROR(copy_status);
  ours.gbps = GBps(static_cast<double>(l.moved_bytes), ours.ms);
  contig.ms = TimeCpu(
      1, iters, [&] { std::memcpy(dst.get(), src.get(), static_cast<size_t>(l.moved_bytes)); });
  contig.gbps = GBps(static_cast<double>(l.moved_bytes), contig.ms);
  // On the CPU a memcpy call costs nanoseconds, so the peer runs over every item.
  const std::vector<int64_t> subset = PeerSubset(l, l.items());
  per_item.items = static_cast<int64_t>(subset.size());
  per_item.ms = TimeCpu(1, iters, [&] {
    for (int64_t item : subset) {
      const int64_t b = item / l.num_pages, i = item % l.num_pages;
      std::memcpy(reinterpret_cast<void*>(dst_bases[b] + l.dst_pages[i] * l.item_bytes),
                  reinterpret_cast<const void*>(src_bases[b] + l.src_pages[i] * l.item_bytes),
                  static_cast<size_t>(l.item_bytes));
    }
  });
  per_item.gbps = GBps(static_cast<double>(subset.size()) * l.item_bytes, per_item.ms);

  out = json{{"page_tokens", l.page_tokens},
             {"item_bytes", l.item_bytes},
             {"buffers", l.num_buffers},
             {"pages_moved_per_buffer", l.num_pages},
             {"pool_pages_per_buffer", l.pool_pages},
             {"items", l.items()},
             {"bytes_moved", l.moved_bytes},
             {"verified_mismatches", check.mismatches},
             {"ours_page_copy_cpu", ours.ToJson()},
             {"contiguous_memcpy", contig.ToJson()},
             {"memcpy_per_item", per_item.ToJson()},
             {"ratio_ours_to_contiguous", Ratio(ours, contig)},
             {"ratio_ours_to_per_item", Ratio(ours, per_item)}};
  fmt::print("{:>6} {:>9} {:>8} {:>9} {:>11} {:>8} {:>9} {:>9} {:>8}\n", l.page_tokens,
             l.item_bytes, l.items(), ours.Cell(), contig.Cell(), RatioCell(Ratio(ours, contig)),
             per_item.Cell(), RatioCell(Ratio(ours, per_item)),
             check.mismatches == 0 ? "ok" : "MISMATCH");
  if (check.mismatches != 0) {
    return DataLoss(fmt::format("PageCopyCpu of {}-token pages left {} wrong bytes", l.page_tokens,
                                check.mismatches));
  }
  return OkStatus();
}

// ---- Command --------------------------------------------------------------------------------

Status RunKernels(const KernelsOptions& o) {
  KVT_ASSIGN_OR_RETURN(std::vector<int> page_tokens, ParseIntList(o.page_tokens));
  KVT_ASSIGN_OR_RETURN(DType dtype, ParseDType(o.dtype));
  if (o.layers <= 0 || o.heads <= 0 || o.head_dim <= 0) {
    return InvalidArgument(
        fmt::format("--layers ({}), --heads ({}) and --head-dim ({}) must be > 0", o.layers,
                    o.heads, o.head_dim));
  }
  if (o.pool_factor < 1.0) {
    return InvalidArgument(fmt::format("--pool-factor is {}; it must be >= 1", o.pool_factor));
  }
  const auto devices = cuda::DeviceCount();
  const bool use_gpu = !o.cpu && devices.count > 0;
  if (!o.cpu && !use_gpu)
    fmt::print("no CUDA device ({}); running the CPU variant\n", devices.reason);
  KVT_ASSIGN_OR_RETURN(int64_t target,
                       ParseBytes(o.bytes.empty() ? (use_gpu ? "1GiB" : "64MiB") : o.bytes));
  const int iters = o.iters > 0 ? o.iters : (use_gpu ? 20 : 5);
  const int64_t elem = ItemSize(dtype);

  json doc;
  doc["tool"] = "kvt-bench kernels";
  doc["date_utc"] = NowUtc();
  doc["command"] = CommandLine();
  doc["mode"] = use_gpu ? "gpu" : "cpu";
  doc["machine"] = DescribeMachine(use_gpu);
  doc["config"] = json{{"layers", o.layers},
                       {"heads", o.heads},
                       {"head_dim", o.head_dim},
                       {"dtype", std::string(DTypeName(dtype))},
                       {"target_bytes", target},
                       {"iters", iters},
                       {"peer_items", o.peer_items},
                       {"pool_factor", o.pool_factor},
                       {"seed", o.seed}};
  doc["notes"] =
      "GB/s = bytes copied / median time (1e9). Per-item peers are timed on an evenly spread "
      "subset of items_timed items and scaled by bytes. Pages are random and distinct on both "
      "sides, drawn from pools of pool_pages_per_buffer pages. On the GPU, ours and each sweep "
      "row are timed interleaved with the contiguous copy (one of each per round); cub's "
      "batched memcpy copies every item in one launch.";
  const std::string card = use_gpu ? doc["machine"].value("gpu", std::string("?")) : "CPU";
  fmt::print(
      "kvt-bench kernels on {} ({}), {} buffers, {} {} x {} heads x {} dims, ~{:.0f} MiB "
      "per run, median of {}\n",
      card, doc["date_utc"].get<std::string>(), 2 * o.layers, std::string(DTypeName(dtype)),
      "elements", o.heads, o.head_dim, static_cast<double>(target) / (1 << 20), iters);
  if (use_gpu) {
    fmt::print("{:>6} {:>9} {:>8} {:>9} {:>11} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8}\n",
               "tokens", "item B", "items", "ours", "contiguous", "ours/ctg", "per-item", "batch",
               "cub", "ours/pi", "ours/bat", "ours/cub", "check");
  } else {
    fmt::print("{:>6} {:>9} {:>8} {:>9} {:>11} {:>8} {:>9} {:>9} {:>8}\n", "tokens", "item B",
               "items", "ours", "contiguous", "ours/ctg", "per-item", "ours/pi", "check");
  }
  std::mt19937 rng(o.seed);
  json results = json::array();
  Status first_error;
  for (int pt : page_tokens) {
    const Layout l = MakeLayout(o, pt, target, elem, rng);
    json r;
    Status s = use_gpu ? RunGpuSize(o, l, iters, r) : RunCpuSize(o, l, iters, r);
    if (!s.ok()) {
      fmt::print("page_tokens {}: {}\n", pt, s.ToString());
      r["page_tokens"] = pt;
      r["error"] = s.ToString();
      if (first_error.ok()) first_error = s;
    }
    results.push_back(r);
  }
  doc["results"] = results;
  fmt::print(
      "GB/s of bytes copied; per-item and batch timed on up to {} items per size "
      "(scaled); ratios vs the same run's contiguous copy{}.\n",
      o.peer_items, use_gpu ? ", timed interleaved with it" : "");
  if (!o.json_path.empty()) {
    KVT_RETURN_IF_ERROR(WriteJson(o.json_path, doc));
    fmt::print("wrote {}\n", o.json_path);
  }
  return first_error;
}

}  // namespace

void AddKernelsCommand(CLI::App& app, int& exit_code) {
  auto opts = std::make_shared<KernelsOptions>();
  CLI::App* cmd =
      app.add_subcommand("kernels",
                         "page gather/scatter kernel vs contiguous memcpy, per-page memcpy and "
                         "cudaMemcpyBatchAsync (CPU variant with --cpu or without a GPU)");
  cmd->add_option("--json", opts->json_path, "write all figures to this JSON file");
  cmd->add_option("--page-tokens", opts->page_tokens, "tokens per page, comma-separated")
      ->capture_default_str();
  cmd->add_option("--layers", opts->layers, "layers (2 x layers buffers)")->capture_default_str();
  cmd->add_option("--heads", opts->heads, "KV heads")->capture_default_str();
  cmd->add_option("--head-dim", opts->head_dim, "head dimension")->capture_default_str();
  cmd->add_option("--dtype", opts->dtype, "element type (bf16, fp16, fp32, fp8_e4m3, ...)")
      ->capture_default_str();
  cmd->add_option("--bytes", opts->bytes, "bytes moved per run (default 1GiB GPU, 64MiB CPU)");
  cmd->add_option("--iters", opts->iters, "timed runs per figure (default 20 GPU, 5 CPU)");
  cmd->add_flag("--cpu", opts->cpu, "run the CPU variant (PageCopyCpu vs memcpy)");
  cmd->add_option("--peer-items", opts->peer_items,
                  "items timed for the per-item memcpy and batch peers")
      ->capture_default_str();
  cmd->add_flag("--sweep", opts->sweep, "also time the kernel's tuning variants (GPU)");
  cmd->add_option("--pool-factor", opts->pool_factor, "pool pages per moved page")
      ->capture_default_str();
  cmd->add_option("--seed", opts->seed, "random page choice")->capture_default_str();
  cmd->callback([opts, &exit_code] {
    Status s = RunKernels(*opts);
    if (!s.ok()) {
      fmt::print(stderr, "kvt-bench kernels: {}\n", s.ToString());
      exit_code = 1;
    }
  });
}

}  // namespace kvt::bench

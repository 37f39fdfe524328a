#include "backends/cuda_ipc/cuda_ipc_program.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <utility>

#include "backends/common/page_bounds.h"
#include "backends/common/run_check.h"

namespace kvt::transfer::cuda_ipc {
namespace {

constexpr uint64_t kMaxInt64 = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

size_t WordsFor(size_t bytes) { return (bytes + sizeof(uint64_t) - 1) / sizeof(uint64_t); }

std::string Num(uint64_t v) { return std::to_string(v); }

// The checks shared by both planners: every published peer buffer is mapped here. Page writes
// also need the peer's buffers to correspond to ours one to one (copy runs name the peer's).
Status CheckSides(std::span<const RemoteRegion> remote, std::span<const uint64_t> dst_bases) {
  if (dst_bases.size() != remote.size()) {
    return Internal("cuda_ipc: " + Num(dst_bases.size()) + " mapped peer buffers for " +
                    Num(remote.size()) + " published ones");
  }
  return OkStatus();
}

// Units of one (source, destination) item-length pair must lie inside both items.
Status CheckUnits(std::span<const PageUnit> units, uint32_t buffer, uint64_t src_item,
                  uint64_t dst_item) {
  for (size_t u = 0; u < units.size(); ++u) {
    const PageUnit& unit = units[u];
    if (unit.bytes > src_item || unit.src_offset > src_item - unit.bytes) {
      return OutOfRange("unit " + Num(u) + " reads [" + Num(unit.src_offset) + ", +" +
                        Num(unit.bytes) + ") of each page, past the " + Num(src_item) +
                        "-byte pages of local buffer " + Num(buffer));
    }
    if (unit.bytes > dst_item || unit.dst_offset > dst_item - unit.bytes) {
      return OutOfRange("unit " + Num(u) + " writes [" + Num(unit.dst_offset) + ", +" +
                        Num(unit.bytes) + ") of each page, past the " + Num(dst_item) +
                        "-byte pages of the peer's buffer " + Num(buffer));
    }
  }
  return OkStatus();
}

}  // namespace

kernels::PageCopyArgs LaunchArgs(const CopyProgram& program, const CopyLaunch& launch,
                                 uint64_t tables_address) {
  kernels::PageCopyArgs args;
  args.src_bases = reinterpret_cast<const uint64_t*>(tables_address + launch.src_bases);
  args.dst_bases = reinterpret_cast<const uint64_t*>(tables_address + launch.dst_bases);
  args.num_buffers = launch.num_buffers;
  if (launch.indexed) {
    args.src_pages = reinterpret_cast<const int32_t*>(tables_address + program.src_pages);
    args.dst_pages = reinterpret_cast<const int32_t*>(tables_address + program.dst_pages);
  }
  args.num_pages = launch.num_pages;
  args.src_page_stride = launch.src_page_stride;
  args.dst_page_stride = launch.dst_page_stride;
  args.src_offset = launch.src_offset;
  args.dst_offset = launch.dst_offset;
  args.bytes = launch.bytes;
  return args;
}

StatusOr<LocalBuffers> LocalBuffers::Create(std::span<const LocalRegion> regions) {
  KVT_ASSIGN_OR_RETURN(LayerTable layers, LayerTable::Create(regions));
  LocalBuffers buffers;
  buffers.regions_.assign(regions.begin(), regions.end());
  buffers.layers_ = std::move(layers);
  return buffers;
}

StatusOr<CopyProgram> PlanPageWrite(const PageWrite& write, const LocalBuffers& local,
                                    std::span<const RemoteRegion> remote,
                                    std::span<const uint64_t> dst_bases) {
  CopyProgram program;
  KVT_RETURN_IF_ERROR(PlanPageWriteInto(write, local, remote, dst_bases, program));
  return program;
}

namespace {

// Every check of a page write against the batch's buffers, buffer by buffer: the first
// violation, named. Run when a write falls outside its batch's shape (which then always finds one).
Status CheckBatch(const PageWrite& write, const LocalBuffers& local,
                  std::span<const RemoteRegion> remote, int64_t src_max, int64_t dst_max) {
  for (uint32_t b : local.layers().Buffers(write.layer_begin, write.layer_end)) {
    const uint64_t src_item = local[b].item_len;
    const uint64_t dst_item = remote[b].item_len;
    if (src_item == 0 || dst_item == 0 || src_item > kMaxInt64 || dst_item > kMaxInt64) {
      return InvalidArgument("buffer " + Num(b) + " has page size " + Num(src_item) + " here and " +
                             Num(dst_item) + " at the peer; both must be > 0");
    }
    const uint64_t src_page_count = local[b].length / src_item;
    const uint64_t dst_page_count = remote[b].length / dst_item;
    if (static_cast<uint64_t>(src_max) >= src_page_count) {
      return OutOfRange("page write reads page " + std::to_string(src_max) + " of local buffer " +
                        Num(b) + ", which holds " + Num(src_page_count) + " pages");
    }
    if (static_cast<uint64_t>(dst_max) >= dst_page_count) {
      return OutOfRange("page write writes page " + std::to_string(dst_max) +
                        " of the peer's buffer " + Num(b) + ", which holds " + Num(dst_page_count) +
                        " pages");
    }
    if (write.units.empty() && src_item != dst_item) {
      return InvalidArgument("whole-page write of buffer " + Num(b) + " between pages of " +
                             Num(src_item) + " bytes here and " + Num(dst_item) +
                             " bytes at the peer; pass units for pools of different layouts");
    }
    KVT_RETURN_IF_ERROR(CheckUnits(write.units, b, src_item, dst_item));
  }
  return OkStatus();
}

// Whether every check of CheckBatch passes, from the shape alone: each holds for every buffer
// exactly when it holds for the batch's smallest page count and page size.
bool InsideShape(const PageWrite& write, const BatchShape& shape, int64_t src_max,
                 int64_t dst_max) {
  if (!shape.usable || src_max >= shape.src_page_end || dst_max >= shape.dst_page_end) {
    return false;
  }
  if (write.units.empty()) return shape.same_page_size;
  for (const PageUnit& unit : write.units) {
    if (unit.bytes > shape.src_item_min || unit.src_offset > shape.src_item_min - unit.bytes ||
        unit.bytes > shape.dst_item_min || unit.dst_offset > shape.dst_item_min - unit.bytes) {
      return false;
    }
  }
  return true;
}

void BuildShape(const LocalBuffers& local, std::span<const RemoteRegion> remote,
                std::span<const uint64_t> dst_bases, int32_t begin, int32_t end,
                BatchShape& shape) {
  shape = BatchShape{};
  shape.layer_begin = begin;
  shape.layer_end = end;
  const std::span<const uint32_t> batch = local.layers().Buffers(begin, end);
  // One launch per (source, destination) page size: buffers sorted so each is one slice.
  std::vector<uint32_t> buffers(batch.begin(), batch.end());
  std::stable_sort(buffers.begin(), buffers.end(), [&](uint32_t a, uint32_t b) {
    return std::pair(local[a].item_len, remote[a].item_len) <
           std::pair(local[b].item_len, remote[b].item_len);
  });
  const size_t nb = buffers.size();
  shape.usable = true;
  shape.src_item_min = shape.dst_item_min = kMaxInt64;
  shape.src_page_end = shape.dst_page_end = std::numeric_limits<int64_t>::max();
  shape.bases.resize(2 * nb);
  for (size_t i = 0; i < nb; ++i) {
    const uint32_t b = buffers[i];
    const uint64_t src_item = local[b].item_len;
    const uint64_t dst_item = remote[b].item_len;
    if (src_item == 0 || dst_item == 0 || src_item > kMaxInt64 || dst_item > kMaxInt64) {
      shape.usable = false;
      return;
    }
    shape.same_page_size = shape.same_page_size && src_item == dst_item;
    shape.src_item_min = std::min(shape.src_item_min, src_item);
    shape.dst_item_min = std::min(shape.dst_item_min, dst_item);
    shape.src_page_end = std::min(
        shape.src_page_end, static_cast<int64_t>(std::min(local[b].length / src_item, kMaxInt64)));
    shape.dst_page_end = std::min(
        shape.dst_page_end, static_cast<int64_t>(std::min(remote[b].length / dst_item, kMaxInt64)));
    shape.bases[i] = local[b].base;
    shape.bases[nb + i] = dst_bases[b];
    if (shape.groups.empty() || shape.groups.back().src_item != src_item ||
        shape.groups.back().dst_item != dst_item) {
      shape.groups.push_back(BatchShape::Group{i, i, src_item, dst_item});
    }
    shape.groups.back().end = i + 1;
  }
}

}  // namespace

const BatchShape& BatchShapes::Get(const LocalBuffers& local, std::span<const RemoteRegion> remote,
                                   std::span<const uint64_t> dst_bases, int32_t begin,
                                   int32_t end) {
  for (const std::unique_ptr<BatchShape>& shape : shapes_) {
    if (shape->layer_begin == begin && shape->layer_end == end) return *shape;
  }
  if (shapes_.size() >= kMaxShapes) {
    shapes_.erase(shapes_.begin(), shapes_.begin() + static_cast<std::ptrdiff_t>(kMaxShapes / 2));
  }
  auto shape = std::make_unique<BatchShape>();
  BuildShape(local, remote, dst_bases, begin, end, *shape);
  shapes_.push_back(std::move(shape));
  return *shapes_.back();
}

Status PlanPageWriteInto(const PageWrite& write, const LocalBuffers& local,
                         std::span<const RemoteRegion> remote, std::span<const uint64_t> dst_bases,
                         CopyProgram& program, BatchShapes* shapes) {
  program.tables.clear();
  program.launches.clear();
  program.src_pages = 0;
  program.dst_pages = 0;
  program.bytes = 0;
  KVT_RETURN_IF_ERROR(CheckRegionCount(local.size(), remote.size()));
  KVT_RETURN_IF_ERROR(CheckSides(remote, dst_bases));
  const size_t n = write.src_pages.size();
  if (write.dst_pages.size() != n) {
    return InvalidArgument("page write with " + Num(n) + " source pages but " +
                           Num(write.dst_pages.size()) +
                           " destination pages; the lists pair up one to one");
  }
  KVT_RETURN_IF_ERROR(
      local.layers().CheckRange(write.num_layers, write.layer_begin, write.layer_end));
  if (n > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return InvalidArgument("page write of " + Num(n) + " pages; at most 2^31 - 1 per write");
  }
  if (n == 0 || write.layer_begin == write.layer_end) return OkStatus();

  const auto [src_min, src_max] = PageBounds(write.src_pages);
  const auto [dst_min, dst_max] = PageBounds(write.dst_pages);
  if (src_min < 0 || dst_min < 0) {
    return OutOfRange("page write names page " + std::to_string(std::min(src_min, dst_min)) +
                      "; page indices are >= 0");
  }

  BatchShape own;
  if (shapes == nullptr) {
    BuildShape(local, remote, dst_bases, write.layer_begin, write.layer_end, own);
  }
  const BatchShape& shape =
      shapes != nullptr ? shapes->Get(local, remote, dst_bases, write.layer_begin, write.layer_end)
                        : own;
  if (!InsideShape(write, shape, src_max, dst_max)) {
    KVT_RETURN_IF_ERROR(CheckBatch(write, local, remote, src_max, dst_max));
    return Internal("cuda_ipc: a page write of layers [" + std::to_string(write.layer_begin) +
                    ", " + std::to_string(write.layer_end) +
                    ") passes every check but lies outside its batch's shape");
  }

  const size_t nb = shape.bases.size() / 2;
  const size_t page_list_words = WordsFor(n * sizeof(int32_t));
  program.tables.assign(2 * nb + 2 * page_list_words, 0);
  std::memcpy(program.tables.data(), shape.bases.data(), shape.bases.size() * sizeof(uint64_t));
  program.src_pages = 2 * nb * sizeof(uint64_t);
  program.dst_pages = program.src_pages + page_list_words * sizeof(uint64_t);
  auto* bytes = reinterpret_cast<uint8_t*>(program.tables.data());
  std::memcpy(bytes + program.src_pages, write.src_pages.data(), n * sizeof(int32_t));
  std::memcpy(bytes + program.dst_pages, write.dst_pages.data(), n * sizeof(int32_t));

  for (const BatchShape::Group& group : shape.groups) {
    CopyLaunch launch;
    launch.src_bases = group.begin * sizeof(uint64_t);
    launch.dst_bases = (nb + group.begin) * sizeof(uint64_t);
    launch.num_buffers = static_cast<int32_t>(group.end - group.begin);
    launch.indexed = true;
    launch.num_pages = static_cast<int64_t>(n);
    launch.src_page_stride = static_cast<int64_t>(group.src_item);
    launch.dst_page_stride = static_cast<int64_t>(group.dst_item);
    auto add = [&](uint64_t src_offset, uint64_t dst_offset, uint64_t unit_bytes) {
      if (unit_bytes == 0) return;
      launch.src_offset = static_cast<int64_t>(src_offset);
      launch.dst_offset = static_cast<int64_t>(dst_offset);
      launch.bytes = static_cast<int64_t>(unit_bytes);
      program.launches.push_back(launch);
      program.bytes += static_cast<uint64_t>(group.end - group.begin) * n * unit_bytes;
    };
    if (write.units.empty()) {
      add(0, 0, group.src_item);
    } else {
      for (const PageUnit& unit : write.units) add(unit.src_offset, unit.dst_offset, unit.bytes);
    }
  }
  if (program.launches.empty()) program.tables.clear();  // only empty units
  return OkStatus();
}

StatusOr<CopyProgram> PlanRunWrite(std::span<const CopyRun> runs,
                                   std::span<const LocalRegion> local,
                                   std::span<const RemoteRegion> remote,
                                   std::span<const uint64_t> dst_bases) {
  KVT_RETURN_IF_ERROR(CheckSides(remote, dst_bases));
  KVT_RETURN_IF_ERROR(CheckRuns(runs, local, remote));
  // Runs of one length share a launch: each run is one "buffer" of one page.
  std::map<uint64_t, std::vector<size_t>> by_length;
  size_t count = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    if (runs[i].bytes == 0) continue;
    by_length[runs[i].bytes].push_back(i);
    ++count;
  }
  CopyProgram program;
  if (count == 0) return program;
  program.tables.assign(2 * count, 0);
  constexpr size_t kMaxPerLaunch = static_cast<size_t>(std::numeric_limits<int32_t>::max());
  size_t slot = 0;
  for (const auto& [length, indices] : by_length) {
    const size_t group_start = slot;
    for (size_t i : indices) {
      const CopyRun& run = runs[i];
      program.tables[slot] = local[run.buffer].base + run.src_offset;
      program.tables[count + slot] = dst_bases[run.DstBuffer()] + run.dst_offset;
      ++slot;
    }
    for (size_t first = group_start; first < slot; first += kMaxPerLaunch) {
      CopyLaunch launch;
      launch.src_bases = first * sizeof(uint64_t);
      launch.dst_bases = (count + first) * sizeof(uint64_t);
      launch.num_buffers = static_cast<int32_t>(std::min(kMaxPerLaunch, slot - first));
      launch.indexed = false;
      launch.num_pages = 1;
      launch.src_page_stride = static_cast<int64_t>(length);
      launch.dst_page_stride = static_cast<int64_t>(length);
      launch.bytes = static_cast<int64_t>(length);
      program.launches.push_back(launch);
    }
    program.bytes += length * indices.size();
  }
  return program;
}

}  // namespace kvt::transfer::cuda_ipc

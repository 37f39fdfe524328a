#include "kvt/transfer/plan.h"

#include <algorithm>
#include <limits>
#include <string>

#include "backends/common/page_bounds.h"

namespace kvt::transfer {
namespace {

// Every buffer of the spec: PlanSpec::buffers as they are, or the uniform 2L K-then-V buffers it
// stands for, written into `storage` (the engine always passes buffers: nothing is copied).
std::span<const PlanBuffer> BuffersOf(const PlanSpec& spec, std::vector<PlanBuffer>& storage) {
  if (!spec.buffers.empty()) return spec.buffers;
  const int32_t layers = std::max(0, spec.num_layers);
  storage.clear();
  storage.reserve(2 * static_cast<size_t>(layers));
  for (int kv = 0; kv < 2; ++kv) {
    for (int32_t l = 0; l < layers; ++l) {
      storage.push_back(PlanBuffer{l, spec.src_item_len, spec.dst_item_len, spec.src_buffer_len,
                                   spec.dst_buffer_len});
    }
  }
  return storage;
}

Status CheckPages(std::span<const int32_t> pages, uint64_t num_pages, const char* side) {
  if (PagesInside(pages, 1, num_pages)) return OkStatus();
  for (size_t i = 0; i < pages.size(); ++i) {
    const int32_t p = pages[i];
    if (p < 1 || static_cast<uint64_t>(p) >= num_pages) {
      return OutOfRange(std::string(side) + " page " + std::to_string(p) + " at position " +
                        std::to_string(i) + " is outside [1, " + std::to_string(num_pages) +
                        "); page 0 is the dummy page and never transferred");
    }
  }
  return OkStatus();
}

bool InRange(const PlanSpec& spec, const PlanBuffer& b) {
  return b.layer >= spec.layer_begin && b.layer < spec.layer_end;
}

}  // namespace

std::span<const CopyRun> Plan::Layers(int32_t a, int32_t b) const {
  const size_t begin = layer_begin_index[a - layer_begin];
  const size_t end = layer_begin_index[b - layer_begin];
  return std::span<const CopyRun>(runs).subspan(begin, end - begin);
}

Status ValidatePlanSpec(const PlanSpec& spec) {
  if (spec.src_pages.size() != spec.dst_pages.size()) {
    return InvalidArgument("source has " + std::to_string(spec.src_pages.size()) +
                           " pages but destination has " + std::to_string(spec.dst_pages.size()) +
                           "; a request moves the same number of pages on both sides");
  }
  if (spec.num_layers <= 0) {
    return InvalidArgument("num_layers=" + std::to_string(spec.num_layers) + " must be positive");
  }
  if (spec.layer_begin < 0 || spec.layer_begin >= spec.layer_end ||
      spec.layer_end > spec.num_layers) {
    return InvalidArgument(
        "layer range [" + std::to_string(spec.layer_begin) + ", " + std::to_string(spec.layer_end) +
        ") is not a non-empty range inside [0, " + std::to_string(spec.num_layers) + ")");
  }
  std::vector<PlanBuffer> uniform;
  const std::span<const PlanBuffer> buffers = BuffersOf(spec, uniform);
  const bool whole_pages = spec.units.empty();
  uint64_t src_pages = std::numeric_limits<uint64_t>::max();
  uint64_t dst_pages = src_pages;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const PlanBuffer& b = buffers[i];
    if (b.layer < 0 || b.layer >= spec.num_layers) {
      return InvalidArgument("buffer " + std::to_string(i) + " belongs to layer " +
                             std::to_string(b.layer) + ", outside [0, " +
                             std::to_string(spec.num_layers) + ")");
    }
    if (!InRange(spec, b)) continue;
    if (b.src_item_len == 0 || b.dst_item_len == 0) {
      return InvalidArgument("item lengths of buffer " + std::to_string(i) +
                             " must be positive (src " + std::to_string(b.src_item_len) +
                             ", dst " + std::to_string(b.dst_item_len) + ")");
    }
    if (whole_pages && b.src_item_len != b.dst_item_len) {
      return InvalidArgument(
          "whole-page transfer needs equal page sizes, but buffer " + std::to_string(i) +
          " has source items of " + std::to_string(b.src_item_len) + " bytes and destination " +
          "items of " + std::to_string(b.dst_item_len) +
          "; give units (offset and bytes) to move part of each page");
    }
    for (size_t u = 0; u < spec.units.size(); ++u) {
      const PageUnit& unit = spec.units[u];
      if (unit.bytes == 0 || unit.src_offset + unit.bytes > b.src_item_len ||
          unit.dst_offset + unit.bytes > b.dst_item_len) {
        return InvalidArgument(
            "unit " + std::to_string(u) + " of " + std::to_string(unit.bytes) +
            " bytes at source offset " + std::to_string(unit.src_offset) +
            " / destination offset " + std::to_string(unit.dst_offset) +
            " is empty or does not fit the items of buffer " + std::to_string(i) + " (" +
            std::to_string(b.src_item_len) + " / " + std::to_string(b.dst_item_len) + " bytes)");
      }
    }
    src_pages = std::min(src_pages, b.src_len / b.src_item_len);
    dst_pages = std::min(dst_pages, b.dst_len / b.dst_item_len);
  }
  if (src_pages == std::numeric_limits<uint64_t>::max()) {
    return InvalidArgument("no buffer belongs to layers [" + std::to_string(spec.layer_begin) +
                           ", " + std::to_string(spec.layer_end) +
                           "); give each buffer the layer it holds (PlanSpec::buffers)");
  }
  KVT_RETURN_IF_ERROR(CheckPages(spec.src_pages, src_pages, "source"));
  KVT_RETURN_IF_ERROR(CheckPages(spec.dst_pages, dst_pages, "destination"));
  return OkStatus();
}

uint64_t PlanBytes(const PlanSpec& spec) {
  uint64_t unit_bytes = 0;
  for (const PageUnit& unit : spec.units) unit_bytes += unit.bytes;
  uint64_t per_page = 0;  // bytes of one page over every buffer of the layer range
  if (spec.buffers.empty()) {
    per_page = (spec.units.empty() ? spec.src_item_len : unit_bytes) * 2 *
               static_cast<uint64_t>(std::max(0, spec.layer_end - spec.layer_begin));
  } else {
    for (const PlanBuffer& b : spec.buffers) {
      if (InRange(spec, b)) per_page += spec.units.empty() ? b.src_item_len : unit_bytes;
    }
  }
  return per_page * spec.src_pages.size();
}

StatusOr<Plan> BuildPlan(const PlanSpec& spec, std::vector<CopyRun> storage) {
  KVT_RETURN_IF_ERROR(ValidatePlanSpec(spec));
  std::vector<PlanBuffer> uniform;
  const std::span<const PlanBuffer> buffers = BuffersOf(spec, uniform);
  const bool whole_pages = spec.units.empty();

  // Page pairs that are consecutive on both sides form one segment; only whole pages coalesce
  // because a partial unit leaves gaps between consecutive pages.
  struct Segment {
    uint64_t src_page, dst_page, count;
  };
  std::vector<Segment> segments;
  for (size_t i = 0; i < spec.src_pages.size(); ++i) {
    const uint64_t s = static_cast<uint64_t>(spec.src_pages[i]);
    const uint64_t d = static_cast<uint64_t>(spec.dst_pages[i]);
    if (whole_pages && !segments.empty()) {
      Segment& last = segments.back();
      if (last.src_page + last.count == s && last.dst_page + last.count == d) {
        ++last.count;
        continue;
      }
    }
    segments.push_back({s, d, 1});
  }

  // The buffers of each layer of the range, in index order: layer l's are
  // by_layer[layer_start[l] .. layer_start[l + 1]) (one flat list, not a list per layer: a
  // one-page request's plan is on its latency path, and that was an allocation per layer).
  const size_t layers = static_cast<size_t>(spec.layer_end - spec.layer_begin);
  std::vector<size_t> layer_start(layers + 1, 0);
  for (const PlanBuffer& b : buffers) {
    if (InRange(spec, b)) ++layer_start[static_cast<size_t>(b.layer - spec.layer_begin) + 1];
  }
  for (size_t l = 0; l < layers; ++l) layer_start[l + 1] += layer_start[l];
  const size_t in_range = layer_start[layers];
  std::vector<uint32_t> by_layer(in_range);
  {
    std::vector<size_t> next(layer_start.begin(), layer_start.end() - 1);
    for (size_t i = 0; i < buffers.size(); ++i) {
      if (!InRange(spec, buffers[i])) continue;
      by_layer[next[static_cast<size_t>(buffers[i].layer - spec.layer_begin)]++] =
          static_cast<uint32_t>(i);
    }
  }

  Plan plan;
  plan.runs = std::move(storage);
  plan.runs.clear();
  plan.layer_begin = spec.layer_begin;
  plan.layer_end = spec.layer_end;
  plan.runs.reserve(in_range * segments.size() * std::max<size_t>(1, spec.units.size()));
  plan.layer_begin_index.reserve(layers + 1);
  for (size_t l = 0; l < layers; ++l) {
    plan.layer_begin_index.push_back(plan.runs.size());
    for (size_t k = layer_start[l]; k < layer_start[l + 1]; ++k) {
      const uint32_t buffer = by_layer[k];
      const PlanBuffer& b = buffers[buffer];
      const PageUnit whole{0, 0, b.src_item_len};
      const std::span<const PageUnit> units =
          whole_pages ? std::span<const PageUnit>(&whole, 1) : spec.units;
      for (const Segment& seg : segments) {
        for (const PageUnit& unit : units) {
          CopyRun run;
          run.buffer = buffer;
          run.src_offset = seg.src_page * b.src_item_len + unit.src_offset;
          run.dst_offset = seg.dst_page * b.dst_item_len + unit.dst_offset;
          run.bytes = seg.count * unit.bytes;  // count > 1 only for whole pages
          plan.total_bytes += run.bytes;
          plan.runs.push_back(run);
        }
      }
    }
  }
  plan.layer_begin_index.push_back(plan.runs.size());
  return plan;
}

}  // namespace kvt::transfer

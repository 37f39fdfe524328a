#include "kvt/transfer/plan.h"

#include <algorithm>
#include <string>

namespace kvt::transfer {
namespace {

Status CheckPages(std::span<const int32_t> pages, uint64_t item_len, uint64_t buffer_len,
                  const char* side) {
  const uint64_t num_pages = item_len == 0 ? 0 : buffer_len / item_len;
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
  if (spec.src_item_len == 0 || spec.dst_item_len == 0) {
    return InvalidArgument("item lengths must be positive (src " +
                           std::to_string(spec.src_item_len) + ", dst " +
                           std::to_string(spec.dst_item_len) + ")");
  }
  const bool whole_pages = spec.units.empty();
  if (whole_pages && spec.src_item_len != spec.dst_item_len) {
    return InvalidArgument("whole-page transfer needs equal page sizes, but the source item is " +
                           std::to_string(spec.src_item_len) + " bytes and the destination " +
                           std::to_string(spec.dst_item_len) +
                           "; give units (offset and bytes) to move part of each page");
  }
  const PageUnit whole{0, 0, spec.src_item_len};
  const std::span<const PageUnit> units =
      whole_pages ? std::span<const PageUnit>(&whole, 1) : spec.units;
  for (size_t u = 0; u < units.size(); ++u) {
    const PageUnit& unit = units[u];
    if (unit.bytes == 0 || unit.src_offset + unit.bytes > spec.src_item_len ||
        unit.dst_offset + unit.bytes > spec.dst_item_len) {
      return InvalidArgument(
          "unit " + std::to_string(u) + " of " + std::to_string(unit.bytes) +
          " bytes at source offset " + std::to_string(unit.src_offset) + " / destination offset " +
          std::to_string(unit.dst_offset) + " is empty or does not fit items of " +
          std::to_string(spec.src_item_len) + " / " + std::to_string(spec.dst_item_len) + " bytes");
    }
  }
  KVT_RETURN_IF_ERROR(CheckPages(spec.src_pages, spec.src_item_len, spec.src_buffer_len, "source"));
  KVT_RETURN_IF_ERROR(
      CheckPages(spec.dst_pages, spec.dst_item_len, spec.dst_buffer_len, "destination"));

  return OkStatus();
}

uint64_t PlanBytes(const PlanSpec& spec) {
  uint64_t per_page = 0;
  if (spec.units.empty()) {
    per_page = spec.src_item_len;
  } else {
    for (const PageUnit& unit : spec.units) per_page += unit.bytes;
  }
  return per_page * spec.src_pages.size() * 2 *
         static_cast<uint64_t>(std::max(0, spec.layer_end - spec.layer_begin));
}

StatusOr<Plan> BuildPlan(const PlanSpec& spec, std::vector<CopyRun> storage) {
  KVT_RETURN_IF_ERROR(ValidatePlanSpec(spec));
  const bool whole_pages = spec.units.empty();
  const PageUnit whole{0, 0, spec.src_item_len};
  const std::span<const PageUnit> units =
      whole_pages ? std::span<const PageUnit>(&whole, 1) : spec.units;

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

  Plan plan;
  plan.runs = std::move(storage);
  plan.runs.clear();
  plan.layer_begin = spec.layer_begin;
  plan.layer_end = spec.layer_end;
  const size_t layers = static_cast<size_t>(spec.layer_end - spec.layer_begin);
  plan.runs.reserve(layers * 2 * segments.size() * units.size());
  plan.layer_begin_index.reserve(layers + 1);
  for (int32_t layer = spec.layer_begin; layer < spec.layer_end; ++layer) {
    plan.layer_begin_index.push_back(plan.runs.size());
    for (int kv = 0; kv < 2; ++kv) {
      const uint32_t buffer = static_cast<uint32_t>(kv * spec.num_layers + layer);
      for (const Segment& seg : segments) {
        for (const PageUnit& unit : units) {
          CopyRun run;
          run.buffer = buffer;
          run.src_offset = seg.src_page * spec.src_item_len + unit.src_offset;
          run.dst_offset = seg.dst_page * spec.dst_item_len + unit.dst_offset;
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

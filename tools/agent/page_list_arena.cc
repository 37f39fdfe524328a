#include "page_list_arena.h"

#include <iterator>
#include <string>

namespace kvt::tools {

RangeAllocator::RangeAllocator(int64_t capacity) : capacity_(capacity > 0 ? capacity : 0) {
  if (capacity_ > 0) free_[0] = capacity_;
  free_units_ = capacity_;
}

StatusOr<Range> RangeAllocator::Allocate(int64_t length) {
  if (length <= 0 || length > capacity_) {
    return InvalidArgument("a page list of " + std::to_string(length) +
                           " entries does not fit an arena of " + std::to_string(capacity_));
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < length) continue;
    Range range{it->first, length};
    const int64_t rest = it->second - length;
    const int64_t rest_offset = it->first + length;
    free_.erase(it);
    if (rest > 0) free_[rest_offset] = rest;
    free_units_ -= length;
    return range;
  }
  return ResourceExhausted("no free run of " + std::to_string(length) +
                           " entries in the page-list arena now (" + std::to_string(free_units_) +
                           " of " + std::to_string(capacity_) + " free, in " +
                           std::to_string(free_.size()) + " runs); retry when requests finish");
}

void RangeAllocator::Free(const Range& range) {
  if (!range.valid() || range.length <= 0 || range.offset + range.length > capacity_) return;
  std::lock_guard<std::mutex> lock(mu_);
  int64_t offset = range.offset;
  int64_t length = range.length;
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && next->first == offset + length) {
    length += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      length += prev->second;
      free_.erase(prev);
    }
  }
  free_[offset] = length;
  free_units_ += range.length;
}

int64_t RangeAllocator::free_units() const {
  std::lock_guard<std::mutex> lock(mu_);
  return free_units_;
}

size_t RangeAllocator::free_runs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return free_.size();
}

StatusOr<std::unique_ptr<PageListArena>> PageListArena::Create(int64_t capacity, int device) {
  if (capacity <= 0) {
    return InvalidArgument("page-list arena capacity " + std::to_string(capacity) +
                           " must be positive");
  }
  const size_t bytes = static_cast<size_t>(capacity) * sizeof(int32_t);
  KVT_ASSIGN_OR_RETURN(cuda::DeviceBuffer dev, cuda::DeviceBuffer::Allocate(bytes, device));
  KVT_ASSIGN_OR_RETURN(cuda::PinnedBuffer mirror, cuda::PinnedBuffer::Allocate(bytes));
  return std::unique_ptr<PageListArena>(
      new PageListArena(capacity, std::move(dev), std::move(mirror)));
}

}  // namespace kvt::tools

#include "kvt/pool/page_allocator.h"

#include <string>
#include <unordered_map>

namespace kvt::pool {

StatusOr<std::unique_ptr<PageAllocator>> PageAllocator::Create(int64_t num_pages) {
  if (num_pages < 1 || num_pages > INT32_MAX) {
    return InvalidArgument("PageAllocator needs 1.." + std::to_string(INT32_MAX) +
                           " usable pages (got " + std::to_string(num_pages) +
                           "); page 0 is the dummy page, so a pool of size S and page_size P "
                           "has S / P usable pages");
  }
  return std::unique_ptr<PageAllocator>(new PageAllocator(num_pages));
}

PageAllocator::PageAllocator(int64_t num_pages)
    : num_pages_(num_pages), allocated_(static_cast<size_t>(num_pages) + 1, false) {
  free_ids_.reserve(static_cast<size_t>(num_pages));
  // A stack: the lowest id on top, so a fresh allocator hands out 1, 2, 3, ...
  for (int64_t id = num_pages; id >= 1; --id) free_ids_.push_back(static_cast<int32_t>(id));
}

StatusOr<std::vector<int32_t>> PageAllocator::Allocate(int64_t n) {
  if (n < 0) return InvalidArgument("cannot allocate " + std::to_string(n) + " pages");
  std::lock_guard<std::mutex> lock(mu_);
  const auto free = static_cast<int64_t>(free_ids_.size());
  if (n > free) {
    return ResourceExhausted("cannot allocate " + std::to_string(n) + " pages: only " +
                             std::to_string(free) + " of " + std::to_string(num_pages_) +
                             " are free; free pages or retry later");
  }
  std::vector<int32_t> pages(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    pages[i] = free_ids_.back();
    free_ids_.pop_back();
    allocated_[pages[i]] = true;
  }
  return pages;
}

Status PageAllocator::Free(std::span<const int32_t> pages) {
  std::lock_guard<std::mutex> lock(mu_);
  // Validate everything first: a bad list must leave the allocator untouched.
  std::unordered_map<int32_t, size_t> seen;
  seen.reserve(pages.size());
  for (size_t i = 0; i < pages.size(); ++i) {
    const int32_t id = pages[i];
    const std::string where = "page id " + std::to_string(id) + " at position " + std::to_string(i);
    if (id == 0) {
      return InvalidArgument(where + " is the dummy page, which is never allocated");
    }
    if (id < 0 || id > num_pages_) {
      return InvalidArgument(where + " is not a page of this allocator (valid ids 1.." +
                             std::to_string(num_pages_) + ")");
    }
    if (!allocated_[id]) {
      return InvalidArgument(where + " is not allocated (double free?)");
    }
    const auto [it, inserted] = seen.emplace(id, i);
    if (!inserted) {
      return InvalidArgument(where + " repeats position " + std::to_string(it->second) +
                             " (double free in one call)");
    }
  }
  for (int32_t id : pages) {
    allocated_[id] = false;
    free_ids_.push_back(id);
  }
  return OkStatus();
}

int64_t PageAllocator::NumFree() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(free_ids_.size());
}

int64_t PageAllocator::NumAllocated() const {
  std::lock_guard<std::mutex> lock(mu_);
  return num_pages_ - static_cast<int64_t>(free_ids_.size());
}

bool PageAllocator::IsAllocated(int32_t page) const {
  std::lock_guard<std::mutex> lock(mu_);
  return page >= 1 && page <= num_pages_ && allocated_[page];
}

}  // namespace kvt::pool

#include "kvt/pool/page_allocator.h"

#include <algorithm>
#include <string>

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
  // One pass marks each page free as it is checked (no allocation, no per-page string: freeing a
  // request's 8192 pages must not cost milliseconds); a bad id rolls the marks back, so a bad
  // list leaves the allocator untouched.
  auto refuse = [&](size_t i, const std::string& why) {
    for (size_t j = 0; j < i; ++j) allocated_[pages[j]] = true;
    return InvalidArgument("page id " + std::to_string(pages[i]) + " at position " +
                           std::to_string(i) + why);
  };
  for (size_t i = 0; i < pages.size(); ++i) {
    const int32_t id = pages[i];
    if (id == 0) return refuse(i, " is the dummy page, which is never allocated");
    if (id < 0 || id > num_pages_) {
      return refuse(
          i, " is not a page of this allocator (valid ids 1.." + std::to_string(num_pages_) + ")");
    }
    if (!allocated_[id]) {
      // Either never allocated, or listed earlier in this call (which marked it free).
      const auto first = std::find(pages.begin(), pages.begin() + static_cast<ptrdiff_t>(i), id);
      if (first != pages.begin() + static_cast<ptrdiff_t>(i)) {
        return refuse(i, " repeats position " + std::to_string(first - pages.begin()) +
                             " (double free in one call)");
      }
      return refuse(i, " is not allocated (double free?)");
    }
    allocated_[id] = false;
  }
  free_ids_.insert(free_ids_.end(), pages.begin(), pages.end());
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

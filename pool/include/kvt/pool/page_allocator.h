// PageAllocator: hands out a pool's page ids to requests.
//
// Page ids run 1..num_pages; page 0 is the pool's dummy page and is never handed out.
// Allocate is all-or-nothing; Free validates every id (range, currently allocated, not listed
// twice) before changing anything, so a bad call leaves the allocator as it was. A fresh
// allocator hands pages out in ascending id order; freed pages are reused first (LIFO, warm in
// caches). Both keep tests and traces deterministic.
//
// Thread safety: every method is safe to call concurrently (one mutex guards the state).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "kvt/common/status.h"

namespace kvt::pool {

class PageAllocator {
 public:
  // `num_pages` usable pages (ids 1..num_pages), e.g. PoolLayout::num_pages().
  // InvalidArgument when num_pages < 1 or does not fit int32 page ids.
  static StatusOr<std::unique_ptr<PageAllocator>> Create(int64_t num_pages);

  PageAllocator(const PageAllocator&) = delete;
  PageAllocator& operator=(const PageAllocator&) = delete;

  // `n` pages, or ResourceExhausted saying how many are free (nothing is taken then).
  // InvalidArgument for n < 0; n == 0 gives an empty list.
  StatusOr<std::vector<int32_t>> Allocate(int64_t n);

  // Returns pages. InvalidArgument naming the first bad id and its position for page 0,
  // ids outside 1..num_pages, pages not currently allocated (double free) and ids listed twice;
  // nothing is freed then.
  Status Free(std::span<const int32_t> pages);

  int64_t num_pages() const { return num_pages_; }
  int64_t NumFree() const;
  int64_t NumAllocated() const;
  bool IsAllocated(int32_t page) const;

 private:
  explicit PageAllocator(int64_t num_pages);

  const int64_t num_pages_;
  mutable std::mutex mu_;
  std::vector<int32_t> free_ids_;  // guarded by mu_; a stack, lowest id on top
  std::vector<bool> allocated_;    // guarded by mu_; indexed by page id
};

}  // namespace kvt::pool

// The bounds of a page-id list, private to the transfer library.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>

namespace kvt::transfer {

// The smallest and largest id of `pages` (anything with size() and operator[] giving int32_t),
// in one branch-free pass the compiler vectorizes. A request carries thousands of page ids and
// is checked several times on its way (the decode call, the prefill side's frame, its plan): each
// check runs this first and looks for the position of a bad id, for its message, only when the
// bounds say there is one. An empty list gives {INT32_MAX, INT32_MIN}.
template <typename Pages>
std::pair<int32_t, int32_t> PageBounds(const Pages& pages) {
  int32_t lo = std::numeric_limits<int32_t>::max();
  int32_t hi = std::numeric_limits<int32_t>::min();
  const auto n = pages.size();
  for (decltype(pages.size()) i = 0; i < n; ++i) {
    const int32_t p = pages[i];
    lo = std::min(lo, p);
    hi = std::max(hi, p);
  }
  return {lo, hi};
}

// True when every id of `pages` lies in [first, end) (an empty list is inside).
template <typename Pages>
bool PagesInside(const Pages& pages, int64_t first, uint64_t end) {
  if (pages.size() == 0) return true;
  const auto [lo, hi] = PageBounds(pages);
  return lo >= first && static_cast<uint64_t>(static_cast<int64_t>(hi)) < end;
}

}  // namespace kvt::transfer

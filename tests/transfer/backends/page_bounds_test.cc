// PageBounds / PagesInside: the fast pass every check of a request's page ids runs before it
// looks for the position of a bad id.
#include "backends/common/page_bounds.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "control/protocol.h"

namespace kvt::transfer {
namespace {

TEST(PageBoundsTest, BoundsOfAListAndOfAnEmptyOne) {
  const std::vector<int32_t> pages = {7, 3, 9, 1, 8};
  EXPECT_EQ(PageBounds(pages), std::make_pair(1, 9));
  const std::vector<int32_t> none;
  EXPECT_EQ(PageBounds(none),
            std::make_pair(std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min()));
  EXPECT_TRUE(PagesInside(none, 1, 2));
}

TEST(PageBoundsTest, InsideOnlyWhenEveryIdIsInTheRange) {
  // Long enough for the vectorized loop's main body and its tail.
  std::vector<int32_t> pages(1027);
  std::iota(pages.begin(), pages.end(), 1);  // 1..1027
  EXPECT_TRUE(PagesInside(pages, 1, 1028));
  EXPECT_FALSE(PagesInside(pages, 1, 1027));  // 1027 is past the end
  for (const size_t at : {size_t{0}, size_t{513}, pages.size() - 1}) {
    for (const int32_t bad : {0, -5, std::numeric_limits<int32_t>::min(), 5000,
                              std::numeric_limits<int32_t>::max()}) {
      std::vector<int32_t> one_bad = pages;
      one_bad[at] = bad;
      EXPECT_FALSE(PagesInside(one_bad, 1, 1028)) << "page " << bad << " at " << at;
    }
  }
  // No upper bound known: only ids below 1 are outside.
  EXPECT_TRUE(PagesInside(pages, 1, std::numeric_limits<uint64_t>::max()));
}

TEST(PageBoundsTest, ReadsPageIdsAsTheyTravelLittleEndian) {
  // The accessor a TransferRequest's dst_page_ids_le32 is checked through.
  struct Le32 {
    std::string bytes;
    int size() const { return static_cast<int>(bytes.size() / 4); }
    int32_t operator[](int i) const { return control::Le32At(bytes, static_cast<size_t>(i)); }
  };
  Le32 pages;
  for (const uint32_t v : {5u, 70000u, 2u, 0x80000000u}) {
    for (int b = 0; b < 4; ++b) pages.bytes.push_back(static_cast<char>((v >> (8 * b)) & 0xFF));
  }
  EXPECT_EQ(PageBounds(pages), std::make_pair(std::numeric_limits<int32_t>::min(), 70000));
  EXPECT_FALSE(PagesInside(pages, 1, 100000));
  pages.bytes.resize(12);  // 5, 70000, 2
  EXPECT_TRUE(PagesInside(pages, 1, 70001));
  EXPECT_FALSE(PagesInside(pages, 1, 70000));
}

}  // namespace
}  // namespace kvt::transfer

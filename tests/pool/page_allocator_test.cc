#include "kvt/pool/page_allocator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <thread>

namespace kvt::pool {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<PageAllocator> Make(int64_t n) {
  auto a = PageAllocator::Create(n);
  EXPECT_TRUE(a.ok()) << a.status();
  return std::move(a).value();
}

TEST(PageAllocatorTest, RejectsBadSizes) {
  for (int64_t n : {int64_t{0}, int64_t{-3}, int64_t{1} << 40}) {
    auto a = PageAllocator::Create(n);
    ASSERT_FALSE(a.ok()) << n;
    EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(a.status().message(), HasSubstr(std::to_string(n)));
  }
}

TEST(PageAllocatorTest, NeverHandsOutPageZeroAndAscendsWhenFresh) {
  auto a = Make(4);
  auto pages = a->Allocate(4);
  ASSERT_TRUE(pages.ok());
  EXPECT_EQ(*pages, (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(a->NumFree(), 0);
  EXPECT_EQ(a->NumAllocated(), 4);
  EXPECT_FALSE(a->IsAllocated(0));
}

TEST(PageAllocatorTest, AllocateIsAllOrNothing) {
  auto a = Make(5);
  ASSERT_TRUE(a->Allocate(3).ok());
  auto too_many = a->Allocate(3);
  ASSERT_FALSE(too_many.ok());
  EXPECT_EQ(too_many.status().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(too_many.status().message(), HasSubstr("only 2 of 5 are free"));
  EXPECT_EQ(a->NumFree(), 2);  // nothing was taken
  EXPECT_TRUE(a->Allocate(2).ok());
}

TEST(PageAllocatorTest, ZeroAndNegativeCounts) {
  auto a = Make(2);
  auto none = a->Allocate(0);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  auto neg = a->Allocate(-1);
  ASSERT_FALSE(neg.ok());
  EXPECT_EQ(neg.status().code(), StatusCode::kInvalidArgument);
}

TEST(PageAllocatorTest, FreeReturnsPagesForReuse) {
  auto a = Make(3);
  auto pages = a->Allocate(3);
  ASSERT_TRUE(pages.ok());
  const std::vector<int32_t> two = {2};
  ASSERT_TRUE(a->Free(two).ok());
  EXPECT_FALSE(a->IsAllocated(2));
  auto again = a->Allocate(1);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, std::vector<int32_t>{2});
}

TEST(PageAllocatorTest, DoubleFreeIsRefusedWithoutChangingState) {
  auto a = Make(4);
  ASSERT_TRUE(a->Allocate(2).ok());  // 1, 2
  const std::vector<int32_t> one = {1};
  ASSERT_TRUE(a->Free(one).ok());
  const std::vector<int32_t> again = {2, 1};
  Status st = a->Free(again);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("page id 1 at position 1"));
  EXPECT_THAT(st.message(), HasSubstr("double free"));
  EXPECT_TRUE(a->IsAllocated(2));  // 2 was not freed by the failed call
  EXPECT_EQ(a->NumFree(), 3);
}

TEST(PageAllocatorTest, DuplicateInOneCallIsRefused) {
  auto a = Make(4);
  ASSERT_TRUE(a->Allocate(2).ok());
  const std::vector<int32_t> dup = {2, 2};
  Status st = a->Free(dup);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("repeats position 0"));
  EXPECT_TRUE(a->IsAllocated(2));
}

TEST(PageAllocatorTest, ABadIdLateInALongListLeavesEveryPageAllocated) {
  auto a = Make(10000);
  auto pages = a->Allocate(8192);
  ASSERT_TRUE(pages.ok());
  std::vector<int32_t> list = *pages;
  list.push_back(list[100]);  // a repeat at the end: everything before it was checked first
  Status st = a->Free(list);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("at position 8192 repeats position 100"));
  for (int32_t id : *pages) ASSERT_TRUE(a->IsAllocated(id)) << id;
  EXPECT_EQ(a->NumFree(), 10000 - 8192);
  ASSERT_TRUE(a->Free(*pages).ok());  // the same list without the repeat frees them all
  EXPECT_EQ(a->NumFree(), 10000);
}

TEST(PageAllocatorTest, ForeignAndDummyIdsAreRefused) {
  auto a = Make(4);
  ASSERT_TRUE(a->Allocate(4).ok());
  for (int32_t id : {0, -1, 5, 1 << 30}) {
    const std::vector<int32_t> bad = {1, id};
    Status st = a->Free(bad);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << id;
    EXPECT_THAT(st.message(), HasSubstr("page id " + std::to_string(id) + " at position 1"));
    EXPECT_TRUE(a->IsAllocated(1)) << "page 1 must stay allocated after a refused Free";
  }
  EXPECT_EQ(a->NumFree(), 0);
}

TEST(PageAllocatorTest, ConcurrentAllocateAndFreeKeepPagesUnique) {
  auto a = Make(1000);
  std::vector<std::thread> threads;
  std::vector<std::vector<int32_t>> got(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 200; ++round) {
        auto pages = a->Allocate(5);
        if (!pages.ok()) continue;
        if (round % 2 == 0) {
          EXPECT_TRUE(a->Free(*pages).ok());
        } else {
          got[t].insert(got[t].end(), pages->begin(), pages->end());
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  std::set<int32_t> all;
  size_t total = 0;
  for (const auto& g : got) {
    all.insert(g.begin(), g.end());
    total += g.size();
  }
  EXPECT_EQ(all.size(), total) << "a page was handed out twice";
  EXPECT_EQ(a->NumAllocated(), static_cast<int64_t>(total));
  EXPECT_EQ(all.count(0), 0u);
}

}  // namespace
}  // namespace kvt::pool

#include "kvt/common/status.h"

#include <gtest/gtest.h>

#include <memory>

namespace kvt {
namespace {

TEST(StatusTest, DefaultIsOk) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.ToString(), "OK");
}

TEST(StatusTest, CarriesCodeAndMessage) {
  Status s = InvalidArgument("page_size=0 must be positive");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.ToString(), "InvalidArgument: page_size=0 must be positive");
  EXPECT_EQ(s.WithContext("pool").message(), "pool: page_size=0 must be positive");
  EXPECT_TRUE(OkStatus().WithContext("x").ok());
}

TEST(StatusTest, OkCodeDropsMessage) {
  Status s(StatusCode::kOk, "ignored");
  EXPECT_TRUE(s.ok());
  EXPECT_TRUE(s.message().empty());
}

StatusOr<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgument("odd");
  return x / 2;
}

Status UseHalf(int x, int* out) {
  KVT_ASSIGN_OR_RETURN(int h, Half(x));
  KVT_RETURN_IF_ERROR(h > 10 ? OutOfRange("too big") : OkStatus());
  *out = h;
  return OkStatus();
}

TEST(StatusOrTest, ValueAndErrorPaths) {
  StatusOr<int> good = Half(4);
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(*good, 2);
  StatusOr<int> bad = Half(3);
  EXPECT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);

  int out = -1;
  EXPECT_TRUE(UseHalf(8, &out).ok());
  EXPECT_EQ(out, 4);
  out = -1;
  EXPECT_EQ(UseHalf(7, &out).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(UseHalf(40, &out).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(out, -1);  // output set only on success
}

TEST(StatusOrTest, MoveOnlyValue) {
  StatusOr<std::unique_ptr<int>> p = std::make_unique<int>(7);
  ASSERT_TRUE(p.ok());
  std::unique_ptr<int> taken = std::move(p).value();
  EXPECT_EQ(*taken, 7);
}

TEST(StatusOrTest, OkStatusWithoutValueBecomesInternal) {
  StatusOr<int> s = OkStatus();
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInternal);
}

TEST(StatusOrDeathTest, AccessingFailedValueAborts) {
  StatusOr<int> bad = NotFound("room 7");
  EXPECT_DEATH((void)bad.value(), "room 7");
}

}  // namespace
}  // namespace kvt

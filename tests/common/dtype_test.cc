#include "kvt/common/dtype.h"

#include <gtest/gtest.h>

namespace kvt {
namespace {

TEST(DTypeTest, SizesAndStoreTypes) {
  EXPECT_EQ(ItemSize(DType::kBF16), 2);
  EXPECT_EQ(ItemSize(DType::kFP16), 2);
  EXPECT_EQ(ItemSize(DType::kFP32), 4);
  EXPECT_EQ(ItemSize(DType::kFP8E4M3), 1);
  EXPECT_EQ(ItemSize(DType::kFP8E5M2), 1);
  EXPECT_EQ(StoreDType(DType::kFP8E4M3), DType::kUInt8);
  EXPECT_EQ(StoreDType(DType::kFP8E5M2), DType::kUInt8);
  EXPECT_EQ(StoreDType(DType::kBF16), DType::kBF16);
  EXPECT_FALSE(IsPoolDType(DType::kUInt8));
}

TEST(DTypeTest, ParsesNamesAndAliases) {
  for (DType d : {DType::kBF16, DType::kFP16, DType::kFP32, DType::kFP8E4M3, DType::kFP8E5M2}) {
    auto parsed = ParseDType(DTypeName(d));
    ASSERT_TRUE(parsed.ok()) << DTypeName(d);
    EXPECT_EQ(*parsed, d);
  }
  EXPECT_EQ(*ParseDType("bfloat16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("float8_e4m3fn"), DType::kFP8E4M3);
}

TEST(DTypeTest, UnknownNameSaysWhatIsValid) {
  auto parsed = ParseDType("int4");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(parsed.status().message().find("'int4'"), std::string::npos);
  EXPECT_NE(parsed.status().message().find("fp8_e4m3"), std::string::npos);
}

}  // namespace
}  // namespace kvt

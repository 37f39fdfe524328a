#include "kvt/pool/layer_type.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kvt::pool {
namespace {

using ::testing::HasSubstr;

TEST(LayerTypeTest, NamesRoundTrip) {
  for (LayerType t :
       {LayerType::kFullAttention, LayerType::kSlidingAttention, LayerType::kLinearAttention}) {
    StatusOr<LayerType> parsed = ParseLayerType(LayerTypeName(t));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, t);
  }
  EXPECT_TRUE(IsKvLayerType(LayerType::kFullAttention));
  EXPECT_TRUE(IsKvLayerType(LayerType::kSlidingAttention));
  EXPECT_FALSE(IsKvLayerType(LayerType::kLinearAttention));
  EXPECT_TRUE(IsStateLayerType(LayerType::kLinearAttention));
}

TEST(LayerTypeTest, UnknownNameIsInvalidArgument) {
  StatusOr<LayerType> parsed = ParseLayerType("mamba");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(parsed.status().message(), HasSubstr("'mamba'"));
  EXPECT_THAT(parsed.status().message(), HasSubstr("linear_attention"));
}

TEST(LayerTypeTest, ParsesListsAndNamesTheBadPosition) {
  StatusOr<std::vector<LayerType>> types = ParseLayerTypes("full_attention,sliding_attention");
  ASSERT_TRUE(types.ok());
  EXPECT_EQ(*types,
            (std::vector<LayerType>{LayerType::kFullAttention, LayerType::kSlidingAttention}));
  EXPECT_TRUE(ParseLayerTypes("")->empty());
  StatusOr<std::vector<LayerType>> bad = ParseLayerTypes("full_attention,,linear_attention");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("position 1"));
  bad = ParseLayerTypes("full_attention,sliding");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("'sliding'"));
}

}  // namespace
}  // namespace kvt::pool

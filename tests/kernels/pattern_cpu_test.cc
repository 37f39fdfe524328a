// Fill / verify round trips, single and double corruptions found at the right place, and the
// pattern's independence across (request, layer, kv, token, byte).
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kvt/kernels/kernels.h"
#include "test_buffers.h"

namespace kvt::kernels {
namespace {

using testing::DistinctIndices;
using testing::HostBytes;
using testing::Uniform;

struct PatternPool {
  int32_t num_layers;
  int64_t page_size, num_tokens, row_bytes, pool_pages;
  std::vector<std::unique_ptr<HostBytes>> k, v;
  std::vector<uint64_t> k_bases, v_bases;
  std::vector<int32_t> pages;

  PatternPool(std::mt19937& rng, int32_t layers, int64_t page_size_, int64_t tokens,
              int64_t row_bytes_)
      : num_layers(layers), page_size(page_size_), num_tokens(tokens), row_bytes(row_bytes_) {
    const int64_t need = (num_tokens + page_size - 1) / page_size;
    pool_pages = need + Uniform(rng, 1, 6);
    for (int32_t l = 0; l < num_layers; ++l) {
      k.push_back(std::make_unique<HostBytes>(pool_pages * page_size * row_bytes, 0, rng));
      v.push_back(std::make_unique<HostBytes>(pool_pages * page_size * row_bytes, 0, rng));
      k_bases.push_back(k.back()->addr());
      v_bases.push_back(v.back()->addr());
    }
    pages = DistinctIndices(need, pool_pages, rng);
  }

  PatternArgs Args(uint64_t request, int32_t first_layer) const {
    PatternArgs a;
    a.request = request;
    a.k_bases = k_bases.data();
    a.v_bases = v_bases.data();
    a.first_layer = first_layer;
    a.num_layers = num_layers;
    a.pages = pages.data();
    a.num_tokens = num_tokens;
    a.page_size = page_size;
    a.row_bytes = row_bytes;
    return a;
  }

  uint8_t* At(int32_t j, int32_t kv, int64_t token, int64_t byte) {
    const int64_t row = pages[token / page_size] * page_size + token % page_size;
    return (kv == 0 ? k[j] : v[j])->data() + row * row_bytes + byte;
  }
};

TEST(PatternTest, FillWritesPatternByteHostAtEveryTokenRow) {
  std::mt19937 rng(5);
  PatternPool pool(rng, 3, 4, 13, 37);
  ASSERT_TRUE(FillPatternCpu(pool.Args(77, 10)).ok());
  for (int32_t j = 0; j < 3; ++j) {
    for (int32_t kv = 0; kv < 2; ++kv) {
      for (int64_t t = 0; t < 13; ++t) {
        for (int64_t b = 0; b < 37; ++b) {
          ASSERT_EQ(*pool.At(j, kv, t, b), PatternByteHost(77, 10 + j, kv, t, b));
        }
      }
    }
  }
}

TEST(PatternTest, RoundTripThenSingleFlipIsLocated) {
  std::mt19937 rng(11);
  for (int iter = 0; iter < 50; ++iter) {
    const int32_t layers = static_cast<int32_t>(Uniform(rng, 1, 4));
    PatternPool pool(rng, layers, Uniform(rng, 1, 8), Uniform(rng, 1, 40), Uniform(rng, 1, 90));
    const uint64_t request = rng();
    const int32_t first_layer = static_cast<int32_t>(Uniform(rng, 0, 30));
    const PatternArgs a = pool.Args(request, first_layer);
    ASSERT_TRUE(FillPatternCpu(a).ok());
    auto clean = VerifyPatternCpu(a);
    ASSERT_TRUE(clean.ok());
    EXPECT_EQ(clean->mismatches, 0u);

    const int32_t j = static_cast<int32_t>(Uniform(rng, 0, layers - 1));
    const int32_t kv = static_cast<int32_t>(Uniform(rng, 0, 1));
    const int64_t t = Uniform(rng, 0, pool.num_tokens - 1);
    const int64_t b = Uniform(rng, 0, pool.row_bytes - 1);
    const uint8_t before = *pool.At(j, kv, t, b);
    *pool.At(j, kv, t, b) = static_cast<uint8_t>(before ^ (1u << Uniform(rng, 0, 7)));
    auto bad = VerifyPatternCpu(a);
    ASSERT_TRUE(bad.ok());
    EXPECT_EQ(bad->mismatches, 1u);
    EXPECT_EQ(bad->layer, first_layer + j);
    EXPECT_EQ(bad->kv, kv);
    EXPECT_EQ(bad->token, t);
    EXPECT_EQ(bad->byte, b);
    EXPECT_EQ(bad->expected, before);
    EXPECT_EQ(bad->actual, *pool.At(j, kv, t, b));
  }
}

TEST(PatternTest, FirstMismatchFollowsLayerKvTokenByteOrder) {
  std::mt19937 rng(3);
  PatternPool pool(rng, 2, 4, 10, 16);
  const PatternArgs a = pool.Args(1, 0);
  ASSERT_TRUE(FillPatternCpu(a).ok());
  *pool.At(1, 0, 0, 0) ^= 0xFF;   // later layer
  *pool.At(0, 1, 9, 15) ^= 0x01;  // earlier: layer 0, V, last token, last byte
  *pool.At(0, 1, 9, 3) ^= 0x10;   // earliest
  auto r = VerifyPatternCpu(a);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->mismatches, 3u);
  EXPECT_EQ(r->layer, 0);
  EXPECT_EQ(r->kv, 1);
  EXPECT_EQ(r->token, 9);
  EXPECT_EQ(r->byte, 3);
}

TEST(PatternTest, BytesDependOnEveryCoordinate) {
  // Over 64 bytes, changing any one coordinate changes most bytes.
  auto differing = [](auto f, auto g) {
    int n = 0;
    for (int64_t b = 0; b < 64; ++b) n += f(b) != g(b);
    return n;
  };
  auto base = [](int64_t b) { return PatternByteHost(5, 3, 0, 7, b); };
  EXPECT_GT(differing(base, [](int64_t b) { return PatternByteHost(6, 3, 0, 7, b); }), 50);
  EXPECT_GT(differing(base, [](int64_t b) { return PatternByteHost(5, 4, 0, 7, b); }), 50);
  EXPECT_GT(differing(base, [](int64_t b) { return PatternByteHost(5, 3, 1, 7, b); }), 50);
  EXPECT_GT(differing(base, [](int64_t b) { return PatternByteHost(5, 3, 0, 8, b); }), 50);
  std::set<uint8_t> values;
  for (int64_t b = 0; b < 64; ++b) values.insert(base(b));
  EXPECT_GT(values.size(), 40u);
}

TEST(PatternTest, RejectsBadArgumentsAndAcceptsEmpty) {
  PatternArgs a;
  a.num_layers = 1;
  a.num_tokens = 4;
  a.row_bytes = 8;
  a.page_size = 0;
  Status s = FillPatternCpu(a);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("page_size is 0"), std::string::npos) << s;
  a.page_size = 2;
  s = VerifyPatternCpu(a).status();
  EXPECT_NE(s.message().find("k_bases is null"), std::string::npos) << s;
  a.num_tokens = -5;
  s = FillPatternCpu(a);
  EXPECT_NE(s.message().find("num_tokens is -5"), std::string::npos) << s;
  PatternArgs empty;
  auto r = VerifyPatternCpu(empty);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->mismatches, 0u);
}

}  // namespace
}  // namespace kvt::kernels

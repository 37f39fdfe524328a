#include "control/auth.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>

namespace kvt::control {
namespace {

using ::testing::HasSubstr;

const std::string kToken = "0123456789abcdef0123456789abcdef";
const std::string kNonce(kAuthNonceBytes, 'n');

TEST(AuthTest, NoncesAreRandomAndSized) {
  StatusOr<std::string> a = MakeNonce();
  StatusOr<std::string> b = MakeNonce();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->size(), kAuthNonceBytes);
  EXPECT_NE(*a, *b);
}

TEST(AuthTest, ClientMacIsDeterministicAndBindsEveryInput) {
  const std::string mac = *ClientAuthMac(kToken, kNonce, "decode-0", v1::ROLE_DECODE);
  EXPECT_EQ(mac.size(), kAuthMacBytes);
  EXPECT_EQ(mac, *ClientAuthMac(kToken, kNonce, "decode-0", v1::ROLE_DECODE));
  EXPECT_NE(mac, *ClientAuthMac(kToken + "x", kNonce, "decode-0", v1::ROLE_DECODE));
  EXPECT_NE(mac,
            *ClientAuthMac(kToken, std::string(kAuthNonceBytes, 'm'), "decode-0", v1::ROLE_DECODE));
  EXPECT_NE(mac, *ClientAuthMac(kToken, kNonce, "decode-1", v1::ROLE_DECODE));
  EXPECT_NE(mac, *ClientAuthMac(kToken, kNonce, "decode-0", v1::ROLE_PREFILL));
}

TEST(AuthTest, FieldBoundariesMatter) {
  // Length prefixes keep ("ab" | "c") apart from ("a" | "bc").
  EXPECT_NE(*ServerAuthMac(kToken, "ab", "c", "s"), *ServerAuthMac(kToken, "a", "bc", "s"));
}

TEST(AuthTest, ClientAndServerProofsDiffer) {
  // A MAC from one direction must not pass as the other's.
  EXPECT_NE(*ClientAuthMac(kToken, kNonce, "x", v1::ROLE_DECODE),
            *ServerAuthMac(kToken, kNonce, kNonce, "x"));
}

TEST(AuthTest, MacEqualsComparesContentAndLength) {
  EXPECT_TRUE(MacEquals("abc", "abc"));
  EXPECT_FALSE(MacEquals("abc", "abd"));
  EXPECT_FALSE(MacEquals("abc", "abcd"));
  EXPECT_TRUE(MacEquals("", ""));
}

TEST(AuthTest, ShortTokensAreRefusedWithAHint) {
  EXPECT_TRUE(CheckClusterToken(kToken).ok());
  Status status = CheckClusterToken("short");
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("5 bytes"));
  EXPECT_THAT(status.message(), HasSubstr("openssl rand"));
}

TEST(AuthTest, EmptyTokenCannotMac) {
  EXPECT_FALSE(ClientAuthMac("", kNonce, "x", v1::ROLE_DECODE).ok());
}

TEST(AuthTest, TokenFromEnvironment) {
  ::setenv("KVT_CLUSTER_TOKEN", kToken.c_str(), 1);
  EXPECT_EQ(ClusterTokenFromEnv(), kToken);
  ::unsetenv("KVT_CLUSTER_TOKEN");
  EXPECT_EQ(ClusterTokenFromEnv(), "");
}

}  // namespace
}  // namespace kvt::control

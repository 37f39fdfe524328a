#include "control/auth.h"

#include <fmt/format.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstdint>

#include "kvt/common/env.h"

namespace kvt::control {
namespace {

constexpr std::string_view kClientLabel = "kvt-auth-client-v1";
constexpr std::string_view kServerLabel = "kvt-auth-server-v1";

// Length-prefixed so that ("ab", "c") and ("a", "bc") give different MAC inputs.
void AppendField(std::string* out, std::string_view field) {
  const auto size = static_cast<uint32_t>(field.size());
  const char prefix[4] = {static_cast<char>(size >> 24), static_cast<char>(size >> 16),
                          static_cast<char>(size >> 8), static_cast<char>(size)};
  out->append(prefix, sizeof(prefix));
  out->append(field);
}

StatusOr<std::string> HmacSha256(std::string_view key, std::string_view data) {
  if (key.empty()) return FailedPrecondition("no cluster token configured");
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int mac_len = 0;
  // One-shot HMAC() is not deprecated in OpenSSL 3 (only the HMAC_CTX functions are).
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(data.data()), data.size(), mac,
           &mac_len) == nullptr ||
      mac_len != kAuthMacBytes) {
    return Internal("OpenSSL HMAC-SHA256 failed");
  }
  return std::string(reinterpret_cast<const char*>(mac), mac_len);
}

}  // namespace

Status CheckClusterToken(std::string_view token) {
  if (token.size() >= kMinClusterTokenBytes) return OkStatus();
  return InvalidArgument(fmt::format(
      "cluster token is {} bytes; use at least {} random bytes (e.g. `openssl rand -hex 32`) "
      "in KVT_CLUSTER_TOKEN or the options' cluster_token",
      token.size(), kMinClusterTokenBytes));
}

std::string ClusterTokenFromEnv() { return env::Get(env::kClusterToken).value_or(""); }

StatusOr<std::string> MakeNonce() {
  std::string nonce(kAuthNonceBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), static_cast<int>(nonce.size())) !=
      1) {
    return Internal("OpenSSL RAND_bytes failed: no randomness for the auth nonce");
  }
  return nonce;
}

StatusOr<std::string> ClientAuthMac(std::string_view token, std::string_view nonce,
                                    std::string_view client_id, v1::Role role) {
  std::string input(kClientLabel);
  AppendField(&input, nonce);
  AppendField(&input, client_id);
  AppendField(&input, std::to_string(static_cast<int>(role)));
  return HmacSha256(token, input);
}

StatusOr<std::string> ServerAuthMac(std::string_view token, std::string_view client_nonce,
                                    std::string_view nonce, std::string_view server_id) {
  std::string input(kServerLabel);
  AppendField(&input, client_nonce);
  AppendField(&input, nonce);
  AppendField(&input, server_id);
  return HmacSha256(token, input);
}

bool MacEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace kvt::control

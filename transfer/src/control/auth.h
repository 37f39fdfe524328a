// HMAC-SHA256 challenge-response over a shared cluster token (OpenSSL).
//
// On a connection to a server that has a token, the server's first frame is an AuthChallenge with
// a fresh 32-byte nonce; the client answers with
//   mac = HMAC-SHA256(token, "kvt-auth-client-v1" | nonce | client_id | role)
// and, to authenticate the server too, its own 32-byte client_nonce; the server then proves the
// token with
//   server_mac = HMAC-SHA256(token, "kvt-auth-server-v1" | client_nonce | nonce | server_id).
// Each variable-length part is length-prefixed so that no two inputs share a MAC input, and the
// two directions use different labels so that one side's MAC cannot be replayed as the other's.
// MACs are compared in constant time (CRYPTO_memcmp).
//
// Thread safety: pure functions (OpenSSL 3 is thread-safe for these); call from any thread.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "kvt/common/status.h"
#include "kvt/transfer/control_options.h"  // ClusterTokenFromEnv
#include "kvt/v1/common.pb.h"

namespace kvt::control {

inline constexpr size_t kAuthNonceBytes = 32;
inline constexpr size_t kAuthMacBytes = 32;  // SHA-256
// Shorter tokens are refused: the token is the only secret guarding the cluster.
inline constexpr size_t kMinClusterTokenBytes = 16;

// OK, or InvalidArgument saying how long the token is and how to make a good one.
Status CheckClusterToken(std::string_view token);

// kAuthNonceBytes bytes from OpenSSL's CSPRNG. Internal when the generator fails.
StatusOr<std::string> MakeNonce();

StatusOr<std::string> ClientAuthMac(std::string_view token, std::string_view nonce,
                                    std::string_view client_id, v1::Role role);
StatusOr<std::string> ServerAuthMac(std::string_view token, std::string_view client_nonce,
                                    std::string_view nonce, std::string_view server_id);

// Constant-time comparison; false when the lengths differ.
bool MacEquals(std::string_view a, std::string_view b);

}  // namespace kvt::control

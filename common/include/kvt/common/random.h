// Random 64-bit values that must not be guessed: backend instance ids, link tokens, nonces that
// tell one process or connection from another. Drawn from std::random_device, which libstdc++
// reads from the kernel's generator (getrandom), not from a seeded pseudo-random engine whose
// next outputs follow from earlier ones.
//
// Thread-safe: each call uses a device of its own.
#pragma once

#include <cstdint>

namespace kvt {

// Any 64-bit value.
uint64_t RandomU64();
// A value other than 0 (0 means "none" where these are kept).
uint64_t RandomNonZeroU64();

}  // namespace kvt

// Test pattern: host byte function and CPU fill / verify.
#include <cstring>

#include "kvt/kernels/kernels.h"
#include "pattern_byte.h"
#include "validate.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the pattern's word stores assume a little-endian host");

namespace kvt::kernels {

uint8_t PatternByteHost(uint64_t request, int32_t layer, int32_t kv, int64_t token, int64_t byte) {
  return internal::PatternByte(request, layer, kv, token, byte);
}

namespace {

uint8_t* RowAddress(const PatternArgs& a, int32_t j, int32_t kv, int64_t token) {
  const uint64_t base = kv == 0 ? a.k_bases[j] : a.v_bases[j];
  const int64_t row =
      static_cast<int64_t>(a.pages[token / a.page_size]) * a.page_size + token % a.page_size;
  return reinterpret_cast<uint8_t*>(base) + row * a.row_bytes;
}

}  // namespace

Status FillPatternCpu(const PatternArgs& args) {
  KVT_RETURN_IF_ERROR(internal::ValidatePattern(args, "FillPatternCpu"));
  if (args.num_layers == 0 || args.num_tokens == 0 || args.row_bytes == 0) return OkStatus();
  for (int32_t j = 0; j < args.num_layers; ++j) {
    for (int32_t kv = 0; kv < 2; ++kv) {
      for (int64_t t = 0; t < args.num_tokens; ++t) {
        uint8_t* row = RowAddress(args, j, kv, t);
        const uint64_t seed = internal::PatternRowSeed(args.request, args.first_layer + j, kv, t);
        const int64_t whole_words = args.row_bytes / 8;
        for (int64_t w = 0; w < whole_words; ++w) {
          // Byte k of the word is (word >> 8k): on a little-endian host that is the word's
          // memory image, so whole words are stored at once.
          const uint64_t word = internal::PatternWord(seed, w);
          std::memcpy(row + w * 8, &word, 8);
        }
        for (int64_t w = whole_words; w * 8 < args.row_bytes; ++w) {
          const uint64_t word = internal::PatternWord(seed, w);
          for (int64_t k = 0; k < 8 && w * 8 + k < args.row_bytes; ++k) {
            row[w * 8 + k] = static_cast<uint8_t>(word >> (8 * k));
          }
        }
      }
    }
  }
  return OkStatus();
}

StatusOr<PatternCheck> VerifyPatternCpu(const PatternArgs& args) {
  KVT_RETURN_IF_ERROR(internal::ValidatePattern(args, "VerifyPatternCpu"));
  PatternCheck check;
  if (args.num_layers == 0 || args.num_tokens == 0 || args.row_bytes == 0) return check;
  for (int32_t j = 0; j < args.num_layers; ++j) {
    for (int32_t kv = 0; kv < 2; ++kv) {
      for (int64_t t = 0; t < args.num_tokens; ++t) {
        const uint8_t* row = RowAddress(args, j, kv, t);
        const uint64_t seed = internal::PatternRowSeed(args.request, args.first_layer + j, kv, t);
        for (int64_t w = 0; w * 8 < args.row_bytes; ++w) {
          const uint64_t word = internal::PatternWord(seed, w);
          if (w * 8 + 8 <= args.row_bytes) {
            uint64_t stored;
            std::memcpy(&stored, row + w * 8, 8);
            if (stored == word) continue;  // the common case: the whole word matches
          }
          for (int64_t k = 0; k < 8 && w * 8 + k < args.row_bytes; ++k) {
            const uint8_t expected = static_cast<uint8_t>(word >> (8 * k));
            const uint8_t actual = row[w * 8 + k];
            if (expected == actual) continue;
            if (check.mismatches++ == 0) {
              check.layer = args.first_layer + j;
              check.kv = kv;
              check.token = t;
              check.byte = w * 8 + k;
              check.expected = expected;
              check.actual = actual;
            }
          }
        }
      }
    }
  }
  return check;
}

}  // namespace kvt::kernels

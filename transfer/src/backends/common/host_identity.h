// Pieces of the text addresses and tokens the device backends (cuda_ipc, nccl) publish in their
// hellos: who this host is, and the one-line "<prefix> name=value ..." records they are written
// in. Shared so that every backend identifies hosts and parses records the same way.
// Pure functions on plain values (ReadBootId reads /proc): thread-safe.
#pragma once

#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "kvt/common/status.h"

namespace kvt::transfer {

// This host's kernel boot id (/proc/sys/kernel/random/boot_id), or "host:<hostname>" (spaces
// replaced) where it cannot be read, which is then logged as a warning under `log_tag`. Reads
// every call: callers keep the result.
std::string ReadBootId(std::string_view log_tag);

// Lower-case hex digits of `v`, without a prefix, as peer addresses show process and instance ids
// (kvt::Hex, with "0x", is for messages).
std::string HexDigits(uint64_t v);

// `text` as a whole is a number in `base`; `out` is set only then.
template <typename T>
bool ParseNumber(std::string_view text, T& out, int base) {
  if (text.empty()) return false;
  T value{};
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value, base);
  if (ec != std::errc() || end != text.data() + text.size()) return false;
  out = value;
  return true;
}

// Peer-supplied text as errors show it: at most 160 characters, control characters replaced.
std::string ShownText(std::string_view text);

// How a one-line record "<prefix> name=value name=value ..." is named in errors.
struct TextRecordFormat {
  std::string_view prefix;       // "nccl/1": family, '/', version
  std::string_view what;         // "nccl address"
  std::string_view not_one;      // "not an nccl address"
  std::string_view use_instead;  // "the peer must use the nccl backend"
};

using TextRecordFields = std::vector<std::pair<std::string_view, std::string_view>>;

// The record's name=value fields in order (views into `text`). InvalidArgument when `text` does
// not start with the prefix (saying so, or naming the other version of the same family), or a
// field is not name=value with a non-empty name.
StatusOr<TextRecordFields> ParseTextRecord(std::string_view text, const TextRecordFormat& format);

}  // namespace kvt::transfer

// Command-line helpers the kvt tools share (CLI11): integer range validators whose errors name
// the allowed range and the value in plain numbers. CLI11's own Range / PositiveNumber compare
// doubles and print their bounds as doubles ("0 not in range 2.2e-308 to 1.8e+308", or 300
// digits), which tells a user nothing.
//
// CLI11 puts the flag in front of a validator's message: "--layers: 0 is not allowed; use an
// integer in 1..4096".
#pragma once

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>

namespace kvt::tools {

// Integers in [min, max] (both inclusive). max = INT64_MAX reads as "at least min".
inline CLI::Validator IntRange(int64_t min, int64_t max) {
  const bool unbounded = max == std::numeric_limits<int64_t>::max();
  const std::string allowed =
      unbounded ? "an integer >= " + std::to_string(min)
                : "an integer in " + std::to_string(min) + ".." + std::to_string(max);
  return CLI::Validator(
      [min, max, allowed](std::string& input) -> std::string {
        errno = 0;
        char* end = nullptr;
        const long long value = std::strtoll(input.c_str(), &end, 10);
        if (input.empty() || end == input.c_str() || *end != '\0' || errno == ERANGE) {
          return "'" + input + "' is not an integer; use " + allowed;
        }
        if (value < min || value > max) return input + " is not allowed; use " + allowed;
        return std::string();
      },
      unbounded ? "INT>=" + std::to_string(min)
                : "INT in " + std::to_string(min) + ".." + std::to_string(max));
}

// Integers >= min.
inline CLI::Validator IntAtLeast(int64_t min) {
  return IntRange(min, std::numeric_limits<int64_t>::max());
}

}  // namespace kvt::tools

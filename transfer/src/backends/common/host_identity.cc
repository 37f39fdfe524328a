#include "backends/common/host_identity.h"

#include <unistd.h>

#include <fstream>

#include "kvt/common/log.h"

namespace kvt::transfer {
namespace {

std::vector<std::string_view> SplitSpaces(std::string_view text) {
  std::vector<std::string_view> tokens;
  size_t i = 0;
  while (i < text.size()) {
    while (i < text.size() && text[i] == ' ') ++i;
    const size_t start = i;
    while (i < text.size() && text[i] != ' ') ++i;
    if (i > start) tokens.push_back(text.substr(start, i - start));
  }
  return tokens;
}

}  // namespace

std::string ReadBootId(std::string_view log_tag) {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (in) std::getline(in, id);
  while (!id.empty() && (id.back() == '\n' || id.back() == ' ')) id.pop_back();
  if (!id.empty() && id.find(' ') == std::string::npos) return id;
  // Without the boot id the hostname stands in: two processes of one host still agree, and peers
  // count as another host unless they fell back the same way (which refuses what needs one host
  // rather than risking it).
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  std::string fallback = std::string("host:") + host;
  for (char& c : fallback) {
    if (c == ' ') c = '_';
  }
  KVT_LOG_WARN(log_tag, "cannot read /proc/sys/kernel/random/boot_id; identifying the host as {}",
               fallback);
  return fallback;
}

std::string HexDigits(uint64_t v) {
  char buf[17];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v, 16);
  return std::string(buf, end);
}

std::string ShownText(std::string_view text) {
  std::string shown(text.substr(0, 160));
  for (char& c : shown) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7F) c = '?';
  }
  if (text.size() > 160) shown += "...";
  return shown;
}

StatusOr<TextRecordFields> ParseTextRecord(std::string_view text, const TextRecordFormat& format) {
  const std::vector<std::string_view> tokens = SplitSpaces(text);
  const std::string prefix(format.prefix);
  if (tokens.empty() || tokens[0] != format.prefix) {
    const std::string family(format.prefix.substr(0, format.prefix.find('/') + 1));
    if (!tokens.empty() && tokens[0].starts_with(family)) {
      return InvalidArgument(std::string(format.what) + " version '" + std::string(tokens[0]) +
                             "', this build reads '" + prefix +
                             "'; run the same kvt version on both sides");
    }
    return InvalidArgument(std::string(format.not_one) + ": '" + ShownText(text) +
                           "' (it must start with '" + prefix + "'); " +
                           std::string(format.use_instead));
  }
  TextRecordFields fields;
  for (size_t i = 1; i < tokens.size(); ++i) {
    const size_t eq = tokens[i].find('=');
    if (eq == std::string_view::npos || eq == 0) {
      return InvalidArgument(std::string(format.what) + " field '" + ShownText(tokens[i]) +
                             "' is not name=value in '" + ShownText(text) + "'");
    }
    fields.emplace_back(tokens[i].substr(0, eq), tokens[i].substr(eq + 1));
  }
  return fields;
}

}  // namespace kvt::transfer

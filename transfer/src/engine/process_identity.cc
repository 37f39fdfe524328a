#include "engine/process_identity.h"

#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <sstream>
#include <string>

namespace kvt::transfer::engine {
namespace {

struct Stat {
  char state = '?';
  uint64_t start = 0;
};

// Fields 3 (state) and 22 (starttime) of /proc/<pid>/stat. The command name (field 2) is in
// parentheses and may hold spaces or ')', so parsing starts after the last ')'.
bool ReadStat(pid_t pid, Stat* out, bool* missing) {
  *missing = false;
  std::ifstream file("/proc/" + std::to_string(pid) + "/stat");
  if (!file) {
    *missing = errno == ENOENT || errno == ESRCH;
    return false;
  }
  std::string line;
  std::getline(file, line);
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return false;
  std::istringstream rest(line.substr(close + 1));
  std::string field;
  // Field 3 is the first after the name; starttime is 19 fields later.
  if (!(rest >> out->state)) return false;
  for (int i = 4; i < 22; ++i) {
    if (!(rest >> field)) return false;
  }
  return static_cast<bool>(rest >> out->start);
}

}  // namespace

uint64_t OwnProcessStart() {
  Stat stat;
  bool missing = false;
  return ReadStat(getpid(), &stat, &missing) ? stat.start : 0;
}

ProcessLiveness CheckProcess(pid_t pid, uint64_t start) {
  if (pid <= 0 || start == 0) return ProcessLiveness::kUnknown;
  Stat stat;
  bool missing = false;
  if (!ReadStat(pid, &stat, &missing)) {
    return missing ? ProcessLiveness::kGone : ProcessLiveness::kUnknown;
  }
  if (stat.start != start) return ProcessLiveness::kGone;  // the pid belongs to another process
  if (stat.state == 'Z' || stat.state == 'X' || stat.state == 'x') return ProcessLiveness::kGone;
  if (stat.state == 'T' || stat.state == 't') return ProcessLiveness::kStopped;
  return ProcessLiveness::kRunning;
}

}  // namespace kvt::transfer::engine

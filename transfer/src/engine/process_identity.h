// Which process this is, in a form a peer on the same host can check later: the pid and the
// process's start time (clock ticks after boot, /proc/<pid>/stat field 22), which together name
// one process even after its pid is reused. Reads /proc; thread-safe.
#pragma once

#include <sys/types.h>

#include <cstdint>

namespace kvt::transfer::engine {

// This process's start time; 0 when /proc cannot be read.
uint64_t OwnProcessStart();

enum class ProcessLiveness {
  kRunning,  // a live process with that pid and start time exists
  kStopped,  // it exists but is stopped (SIGSTOP, a debugger): it runs again when continued
  kGone,     // none does (exited, a zombie that can do nothing more, or the pid was reused)
  kUnknown,  // /proc could not tell (then nothing is concluded)
};
ProcessLiveness CheckProcess(pid_t pid, uint64_t start);

}  // namespace kvt::transfer::engine

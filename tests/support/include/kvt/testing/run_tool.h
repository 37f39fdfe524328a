// Runs a built tool with a shell command line and captures its exit code, stdout and stderr, for
// the command-line tests of the tools.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

namespace kvt::testing {

struct ToolResult {
  int exit_code = -1;  // -1 when the tool did not exit normally
  std::string out;
  std::string err;
};

inline ToolResult RunTool(const std::string& binary, const std::string& args) {
  char err_path[] = "/tmp/kvt_tool_cli_XXXXXX";
  const int fd = mkstemp(err_path);
  if (fd >= 0) close(fd);
  const std::string cmd = binary + " " + args + " 2>" + err_path;
  ToolResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream err(err_path);
  std::stringstream ss;
  ss << err.rdbuf();
  r.err = ss.str();
  std::remove(err_path);
  return r;
}

}  // namespace kvt::testing

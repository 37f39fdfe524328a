// kvt-bench: benchmarks that print a table and write JSON (never timed assertions).
#include <CLI/CLI.hpp>

#include "bench_common.h"
#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"kvt-bench: kvt data-movement benchmarks (tables + JSON)"};
  app.require_subcommand(1);
  kvt::bench::SetCommandLine(argc, argv);
  int exit_code = 0;
  kvt::bench::AddKernelsCommand(app, exit_code);
  kvt::bench::AddTransferCommand(app, exit_code);
  kvt::bench::AddLoadCommand(app, exit_code);
  kvt::bench::AddCopyCommand(app, exit_code);
  kvt::bench::AddCudaCallsCommand(app, exit_code);
  kvt::bench::AddControlCommand(app, exit_code);
  CLI11_PARSE(app, argc, argv);
  return exit_code;
}

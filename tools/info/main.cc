// kvt-info: prints what kvt sees (no subcommand) or a pool layout (`layout`).
// Exit codes: 0 success, 1 a refused layout or failed probe, 2 bad command line.
#include <CLI/CLI.hpp>
#include <iostream>

#include "layout_command.h"
#include "system_info.h"

int main(int argc, char** argv) {
  CLI::App app{"kvt-info: what kvt sees on this machine, and KV pool layouts"};
  bool json = false;
  app.add_flag("--json", json, "print one JSON object instead of text");

  kvt::tools::LayoutFlags layout;
  CLI::App* layout_cmd =
      app.add_subcommand("layout", "build a pool on host memory and print its layout");
  layout_cmd->add_flag("--json", json, "print one JSON object instead of a table");
  kvt::tools::AddLayoutFlags(layout_cmd, &layout);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // CLI11 reports through exceptions; they end here, never escape main.
    return app.exit(e) == 0 ? 0 : 2;
  }
  try {
    if (layout_cmd->parsed()) return kvt::tools::RunLayout(layout, json);
    const nlohmann::json info = kvt::tools::CollectSystemInfo();
    if (json) {
      std::cout << info.dump(2) << "\n";
    } else {
      kvt::tools::PrintSystemInfo(info);
    }
    return 0;
  } catch (const std::exception& e) {
    // nlohmann::json throws on misuse; report instead of terminating.
    std::cerr << "kvt-info: " << e.what() << "\n";
    return 1;
  }
}

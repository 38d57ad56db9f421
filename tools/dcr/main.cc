// dcr: bit-exact delta-compressed refit. One file per subcommand.
#include <cstdio>

#include "cli.h"
#include "dcr/progress.h"

namespace dcr::cli {

int& ExitCode() {
  static int code = kExitOk;
  return code;
}

int Fail(const std::string& command, const Status& status) {
  std::fprintf(stderr, "dcr %s: %s\n", command.c_str(), status.ToString().c_str());
  return kExitError;
}

Result<uint64_t> ParseBytes(const std::string& text) {
  std::size_t used = 0;
  double value = 0;
  try {  // std::stod is the one throwing call we make; keep it contained here
    value = std::stod(text, &used);
  } catch (...) {
    return InvalidArgument("'" + text + "' is not a size (try 64MB, 1.5GiB or 4096)");
  }
  std::string unit = text.substr(used);
  static const std::pair<const char*, double> kUnits[] = {
      {"", 1}, {"B", 1}, {"kB", 1e3}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12},
      {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
  for (const auto& [name, scale] : kUnits)
    if (unit == name) {
      const double bytes = value * scale;
      if (!(bytes >= 0) || bytes > 1.8e19) return InvalidArgument("size '" + text + "' is out of range");
      return static_cast<uint64_t>(bytes);
    }
  return InvalidArgument("unknown unit in '" + text + "' (use B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)");
}

}  // namespace dcr::cli

int main(int argc, char** argv) {
  CLI::App app{"dcr: bit-exact delta-compressed refit of model weights"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "dcr 0.1.0");
  dcr::cli::AddInspectCommand(app);
  dcr::cli::AddDiffCommand(app);
  dcr::cli::AddGenCommand(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : dcr::cli::kExitError;
  }
  return dcr::cli::ExitCode();
}

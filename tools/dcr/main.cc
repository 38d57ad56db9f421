// dcr: bit-exact delta-compressed refit. One file per subcommand.
#include <cstdio>

#include "cli.h"
#include "dcr/progress.h"
#include "fault_hooks.h"

namespace dcr::cli {

int& ExitCode() {
  static int code = kExitOk;
  return code;
}

int Fail(const std::string& command, const Status& status) {
  std::fprintf(stderr, "dcr %s: %s\n", command.c_str(), status.ToString().c_str());
  return kExitError;
}

Result<std::unique_ptr<MetricsServer>> ServeMetrics(const std::string& command, const std::string& address) {
  if (address.empty()) return std::unique_ptr<MetricsServer>();
  auto server = MetricsServer::Start(address);
  if (!server.ok()) return server.status().WithContext("--metrics");
  std::fprintf(stderr, "dcr %s: metrics at %s\n", command.c_str(), (*server)->url().c_str());
  return server;
}

}  // namespace dcr::cli

int main(int argc, char** argv) {
  CLI::App app{"dcr: bit-exact delta-compressed refit of model weights"};
  app.require_subcommand(1);
  const std::string_view notice = dcr::cli::FaultInjectionNotice();
  app.set_version_flag("--version", notice.empty() ? std::string("dcr 0.1.0") : "dcr 0.1.0\n" + std::string(notice));
  dcr::cli::AddInspectCommand(app);
  dcr::cli::AddDiffCommand(app);
  dcr::cli::AddGenCommand(app);
  dcr::cli::AddDeltaCommand(app);
  dcr::cli::AddRefitCommands(app);
  dcr::cli::AddStoreCommand(app);
  dcr::cli::AddLayoutCommand(app);
  dcr::cli::AddRelayCommand(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : dcr::cli::kExitError;
  }
  return dcr::cli::ExitCode();
}

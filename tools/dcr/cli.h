// Shared plumbing of the dcr subcommands: each subcommand file defines
// Add<Name>Command(app), which registers its options and a callback that
// sets the process exit code. Subcommands parse and print; logic lives in src/.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dcr/layout.h"
#include "dcr/metrics.h"
#include "dcr/status.h"

namespace dcr::cli {

// Exit codes shared by every subcommand.
inline constexpr int kExitOk = 0;
inline constexpr int kExitDiffers = 1;  // dcr diff: the inputs differ
inline constexpr int kExitError = 2;

// Prints "dcr <command>: <status>" to stderr and returns kExitError.
int Fail(const std::string& command, const Status& status);

// Bytes per changed word (0 when nothing changed).
inline double PerChange(uint64_t bytes, uint64_t changed) {
  return changed ? static_cast<double>(bytes) / static_cast<double>(changed) : 0.0;
}

// A layout map JSON file, parsed and validated (errors name the file).
Result<LayoutMap> ReadLayoutFile(const std::string& path);

// With an address (--metrics HOST:PORT): the metrics endpoint, serving
// until the returned server is destroyed, its URL printed on stderr;
// without, null.
Result<std::unique_ptr<MetricsServer>> ServeMetrics(const std::string& command, const std::string& address);

// The exit code the chosen subcommand's callback sets.
int& ExitCode();

void AddInspectCommand(CLI::App& app);
void AddDiffCommand(CLI::App& app);
void AddGenCommand(CLI::App& app);
void AddDeltaCommand(CLI::App& app);
void AddRefitCommands(CLI::App& app);  // publish, follow, status
void AddStoreCommand(CLI::App& app);
void AddLayoutCommand(CLI::App& app);  // generate, validate, show, load
void AddRelayCommand(CLI::App& app);  // relay, relay keygen | plan | push | status | tree

// A whole file's bytes, or kNotFound naming it.
Result<std::string> ReadWholeFile(const std::string& path);

// dcr relay tree (relay_tree_command.cc), under `relay`.
void AddRelayTreeCommand(CLI::App* relay);

// The relays' --stats files as the tree (`dcr relay status`, `dcr status
// --relay-stats`): each relay under its upstream with its links' bytes,
// objects, acks and spool; or a JSON array of the files. kInvalidArgument
// naming a file that is not a relay stats file, kNotFound for a missing one.
Result<std::string> FormatRelayTree(const std::vector<std::string>& stats_files, bool as_json);

}  // namespace dcr::cli

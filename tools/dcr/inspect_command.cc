// dcr inspect PATH [--json] [--checksums]: the tensors of a checkpoint.
#include <fmt/format.h>

#include <map>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "dcr/checkpoint.h"
#include "dcr/hash.h"
#include "dcr/json.h"
#include "dcr/progress.h"
#include "dcr/thread_pool.h"

namespace dcr::cli {
namespace {

struct InspectArgs {
  std::string path;
  bool json = false;
  bool checksums = false;
};

int RunInspect(const InspectArgs& args) {
  auto opened = Checkpoint::Open(args.path);
  if (!opened.ok()) return Fail("inspect", opened.status());
  const Checkpoint& ckpt = *opened;
  std::vector<uint64_t> hashes(args.checksums ? ckpt.size() : 0);
  if (args.checksums) {
    Progress progress("checksums", ckpt.total_bytes());
    DefaultPool().ParallelFor(hashes.size(), [&](size_t i) {
      const auto data = ckpt.Data(i);
      hashes[i] = Xxh3_64(data.data(), data.size());
      progress.Add(data.size());
    });
  }
  std::map<std::string, std::pair<uint64_t, uint64_t>> by_dtype;  // name -> (tensors, bytes)
  for (const auto& t : ckpt.tensors()) {
    auto& [n, b] = by_dtype[std::string(Name(t.dtype))];
    ++n;
    b += t.nbytes;
  }

  if (args.json) {
    nlohmann::ordered_json doc;
    doc["path"] = ckpt.path();
    doc["files"] = ckpt.files();
    auto& tensors = doc["tensors"] = nlohmann::ordered_json::array();
    for (size_t i = 0; i < ckpt.size(); ++i) {
      const auto& t = ckpt.tensors()[i];
      nlohmann::ordered_json e = {{"name", t.name},      {"dtype", Name(t.dtype)}, {"shape", t.shape},
                                  {"elements", t.numel}, {"bytes", t.nbytes},      {"file", ckpt.FileOf(i)}};
      if (args.checksums) e["xxh3"] = fmt::format("{:016x}", hashes[i]);
      tensors.push_back(std::move(e));
    }
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [k, v] : ckpt.metadata()) meta[k] = v;
    doc["metadata"] = meta;
    auto& dtypes = doc["dtypes"] = nlohmann::ordered_json::object();
    for (const auto& [name, nb] : by_dtype) dtypes[name] = {{"tensors", nb.first}, {"bytes", nb.second}};
    doc["total_tensors"] = ckpt.size();
    doc["total_elements"] = ckpt.total_elements();
    doc["total_bytes"] = ckpt.total_bytes();
    fmt::print("{}\n", JsonText(doc, 2));
    return kExitOk;
  }

  size_t width = 6;
  for (const auto& t : ckpt.tensors()) width = std::max(width, t.name.size());
  fmt::print("{:<{}}  {:<11}  {:<22}  {:>14}{}\n", "tensor", width, "dtype", "shape", "bytes",
             args.checksums ? "  xxh3" : "");
  for (size_t i = 0; i < ckpt.size(); ++i) {
    const auto& t = ckpt.tensors()[i];
    fmt::print("{:<{}}  {:<11}  {:<22}  {:>14}{}\n", t.name, width, Name(t.dtype),
               fmt::format("[{}]", fmt::join(t.shape, ", ")), t.nbytes,
               args.checksums ? fmt::format("  {:016x}", hashes[i]) : "");
  }
  fmt::print("\n{} tensors, {} elements, {} bytes ({:.3f} GB) in {} file(s)\n", ckpt.size(), ckpt.total_elements(),
             ckpt.total_bytes(), static_cast<double>(ckpt.total_bytes()) / 1e9, ckpt.files().size());
  for (const auto& [name, nb] : by_dtype)
    fmt::print("  {:<11} {:>6} tensors  {:>14} bytes\n", name, nb.first, nb.second);
  return kExitOk;
}

}  // namespace

void AddInspectCommand(CLI::App& app) {
  auto args = std::make_shared<InspectArgs>();
  auto* cmd = app.add_subcommand("inspect", "List a checkpoint's tensors: dtype, shape, bytes, totals");
  cmd->add_option("path", args->path, "a .safetensors file or a checkpoint directory")->required();
  cmd->add_flag("--json", args->json, "print JSON");
  cmd->add_flag("--checksums", args->checksums, "add each tensor's XXH3-64 over its bytes");
  cmd->callback([args] { ExitCode() = RunInspect(*args); });
}

}  // namespace dcr::cli
